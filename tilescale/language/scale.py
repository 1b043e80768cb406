"""``T.Scale``: name the level of the machine a block of code runs at, and what it may reach.

Example::

    with T.Kernel(num_blocks, threads=128) as bx:
        with T.Scale("device") as (rank, world):
            T.copy(tile, B[bx * 64, 0], dst_pe=(rank + 1) % world)
            T.barrier()                     # every block of every device

Inside ``T.Scale("device")``, ``rank`` is this process's rank and ``world`` the number of
ranks, both within the process group the kernel is called over (the group of its symmetric
arguments, see ``tilescale.jit``). ``rank`` is a runtime value (one compiled kernel serves
every rank, and every group of its size); ``world`` a compile-time constant, the size of
the group the kernel is built for (``tilescale.jit``'s ``group=``: the whole job by
default) or :func:`build_options`'s. Inside
``T.Scale("cta_cluster")`` (a kernel launched with ``cluster_dims``) they are the block's
rank in its thread-block cluster and the cluster size (see ``tilescale.language.cluster``);
``"warpgroup"`` and ``"warp"`` give the calling thread's warpgroup or warp and how many
the block has, for task specialisation. Scopes nest; the innermost one decides what
``T.barrier()`` synchronises.

While a ``T.prim_func`` is being built, a :class:`BuildContext` collects what the
distributed operations need from the host (peer-address tables of symmetric arguments,
the rank, the wait-status record) as hidden parameters that ``T.prim_func`` appends to the
kernel's signature and ``tilescale.jit`` binds on every call.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import tilelang.language as tl
from tilelang.language.kernel import KernelLaunchFrame
from tvm import tirx

from tilescale.comm import ADDRESS, DeviceLowering, device_lowering, lowering_names
from tilescale.runtime import is_initialized, world_size

SCALES = ("device", "cta_cluster", "warpgroup", "warp")
# Blocks per cluster that every Hopper GPU launches (16 needs a non-portable opt-in that
# TileLang's launcher does not make).
MAX_CLUSTER_SIZE = 8

# Names of the hidden parameters; the jit binds them by these names.
RANK_PARAM = "ts_rank"
STATUS_PARAM = "ts_status"
TIMEOUT_PARAM = "ts_timeout_ns"
SYNC_TABLE_PARAM = "ts_sync_peers"
PES_PARAM = "ts_pes"
PEER_TABLE_SUFFIX = "__peers"
# as_written's opaque identity per dtype: a C++ cast, which TVM's simplifier cannot see into
# and every device compiler takes without a helper.
AS_WRITTEN_CASTS = {"int32": "static_cast<int>", "int64": "static_cast<int64_t>"}


def as_written(value: int | tirx.PrimExpr) -> tirx.PrimExpr:
    """``value`` kept as written: TileLang does not rewrite it into a closed form.

    TileLang 0.1.15 (TVM's simplifier) compiles an index such as ``table[(rank + world - 1 - p) %
    world]``, ``p`` a loop variable, into a closed form without ``rank`` (for world 3, 4 and 8:
    ``-(p <= 0 ? p : p - world)``, right on rank 1 only), and ``(rank - p) // 4`` wrong as well:
    every rank of an all-gather GEMM put to the same peers, and one got nothing (4x H100). The
    CPU path runs the expression as written, so only the generated code shows it. Behind a
    cast (``static_cast<int>(...)``), which TVM treats as an opaque call, it is computed as
    written. Remote operations index the peer tables through it, and ``ts.jit`` wraps such
    index arithmetic of every kernel it builds (:func:`tilescale.tir_fixes.keep_index_arithmetic`).

    Example::

        table[as_written((rank + world - 1 - p) % world)]

    Args:
        value: An int32 or int64 expression (a constant is returned as it is).

    Returns:
        tirx.PrimExpr: ``value``, through the cast unless it is a constant.
    """
    if isinstance(value, int):
        return tirx.const(value, "int32")
    if isinstance(value, tirx.IntImm):
        return value
    return tl.call_extern(str(value.dtype), AS_WRITTEN_CASTS[str(value.dtype)], value)


@dataclass
class BuildContext:
    """What the distributed operations of one ``T.prim_func`` ask of the host."""

    scales: list[str] = field(default_factory=list)
    cluster_size: int | None = None  # set while a T.Scale("cta_cluster") is open
    peer_tables: dict[str, tuple[tirx.Buffer, tirx.Buffer]] = field(default_factory=dict)
    # Arguments accessed on other ranks (symmetric tensors), with or without a peer table.
    remote_args: dict[str, tirx.Buffer] = field(default_factory=dict)
    scalars: dict[str, tirx.Var] = field(default_factory=dict)
    sync: tirx.Buffer | None = None
    pes: tirx.Buffer | None = None
    _world: int | None = None
    # How remote operations lower: "address" (loads/stores through peer tables) or a registered
    # DeviceLowering's name (set by build_options(remote=...); see tilescale.comm).
    remote: str = field(default_factory=lambda: getattr(_state, "remote", None) or ADDRESS)

    @property
    def world(self) -> int:
        """The world size, looked up only when a distributed operation needs it, so that
        single-GPU programs build without a job."""
        if self._world is None:
            self._world = _build_world_size()
        return self._world

    def scalar(self, name: str, dtype: str) -> tirx.Var:
        """The hidden scalar parameter ``name`` (created on first use).

        Args:
            name: The parameter's name (e.g. the rank or timeout parameter).
            dtype: Its TVM dtype (``"int32"``, ``"int64"``).

        Returns:
            tirx.Var: The same variable on every call with this ``name`` in this build; the jit binds it.
        """
        if name not in self.scalars:
            self.scalars[name] = tirx.Var(name, dtype)
        return self.scalars[name]

    @property
    def rank(self) -> tirx.Var:
        return self.scalar(RANK_PARAM, "int32")

    def peer_table(self, param: tirx.Buffer) -> tirx.Buffer:
        """The table of ``param``'s address on every rank (a hidden int64 parameter)."""
        if param.name not in self.peer_tables:
            table = tirx.decl_buffer((self.world,), "int64", name=param.name + PEER_TABLE_SUFFIX)
            self.peer_tables[param.name] = (param, table)
        return self.peer_tables[param.name][1]

    @property
    def lowering(self) -> DeviceLowering | None:
        """The device calls remote operations lower to, or None for the address lowering."""
        return device_lowering(self.remote)

    def pe_table(self) -> tirx.Buffer:
        """The global rank of every rank of the kernel's group (a hidden int32 parameter), which
        a library's device calls address peers by."""
        if self.pes is None:
            self.pes = tirx.decl_buffer((self.world,), "int32", name=PES_PARAM)
        return self.pes

    def global_pe(self, pe: int | tirx.PrimExpr) -> tirx.PrimExpr:
        """The library's number of rank ``pe`` of the kernel's group: ``pes[pe]``."""
        return tirx.BufferLoad(self.pe_table(), [as_written(pe)])

    def sync_table(self) -> tirx.Buffer:
        """Addresses of the runtime's barrier workspace on every rank."""
        if self.sync is None:
            self.sync = tirx.decl_buffer((self.world,), "int64", name=SYNC_TABLE_PARAM)
        return self.sync


