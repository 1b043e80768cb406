"""``tilescale.jit``: compile distributed kernels with TileLang and bind their hidden arguments.

Example::

    @ts.jit
    def ring_shift(M, N, block_M, dtype="bfloat16"):
        @T.prim_func
        def main(A: T.Tensor((M, N), dtype), B: T.Tensor((M, N), dtype)):
            ...
        return main

    kernel = ring_shift(4096, 1024, 64)     # compiled once per arguments, then cached
    kernel(A, B)                            # B symmetric: its peer table is passed for you

The factory is TileLang's lazy style (it returns a ``T.prim_func``); every keyword of
``tilelang.jit`` is accepted. A kernel's hidden arguments (see
``tilescale.language.kernel``) are bound per call from the tensors passed, so two kernels,
or one kernel called with different symmetric tensors, never share address state.

Process groups: a kernel runs over the group of the symmetric tensors it is called with
(``T.Scale("device")`` gives the rank and size within it; remote copies, signals and
``T.barrier()`` address its ranks). The group size is a compile-time constant, so the
factory takes a reserved keyword ``group=`` (None: the whole job) naming the group whose
size the kernel is built for; the call takes ``group=`` too, for kernels with no
symmetric argument (barriers only: the whole job otherwise), and checks the tensors'::

    kernel = ring_shift(4096, 1024, 64, group=tp)     # built for tp's size
    kernel(A, B)                                      # B symmetric over tp: runs over tp
    barrier_only(group=tp)(group=tp)
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import tilelang
import torch
import tvm_ffi
from tvm import tirx
from tvm.runtime import Executable

from tilescale import comm, runtime
from tilescale.groups import GroupState
from tilescale.language.scale import (
    ADDRESS,
    PES_PARAM,
    RANK_PARAM,
    STATUS_PARAM,
    SYNC_TABLE_PARAM,
    TIMEOUT_PARAM,
    build_options,
    requested_remote,
)
from tilescale.plans import PlanCache
from tilescale.symmetric import check_group, lookup, peer_table
from tilescale.tir_fixes import coherent_reads, guard_unit_loops, keep_index_arithmetic


def _grid_blocks(func: tirx.PrimFunc) -> int | None:
    """Blocks in the launch grid when they are compile-time constants, else None."""
    extents: dict[str, int | None] = {}

    def visit(node: Any) -> None:
        if isinstance(node, tirx.AttrStmt) and node.attr_key == "thread_extent":
            tag = node.node.thread_tag
            if tag.startswith("blockIdx"):
                extents[tag] = int(node.value) if isinstance(node.value, tirx.IntImm) else None

    tirx.stmt_functor.post_order_visit(func.body, visit)
    if any(v is None for v in extents.values()):
        return None
    blocks = 1
    for v in extents.values():
        blocks *= v
    return blocks


def _has_dynamic_shape(func: tirx.PrimFunc, name: str) -> bool:
    """Whether ``func``'s tensor parameter ``name`` has a dimension that is not a constant."""
    for p in func.params:
        buf = func.buffer_map.get(p)
        if buf is not None and buf.name == name:
            return any(not isinstance(d, tirx.IntImm) for d in buf.shape)
    return False


def _user_params(func: tirx.PrimFunc, hidden: dict[str, str]) -> list[str]:
    names = []
    for p in func.params:
        buf = func.buffer_map.get(p)
        name = buf.name if buf is not None else p.name
        if name not in hidden:
            names.append(name)
    return names


def _normalize_out_idx(out_idx: list[int] | int | None, n_user: int) -> list[int] | None:
    # Hidden parameters follow the user's, so negative indices count from the user's last.
    if out_idx is None:
        return None
    idx = [out_idx] if isinstance(out_idx, int) else list(out_idx)
    for i in idx:
        if not -n_user <= i < n_user:
            raise IndexError(f"out_idx {i} out of range for a kernel with {n_user} parameters")
    return [i % n_user for i in idx]


