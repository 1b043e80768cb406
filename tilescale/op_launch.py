"""An op's kernel call whose launch is learned at its first calls and then made from C++.

Example::

    call = OpLaunch(kernel, lambda t, out, s: (t[0], t[1], ex.buffers, out[0], board, s[0]),
                    outputs=[(m, n)], group=group)
    out = call((a, weight), (ident,))          # in an op's plan, whose key fixes shapes and dtypes

An eager kernel call through TileLang's entry function costs about a kernel launch on the
host, and an op's Python around it as much again (the output's allocation, the hidden
arguments' lookup: ``benchmarks/host_cost.py --breakdown``). An op's plan fixes everything but
its tensors' addresses and a few scalars (the call identity), so after two calls the kernel's
parameters are known: the C++ launcher (``tilescale/csrc/launcher.cpp``) allocates the outputs,
writes the addresses (into TMA descriptors too) and scalars into the learned parameter bytes and
calls ``cuLaunchKernelEx``, in one call from Python.

Which parameter bytes belong to which argument is found, not assumed: the entry function's launch
is captured (a CUDA stream capture: nothing runs), and again with every scalar changed; a pointer
parameter is an argument's whose address it holds, a TMA descriptor an argument's if putting that
argument's address into it changes nothing, a scalar parameter the one scalar whose change changed
it. Any other change, or a parameter that two arguments could explain, leaves the call on the entry
function. The map must then rebuild the first call's parameters exactly, and the second's.

``TILESCALE_NATIVE_LAUNCH``: ``1`` (default), ``0`` (every call through the entry function),
``check`` (every learned launch's bytes compared with a capture of the entry function's: tests).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tilescale import cuda_driver, runtime
from tilescale.native import launcher_module
from tilescale.plans import PlanCache

TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
_MODE = os.environ.get("TILESCALE_NATIVE_LAUNCH", "1")
# What this process did: launches learned, calls left on the entry function (by reason), native launches.
_counts: dict[str, int] = {"learned": 0, "native launches": 0}

Arguments = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[int]], tuple]


def counts() -> dict[str, int]:
    """Launches learned, kernels left on the entry function (``"entry: <reason>"``) and native
    launches made in this process.

    Example::

        counts()     # {"learned": 3, "native launches": 1200}
    """
    return dict(_counts)


def mode() -> str:
    """``"1"`` (learned launches from C++, the default), ``"0"`` (every call through TileLang's
    entry function) or ``"check"`` (every native launch's bytes compared with the entry function's)."""
    return _MODE


def set_mode(value: str) -> str:
    """Set :func:`mode` for this process (benchmarks time both ways in one run); returns the previous one.

    Example::

        previous = set_mode("0")
    """
    global _MODE
    if value not in ("0", "1", "check"):
        raise ValueError(f"native launch mode must be '0', '1' or 'check', got {value!r}")
    previous, _MODE = _MODE, value
    return previous


def _entry(reason: str) -> bool:
    _counts[f"entry: {reason}"] = _counts.get(f"entry: {reason}", 0) + 1
    return False


@dataclass(frozen=True)
class ParamMap:
    """Where each argument goes in a kernel's parameter bytes: (argument, offset) of parameters
    holding a tensor argument's address, directly (``pointers``) or as a TMA descriptor's
    (``tensor_maps``); (argument, offset, size) of integer scalar parameters (``scalars``)."""

    pointers: tuple[tuple[int, int], ...] = ()
    tensor_maps: tuple[tuple[int, int], ...] = ()
    scalars: tuple[tuple[int, int, int], ...] = ()


def scalar_bytes(value: int, size: int) -> bytes:
    """``value`` as an integer kernel parameter of ``size`` bytes (little endian; wraps)."""
    return (int(value) & ((1 << (8 * size)) - 1)).to_bytes(size, "little")


def perturbed(value: int, index: int) -> int:
    """A value that differs from ``value``, and from the other scalars' perturbations."""
    return value + index + 1


