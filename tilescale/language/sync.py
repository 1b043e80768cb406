"""Cross-device signals, waits, fences and barriers: ``T.signal``, ``T.wait``, ``T.fence``, ``T.barrier``;
the ranks' agreement on what they call: ``T.agree``, ``T.announce``; and a kernel's own call
count on the device: ``T.count_call``.

Example (a producer block announces a tile it put into its peer's buffer)::

    T.copy(tile, B[bx * 64, 0], dst_pe=peer)        # remote put
    T.signal(flags[bx], 1, pe=peer)                  # release: the tile is visible first
    ...
    T.wait(flags[bx], "ge", 1)                       # acquire, on the consumer

All of them are *block-level* operations, like ``T.copy``: every thread of the block must
reach them (they synchronise the block), and one thread talks to the other devices.

Memory ordering, and why it holds (PTX memory model):

* A remote put may have been lowered to TMA bulk stores whose completion TileLang waits
  for only until shared memory has been *read* (``tma_store_wait<0, true>``). Before a
  signal, every thread therefore waits for its own bulk groups to *complete*
  (``cp.async.bulk.wait_group 0``) and fences the async proxy, so the data is written.
* ``__syncthreads`` then makes all threads' writes precede thread 0's
  ``fence.acq_rel.sys`` + ``st/red.release.sys``: release is cumulative, so a peer
  that observes the flag with ``ld.acquire.sys`` observes the whole block's data. A
  signal of this rank's own flag (no ``pe``), which only this GPU's blocks observe,
  releases at GPU scope (``fence.acq_rel.gpu`` + ``st/red.release.gpu``).
* After a wait succeeds, ``__syncthreads`` orders the acquiring thread before all others,
  and ``fence.proxy.async`` lets later TMA loads see what the generic proxy acquired.

Every wait is bounded by ``TILESCALE_WAIT_TIMEOUT_S`` (a kernel argument, no recompile).
The first wait to expire records rank, block, flag address, expected and observed values
in a status record the host reads; all other waits of the job then give up at once, the
kernel ends, and the host raises :class:`tilescale.WaitTimeoutError`.

Agreement: a kernel whose ranks must run the same call (an op at the same shapes) passes
each call's signature as a kernel argument and checks it at the point where ranks meet:
``T.agree(sig)`` is a ``T.barrier()`` that also compares the ranks' signatures and
returns 0 on a difference; ``T.announce`` + ``T.wait(..., agree=)`` do the same for ranks
that meet in flags. A difference is recorded in the same status record (one per job, like
a timeout, ending every wait) and the host raises :class:`tilescale.ShapeMismatchError`.
"""

from __future__ import annotations

import tilelang.language as tl
from tvm import tirx

from tilescale.language.cluster import cluster_barrier
from tilescale.language.remote import check_remote, remote_buffer
from tilescale.language.scale import STATUS_PARAM, TIMEOUT_PARAM, current_context
from tilescale.protocol import COMPARISONS, DEVICE_HEADER, SIGNAL_OPS

SIGNAL_SCOPES = ("block", "warp")
# The address lowering's device helpers (PRELUDE), by the roles of a DeviceLowering's
# (tilescale.comm.base): the interpreter runs either lowering's calls by these roles.
ADDRESS_HELPERS = {
    "signal": "tilescale::block_signal", "warp_signal": "tilescale::warp_signal",
    "local_signal": "tilescale::local_block_signal", "local_warp_signal": "tilescale::local_warp_signal",
    "wait": "tilescale::block_wait", "warp_wait": "tilescale::warp_wait", "fence": "tilescale::block_fence",
    "barrier": "tilescale::grid_barrier", "agree": "tilescale::grid_agree", "announce": "tilescale::announce",
}

# T.count_call's device helper: the same in every lowering (it touches only this rank's memory).
COUNT_CALL_EXTERN = "tilescale::count_call"