class DistributedKernel:
    """A compiled kernel that fills in its hidden distributed arguments on every call.

    :func:`jit` constructs it.

    Args:
        func: The ``T.prim_func``, with tilescale's hidden parameters (``tilescale.language.prim_func``).
        out_idx: Parameters the kernel allocates and returns (TileLang's ``out_idx``); None: none.
        **compile_kwargs: Passed to TileLang's compile (``target``, ...); in a job on the CPU path
            with no ``target`` given, the kernel runs in tilescale's interpreter.

    Raises:
        TypeError: ``out_idx`` names a tensor the kernel accesses on other ranks.
        NotImplementedError: ``out_idx`` on the CPU path.
    """

    def __init__(self, func: tirx.PrimFunc, out_idx: list[int] | int | None = None, **compile_kwargs: Any):
        func = keep_index_arithmetic(guard_unit_loops(func))
        attrs = func.attrs if func.attrs is not None else {}
        self.hidden: dict[str, str] = {str(k): str(v) for k, v in dict(attrs.get("tilescale.hidden", {})).items()}
        world = attrs.get("tilescale.world_size")
        self.world_size = int(world) if world is not None else None
        self.params = _user_params(func, self.hidden)
        outputs = _normalize_out_idx(out_idx, len(self.params)) or []
        self.inputs = [name for i, name in enumerate(self.params) if i not in outputs]
        remote_outputs = sorted({arg for arg in self.hidden.values() if arg} - set(self.inputs))
        if remote_outputs:
            raise TypeError(
                f"out_idx makes {', '.join(map(repr, remote_outputs))} an output the kernel allocates, but the "
                "kernel accesses it on other ranks, so it must be a symmetric tensor passed in: drop it from out_idx"
            )
        self.grid_blocks = _grid_blocks(func)
        self.remote = str(attrs.get("tilescale.remote", ADDRESS))
        lowering = comm.device_lowering(self.remote)  # None: the address lowering
        if _runs_on_cpu(compile_kwargs):
            if outputs:
                raise NotImplementedError("CPU path: out_idx is not supported; pass output tensors in")
            from tilescale.interpreter import CpuKernel

            self.kernel = CpuKernel(func)  # runs either lowering's operations
        elif lowering is not None:
            self.kernel = lowering.load(func, outputs, **compile_kwargs)
        else:
            # The attribute keeps TileLang's disk cache from serving a kernel generated without it.
            with coherent_reads():
                self.kernel = tilelang.compile(func.with_attr("tilescale.coherent_reads", 1), out_idx=outputs or None,
                                               **compile_kwargs)
        # Hidden arguments in order: a group's fixed value by name, or _TableOf a user argument.
        self._layout = [name if name in _FIXED else _TableOf(self.inputs.index(arg))
                        for name, arg in self.hidden.items()]
        self._tables = [h.index for h in self._layout if isinstance(h, _TableOf)]  # user arguments
        self._slots = [pos for pos, h in enumerate(self._layout) if isinstance(h, _TableOf)]  # where their tables go
        # User arguments reached by address through device calls: symmetric, but no table to bind.
        self._by_address = [self.inputs.index(str(n)) for n in attrs.get("tilescale.symmetric", [])]
        # What a launch learned once (tilescale.op_launch) must key on: the user arguments whose
        # addresses select hidden arguments, and those whose shapes give the kernel sizes.
        self.peer_arguments = (*self._tables, *self._by_address)
        self.dynamic_arguments = tuple(i for i, name in enumerate(self.inputs) if _has_dynamic_shape(func, name))
        # Per group this kernel has run over (checked at its first call there): the hidden
        # arguments with its fixed values filled in, the tables' slots still None.
        self._fixed: dict[int, tuple[GroupState, list[Any]]] = {}
        # Hidden arguments by (group, addresses of the symmetric arguments), see __call__.
        self._plans = PlanCache()
        self._launch: Callable[..., Any] = self._first_launch

    def get_kernel_source(self) -> str:
        """The generated device source (CUDA C++ for GPU targets)."""
        return self.kernel.get_kernel_source()

    def _check_launch(self, rt: runtime.Runtime, state: GroupState) -> list[Any]:
        """Checks that hold for every call over this group, done at its first call there;
        returns the hidden arguments with the group's fixed values (None where a table goes)."""
        if self.world_size is not None and self.world_size != state.size:
            if state.whole_job:
                raise RuntimeError(f"kernel built for {self.world_size} ranks called in a job of {state.size}")
            raise RuntimeError(f"kernel built for {self.world_size} ranks called over the {state.describe()} of "
                               f"{state.size} ranks: build it with group= of that group (see tilescale.jit)")
        state.backend.check_lowering(self.remote)
        if SYNC_TABLE_PARAM in self.hidden and rt.device.type == "cuda" and self.grid_blocks is not None:
            sms = torch.cuda.get_device_properties(rt.device).multi_processor_count
            if self.grid_blocks > sms:
                raise ValueError(
                    f"this kernel uses T.barrier() across {self.grid_blocks} blocks, but only {sms} are "
                    "guaranteed to be resident at once on this GPU; use at most one block per SM"
                )
        sync = state.allocations[state.sync_workspace.untyped_storage().data_ptr()]
        fixed = {
            RANK_PARAM: state.rank,
            STATUS_PARAM: state.wait_status.data_ptr(),
            TIMEOUT_PARAM: rt.wait_timeout_ns,
            SYNC_TABLE_PARAM: peer_table(sync, 0),
            PES_PARAM: state.pes,
        }
        return [None if isinstance(h, _TableOf) else fixed[h] for h in self._layout]

    def __call__(self, *args: Any, group: Any = None) -> Any:
        """Launch on ``args``; ``group`` (a ``torch.distributed.ProcessGroup``) names the group a
        kernel with no symmetric argument runs over (None: the whole job), and must be the
        symmetric arguments' group where there are some.

        The first call with given symmetric tensors (by address) and group checks them and
        keeps the hidden arguments it found (:mod:`tilescale.plans`); later calls with the same
        ones only look them up. Every call still reads the status the kernels report failed
        waits and disagreeing ranks in."""
        if not self.hidden:
            return self._launch(*args)
        return self._launch(*args, *self._hidden_of(args, group))

    def prepare(self, *args: Any, group: Any = None) -> tuple[Callable[..., Any], tuple]:
        """What a call on ``args`` would launch, without launching: the compiled kernel's launch
        and its whole argument list (``args`` then the hidden arguments), every check a call
        makes done. ``tilescale.op_launch`` learns a kernel's parameters from it.

        Example::

            launch, full = kernel.prepare(a, weight, out, group=group)
            launch(*full)                                  # the same as kernel(a, weight, out, group=group)
        """
        return self._resolved_launch(), (*args, *(self._hidden_of(args, group) if self.hidden else ()))

    def _hidden_of(self, args: tuple, group: Any) -> list[Any]:
        """The hidden arguments of a call on ``args`` over ``group`` (looked up, or checked and kept)."""
        rt = runtime.current()
        runtime.check_device_waits()  # a kernel recorded a failure: raise it (host-memory reads per group)
        if len(args) != len(self.inputs):
            raise TypeError(f"kernel takes {len(self.inputs)} arguments ({', '.join(self.inputs)}), got {len(args)}")
        try:
            key = (group, *[args[i].data_ptr() for i in self._tables])
        except AttributeError:  # not a tensor: _bind says what is wrong
            key = None
        plan = self._plans.get(key)
        if plan is None:
            plan = self._bind(args, group)
            if key is not None and all(key[1:]):  # address 0: a tensor with no elements, nothing to key by
                self._plans.put(key, plan)
        hidden, spans = plan
        # Arguments reached by address are not part of the key: their spans are this call's.
        rt.last_kernel_spans = spans + _spans(self.inputs, args, self._by_address) if self._by_address else spans
        return hidden

    def _bind(self, args: tuple, group: Any) -> tuple[list[Any], tuple[tuple[str, int, int, int], ...]]:
        """The hidden arguments of a call on ``args`` over ``group``, every argument and the group
        checked, and the spans of the arguments with peer tables (``Runtime.last_kernel_spans``;
        the plan's key fixes their addresses)."""
        rt = runtime.current()
        tables, state = self._peer_tables(args)
        if state is None or group is not None:
            wanted = runtime.group_state(group)
            if state is not None:
                check_group(state, wanted, f"argument '{self.inputs[[*self._tables, *self._by_address][0]]}'")
            state = wanted
        found = self._fixed.get(id(state))
        if found is None or found[0] is not state:  # a released group's id may be reused
            found = self._fixed[id(state)] = (state, self._check_launch(rt, state))
        hidden = found[1].copy()
        for slot, table in zip(self._slots, tables, strict=True):
            hidden[slot] = table
        if self._resolved_launch() is not self.kernel:  # TVM-FFI's entry function: the tables converted once
            hidden = [tvm_ffi.from_dlpack(h) if isinstance(h, torch.Tensor) else h for h in hidden]
        return hidden, _spans(self.inputs, args, self._tables)

    def _first_launch(self, *args: Any) -> Any:
        return self._resolved_launch()(*args)

    def _resolved_launch(self) -> Callable[..., Any]:
        """The compiled kernel's launch (:func:`_fastest_launch`), looked up at its first use."""
        if self._launch == self._first_launch:
            self._launch = _fastest_launch(self.kernel)
        return self._launch

    def _peer_tables(self, args: tuple) -> tuple[list[torch.Tensor], GroupState | None]:
        """Peer tables of the arguments accessed on other ranks (in ``_tables`` order), and
        their group (None if none)."""
        tables = []
        state = None
        remote = [*self._tables, *self._by_address]
        for index in remote:
            found = lookup(args[index])
            if found is None:
                raise TypeError(
                    f"argument '{self.inputs[index]}' is accessed on other ranks by this kernel, so it must be a "
                    "symmetric tensor (allocate it with tilescale.empty/zeros)"
                )
            entry, offset = found
            if state is None:
                state = entry.group
            elif entry.group is not state:
                first = self.inputs[remote[0]]
                raise ValueError(f"one kernel call mixes symmetric tensors of two groups: '{first}' of the "
                                 f"{state.describe()}, '{self.inputs[index]}' of the {entry.group.describe()}")
            if index in self._by_address:
                continue
            table = entry.ptr_tables.get(offset)
            tables.append(table if table is not None else peer_table(entry, offset))
        return tables, state