_state = threading.local()


def open_context() -> BuildContext | None:
    """The build context of the ``T.prim_func`` being built, or None outside one.

    Example::

        ctx = open_context()
        prelude = ctx.lowering.prelude if ctx is not None and ctx.lowering is not None else ""
    """
    return getattr(_state, "context", None)


def current_context() -> BuildContext:
    """The build context of the ``T.prim_func`` being built (raises outside one)."""
    ctx = getattr(_state, "context", None)
    if ctx is None:
        raise RuntimeError("distributed tile operations can only be used inside a tilescale T.prim_func")
    return ctx


def _build_world_size() -> int:
    override = getattr(_state, "world_size", None)
    if override is not None:
        return override
    if is_initialized():
        return world_size()
    raise RuntimeError(
        "the world size of a distributed kernel is a compile-time constant: call tilescale.init() "
        "first, or build inside `with tilescale.language.build_options(world_size=N):`"
    )


def requested_remote() -> str | None:
    """The lowering an enclosing ``build_options(remote=...)`` asks for, or None."""
    return getattr(_state, "remote", None)


@contextlib.contextmanager
def build_options(world_size: int | None = None, remote: str | None = None) -> Iterator[None]:
    """Build kernels for ``world_size`` ranks without a running job (e.g. to inspect lowering),
    and/or with remote operations lowered to a one-sided library's device calls.

    Example::

        with build_options(world_size=8):
            kernel = tilelang.lower(my_prim_func_factory(...), target="cuda")
        with build_options(world_size=16, remote="nvshmem"):   # NVSHMEM calls, not peer addresses
            func = my_prim_func_factory(...)

    ``remote`` is ``"address"`` (the default: loads and stores through peer addresses) or
    a registered device lowering (``tilescale.comm.lowering_names()``: ``"nvshmem"``, see
    ``tilescale.comm.nvshmem.lowering``); None keeps the enclosing setting. Around calls of
    ``tilescale.jit`` kernels (and ``ts.ops``) in a running job, ``remote`` overrides the
    lowering the group's backend picks (``ts.group_state(group).lowering``).

    Args:
        world_size: Number of ranks to build for (positive); None keeps the enclosing setting,
            and outside any, the running job's world size.
        remote: The remote lowering, as described above; None keeps the enclosing setting.

    Yields:
        None. The settings apply to builds in this thread until the block exits.

    Raises:
        ValueError: ``world_size`` < 1, or ``remote`` is not a registered lowering.
    """
    if world_size is not None and world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if remote is not None and remote not in lowering_names():
        raise ValueError(f"remote must be one of {list(lowering_names())}, got {remote!r}")
    saved = getattr(_state, "world_size", None), getattr(_state, "remote", None)
    _state.world_size = world_size if world_size is not None else saved[0]
    _state.remote = remote if remote is not None else saved[1]
    try:
        yield
    finally:
        _state.world_size, _state.remote = saved