# The address lowering's device helpers and the protocol's device side (package data; the
# numbers it writes as literals are tilescale.protocol's, checked by tests/test_language.py).
PRELUDE = DEVICE_HEADER.read_text()


def _status_args() -> list[tirx.PrimExpr]:
    ctx = current_context()
    return [ctx.scalar(STATUS_PARAM, "int64"), ctx.rank, ctx.scalar(TIMEOUT_PARAM, "int64")]


def _int32_flag(flag: tirx.BufferLoad, what: str) -> tirx.BufferLoad:
    if not isinstance(flag, tirx.BufferLoad):
        raise TypeError(f"{what} takes one element of a flag tensor, e.g. flags[i]; got {type(flag).__name__}")
    if str(flag.buffer.dtype) != "int32":
        raise TypeError(f"{what}: flag tensor '{flag.buffer.name}' must be int32, not {flag.buffer.dtype}")
    return flag


def signal(flag: tirx.BufferLoad, value: int | tirx.PrimExpr = 1, *, pe: int | tirx.PrimExpr | None = None,
           op: str = "set", scope: str = "block") -> tirx.PrimExpr:
    """Set (``op="set"``) or add to (``op="add"``) ``flag`` on rank ``pe`` with release semantics.

    Example::

        T.signal(flags[bx], 1, pe=peer, op="add")

    Everything this block wrote before (local or remote, TMA included) is visible to whoever
    observes the new value. ``pe=None`` signals this rank's own copy, which only this GPU's
    blocks wait on (``T.wait`` reads this rank's flags): it is released at GPU scope, in any
    lowering, and publishes what the block wrote to this GPU's memory; puts to peers before
    it are ordered by a signal of the peer's flag or a ``T.fence()``, not by it. A flag of a
    peer (``pe`` given, even this rank) takes a system-scope release (in the device-call
    lowering, after a quiet) that covers the puts too.

    ``scope="warp"``: every warp that runs the statement signals once, after its own writes,
    without synchronising the block: ``op="add"`` then adds ``value`` per warp (a block of
    ``threads`` adds ``value * threads // 32``). For code that only some warps run, such as
    the epilogue of a warp-specialised GEMM (its consumer warps)::

        T.signal(flags[rank], 1, pe=owner, op="add", scope="warp")

    Args:
        flag: One element of an int32 flag tensor (``flags[i]``); with ``pe`` it must be a
            symmetric tensor argument.
        value: The value to set or add (default 1).
        pe: The rank whose copy of ``flag`` to update; None (default) is this rank's own.
        op: ``"set"`` (default) or ``"add"`` (atomic).
        scope: ``"block"`` (default: once per block, after its writes) or ``"warp"`` (see above).

    Returns:
        tirx.PrimExpr: The device call; evaluate it as a statement (``T.signal(...)`` in a kernel).

    Raises:
        ValueError: unknown ``op`` or ``scope``.
        TypeError: ``flag`` is not an element of an int32 tensor, or (with ``pe``) not a global argument.
        IndexError: a constant ``pe`` is out of range.
    """
    if op not in SIGNAL_OPS:
        raise ValueError(f"T.signal op must be one of {sorted(SIGNAL_OPS)}, got {op!r}")
    if scope not in SIGNAL_SCOPES:
        raise ValueError(f"T.signal scope must be one of {SIGNAL_SCOPES}, got {scope!r}")
    flag = _int32_flag(flag, "T.signal")
    if pe is None:  # this rank's own flag: GPU-scope release, the same helper in every lowering
        name = ADDRESS_HELPERS["local_signal" if scope == "block" else "local_warp_signal"]
        return tl.call_extern("handle", name, tl.address_of(flag), value, SIGNAL_OPS[op])
    lowering = current_context().lowering
    if lowering is not None:  # device calls: this rank's address of the flag, and the peer's global rank
        check_remote(flag.buffer, pe, "T.signal's flag")
        name = lowering.signal if scope == "block" else lowering.warp_signal
        return tl.call_extern("handle", name, tl.address_of(flag), value, SIGNAL_OPS[op],
                              current_context().global_pe(pe))
    flag = tirx.BufferLoad(remote_buffer(flag.buffer, pe, "T.signal's flag"), flag.indices)
    name = ADDRESS_HELPERS["signal" if scope == "block" else "warp_signal"]
    return tl.call_extern("handle", name, tl.address_of(flag), value, SIGNAL_OPS[op])