def _spans(names: list[str], args: tuple, indices: list[int]) -> tuple[tuple[str, int, int, int], ...]:
    """(name, address, bytes, element size) of the arguments at ``indices``, to name a flag by its address."""
    return tuple((names[i], args[i].data_ptr(), args[i].numel() * args[i].element_size(), args[i].element_size())
                 for i in indices)


# Hidden arguments that depend on the group (and job), not on the call's tensors.
_FIXED = (RANK_PARAM, STATUS_PARAM, TIMEOUT_PARAM, SYNC_TABLE_PARAM, PES_PARAM)


@dataclass(frozen=True)
class _TableOf:
    """A hidden argument that is the peer table of user argument ``index``."""

    index: int


def _fastest_launch(kernel: Any) -> Callable[..., Any]:
    """The launch of a compiled kernel with the least host work: for TileLang's default
    ``tvm_ffi`` backend, the compiled module's entry function itself (a C function of
    TVM-FFI), which ``JITKernel.__call__`` reaches through its adapter's Python wrapper and
    ``Executable.__call__``, both doing per call what a kernel without ``out_idx`` does not
    need (output allocation, a module attribute lookup); anything else is called as it is."""
    adapter = getattr(kernel, "adapter", None)
    if (getattr(kernel, "execution_backend", None) != "tvm_ffi" or getattr(adapter, "result_idx", None)
            or not hasattr(adapter, "_get_executable")):
        return kernel
    executable = adapter._get_executable()
    # A kernel compiled now holds an Executable; one TileLang loaded from its disk cache, the module.
    module = executable.jit() if isinstance(executable, Executable) else executable
    return module.main


