"""``T.Scale``: name the level of the machine a block of code runs at, and what it may reach.

Example::

    with T.Kernel(num_blocks, threads=128) as bx:
        with T.Scale("device") as (rank, world):
            T.copy(tile, B[bx * 64, 0], dst_pe=(rank + 1) % world)
            T.barrier()                     # every block of every device

Inside ``T.Scale("device")``, ``rank`` is this process's rank (a runtime value: one
compiled kernel serves every rank) and ``world`` the number of ranks (a compile-time
constant, taken from ``tilescale.init`` or :func:`build_options`). Scopes nest; the
innermost one decides what ``T.barrier()`` synchronises.

While a ``T.prim_func`` is being built, a :class:`BuildContext` collects what the
distributed operations need from the host (peer-address tables of symmetric arguments,
the rank, the wait-status record) as hidden parameters that ``T.prim_func`` appends to the
kernel's signature and ``tilescale.jit`` binds on every call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from tvm import tirx

from tilescale.runtime import is_initialized, world_size

SCALES = ("device",)

# Names of the hidden parameters; the jit binds them by these names.
RANK_PARAM = "ts_rank"
STATUS_PARAM = "ts_status"
TIMEOUT_PARAM = "ts_timeout_ns"
SYNC_TABLE_PARAM = "ts_sync_peers"
PEER_TABLE_SUFFIX = "__peers"


@dataclass
class BuildContext:
    """What the distributed operations of one ``T.prim_func`` ask of the host."""

    scales: list[str] = field(default_factory=list)
    peer_tables: dict[str, tuple[tirx.Buffer, tirx.Buffer]] = field(default_factory=dict)
    scalars: dict[str, tirx.Var] = field(default_factory=dict)
    sync: tirx.Buffer | None = None
    _world: int | None = None

    @property
    def world(self) -> int:
        """The world size, looked up only when a distributed operation needs it, so that
        single-GPU programs build without a job."""
        if self._world is None:
            self._world = _build_world_size()
        return self._world

    def scalar(self, name: str, dtype: str) -> tirx.Var:
        """The hidden scalar parameter ``name`` (created on first use)."""
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

    def sync_table(self) -> tirx.Buffer:
        """Addresses of the runtime's barrier workspace on every rank."""
        if self.sync is None:
            self.sync = tirx.decl_buffer((self.world,), "int64", name=SYNC_TABLE_PARAM)
        return self.sync


_state = threading.local()


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


@contextlib.contextmanager
def build_options(world_size: int) -> Iterator[None]:
    """Build kernels for ``world_size`` ranks without a running job (e.g. to inspect lowering).

    Example::

        with build_options(world_size=8):
            kernel = tilelang.lower(my_prim_func_factory(...), target="cuda")
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    saved = getattr(_state, "world_size", None)
    _state.world_size = world_size
    try:
        yield
    finally:
        _state.world_size = saved


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


@contextlib.contextmanager
def Scale(level: str = "device") -> Iterator[tuple[tirx.PrimExpr, int]]:  # noqa: N802 - mirrors T.Kernel
    """Enter a scope of the machine hierarchy and get ``(id, count)`` at that level.

    Example::

        with T.Scale("device") as (rank, world):
            peer = (rank + 1) % world

    Only ``"device"`` (the ranks of the job) exists so far.
    """
    if level not in SCALES:
        raise ValueError(f"unknown scale {level!r}; supported: {', '.join(SCALES)}")
    ctx = current_context()
    ctx.scales.append(level)
    try:
        yield ctx.rank, ctx.world
    finally:
        ctx.scales.pop()
