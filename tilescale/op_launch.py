"""An op's kernel calls, whose launches are learned at their first calls and then made from C++.

Example::

    call = OpLaunch([(kernel, lambda t, out, s: (t[0], t[1], ex.buffers, out[0], board, s[0]))],
                    outputs=[(m, n)], group=group)
    out = call((a, weight), (ident,))          # in an op's plan, whose key fixes shapes and dtypes

An eager kernel call through TileLang's entry function costs about a kernel launch on the
host, and an op's Python around it as much again (the outputs' allocation, the hidden
arguments' lookup: ``benchmarks/host_cost.py --breakdown``). An op's plan fixes everything but
its tensors' addresses and a few scalars (the call identity), so after two calls the kernels'
parameters are known: the C++ program (``tilescale/csrc/launcher.cpp``) allocates the outputs,
writes the addresses (into TMA descriptors too) and scalars into each kernel's learned parameter
bytes and calls ``cuLaunchKernelEx`` for each, in one call from Python.

Which parameter bytes belong to which argument is found, not assumed: each entry function's launch
is captured (a CUDA stream capture: nothing runs), and again with every scalar changed; a pointer
parameter is an argument's whose address it holds, a TMA descriptor an argument's if putting that
argument's address into it changes nothing, a scalar parameter the one scalar whose change changed
it. Any other change, or a parameter that two arguments could explain, leaves the call on the entry
functions. The map must then rebuild the first call's parameters exactly, and the second's.

An op whose repeated calls need nothing per call but their tensors' layouts and its call
identity goes further: :class:`Direct` sends such a call straight to the learned program, the
layouts compared and the call numbered in C++, without the op's Python path.

``TILESCALE_NATIVE_LAUNCH``: ``1`` (default), ``0`` (every call through the entry function),
``check`` (every learned launch's bytes compared with a capture of the entry function's: tests).
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tilescale import cuda_driver, runtime
from tilescale.native import launcher_module
from tilescale.plans import PlanCache, capturing

TENSOR_MAP_BYTES = 128  # sizeof(CUtensorMap)
_MODE = os.environ.get("TILESCALE_NATIVE_LAUNCH", "1")
# What this process did: launches learned, calls left on the entry function (by reason); the
# native launches are counted in C++ (every Program's call).
_counts: dict[str, int] = {"learned": 0}

Arguments = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor], Sequence[int]], tuple]


def counts() -> dict[str, int]:
    """Launches learned, kernels left on the entry function (``"entry: <reason>"``), native
    launches and direct calls made in this process.

    Example::

        counts()     # {"learned": 3, "native launches": 1200, "direct calls": 900}

    Native launches and direct calls (:class:`Direct`) are counted in C++.
    """
    module = launcher_module() if _counts["learned"] else None  # learned nothing: nothing launched natively
    native = (module.native_launches(), module.direct_calls()) if module is not None else (0, 0)
    return {**_counts, "native launches": native[0], "direct calls": native[1]}


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
    (``tensor_maps``); (argument, offset, size) of integer scalar parameters (``scalars``); the
    tensor arguments found in no parameter (``unplaced``: the kernel must be shown not to take them)."""

    pointers: tuple[tuple[int, int], ...] = ()
    tensor_maps: tuple[tuple[int, int], ...] = ()
    scalars: tuple[tuple[int, int, int], ...] = ()
    unplaced: tuple[int, ...] = ()


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
        The map (scalars in no parameter left out: the kernel does not take them; tensors in no
        parameter listed); or the reason (a str) if a parameter changed that no one scalar
        explains, an address is two arguments', or a tensor has no address (an empty tensor).
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
    # A scalar that changed no parameter is one the compiled kernel does not take (TileLang drops
    # unused parameters; a launch it shaped would differ between the captures, which the caller
    # compares): each call's value goes nowhere. A tensor found nowhere may be one it does not
    # take, or one it takes in a form not recognised: the caller tells which (``unplaced``).
    unplaced = set(tensors) - {i for i, _ in pointers} - {i for i, _ in tensor_maps}
    return ParamMap(tuple(pointers), tuple(tensor_maps), tuple(found_scalars), tuple(sorted(unplaced)))


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
    """Where a call's changing arguments stand in one kernel's whole argument list: the tensors'
    addresses and the scalars' values by index there, and each index's number in the call
    (tensors then outputs; scalars). A kernel of several in an op may take some of them only.
    A tensor passed more than once (at one address) stands at its first index; ``also`` numbers
    its other indices."""

    addresses: dict[int, int]
    values: dict[int, int]
    tensor_number: dict[int, int]
    scalar_number: dict[int, int]
    also: dict[int, int]

    def every_index(self) -> dict[int, int]:
        """Each index holding one of the call's tensors, with its number (``also``'s too)."""
        return {**self.tensor_number, **self.also}

    def ordered(self, addresses: dict[int, int], values: dict[int, int], tensors: int,
                scalars: int) -> tuple[list[int], list[int]]:
        """``addresses`` and ``values`` (by index, as this call's) in the launcher's order, for a
        call of ``tensors`` tensors and outputs and ``scalars`` scalars (those not taken: 0)."""
        at, of = [0] * tensors, [0] * scalars
        for i, n in self.tensor_number.items():
            at[n] = addresses[i]
        for i, n in self.scalar_number.items():
            of[n] = values[i]
        return at, of