def map_params(params: Sequence[tuple[int, int]], blob: bytes, changed: bytes, tensors: dict[int, int],
               scalars: dict[int, tuple[int, int]], holds_address: Callable[[bytes, int], bool]) -> ParamMap | str:
    """The :class:`ParamMap` of a kernel's parameters, or why they cannot be told apart.

    Args:
        params: (offset, size) of each parameter.
        blob: The parameters' bytes of a launch.
        changed: Those of the same launch with every scalar argument changed.
        tensors: Address of each tensor argument that changes between calls, by argument index.
        scalars: (value, changed value) of each integer argument that changes between calls, by argument index.
        holds_address: Whether a TMA descriptor's bytes hold a given address.

    Returns:
        The map; or the reason (a str) if a parameter changed that no one scalar explains, an
        address is two arguments', an argument has no address (an empty tensor), or an argument
        is in no parameter.
    """
    addresses = list(tensors.values())
    if 0 in addresses or len(set(addresses)) != len(addresses):
        return "an empty tensor, or two tensors at one address"
    by_address = {a: i for i, a in tensors.items()}
    pointers, tensor_maps, found_scalars = [], [], []
    for offset, size in params:
        now, then = blob[offset:offset + size], changed[offset:offset + size]
        if now != then:
            matches = [i for i, (v, w) in scalars.items() if size in (4, 8) and now == scalar_bytes(v, size)
                       and then == scalar_bytes(w, size)]
            if len(matches) != 1:
                return f"the parameter at byte {offset} ({size} bytes) changed with {len(matches)} scalars"
            found_scalars.append((matches[0], offset, size))
        elif size == 8 and int.from_bytes(now, "little") in by_address:
            pointers.append((by_address[int.from_bytes(now, "little")], offset))
        elif size == TENSOR_MAP_BYTES:
            holders = [i for i, a in tensors.items() if holds_address(now, a)]
            if len(holders) > 1:
                return f"the TMA descriptor at byte {offset} holds {len(holders)} arguments' addresses"
            if holders:
                tensor_maps.append((holders[0], offset))
    placed = {i for i, _ in pointers} | {i for i, _ in tensor_maps} | {i for i, _, _ in found_scalars}
    if placed != set(tensors) | set(scalars):
        return f"arguments {sorted(set(tensors) | set(scalars) - placed)} are in no parameter"
    return ParamMap(tuple(pointers), tuple(tensor_maps), tuple(found_scalars))


def _holds_address(tensor_map: bytes, address: int) -> bool:
    """Whether the TMA descriptor ``tensor_map`` points at ``address`` (putting it in changes nothing)."""
    buffer = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + 64))()
    aligned = ctypes.addressof(buffer) + (-ctypes.addressof(buffer) % 64)
    ctypes.memmove(aligned, tensor_map, TENSOR_MAP_BYTES)
    if cuda_driver.replace_address(aligned, address) != 0:
        return False
    return ctypes.string_at(aligned, TENSOR_MAP_BYTES) == tensor_map


@dataclass(frozen=True)
class _Places:
    """Where a call's changing arguments stand in the kernel's whole argument list: the tensors'
    addresses and the scalars' values by index there, and each index's number in the launcher's
    call (tensors then outputs; scalars)."""

    addresses: dict[int, int]
    values: dict[int, int]
    tensor_number: dict[int, int]
    scalar_number: dict[int, int]

    def ordered(self, addresses: dict[int, int], values: dict[int, int]) -> tuple[list[int], list[int]]:
        """``addresses`` and ``values`` (by index, as this call's) in the launcher's order."""
        tensors, scalars = [0] * len(self.tensor_number), [0] * len(self.scalar_number)
        for i, n in self.tensor_number.items():
            tensors[n] = addresses[i]
        for i, n in self.scalar_number.items():
            scalars[n] = values[i]
        return tensors, scalars


def places_of(arguments: Arguments, full: tuple, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
              scalars: Sequence[int]) -> _Places | None:
    """Where a call's tensors, outputs and scalars stand in ``full``, the kernel's whole argument
    list that ``arguments(tensors, outputs, scalars)`` began. A tensor stands where it, or a view
    of it at its address (an output reshaped), is passed. None where one is passed twice, another
    argument is a view of one elsewhere in its memory (that address would change unseen), or a
    scalar cannot be placed (found by calling ``arguments`` with every scalar changed)."""
    varying = (*tensors, *outputs)
    moved = arguments(tensors, outputs, [perturbed(v, j) for j, v in enumerate(scalars)])
    storages = [t.untyped_storage().data_ptr() for t in varying]
    positions: list[list[int]] = [[] for _ in varying]
    for i, a in enumerate(full[:len(moved)]):
        if not isinstance(a, torch.Tensor) or a.untyped_storage().data_ptr() not in storages:
            continue
        owners = [n for n, t in enumerate(varying) if a is t or (storages[n] == a.untyped_storage().data_ptr()
                                                                  and a.data_ptr() == t.data_ptr())]
        if len(owners) != 1:
            return None
        positions[owners[0]].append(i)
    if any(len(p) != 1 for p in positions):
        return None
    scalar_at = [i for i, (a, b) in enumerate(zip(full, moved, strict=False))
                 if not isinstance(a, torch.Tensor) and a != b]
    if len(scalar_at) != len(scalars) or any(full[i] != v for i, v in zip(scalar_at, scalars, strict=True)):
        return None
    return _Places(addresses={p[0]: full[p[0]].data_ptr() for p in positions},
                   values={i: full[i] for i in scalar_at},
                   tensor_number={p[0]: n for n, p in enumerate(positions)},
                   scalar_number={i: j for j, i in enumerate(scalar_at)})


