"""``all_gather_gemm``: the column-parallel GEMM whose gathered rows arrive while it runs,
moved by the copy engines or by SM pusher blocks (the package's docstring says how)."""

import contextlib

import torch
import torch.distributed as dist

from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.jit import kernel_lowering
from tilescale.language.scale import ADDRESS
from tilescale.ops._common import call_identity, check_same_across_ranks, signature, tl_dtype
from tilescale.ops._gemm import TileConfig
from tilescale.ops.tp_gemm.exchange import _exchange, _gather_exchange, _StreamWrites
from tilescale.ops.tp_gemm.kernels import ag_own_gemm_kernel, ag_peer_gemm_kernel, announce_kernel
from tilescale.ops.tp_gemm.plan import PUSH_BLOCKS, _check_pair, _choose, _fused_wins, choose_tile, chunk_tiles
from tilescale.symmetric import peer_ptrs

_stream_writes: _StreamWrites | None = None


def _copy_engine_gather(state: GroupState, a_shard: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
                        tile: TileConfig, ident: tuple[torch.Tensor, int]) -> None:
    """The all-gather GEMM with copies as producer. On the main stream, the own segment's GEMM
    (:func:`ag_own_gemm_kernel`, no pushers) starts at once; meanwhile, on a high-priority side
    stream, :func:`announce_kernel` announces the call (``ident``: the call board and this
    call's identity) and this rank's rows go chunk by chunk into every peer's gather buffer
    (``rank - 1, rank - 2, ...``), each chunk followed by a stream-ordered write of the call's
    epoch to its flag there. The main stream then waits for those copies and runs the peers'
    segments (:func:`ag_peer_gemm_kernel`), whose tiles wait for their chunks and check the
    senders' announcements.

    Waiting for this rank's own copies before the waiting kernel is what keeps it free of
    deadlock whoever executes a copy (a device-to-device copy may run on SMs): the copies
    never wait for a kernel that waits, so every rank's rows arrive.

    A peer whose call differs is found by the peer kernels' waits, after the copies have
    landed: the copies are sized by this rank's shape, and cannot be checked before they are
    issued without a round trip. They stay in bounds because they only ever write the peer's
    copy of this rank's own exchange: a symmetric allocation, the same size on every rank
    (``symmetric.empty`` checks that), keyed by everything that sizes or places a copy (rows
    padded, K, dtype, tile height, chunk), and a copy covers at most ``padded`` rows of this
    rank's segment of one buffer set. A peer running another shape does not read that
    exchange in this call, and one running the same exchange (rows padded alike) gets the
    announcement, with a different signature, before the flags: ShapeMismatchError.
    """
    global _stream_writes
    world, rank, group = state.size, state.rank, state.process_group
    (m, k), n = a_shard.shape, weight.shape[0]
    bm, dtype = tile.block_M, tl_dtype(a_shard)
    padded = -(-m // bm) * bm
    own = ag_own_gemm_kernel(world, dtype, m, padded, k, n, 0, tile, group=group)
    if world == 1:  # nothing to gather, no peer to agree with
        own(a_shard, weight, out, group=group)
        return
    per_copy = chunk_tiles(padded // bm, k, bm, a_shard.element_size())
    chunks = -(-(padded // bm) // per_copy)
    ex = _gather_exchange(state, ("ag-ce", padded, k, a_shard.dtype, bm, per_copy), world * padded, k, a_shard.dtype,
                          world * chunks)
    peers = ag_peer_gemm_kernel(world, dtype, padded, k, n, per_copy, tile, "epoch", group=group)
    ex.calls += 1
    epoch, first = ex.calls, (ex.calls % 2) * world * padded
    main = torch.cuda.current_stream() if ex.stream is not None else None

    def side() -> contextlib.AbstractContextManager:
        return torch.cuda.stream(ex.stream) if main is not None else contextlib.nullcontext()

    if main is not None:
        _stream_writes = _stream_writes or _StreamWrites()
        ex.stream.wait_stream(main)  # a_shard is ready, and the previous call is done with the buffers
    with side():  # launched before the own GEMM, so that it gets an SM before the GEMM takes them all
        announce_kernel(world, group=group)(*ident, group=group)
    own(a_shard, weight, out, group=group)
    with side():
        for step in range(1, world):
            peer = (rank - step) % world
            for c in range(chunks):
                rows = slice(c * per_copy * bm, min(m, (c + 1) * per_copy * bm))
                dst = first + rank * padded
                ex.peer_buffers[peer][dst + rows.start:dst + rows.stop].copy_(a_shard[rows])
                if main is not None:
                    flag = ex.peer_flags[peer].data_ptr() + (rank * chunks + c) * ex.flags.element_size()
                    _stream_writes(ex.stream, flag, epoch)
                else:  # CPU path: the copy above is done; stores reach the peer in order
                    ex.peer_flags[peer][rank * chunks + c] = epoch
    if main is not None:
        main.wait_stream(ex.stream)
    peers(ex.buffers[first:first + world * padded], weight, out, ex.flags, epoch, *ident, group=group)


def _sm_gather(state: GroupState, a_shard: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None,
               tile: TileConfig, push_blocks: int, ident: tuple[torch.Tensor, int]) -> None:
    """The all-gather GEMM with SM pushers: :func:`ag_own_gemm_kernel` (the pushers, which
    announce the call first, and the own segment), then :func:`ag_peer_gemm_kernel` (the
    peers' segments, counted flags, waits checking the announcements); ``ident``: the call
    board and this call's identity (:func:`call_identity`). Call counts and flag targets live
    on the device, so a CUDA graph can capture it. ``out=None``: only make its exchange, peer
    tables and kernels (for a capture later). Pushers write only the peers' copies of this
    rank's own exchange, sized alike on every rank, so a peer whose call differs is never
    written out of bounds."""
    world, group = state.size, state.process_group
    (m, k), n = a_shard.shape, weight.shape[0]
    bm, dtype = tile.block_M, tl_dtype(a_shard)
    padded = -(-m // bm) * bm
    ex = _exchange(state, ("ag", padded, k, a_shard.dtype, bm), (world * padded, k), a_shard.dtype,
                   world * padded // bm)
    peer_ptrs(ex.buffers), peer_ptrs(ex.flags), peer_ptrs(ident[0])  # peer tables, made outside any capture
    own = ag_own_gemm_kernel(world, dtype, m, padded, k, n, push_blocks, tile, group=group)
    peers = ag_peer_gemm_kernel(world, dtype, padded, k, n, 1, tile, "state", group=group) if world > 1 else None
    if out is None:
        ex.step(push_blocks)
        return
    ex.advance(push_blocks)  # every pusher signals every row tile once per call
    own(a_shard, ex.buffers, weight, out, ex.flags, ex.state, *ident, group=group)
    if peers is not None:
        peers(ex.buffers, weight, out, ex.flags, ex.state, *ident, group=group)


PRODUCERS = ("copy_engine", "sm")


def all_gather_gemm(a_shard: torch.Tensor, weight: torch.Tensor, plan: str | None = None,
                    tile: TileConfig | None = None, push_blocks: int = PUSH_BLOCKS,
                    producer: str | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``all_gather(a_shard) @ weight.T`` with the gather overlapped with the GEMM.

    Example::

        y = ts.ops.all_gather_gemm(x_rows, w_cols)     # (world * rows, N_local)

    ``a_shard``: this rank's rows (M_local, K), the same shape on every rank; ``weight``:
    this rank's (N_local, K). ``tile``: the fused kernel's GEMM tile (:func:`choose_tile`).
    ``producer``: who moves the rows in the fused plan: ``"copy_engine"`` (copies and flag
    writes on a side stream, the GEMM keeps every SM; the default, except inside a CUDA graph
    capture) or ``"sm"`` (``push_blocks`` blocks of the GEMM kernel push the rows; counts its
    calls on the device, so it is what a captured call runs). ``group``: the tensor-parallel
    process group (None: the whole job); ``world`` is its size.

    Fused calls whose ranks differ (shapes, dtype, tile, producer) raise
    ``ts.ShapeMismatchError`` on every rank; zero rows on every rank give an empty result.
    """
    _check_pair(a_shard, weight)
    if push_blocks < 1:
        raise ValueError(f"push_blocks must be positive, got {push_blocks}")
    if producer not in (None, *PRODUCERS):
        raise ValueError(f"producer must be one of {PRODUCERS} or None, got {producer!r}")
    state = runtime.group_state(group)
    world = state.size
    (m, k), n = a_shard.shape, weight.shape[0]
    check_same_across_ranks(state, "all_gather_gemm", [m, k, n, str(a_shard.dtype)], every_call=m == 0)
    if m == 0:
        return a_shard.new_empty(0, n)
    tile = tile or choose_tile(m, n, kernels=(1, world - 1))
    padded = -(-m // tile.block_M) * tile.block_M
    seg_tiles = padded // tile.block_M * -(-n // tile.block_N)  # own segment, then the peers' in a second kernel
    wins = _fused_wins(2 * world * m * k * n, [seg_tiles, (world - 1) * seg_tiles],
                       (world - 1) * m * k * a_shard.element_size())
    if _choose(plan, world * m, wins, group) == "unfused":
        gathered = torch.empty(world * m, k, dtype=a_shard.dtype, device=a_shard.device)
        dist.all_gather_into_tensor(gathered, a_shard, group=group)
        return gathered @ weight.T
    capturing = a_shard.is_cuda and torch.cuda.is_current_stream_capturing()
    # The copies need the peers' buffers mapped here (one node, no NVSHMEM calls).
    mapped = kernel_lowering(group) in (None, ADDRESS)
    out = torch.empty(world * padded, n, dtype=a_shard.dtype, device=a_shard.device)
    producer = producer or ("sm" if capturing or not mapped else "copy_engine")
    if producer == "copy_engine":
        if capturing:
            raise RuntimeError("all_gather_gemm(producer='copy_engine') cannot be captured in a CUDA graph: its flag "
                               "values are counted on the host; capture producer='sm' (the default in a capture)")
        if not mapped:
            raise ValueError("all_gather_gemm(producer='copy_engine') needs every peer's memory mapped in this "
                             "process; with NVSHMEM calls between the ranks use producer='sm' (the default there)")
    ident = call_identity(state, signature("all_gather_gemm", a_shard, f"N={n}", tile,
                                    producer if producer == "copy_engine" else f"sm push_blocks={push_blocks}"))
    if producer == "copy_engine":
        if a_shard.is_cuda:  # made now, so that a capture later finds the SM plan ready
            _sm_gather(state, a_shard, weight, None, tile, push_blocks, ident)
        _copy_engine_gather(state, a_shard, weight, out, tile, ident)
    else:
        _sm_gather(state, a_shard, weight, out, tile, push_blocks, ident)
    return out if padded == m else out.view(world, padded, n)[:, :m].reshape(world * m, n)