def places_of(arguments: Arguments, full: tuple, tensors: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
              scalars: Sequence[int]) -> _Places | None:
    """Where a call's tensors, outputs and scalars stand in ``full``, the kernel's whole argument
    list that ``arguments(tensors, outputs, scalars)`` began. A tensor stands where it, or a view
    of it at its address (an output reshaped, a two-shot reduction's source and its first row),
    is passed; a scalar where changing it (calling ``arguments`` with every scalar changed)
    changes an argument to its changed value. None where another argument is a view of one
    elsewhere in its memory (that address would change unseen), or an argument changed that no
    one scalar explains."""
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
    scalar_number: dict[int, int] = {}
    for i, (a, b) in enumerate(zip(full, moved, strict=False)):
        if isinstance(a, torch.Tensor) or a == b:
            continue
        which = [j for j, v in enumerate(scalars) if a == v and b == perturbed(v, j)]
        if len(which) != 1 or which[0] in scalar_number.values():
            return None
        scalar_number[i] = which[0]
    return _Places(addresses={p[0]: full[p[0]].data_ptr() for p in positions if p},
                   values={i: full[i] for i in scalar_number},
                   tensor_number={p[0]: n for n, p in enumerate(positions) if p},
                   scalar_number=scalar_number,
                   also={i: n for n, p in enumerate(positions) for i in p[1:]})


@dataclass(frozen=True)
class Output:
    """An output each ``OpLaunch`` call allocates.

    Example::

        Output((m, n))                                  # the call's first tensor's dtype
        Output((world, tokens), torch.int32, packed=True)

    Args:
        shape: Its shape.
        dtype: Its dtype; None: the call's first tensor's.
        packed: Viewed in the call's one allocation of packed outputs (``PACK_ALIGN``-aligned):
            one allocation for an op's small outputs instead of one each (their memory goes
            back when all of them are dropped). Needs ``dtype``.
        returned: Whether the call returns it; False: scratch the kernels write and read (a packed
            output: the C++ program makes, wraps and frees no tensor for it).
    """

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None
    packed: bool = False
    returned: bool = True


@dataclass(frozen=True)
class View:
    """A view each ``OpLaunch`` call returns after its outputs: of output ``of``'s bytes (an output
    with a dtype and an allocation of its own) as ``dtype``, ``shape`` and ``strides`` from element
    ``offset`` (elements of ``dtype``). Kernels take the output, not its views: they cost the call
    no view op (the FP8 dispatch's rows as values and scales).

    Example::

        View(0, (rows, hidden), torch.float8_e4m3fn, (width, 1))          # output 0: (rows, width) bytes
    """

    of: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    strides: tuple[int, ...]
    offset: int = 0


# Bytes each packed output is aligned to: kernels' vector accesses may assume their tensors start
# aligned, as torch's allocations do.
PACK_ALIGN = 256


