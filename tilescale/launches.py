"""Launch templates: a kernel's launch recorded once, then launched again with new arguments
through the CUDA driver, without TileLang's host code.

Example::

    template = LaunchTemplates(entry, user_args=8)   # entry: the compiled kernel's host function
    template.launch(args)                            # args: the user's, then the hidden ones

TileLang's host code (TVM-FFI's entry function) converts every tensor argument, checks its
shape, dtype and strides, and encodes the kernel's TMA descriptors, per call. A caller that
guarantees those (tilescale's ops: their plans are keyed by them, see ``tilescale.plans``)
can launch from a template instead: the kernel's parameter bytes as the entry function made
them once, with each call's tensor addresses, TMA descriptor addresses
(``cuTensorMapReplaceAddress``) and scalars written in, then one ``cuLaunchKernelEx``.

Which parameter bytes belong to which argument is found, not assumed: the entry function's
launch is captured (a CUDA stream capture: nothing runs) with the call's arguments and again
with every scalar changed; a pointer parameter is an argument's whose address it holds, a
TMA descriptor an argument's if putting that argument's address into it changes nothing, a
scalar parameter the one argument whose change changed it. Any other change, or a parameter
that two arguments could explain, leaves the kernel on its entry function. The mapping must
then rebuild the previous call's parameters exactly as that call's own capture recorded them
before the template is used. ``TILESCALE_LAUNCH_TEMPLATES=check`` compares every templated
launch with a capture of the entry function on the same arguments (tests); ``=0`` turns
templates off.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tilescale import cuda_driver

TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
_MODE = os.environ.get("TILESCALE_LAUNCH_TEMPLATES", "1")
# What this process made: templates, kernels left on their entry function (by reason), templated launches.
_made: dict[str, int] = {"templates": 0, "templated launches": 0}


def made() -> dict[str, int]:
    """Counts of templates made, kernel shapes left on the entry function (``"entry: <reason>"``)
    and launches made from templates in this process.

    Example::

        made()     # {"templates": 12, "templated launches": 340, "entry: a parameter changed ...": 1}
    """
    return dict(_made)


def _entry(reason: str) -> bool:
    """Count a kernel shape left on its entry function for ``reason``; returns False (its marker)."""
    _made[f"entry: {reason}"] = _made.get(f"entry: {reason}", 0) + 1
    return False


def mode() -> str:
    """``"1"`` (templates on, the default), ``"0"`` (off) or ``"check"`` (every templated launch
    compared with the entry function's own parameters), from ``TILESCALE_LAUNCH_TEMPLATES`` or :func:`set_mode`."""
    return _MODE


def set_mode(value: str) -> str:
    """Set :func:`mode` for this process (benchmarks time both ways in one run); returns the previous mode.

    Example::

        previous = set_mode("0")     # every kernel on TileLang's entry function
    """
    global _MODE
    if value not in ("0", "1", "check"):
        raise ValueError(f"launch template mode must be '0', '1' or 'check', got {value!r}")
    previous, _MODE = _MODE, value
    return previous


@dataclass(frozen=True)
class ParamMap:
    """Where each call's arguments go in a kernel's parameter bytes.

    ``pointers``, ``tensor_maps``: (argument, offset) of parameters holding that tensor
    argument's address, directly or as a TMA descriptor's; ``scalars``: (argument, offset,
    size, is_float) of scalar parameters.
    """

    pointers: tuple[tuple[int, int], ...] = ()
    tensor_maps: tuple[tuple[int, int], ...] = ()
    scalars: tuple[tuple[int, int, int, bool], ...] = ()


def scalar_bytes(value: int | float, size: int, is_float: bool) -> bytes:
    """``value`` as a kernel parameter of ``size`` bytes (little endian; integers wrap)."""
    if is_float:
        return struct.pack("<f" if size == 4 else "<d", value)
    return (int(value) & ((1 << (8 * size)) - 1)).to_bytes(size, "little")


def perturbed(value: int | float, index: int) -> int | float:
    """A value of ``value``'s type that differs from it, and from the other scalars' perturbations."""
    return value + index + 1


def map_params(params: Sequence[tuple[int, int]], blob: bytes, changed: bytes, tensors: dict[int, int],
               scalars: dict[int, int | float], holds_address: Callable[[bytes, int], bool]) -> ParamMap | None:
    """The :class:`ParamMap` of a kernel's parameters, or None where they cannot be told apart.

    Args:
        params: (offset, size) of each parameter.
        blob: The parameters' bytes of a launch.
        changed: Those of the same launch with every scalar argument ``i`` changed to
            ``perturbed(value, i)``.
        tensors: Address of each tensor argument that may change between calls, by argument index.
        scalars: Value of each scalar argument that may change, by argument index.
        holds_address: Whether a TMA descriptor's bytes hold a given address.

    Returns:
        The map; None if a parameter changed that no one scalar explains, an address is two
        arguments', or an argument has no address (an empty tensor).
    """
    addresses = list(tensors.values())
    if 0 in addresses or len(set(addresses)) != len(addresses):
        return None
    by_address = {a: i for i, a in tensors.items()}
    pointers, tensor_maps, found_scalars = [], [], []
    for offset, size in params:
        now, then = blob[offset:offset + size], changed[offset:offset + size]
        if now != then:
            matches = [i for i, v in scalars.items() if isinstance(v, (int, float)) and size in (4, 8)
                       and now == scalar_bytes(v, size, isinstance(v, float))
                       and then == scalar_bytes(perturbed(v, i), size, isinstance(v, float))]
            if len(matches) != 1:
                return None
            found_scalars.append((matches[0], offset, size, isinstance(scalars[matches[0]], float)))
        elif size == 8 and int.from_bytes(now, "little") in by_address:
            pointers.append((by_address[int.from_bytes(now, "little")], offset))
        elif size == TENSOR_MAP_BYTES:
            holders = [i for i, a in tensors.items() if holds_address(now, a)]
            if len(holders) > 1:
                return None
            if holders:
                tensor_maps.append((holders[0], offset))
    return ParamMap(tuple(pointers), tuple(tensor_maps), tuple(found_scalars))


def _holds_address(tensor_map: bytes, address: int) -> bool:
    """Whether the TMA descriptor ``tensor_map`` points at ``address`` (putting it in changes nothing)."""
    buffer = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + 64))()
    aligned = ctypes.addressof(buffer) + (-ctypes.addressof(buffer) % 64)
    ctypes.memmove(aligned, tensor_map, TENSOR_MAP_BYTES)
    if cuda_driver.replace_address(aligned, address) != 0:
        return False
    return ctypes.string_at(aligned, TENSOR_MAP_BYTES) == tensor_map