def wait(flag: tirx.BufferLoad, cmp: str, value: int | tirx.PrimExpr, *, scope: str = "block",
         agree: tuple[tirx.Buffer, tirx.PrimExpr] | None = None) -> tirx.PrimExpr:
    """Block until this rank's ``flag`` compares ``cmp`` to ``value``, with acquire semantics.

    Example::

        T.wait(flags[bx], "ge", step + 1)

    ``cmp`` is one of ``eq ne ge gt le lt``. The wait is bounded (see module docs).

    ``scope="warp"``: every warp that runs the statement waits on its own, without
    synchronising the block; for code that only some warps run, such as the epilogue of a
    warp-specialised GEMM (its consumer warps), which then reads what the flag announced::

        T.wait(flags[tile], "ge", target, scope="warp")

    ``agree=(board, ident)``: the wait also ends when a peer announced (``T.announce``) the
    same call number as ``ident`` with another signature, and the host raises
    :class:`tilescale.ShapeMismatchError`, instead of a timeout: for kernels whose ranks meet
    in flags rather than in a ``T.agree`` barrier. The board is checked again once the flag
    holds, so every block that signals the flag must announce before it signals.

    Args:
        flag: One element of this rank's int32 flag tensor (``flags[i]``).
        cmp: The comparison ``flag <cmp> value``: ``"eq"``, ``"ne"``, ``"ge"``, ``"gt"``, ``"le"``, ``"lt"``.
        value: The value compared against (constant or runtime expression).
        scope: ``"block"`` (default) or ``"warp"``.
        agree: Optional ``(board, ident)``: a 1-D int64 symmetric board of ``2 * world`` slots and this
            call's identity, as given to :func:`announce`.

    Returns:
        tirx.PrimExpr: The device call; evaluate it as a statement. A wait that does not complete in
        the job's timeout records a status the host reports as an error.

    Raises:
        ValueError: unknown ``cmp`` or ``scope``.
        TypeError: ``flag`` is not an element of an int32 tensor, or the board is not a 1-D int64 tensor
            argument.
    """
    if cmp not in COMPARISONS:
        raise ValueError(f"T.wait comparison must be one of {sorted(COMPARISONS)}, got {cmp!r}")
    if scope not in SIGNAL_SCOPES:
        raise ValueError(f"T.wait scope must be one of {SIGNAL_SCOPES}, got {scope!r}")
    flag = _int32_flag(flag, "T.wait")
    role = "wait" if scope == "block" else "warp_wait"
    lowering = current_context().lowering
    name = getattr(lowering, role) if lowering is not None else ADDRESS_HELPERS[role]
    check = []
    if agree is not None:
        board, ident = agree
        _check_board(board, "T.wait's agree")
        check = [tl.address_of(tirx.BufferLoad(board, [0])), current_context().world, ident]
    return tl.call_extern("handle", name, tl.address_of(flag), COMPARISONS[cmp], value,
                          *_status_args(), *check)


def _check_board(board: tirx.Buffer, what: str) -> None:
    if not isinstance(board, tirx.Buffer) or str(board.dtype) != "int64" or len(board.shape) != 1:
        raise TypeError(f"{what}: the board must be a 1-D int64 tensor argument (two slots per rank)")
    check_remote(board, 0, what)