def packed_layout(outputs: Sequence[Output]) -> tuple[list[int], int]:
    """Each output's byte offset in the packed allocation (-1: an allocation of its own), and its size.

    Example::

        packed_layout([Output((3,), torch.int32, True), Output((8, 8))])   # ([0, -1], 256)
    """
    offsets, end = [], 0
    for o in outputs:
        if not o.packed:
            offsets.append(-1)
            continue
        if o.dtype is None:
            raise ValueError(f"a packed output needs its dtype: {o}")
        offsets.append(end)
        end += max(1, -(-math.prod(o.shape) * o.dtype.itemsize // PACK_ALIGN)) * PACK_ALIGN
    return offsets, end


class OpLaunch:
    """An op's kernel calls, in order: through the kernels' entry functions at a key's first two
    calls, which teach their parameters, then from C++, all in one call (see the module's docstring).

    Learned launches hold what the entry functions derived from the call's tensors besides their
    addresses: the sizes of dimensions a kernel leaves dynamic, and the peer tables of symmetric
    tensors. So launches are learned and kept per key of those: the shapes of the tensors with
    dynamic dimensions and the addresses of the symmetric ones (``LEARNED_KEYS`` keys at most;
    calls of further keys go through the entry functions). Like every plan (``tilescale.plans``)
    they are dropped when symmetric memory or a group goes away.

    Example::

        call = OpLaunch([(route, lambda t, o, s: (t[1], o[0], s[0])),
                         (send, lambda t, o, s: (t[0], o[0], o[1], board, s[1]))],
                        [Output((world, tokens), torch.int32, packed=True), Output((rows, hidden))], group=group)
        slots, rows = call((x, idx), (watch, ident))

    Args:
        steps: ``(kernel, arguments)`` of each kernel in launch order: a ``tilescale.jit`` kernel,
            and ``arguments(tensors, outputs, scalars)``, its arguments for a call on ``tensors``
            (those that change between calls) with ``outputs`` (allocated per call) and the
            integer ``scalars`` that change between calls. A kernel may take some of them only.
        outputs: What each call allocates: an :class:`Output`, or a shape (the first tensor's
            dtype, on its device). A call returns those it returns (all but scratch), in order.
        views: What each call returns after its outputs: views of them (:class:`View`).
        group: The kernel calls' ``group=``.
    """

    LEARNED_KEYS = 16

    def __init__(self, steps: Sequence[tuple[Any, Arguments]], outputs: Sequence[Output | Sequence[int]] = (), *,
                 views: Sequence[View] = (), group: Any = None):
        self.steps = [(kernel, arguments) for kernel, arguments in steps]
        self._kernels = len(self.steps)
        self.group = group
        self.outputs = [o if isinstance(o, Output) else Output(tuple(o)) for o in outputs]
        self.views = list(views)
        if bad := [v for v in self.views if not 0 <= v.of < len(self.outputs) or self.outputs[v.of].packed
                   or self.outputs[v.of].dtype is None]:
            raise ValueError(f"a view is of an output with a dtype and an allocation of its own: {bad}")
        if bad := [o for o in self.outputs if not (o.returned or o.packed)]:
            raise ValueError(f"an output not returned is a packed one: {bad}")
        self._returned = [i for i, o in enumerate(self.outputs) if o.returned]
        self._offsets, self._packed_bytes = packed_layout(self.outputs)
        # Each output's contiguous strides, for the entry path's views of the packed bytes.
        self._strides = [[math.prod(o.shape[i + 1:]) for i in range(len(o.shape))] for o in self.outputs]
        self._natives = PlanCache(self.LEARNED_KEYS)  # by key: the C++ program, its launchers, the kernels' spans
        self._first = PlanCache(self.LEARNED_KEYS)  # by key: the first call's captures and places
        self._shaped: tuple[int, ...] = ()  # the tensors (by number) whose shapes key a launch
        self._symmetric: tuple[int, ...] = ()  # those whose addresses key it
        self._keyed = False  # whether any do (else every call has the one key ())
        self._wait_failed: type[Exception] = RuntimeError  # the module's DeviceWaitFailed, once learned
        self._device: int | None = None  # the CUDA device's index
        self._learning = runtime.device().type == "cuda"

    def _key(self, tensors: Sequence[torch.Tensor]) -> tuple:
        """The key of a call's learned launch (() for most: the TP GEMMs have one launch for every call)."""
        return (*[tensors[n].shape for n in self._shaped], *[tensors[n].data_ptr() for n in self._symmetric])

    def __call__(self, tensors: Sequence[torch.Tensor], scalars: Sequence[int] = ()) -> Any:
        """Launch on ``tensors`` and ``scalars``; returns the output (None if none, a list if several)."""
        found = self._natives.get(self._key(tensors) if self._keyed else ())
        if found is not None and _MODE == "1":
            program, _, runtime.current().last_kernel_spans = found  # what a failed wait names
            try:
                out = program.call(tensors, scalars, torch._C._cuda_getCurrentRawStream(self._device))
            except ValueError:  # a TMA descriptor refused an address: the entry function says why
                return self._entry_call(tensors, scalars, found)
            except self._wait_failed:  # a kernel recorded a failure (the program read it): nothing launched
                runtime.check_device_waits()
                raise
            return out
        return self._entry_call(tensors, scalars, found)

    def native(self, tensors: Sequence[torch.Tensor]) -> tuple[Any, tuple] | None:
        """The C++ program learned for calls on ``tensors`` and the kernels' spans (what a failed
        wait names); None if none is, or if symmetric tensors' addresses key the launches (a
        :class:`Direct` site tells calls apart by their tensors' layouts only)."""
        if self._symmetric or _MODE != "1":
            return None
        found = self._natives.get(self._key(tensors) if self._keyed else ())
        return None if found is None else (found[0], found[2])

    def _allocate(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A call's outputs, laid out as the C++ program lays them out: each packed one a strided
        view of the packed bytes viewed as its dtype (one view op per output)."""
        device = tensors[0].device
        packed = torch.empty(self._packed_bytes, dtype=torch.uint8, device=device) if self._packed_bytes else None
        as_dtype: dict[torch.dtype, torch.Tensor] = {}
        made = []
        for o, offset, strides in zip(self.outputs, self._offsets, self._strides, strict=True):
            dtype = o.dtype or tensors[0].dtype
            if offset < 0:
                made.append(torch.empty(o.shape, dtype=dtype, device=device))
                continue
            if dtype not in as_dtype:
                as_dtype[dtype] = packed.view(dtype)
            made.append(as_dtype[dtype].as_strided(o.shape, strides, offset // dtype.itemsize))
        return made

    def _with_views(self, outputs: list[torch.Tensor]) -> Any:
        """A call's result: its outputs and views (None if none, the one, or a list)."""
        made = [outputs[i] for i in self._returned]
        made += [outputs[v.of].view(v.dtype).as_strided(v.shape, v.strides, v.offset) for v in self.views]
        return None if not made else made[0] if len(made) == 1 else made

    def _entry_call(self, tensors: Sequence[torch.Tensor], scalars: Sequence[int], found: tuple | None) -> Any:
        """The call through the kernels' entry functions (``found``: the call's learned launch, if
        any), learning the launch or, in mode ``check``, comparing and making it from there."""
        outputs = self._allocate(tensors)
        rt, prepared, spans = runtime.current(), [], ()
        for kernel, arguments in self.steps:  # every check of every kernel's call before any launch
            rt.last_kernel_spans = ()  # a kernel with no peer tables sets none
            prepared.append(kernel.prepare(*arguments(tensors, outputs, scalars), group=self.group))
            spans += rt.last_kernel_spans
        rt.last_kernel_spans = spans
        in_capture = capturing(tensors[0])
        if found is not None and _MODE == "check" and not in_capture:
            self._check(found[1], prepared, tensors, outputs, scalars)
        else:
            if (self._learning and found is None and _MODE != "0" and len(self._natives) < self.LEARNED_KEYS
                    and not in_capture):
                self._learn(prepared, tensors, outputs, scalars, spans)
            for launch, full in prepared:
                launch(*full)
        return self._with_views(outputs)

    def _learn(self, prepared: list[tuple[Callable, tuple]], tensors: Sequence[torch.Tensor],
               outputs: Sequence[torch.Tensor], scalars: Sequence[int], spans: tuple) -> None:
        """At a key's first call: its captures. At its second: the launchers, checked against both
        calls, and the program that makes them."""
        module = launcher_module()
        if module is None:
            self._learning = _entry("no C++ launcher")
            return
        places = [places_of(arguments, full, tensors, outputs, scalars)
                  for (_, arguments), (_, full) in zip(self.steps, prepared, strict=True)]
        if any(p is None for p in places):
            self._learning = _entry("arguments not placed")
            return
        n = len(tensors)  # the call's tensors' numbers (outputs come after): what keys a launch
        self._shaped = tuple(sorted({t for (kernel, _), p in zip(self.steps, places, strict=True)
                                     for i, t in p.every_index().items() if t < n and i in kernel.dynamic_arguments}))
        self._symmetric = tuple(sorted({t for (kernel, _), p in zip(self.steps, places, strict=True)
                                        for i, t in p.every_index().items() if t < n and i in kernel.peer_arguments}))
        self._keyed = bool(self._shaped or self._symmetric)
        self._wait_failed = module.DeviceWaitFailed
        key = self._key(tensors)
        device = tensors[0].device
        try:
            captured = [cuda_driver.capture_kernel(lambda f=launch, a=full: f(*a), device) for launch, full in prepared]
            if any(c is None for c in captured):
                self._learning = _entry("the entry function enqueues other than one kernel")
                return
            earlier = self._first.get(key)
            if earlier is None:
                self._first.put(key, (captured, places))
                return
            moved = []
            for (launch, full), p in zip(prepared, places, strict=True):
                changed_full = list(full)
                for i, v in p.values.items():
                    changed_full[i] = perturbed(v, p.scalar_number[i])
                moved.append((cuda_driver.capture_kernel(lambda f=launch, a=changed_full: f(*a), device),
                              {i: (v, changed_full[i]) for i, v in p.values.items()}))
        except Exception as e:  # noqa: BLE001 - the entry refused changed scalars, or the driver a call
            self._learning = _entry(f"{type(e).__name__}: {e}"[:200])
            return
        self._first.put(key, None)
        counts = (n + len(outputs), len(scalars))
        launchers = []
        for index, step in enumerate(zip(*earlier, captured, places, moved, strict=True)):
            def untaken(arguments: Sequence[int], index: int = index) -> bool:
                # A tensor whose address keys the launch (a symmetric one) needs no parameter of its
                # own: what the kernel reaches it by, its peer table (a reduction reading every
                # rank's copy may take nothing else), is fixed by the address and learned with the
                # key. Any other tensor found nowhere must be shown not taken.
                numbers = [places[index].tensor_number[i] for i in arguments]
                rest = [t for t in numbers if t not in self._symmetric]
                return not rest or self._untaken(index, rest, captured[index], tensors, outputs, scalars)
            launcher = _launcher(module, *step, counts, untaken)
            if isinstance(launcher, str):
                self._learning = _entry(launcher)
                return
            launchers.append(launcher)
        program = module.Program(launchers, [(list(o.shape), o.dtype, offset)
                                             for o, offset in zip(self.outputs, self._offsets, strict=True)],
                                 self._packed_bytes,
                                 [(v.of, list(v.shape), list(v.strides), v.offset, v.dtype) for v in self.views],
                                 [i for i, o in enumerate(self.outputs) if not o.returned])
        self._natives.put(key, (program, launchers, spans))
        self._device = device.index
        _counts["learned"] += 1

    def _untaken(self, index: int, numbers: Sequence[int], captured: Any, tensors: Sequence[torch.Tensor],
                 outputs: Sequence[torch.Tensor], scalars: Sequence[int]) -> bool:
        """Whether step ``index``'s kernel does not take the call's tensors ``numbers`` (tensors then
        outputs): its launch, captured with those elsewhere in memory, has ``captured``'s bytes."""
        kernel, arguments = self.steps[index]
        moved = [torch.empty_like(t) if n in numbers else t for n, t in enumerate((*tensors, *outputs))]
        try:
            launch, full = kernel.prepare(*arguments(moved[:len(tensors)], moved[len(tensors):], scalars),
                                          group=self.group)
            again = cuda_driver.capture_kernel(lambda: launch(*full), tensors[0].device)
        except Exception:  # noqa: BLE001 - the entry refused the substitutes (a symmetric tensor): taken
            return False
        return again is not None and again.blob == captured.blob

    def _check(self, launchers: list[Any], prepared: list[tuple[Callable, tuple]], tensors: Sequence[torch.Tensor],
               outputs: Sequence[torch.Tensor], scalars: Sequence[int]) -> None:
        """Write the call into its learned launchers and launch it from there, after checking that
        each kernel's bytes are its entry function's (a capture of it); raise if not."""
        addresses = [t.data_ptr() for t in (*tensors, *outputs)]
        for launcher, (launch, full) in zip(launchers, prepared, strict=True):
            captured = cuda_driver.capture_kernel(lambda f=launch, a=full: f(*a), tensors[0].device)
            if captured is None or not launcher.write(addresses, list(scalars)) or launcher.blob() != captured.blob:
                raise RuntimeError("native launch: the parameters written differ from the entry function's "
                                   f"({self.steps!r}); set TILESCALE_NATIVE_LAUNCH=0 and report this")
        stream = torch._C._cuda_getCurrentRawStream(self._device)
        for launcher in launchers:
            launcher.launch(stream)
        _counts["checked launches"] = _counts.get("checked launches", 0) + len(launchers)


# What a :class:`Direct` call returns where it made none: the caller takes the op's Python path.
MISSED = NotImplemented


class Direct:
    """One op's repeated calls made straight from C++, without the op's Python path.

    Example::

        _direct = Direct()

        def gemm_all_reduce(a, weight, plan=None, *, group=None):
            site = ("gemm_all_reduce", plan, group)      # the op's arguments besides its tensors
            out = _direct(site, (a, weight))
            if out is not MISSED:
                return out
            ...                                          # the op's path: checks, plan, its OpLaunch call
            _direct.learn(site, call, (a, weight), state, sig)

    An op's plan is keyed by its other arguments and its tensors' layouts (shape, dtype, device,
    contiguity), which its first call checked. Here the other arguments key a *site* in Python;
    the site (``launcher.cpp``'s ``Site``) compares the call's tensors' layouts with those each
    of its programs was learned on, and on a match, outside a stream capture, runs that program
    with the call's identity as its last scalar: the group's next call number (the counter
    ``call_identity`` numbers the group's calls in) and the plan's signature, which the kernels
    check the ranks agree on, as every call through the op's path. So a repeated call costs a
    lookup and one C++ call. Scalars that differ from call to call besides the identity (a
    dispatch's id-check word) the call passes. An op whose kernels take no identity (a
    rank-local op; a combine, whose signature names its dispatch and takes no call number, as
    on its path) learns with ``sig=None``. Any other call (another layout, a capture, not tensors, an
    address a TMA descriptor refuses) returns :data:`MISSED` having done nothing. Sites are plans: they
    go at every invalidation (``tilescale.plans``), and with ``TILESCALE_NATIVE_LAUNCH`` other
    than ``1`` there are none.

    Args:
        limit: Sites kept (op arguments), and programs per site, at most.
    """

    def __init__(self, limit: int = OpLaunch.LEARNED_KEYS):
        self.limit = limit
        self._sites = PlanCache(limit)  # by site: the C++ site, the device's index, the module's DeviceWaitFailed

    def __call__(self, site: tuple, tensors: tuple, scalars: tuple = (), found: Any = None) -> Any:
        """The call's outputs (as its OpLaunch returns them), or :data:`MISSED`.

        Args:
            site: The op's arguments besides its tensors.
            tensors: The call's tensors.
            scalars: The call's scalars other than its identity, which comes last (a dispatch's
                id-check word; a combine's signature, which names its dispatch and no call number).
            found: What :meth:`find` gave for ``site`` just before, if the caller asked (one
                lookup a call, not two).
        """
        if found is None:
            found = self.find(site)
            if found is None:
                return MISSED
        native, device, wait_failed = found
        try:
            return native.call(tensors, torch._C._cuda_getCurrentRawStream(device), scalars)
        except (TypeError, ValueError):  # not tensors (the op's checks say so), or a refused address: nothing done
            return MISSED
        except wait_failed:  # a kernel recorded a failure: nothing launched
            runtime.check_device_waits()
            raise

    def find(self, site: tuple) -> Any:
        """The site's entry if calls at ``site`` may go direct (a program learned there, native
        launches on), else None. A caller with per-call work before the call (a dispatch's
        id-check word) asks first, and passes the entry to the call as ``found``."""
        return self._sites.get(site) if _MODE == "1" else None

    def learn(self, site: tuple, call: OpLaunch, tensors: tuple, state: Any = None, sig: int | None = None) -> None:
        """After a call through the op's path that ran ``call`` on ``tensors`` with the identity of
        ``sig`` on ``state``'s group as its last scalar, or with no identity where ``sig`` is None
        (a site's calls are all of one kind), outside a capture: its learned program, if any, for
        later calls at ``site`` with tensors of these layouts."""
        learned = call.native(tensors)
        if learned is None:
            return
        found = self._sites.get(site)
        if found is None:
            module = launcher_module()
            found = self._sites.put(site, (module.Site(None if sig is None else state.call_counter),
                                           tensors[0].device.index, module.DeviceWaitFailed))
        native = found[0]
        if len(native) < self.limit and not native.covers(tensors):
            native.add(tensors, learned[0], -1 if sig is None else sig, runtime.current(), learned[1])


def _launcher(module: ModuleType, first: Any, first_places: _Places, captured: Any, places: _Places,
              moved: tuple[Any, dict[int, tuple[int, int]]], counts: tuple[int, int],
              untaken: Callable[[Sequence[int]], bool]) -> Any:
    """One kernel's C++ launcher from its captures at a key's two learning calls (``moved``: the
    second's capture with every scalar changed, and the scalars' values), checked to rebuild both
    calls' parameter bytes; or why it cannot be made (a str). ``counts``: the addresses and
    scalars a call passes; ``untaken(arguments)``: whether the kernel does not take those tensor
    arguments (found in no parameter)."""
    changed, values = moved
    shape = (captured.func, captured.grid, captured.block, captured.params)
    if changed is None or (first.func, first.grid, first.block, first.params) != shape or (
            changed.func, changed.grid, changed.block, changed.params) != shape:
        return "the launch differs between calls"
    if (first_places.every_index(), first_places.scalar_number) != (places.every_index(), places.scalar_number):
        return "the first call's arguments stand elsewhere"
    found = map_params(captured.params, captured.blob, changed.blob, places.addresses, values, _holds_address)
    if isinstance(found, str):
        return f"parameters not told apart: {found}"
    if found.unplaced and not untaken(found.unplaced):
        return f"tensor arguments {list(found.unplaced)} are in no parameter the map knows"
    tn, sn = places.tensor_number, places.scalar_number
    try:
        native = module.Launcher(
            captured.func, list(captured.grid), list(captured.block), captured.shared_bytes, captured.attributes,
            [o for o, _ in captured.params], captured.blob, [(tn[i], o) for i, o in found.pointers],
            [(tn[i], o) for i, o in found.tensor_maps], [(sn[i], o, size) for i, o, size in found.scalars], *counts)
    except RuntimeError as e:  # a layout the launcher does not take
        return f"launcher refused: {e} (parameters {captured.params}, map {found})"[:400]
    for record, at_call in ((first, first_places), (captured, places)):  # both calls' bytes, rebuilt
        native.forget_addresses()
        written = native.write(*at_call.ordered(at_call.addresses, at_call.values, *counts))
        if not written or native.blob() != record.blob:
            return "the map does not rebuild the calls' parameters"
    return native