@dataclass
class _Template:
    """A kernel's launch with its parameter map, and the addresses its buffer holds now."""

    launcher: cuda_driver.KernelLauncher
    params: ParamMap
    size: int
    addresses: dict[int, int] = field(default_factory=dict)

    def write(self, args: Sequence[Any]) -> bool:
        """Write ``args`` into the parameters; False if a TMA descriptor refused an address."""
        buffer, base = self.launcher.buffer, self.launcher.base
        for i, offset in self.params.pointers:
            struct.pack_into("<Q", buffer, base + offset, args[i].data_ptr())
        for i, offset in self.params.tensor_maps:
            address = args[i].data_ptr()
            if self.addresses.get(offset) != address:
                if cuda_driver.replace_address(self.launcher.address + offset, address) != 0:
                    self.addresses.pop(offset, None)
                    return False
                self.addresses[offset] = address
        for i, offset, size, is_float in self.params.scalars:
            buffer_view = scalar_bytes(args[i], size, is_float)
            struct.pack_into(f"{size}s", buffer, base + offset, buffer_view)
        return True


class LaunchTemplates:
    """The templates of one kernel entry function, per shape of its arguments with dynamic dimensions.

    Args:
        entry: The kernel's launch on (user arguments, hidden arguments).
        user_args: How many leading arguments change between calls (the rest, hidden, do not
            for a given instance: keep one instance per set of hidden arguments).
        dynamic: User arguments with dynamic dimensions: their shapes select the template.
    """

    def __init__(self, entry: Callable[..., Any], user_args: int, dynamic: Sequence[int] = ()):
        self.entry = entry
        self.user_args = user_args
        self.dynamic = tuple(dynamic)
        # Per shape key: the template, False (the entry function stays), or the first call's record.
        self._by_shape: dict[tuple, _Template | bool | tuple] = {}

    def launch(self, args: Sequence[Any], device: torch.device) -> None:
        """Launch the kernel on ``args`` (user then hidden) on the current stream of ``device``."""
        key = tuple(args[i].shape for i in self.dynamic)
        template = self._by_shape.get(key)
        if type(template) is _Template and _MODE != "0":
            if template.write(args):
                if _MODE == "check" and not torch.cuda.is_current_stream_capturing():
                    self._compare(template, args, device)
                template.launcher(torch._C._cuda_getCurrentRawStream(device.index))
                _made["templated launches"] += 1
                return
        elif ((template is None or type(template) is tuple) and _MODE != "0"
              and not torch.cuda.is_current_stream_capturing()):
            template = self._by_shape[key] = self._learn(template, args, device)
            if type(template) is _Template:
                self.launch(args, device)
                return
        self.entry(*args)

    def _record(self, args: Sequence[Any], device: torch.device) -> tuple:
        """A capture of the entry function on ``args``: (kernel, tensor addresses, scalar values)."""
        captured = cuda_driver.capture_kernel(lambda: self.entry(*args), device)
        tensors = {i: a.data_ptr() for i, a in enumerate(args[:self.user_args]) if isinstance(a, torch.Tensor)}
        scalars = {i: a for i, a in enumerate(args[:self.user_args])
                   if isinstance(a, (int, float)) and not isinstance(a, bool)}
        return captured, tensors, scalars

    def _learn(self, first: tuple | None, args: Sequence[Any], device: torch.device) -> _Template | bool | tuple:
        """At a shape's first call: its record. At its second: the template, checked against the
        first call's record, or False (the entry function stays)."""
        try:
            captured, tensors, scalars = self._record(args, device)
            if captured is None:
                return _entry("the entry function enqueues other than one kernel")
            if first is None:
                return captured, tensors, scalars
            changed_args = list(args)
            for i, v in scalars.items():
                changed_args[i] = perturbed(v, i)
            changed = cuda_driver.capture_kernel(lambda: self.entry(*changed_args), device)
        except Exception as e:  # noqa: BLE001 - the entry refused changed scalars, or the driver a call
            return _entry(f"{type(e).__name__}: {e}"[:200])
        if changed is None or changed.params != captured.params:
            return _entry("changed scalars changed the launch")
        params = map_params(captured.params, captured.blob, changed.blob, tensors, scalars, _holds_address)
        if params is None:
            return _entry("parameters not told apart")
        template = _Template(cuda_driver.KernelLauncher(captured), params, len(captured.blob))
        # The map must rebuild the first call's parameters from this call's.
        before, before_tensors, before_scalars = first
        if before.params != captured.params or set(before_tensors) != set(tensors):
            return _entry("the first call's launch differs")
        earlier = list(args)
        for i, address in before_tensors.items():
            earlier[i] = _Address(address)
        for i, value in before_scalars.items():
            earlier[i] = value
        if not template.write(earlier) or template.launcher.blob(template.size) != before.blob:
            return _entry("the map does not rebuild the first call's parameters")
        template.addresses.clear()  # the next write puts this call's addresses back
        _made["templates"] += 1
        return template

    def _compare(self, template: _Template, args: Sequence[Any], device: torch.device) -> None:
        captured = cuda_driver.capture_kernel(lambda: self.entry(*args), device)
        if captured is None or captured.blob != template.launcher.blob(template.size):
            raise RuntimeError("launch template: the parameters written differ from the entry function's "
                               f"({self.entry!r}); set TILESCALE_LAUNCH_TEMPLATES=0 and report this")


@dataclass(frozen=True)
class _Address:
    """Stands for a tensor at ``address`` when a template is checked against an earlier call."""

    address: int

    def data_ptr(self) -> int:
        return self.address