def announce(board: tirx.Buffer, ident: int | tirx.PrimExpr) -> tirx.PrimExpr:
    """Store this call's identity in this rank's slot of every rank's ``board``, for the peers'
    ``T.wait(..., agree=(board, ident))``.

    Example::

        T.announce(board, ident)   # ident: (call number << 32) | signature, a kernel argument
        ...                        # this block's puts
        T.signal(flags[i], 1, pe=peer)
        ...
        T.wait(flags[i], "ge", target, agree=(board, ident))

    ``board`` is a symmetric int64 tensor of ``2 * world`` slots (row ``call number % 2``,
    slot ``rank``): the call number, the same on every rank for the same call, tells a waiting
    peer this call's identity from an earlier one's, and a rank announces call c + 2 only after
    its peers have finished call c. Every block that signals a flag checked with ``agree``
    announces before signalling (the signal releases it); it does not synchronise.

    Args:
        board: A symmetric 1-D int64 tensor argument of ``2 * world`` slots.
        ident: This call's identity, ``(call number << 32) | signature`` (usually a kernel argument).

    Returns:
        tirx.PrimExpr: The device call; evaluate it as a statement.

    Raises:
        TypeError: ``board`` is not a 1-D int64 global tensor argument.
    """
    _check_board(board, "T.announce")
    ctx = current_context()
    if ctx.lowering is not None:
        return tl.call_extern("handle", ctx.lowering.announce, tl.address_of(tirx.BufferLoad(board, [0])), ctx.rank,
                              ctx.world, ident, ctx.pe_table().data)
    table = ctx.peer_table(board)
    return tl.call_extern("handle", ADDRESS_HELPERS["announce"], table.data, ctx.rank, ctx.world, ident)


def count_call(state: tirx.Buffer, step: int | tirx.PrimExpr, call: tirx.Buffer,
               blocks: int | tirx.PrimExpr = 0) -> tirx.PrimExpr:
    """Count a kernel's calls on the device: ``call[0]`` gets this call's number (1, 2, ...) and
    ``call[1]`` its flag target (the running total of ``step`` per call), and the kernel's last
    block to get here advances ``state``, so the next launch in stream order reads the next
    call's. No host value: a CUDA graph replays the count.

    Example::

        with T.Kernel(1, threads=128):                 # one block: one signal per flag per call
            with T.Scale("device") as (rank, world):
                call = T.alloc_local((2,), "int32")
                T.count_call(state, 1, call)           # state: zeros(3) int32, this rank's
                T.copy(tile, recv[call[0] % 2 * 64, 0], dst_pe=peer)   # buffer sets alternate
                T.signal(flags[rank], 1, pe=peer, op="add")
                T.wait(flags[peer], "ge", call[1])     # flags only grow: no reset between calls

    Every block reads the count before it counts itself in, and only the last of ``blocks``
    (0: every block of the grid) writes the next one, after every block has counted itself
    in: no block reads a half-advanced count, and a launch advances it exactly once (on GPUs
    every block runs to its end, also after a wait that timed out). ``state[2]`` holds the
    blocks counted in so far (0 between launches). Every thread of the block must reach it
    (it synchronises the block); blocks counted need not be resident together.

    Args:
        state: a 1-D int32 tensor argument of (at least) 3 elements on this rank, zeros at first.
        step: what the call adds to the flag target.
        call: a local int32 buffer of 2 elements that receives the call's number and target.
        blocks: how many blocks count themselves in per launch (0: every block of the grid).

    Returns:
        The statement.
    """
    if not isinstance(state, tirx.Buffer) or str(state.dtype) != "int32" or len(state.shape) != 1:
        raise TypeError("T.count_call: state must be a 1-D int32 tensor argument (3 elements)")
    if not isinstance(call, tirx.Buffer) or str(call.dtype) != "int32" or not call.scope().startswith("local"):
        raise TypeError('T.count_call: call must be a local int32 buffer, T.alloc_local((2,), "int32")')
    return tl.call_extern("handle", COUNT_CALL_EXTERN, state.data, step, blocks, call.data)