class OpLaunch:
    """One kernel call of an op's plan: through the kernel's entry function at its first two
    calls, which teach its parameters, then from C++ (see the module's docstring).

    A learned launch holds what the entry function derived from the call's tensors besides their
    addresses: the sizes of dimensions the kernel leaves dynamic, and the peer tables of
    symmetric tensors. So launches are learned and kept per key of those: the shapes of the
    tensors with dynamic dimensions and the addresses of the symmetric ones (``LEARNED_KEYS``
    keys at most; calls of further keys go through the entry function). Like every plan
    (``tilescale.plans``) they are dropped when symmetric memory or a group goes away.

    Args:
        kernel: The ``tilescale.jit`` kernel.
        arguments: ``arguments(tensors, outputs, scalars)``: the kernel's arguments for a call
            on ``tensors`` (those that change between calls) with ``outputs`` (allocated per call)
            and the integer ``scalars`` that change between calls.
        outputs: The shape of each output a call allocates (``dtype``, else the first tensor's
            dtype; on its device).
        group: The kernel call's ``group=``.
        dtype: The outputs' dtype, if not the first tensor's.
    """

    LEARNED_KEYS = 16

    def __init__(self, kernel: Any, arguments: Arguments, outputs: Sequence[Sequence[int]] = (), *,
                 group: Any = None, dtype: torch.dtype | None = None):
        self.kernel, self.arguments, self.group = kernel, arguments, group
        self.outputs = [tuple(s) for s in outputs]
        self.dtype = dtype
        self._natives = PlanCache(self.LEARNED_KEYS)  # by key: the C++ launcher, the kernel's spans
        self._first = PlanCache(self.LEARNED_KEYS)  # by key: the first call's capture and places
        self._shaped: tuple[int, ...] = ()  # the tensors (by number) whose shapes key a launch
        self._symmetric: tuple[int, ...] = ()  # those whose addresses key it
        self._device: int | None = None  # the CUDA device's index
        self._learning = runtime.device().type == "cuda"

    def _key(self, tensors: Sequence[torch.Tensor]) -> tuple:
        if not (self._shaped or self._symmetric):  # the common case (TP GEMMs): one launch for every call
            return ()
        return (*[tensors[n].shape for n in self._shaped], *[tensors[n].data_ptr() for n in self._symmetric])

    def __call__(self, tensors: Sequence[torch.Tensor], scalars: Sequence[int] = ()) -> Any:
        """Launch on ``tensors`` and ``scalars``; returns the output (None if none, a list if several)."""
        found = self._natives.get(self._key(tensors))
        if found is not None and _MODE == "1":
            runtime.check_device_waits()  # a kernel recorded a failure: raise it (host-memory reads)
            native, runtime.current().last_kernel_spans = found
            try:
                out = native.call(tensors, scalars, torch._C._cuda_getCurrentRawStream(self._device))
            except ValueError:  # a TMA descriptor refused an address: the entry function says why
                return self._entry_call(tensors, scalars, found)
            _counts["native launches"] += 1
            return out
        return self._entry_call(tensors, scalars, found)

    def _allocate(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        dtype = self.dtype or tensors[0].dtype
        return [torch.empty(s, dtype=dtype, device=tensors[0].device) for s in self.outputs]

    def _entry_call(self, tensors: Sequence[torch.Tensor], scalars: Sequence[int], found: tuple | None) -> Any:
        """The call through the kernel's entry function (``found``: the call's learned launch, if
        any), learning the launch or, in mode ``check``, comparing and making it from there."""
        outputs = self._allocate(tensors)
        args = self.arguments(tensors, outputs, scalars)
        launch, full = self.kernel.prepare(*args, group=self.group)
        if found is not None and _MODE == "check" and not torch.cuda.is_current_stream_capturing():
            self._check(found[0], launch, full, tensors, outputs, scalars)
        else:
            if (self._learning and found is None and _MODE != "0" and len(self._natives) < self.LEARNED_KEYS
                    and not torch.cuda.is_current_stream_capturing()):
                self._learn(launch, full, tensors, outputs, scalars)
            launch(*full)
        return None if not outputs else outputs[0] if len(outputs) == 1 else outputs

    def _learn(self, launch: Callable, full: tuple, tensors: Sequence[torch.Tensor],
               outputs: Sequence[torch.Tensor], scalars: Sequence[int]) -> None:
        """At a key's first call: its capture. At its second: the launcher, checked against both calls."""
        module = launcher_module()
        if module is None:
            self._learning = _entry("no C++ launcher")
            return
        places = places_of(self.arguments, full, tensors, outputs, scalars)
        if places is None:
            self._learning = _entry("arguments not placed")
            return
        at = {i: n for i, n in places.tensor_number.items() if n < len(tensors)}  # the call's tensors' positions
        self._shaped = tuple(sorted(n for i, n in at.items() if i in self.kernel.dynamic_arguments))
        self._symmetric = tuple(sorted(n for i, n in at.items() if i in self.kernel.peer_arguments))
        key = self._key(tensors)
        device = tensors[0].device
        try:
            captured = cuda_driver.capture_kernel(lambda: launch(*full), device)
            if captured is None:
                self._learning = _entry("the entry function enqueues other than one kernel")
                return
            earlier = self._first.get(key)
            if earlier is None:
                self._first.put(key, (captured, places))
                return
            changed_full = list(full)
            for i, v in places.values.items():
                changed_full[i] = perturbed(v, places.scalar_number[i])
            changed = cuda_driver.capture_kernel(lambda: launch(*changed_full), device)
        except Exception as e:  # noqa: BLE001 - the entry refused changed scalars, or the driver a call
            self._learning = _entry(f"{type(e).__name__}: {e}"[:200])
            return
        first, first_places = earlier
        self._first.put(key, None)
        if (changed is None or changed.params != captured.params or first.params != captured.params
                or (first.func, first.grid, first.block) != (captured.func, captured.grid, captured.block)):
            self._learning = _entry("the launch differs between calls")
            return
        if (first_places.tensor_number, first_places.scalar_number) != (places.tensor_number, places.scalar_number):
            self._learning = _entry("the first call's arguments stand elsewhere")
            return
        moved = {i: (v, changed_full[i]) for i, v in places.values.items()}
        found = map_params(captured.params, captured.blob, changed.blob, places.addresses, moved, _holds_address)
        if isinstance(found, str):
            self._learning = _entry(f"parameters not told apart: {found}")
            return
        tn, sn = places.tensor_number, places.scalar_number
        try:
            native = module.Launcher(
                captured.func, list(captured.grid), list(captured.block), captured.shared_bytes, captured.attributes,
                [o for o, _ in captured.params], captured.blob, [(tn[i], o) for i, o in found.pointers],
                [(tn[i], o) for i, o in found.tensor_maps], [(sn[i], o, size) for i, o, size in found.scalars],
                self.outputs, self.dtype)
        except RuntimeError as e:  # a layout the launcher does not take
            self._learning = _entry(f"launcher refused: {e} (parameters {captured.params}, map {found})"[:400])
            return
        for record, at_call in ((first, first_places), (captured, places)):  # both calls' bytes, rebuilt
            native.forget_addresses()
            if not native.write(*places.ordered(at_call.addresses, at_call.values)) or native.blob() != record.blob:
                self._learning = _entry("the map does not rebuild the calls' parameters")
                return
        self._natives.put(key, (native, runtime.current().last_kernel_spans))
        self._device = device.index
        _counts["learned"] += 1

    def _check(self, native: Any, launch: Callable, full: tuple, tensors: Sequence[torch.Tensor],
               outputs: Sequence[torch.Tensor], scalars: Sequence[int]) -> None:
        """Write the call into its learned launcher and launch it from there, after checking that
        its bytes are the entry function's (a capture of it); raise if not."""
        captured = cuda_driver.capture_kernel(lambda: launch(*full), tensors[0].device)
        addresses = [t.data_ptr() for t in (*tensors, *outputs)]
        if captured is None or not native.write(addresses, list(scalars)) or native.blob() != captured.blob:
            raise RuntimeError("native launch: the parameters written differ from the entry function's "
                               f"({self.kernel!r}); set TILESCALE_NATIVE_LAUNCH=0 and report this")
        native.launch(torch._C._cuda_getCurrentRawStream(self._device))
        _counts["checked launches"] = _counts.get("checked launches", 0) + 1