def _runs_on_cpu(compile_kwargs: dict) -> bool:
    """Kernels of a job on the CPU path run in tilescale's interpreter, unless a target is named."""
    return runtime.is_initialized() and runtime.device().type == "cpu" and compile_kwargs.get("target") is None


@contextlib.contextmanager
def _source_lines() -> Iterator[None]:
    # The interpreter names kernel source lines in its errors: have TileLang record them.
    saved = os.environ.get("TILELANG_ENABLE_IR_SPAN")
    os.environ["TILELANG_ENABLE_IR_SPAN"] = "1"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["TILELANG_ENABLE_IR_SPAN"]
        else:
            os.environ["TILELANG_ENABLE_IR_SPAN"] = saved


def _build(factory: Callable[..., Any], args: tuple, kwargs: dict, world: int | None, remote: str | None,
           cpu: bool) -> tirx.PrimFunc:
    spans = _source_lines() if cpu else contextlib.nullcontext()
    with spans, build_options(world_size=world, remote=remote) if world is not None else contextlib.nullcontext():
        func = factory(*args, **kwargs)
    if not isinstance(func, tirx.PrimFunc):
        raise TypeError(f"{factory.__name__} must return a T.prim_func, got {type(func).__name__}")
    return func


def kernel_lowering(group: Any = None) -> str | None:
    """How remote operations of kernels built now for ``group`` (None: the whole job) lower: as
    an enclosing ``build_options(remote=)`` asks, else as the group's backend picks
    (``ts.group_state(group).lowering``: peer addresses inside a node, the backend's device
    calls across nodes); None outside a job.

    Example::

        kernel_lowering(tp)     # "address": TP inside a node
        kernel_lowering(ep)     # "nvshmem": EP across nodes on the nvshmem backend
    """
    requested = requested_remote()
    if requested is not None or not runtime.is_initialized():
        return requested
    return runtime.group_state(group).lowering