def fence() -> tirx.PrimExpr:
    """Order this block's earlier global writes (local, remote, TMA) before its later ones, system-wide."""
    lowering = current_context().lowering
    return tl.call_extern("handle", lowering.fence if lowering is not None else ADDRESS_HELPERS["fence"])


def agree(signature: int | tirx.PrimExpr) -> tirx.PrimExpr:
    """A device-scope ``T.barrier()`` at which the ranks also check that they run the same call:
    1 (int32, the same in every block of every rank) when every rank passed the same
    ``signature``, else 0, and the host raises :class:`tilescale.ShapeMismatchError` on every
    rank (at the next launch, ``ts.synchronize()`` or ``ts.barrier()``; on the CPU path when the
    kernel returns).

    Example::

        ok = T.alloc_local((1,), "int32")
        ok[0] = T.agree(sig)          # sig: a kernel argument, e.g. a hash of the op and its shapes
        if ok[0] == 1:
            ...                       # read and write peers' data
        T.barrier()

    The signature is a scalar argument, so a CUDA graph replays it with the call. Cost:
    ``world`` int32 stores (block 0, before the barrier, which releases them) and ``world``
    local loads per block after it.

    Args:
        signature: This call's signature (a positive 31-bit number, usually a scalar kernel argument:
            ``tilescale.errors.call_signature``).

    Returns:
        tirx.PrimExpr: An int32 expression: 1 when the ranks agree, else 0.

    Raises:
        RuntimeError: not directly inside ``T.Scale("device")``.
    """
    ctx = current_context()
    if ctx.scales[-1:] != ["device"]:
        raise RuntimeError('T.agree() must be inside a T.Scale("device") scope: it checks the ranks of the job')
    table = ctx.sync_table()
    status, rank, timeout = _status_args()
    if ctx.lowering is not None:
        return tl.call_extern("int32", ctx.lowering.agree, table.data, rank, ctx.world, status, timeout, signature,
                              ctx.pe_table().data)
    return tl.call_extern("int32", ADDRESS_HELPERS["agree"], table.data, rank, ctx.world, status, timeout, signature)


def barrier() -> tirx.PrimExpr:
    """Synchronise at the innermost ``T.Scale``: every block of every rank (``"device"``), every
    block of the thread-block cluster (``"cta_cluster"``) or the threads of the warp (``"warp"``).

    Example::

        with T.Scale("device"):
            T.copy(tile, B[bx * 64, 0], dst_pe=peer)
            T.barrier()            # all puts of all ranks have landed

    Writes before the barrier (remote ones included) are visible to every participant after
    it. Device scope: all blocks of the grid must be resident at once (the jit refuses grids
    larger than the GPU's SM count); reusable any number of times (e.g. inside loops);
    kernels that use it must not run concurrently with each other. Cluster scope: every
    thread of the block must reach it (``barrier.cluster`` is aligned).
    """
    ctx = current_context()
    if not ctx.scales:
        raise RuntimeError("T.barrier() must be inside a T.Scale(...) scope, which says what it synchronises")
    level = ctx.scales[-1]
    if level == "cta_cluster":
        return cluster_barrier()
    if level == "warp":
        return tl.call_extern("handle", "__syncwarp")
    if level == "warpgroup":
        raise NotImplementedError(
            'T.barrier() in T.Scale("warpgroup"): use a named barrier, T.sync_threads(barrier_id, 128), with '
            "an id no other part of the kernel uses (TileLang's warp specialisation takes some)"
        )
    table = ctx.sync_table()
    status, rank, timeout = _status_args()
    if ctx.lowering is not None:
        return tl.call_extern("handle", ctx.lowering.barrier, table.data, rank, ctx.world, status, timeout,
                              ctx.pe_table().data)
    return tl.call_extern("handle", ADDRESS_HELPERS["barrier"], table.data, rank, ctx.world, status, timeout)