@contextlib.contextmanager
def building() -> Iterator[BuildContext]:
    """Open the build context of one ``T.prim_func`` (nesting is an error)."""
    if getattr(_state, "context", None) is not None:
        raise RuntimeError("a tilescale T.prim_func cannot be defined while another one is being built")
    ctx = BuildContext()
    _state.context = ctx
    try:
        yield ctx
    finally:
        _state.context = None


def _cluster_scope() -> tuple[tirx.PrimExpr, int]:
    frame = KernelLaunchFrame.Current()
    if frame is None:
        raise RuntimeError('T.Scale("cta_cluster") must be inside a T.Kernel launched with cluster_dims=...')
    dims = frame.get_cluster_dims()
    size = math.prod(dims)
    if size == 1:
        raise ValueError(
            'T.Scale("cta_cluster") needs a cluster launch: pass cluster_dims=(x, y, z) to T.Kernel '
            "(blocks of one cluster share distributed shared memory)"
        )
    if size > MAX_CLUSTER_SIZE:
        raise ValueError(f"cluster_dims {dims} make clusters of {size} blocks; GPUs launch at most "
                         f"{MAX_CLUSTER_SIZE} per cluster")
    for axis, (blocks, d) in enumerate(zip(frame.get_block_extents(), dims, strict=True)):
        if isinstance(blocks, int) and blocks % d:
            raise ValueError(f"grid extent {blocks} along axis {'xyz'[axis]} is not a multiple of the cluster "
                             f"dimension {d} (cluster_dims {dims}); CUDA cannot launch that grid")
    return tl.block_rank_in_cluster(), size


def _threads_in_block() -> int:
    frame = KernelLaunchFrame.Current()
    if frame is None:
        raise RuntimeError("T.Scale of warps must be inside a T.Kernel")
    return frame.get_num_threads()


def _thread_group_scope(level: str) -> tuple[tirx.PrimExpr, int]:
    width = {"warpgroup": 128, "warp": 32}[level]
    threads = _threads_in_block()
    if threads % width:
        raise ValueError(f'T.Scale("{level}") needs a multiple of {width} threads per block, got {threads}')
    index = tl.get_warp_group_idx() if level == "warpgroup" else tl.get_warp_idx()
    return index, threads // width


@contextlib.contextmanager
def Scale(level: str = "device") -> Iterator[tuple[tirx.PrimExpr, int]]:  # noqa: N802 - mirrors T.Kernel
    """Enter a scope of the machine hierarchy and get ``(id, count)`` at that level.

    Example::

        with T.Scale("device") as (rank, world):
            peer = (rank + 1) % world
        with T.Scale("cta_cluster") as (cta_rank, cluster_size):
            T.copy(tile, tile, dst_cta=(cta_rank + 1) % cluster_size)

    Levels: ``"device"`` (the ranks of the kernel's process group), ``"cta_cluster"`` (the blocks of a
    thread-block cluster; the kernel must be launched with ``cluster_dims``),
    ``"warpgroup"`` and ``"warp"`` (thread groups of the block: per-thread values, so
    GPU-only).

    Args:
        level: ``"device"`` (default), ``"cta_cluster"``, ``"warpgroup"`` or ``"warp"``.

    Yields:
        tuple: ``(id, count)`` at that level, e.g. ``(rank, world)``: the id a kernel expression,
        the count an int.

    Raises:
        ValueError: an unknown ``level``, or a block's threads not a multiple of the group's width.
        RuntimeError: ``"cta_cluster"`` in a kernel launched without ``cluster_dims``.
    """
    if level not in SCALES:
        raise ValueError(f"unknown scale {level!r}; supported: {', '.join(SCALES)}")
    ctx = current_context()
    if level == "device":
        ids = (ctx.rank, ctx.world)
    elif level == "cta_cluster":
        ids = _cluster_scope()
    else:
        ids = _thread_group_scope(level)
    saved_cluster = ctx.cluster_size
    if level == "cta_cluster":
        ctx.cluster_size = ids[1]
    ctx.scales.append(level)
    try:
        yield ids
    finally:
        ctx.scales.pop()
        ctx.cluster_size = saved_cluster