class KernelFactory:
    """What :func:`jit` makes of a kernel factory: calling it builds and compiles a
    :class:`DistributedKernel` per arguments (cached), as TileLang's ``JITImpl`` does in its lazy mode.

    Example::

        @ts.jit
        def ring_shift(M, N, block_M, dtype="bfloat16"):
            ...

        kernel = ring_shift(4096, 1024, 64)               # compiled once, then cached
        ring_shift.compile(4096, 1024, 64, group=tp)       # the same, built for tp's size
        print(ring_shift.get_kernel_source(4096, 1024, 64))
        ring_shift.get_tir(4096, 1024, 64)                 # the T.prim_func, not compiled
        ring_shift.cache_clear()

    Every method takes the factory's arguments and tilescale's keyword ``group=`` (the
    process group whose size the kernel is built for; None: the whole job).

    :func:`jit` constructs it.

    Args:
        factory: The kernel factory (returns a ``T.prim_func``); it must not take ``group``.
        out_idx: As TileLang's ``out_idx``, for every kernel it makes.
        compile_kwargs: Passed to TileLang's compile.

    Raises:
        TypeError: the factory has a parameter named ``group``.
    """

    def __init__(self, factory: Callable[..., Any], out_idx: list[int] | int | None, compile_kwargs: dict):
        if "group" in inspect.signature(factory).parameters:
            raise TypeError(f"{factory.__name__}: the factory keyword 'group' is tilescale.jit's (the process group "
                            "a kernel is built for); rename the factory's parameter")
        functools.update_wrapper(self, factory)
        self.factory = factory
        self.out_idx = out_idx
        self.compile_kwargs = compile_kwargs
        self._compiled: dict[tuple, DistributedKernel] = {}  # by arguments, world size and lowering
        self._by_group = PlanCache()  # by arguments, group and requested lowering: no group size lookup

    def __call__(self, *args: Any, group: Any = None, **kwargs: Any) -> DistributedKernel:
        """The kernel of these arguments built for ``group``'s size (see :meth:`compile`)."""
        if not runtime.is_initialized():
            return self.compile(*args, group=group, **kwargs)
        try:
            key = (args, tuple(sorted(kwargs.items())) if kwargs else (), group, requested_remote())
            kernel = self._by_group.get(key)
        except TypeError:  # unhashable arguments: compile() says so
            key, kernel = None, None
        if kernel is None:
            kernel = self.compile(*args, group=group, **kwargs)
            if key is not None:
                self._by_group.put(key, kernel)
        return kernel

    def compile(self, *args: Any, group: Any = None, **kwargs: Any) -> DistributedKernel:
        """Build and compile the kernel of these arguments (once: later calls return the same kernel).

        Args:
            *args, **kwargs: the factory's arguments.
            group: the process group the kernel is built for (None: the whole job).

        Returns:
            The compiled :class:`DistributedKernel`.
        """
        world, remote = self._options(group)
        key = (args, tuple(sorted(kwargs.items())) if kwargs else (), world, remote)
        kernel = self._compiled.get(key)
        if kernel is None:
            func = _build(self.factory, args, kwargs, world, remote, _runs_on_cpu(self.compile_kwargs))
            kernel = self._compiled[key] = DistributedKernel(func, self.out_idx, **self.compile_kwargs)
        return kernel

    def get_tir(self, *args: Any, group: Any = None, **kwargs: Any) -> tirx.PrimFunc:
        """The ``T.prim_func`` the factory builds for these arguments (not compiled, not cached).

        Args:
            *args, **kwargs: the factory's arguments.
            group: the process group whose size the kernel is built for (None: the whole job).

        Returns:
            The kernel's ``tirx.PrimFunc``, its remote operations as they are before lowering.
        """
        world, remote = self._options(group)
        return _build(self.factory, args, kwargs, world, remote, _runs_on_cpu(self.compile_kwargs))

    def get_kernel_source(self, *args: Any, group: Any = None, **kwargs: Any) -> str:
        """The generated device source of the kernel of these arguments (compiled if not yet).

        Args:
            *args, **kwargs: the factory's arguments.
            group: the process group whose size the kernel is built for (None: the whole job).

        Returns:
            CUDA C++ for GPU targets.
        """
        return self.compile(*args, group=group, **kwargs).get_kernel_source()

    def cache_clear(self) -> None:
        """Forget every compiled kernel (the next call of each arguments compiles again)."""
        self._compiled.clear()
        self._by_group.clear()

    @staticmethod
    def _options(group: Any) -> tuple[int | None, str | None]:
        """(world size, lowering) a kernel built now for ``group`` gets (None, as requested) outside a job."""
        return (runtime.group_size(group) if runtime.is_initialized() else None), kernel_lowering(group)


def jit(func: Callable[..., Any] | tirx.PrimFunc | None = None, *, out_idx: list[int] | int | None = None,
        **compile_kwargs: Any) -> Any:
    """Compile a kernel factory (or a ``T.prim_func``) into distributed kernels, cached per arguments.

    Example::

        @ts.jit(out_idx=[-1])
        def add_one(N):
            @T.prim_func
            def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
                ...
            return main

        add_one(1024)(a)                       # a DistributedKernel, compiled at its first use
        add_one.get_kernel_source(1024)         # see KernelFactory for the other methods

    Args:
        func: the factory (a function returning a ``T.prim_func``), or a ``T.prim_func``.
        out_idx: parameters the kernel allocates and returns (as ``tilelang.jit``'s).
        **compile_kwargs: those of ``tilelang.compile`` (``target``, ``execution_backend``,
            ``pass_configs``, ``compile_flags``, ``verbose``).

    Returns:
        A :class:`KernelFactory` for a factory, a :class:`DistributedKernel` for a ``T.prim_func``
        (or, without ``func``, a decorator making one of these). The factory's keyword ``group=``
        is tilescale's: the process group whose size the kernel is built for (None: the whole job).
    """

    def wrap(factory: Callable[..., Any] | tirx.PrimFunc) -> Any:
        if isinstance(factory, tirx.PrimFunc):
            return DistributedKernel(factory, out_idx, **compile_kwargs)
        return KernelFactory(factory, out_idx, compile_kwargs)

    return wrap(func) if func is not None else wrap
