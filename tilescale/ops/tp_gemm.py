"""Tensor-parallel GEMMs with communication overlapped tile by tile.

``all_gather_gemm(a_shard, weight)``: ``all_gather(a_shard) @ weight.T`` (column parallel).
The first blocks of one kernel push this rank's rows, row tile by row tile, into every
rank's gather buffer (its own first, then ``rank - 1, rank - 2, ...``, the order in which
the others reach this rank's segment) and add to that rank's arrival flag for the row tile;
the other blocks compute output tiles, this rank's own segment first and then each peer's
segment in ``rank + 1, rank + 2, ...`` order, each waiting for its row tile's flag before
its first K step. Segments are padded to whole row tiles, so a tile never reads rows that
have not arrived.

``gemm_reduce_scatter(a, weight)`` and ``gemm_all_reduce(a, weight)``: each rank's GEMM
kernel writes every finished output tile straight into the receive buffer of the rank(s)
that need it (the tile's row owner, or every rank) and signals it there; a reduction kernel
sums the received partial tiles once its flags say they have all landed. Tiles are visited
so that ranks send to different peers first. At decode sizes, where every output tile has
an SM of its own, ``gemm_all_reduce`` is one kernel: each tile's block exchanges partials
with the same block of the other ranks and sums them itself.

Flags only grow: each call adds one "epoch" of arrivals, and waits compare against the
running total, so no flag is ever reset between calls (which would race with a fast peer).
The call count and that total live on the device, advanced in stream order before each
call's kernels, so a call captured in a CUDA graph advances them on every replay.
Each op picks ``plan="fused"`` or the non-overlapped ``plan="unfused"`` (torch.distributed
collective + torch matmul): on GPUs the measured faster one, unfused (see ``_choose``),
elsewhere from the shape; pass ``plan`` to force one.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import tilescale.language as T
from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.jit import jit
from tilescale.ops._common import check_input, check_same_across_ranks, sm_count, tl_dtype
from tilescale.ops._gemm import DEFAULT, NARROW, THREADS, WIDE, TileConfig, gemm_tile, tile_coords
from tilescale.symmetric import allocate

# Blocks of the all-gather GEMM kernel that push rows to the peers (the rest compute tiles):
# on 2x H200, 32 beat 8 and 16 at three of the four benchmark shapes
# (benchmarks/results/tp-gemm-nvidia-h200-x2-20261122-235927.json).
PUSH_BLOCKS = 32
# Below this many output rows, overlapping cannot hide anything worth its synchronisation
# (the CPU path's threshold; GPUs use FUSED_MIN_ROWS_GPU, measured).
FUSED_MIN_ROWS = 1024
# On H200 the fused AG-GEMM and GEMM-RS beat NCCL + cuBLAS from 4096 output rows on and
# lose below (TileLang's GEMM is ~0.9x cuBLAS's there, the overlap cannot make it up).
FUSED_MIN_ROWS_GPU = 4096


@jit
def ag_gemm_kernel(world: int, dtype: str, rows: int, padded_rows: int, K: int, N: int, push_blocks: int,
                   tile_cfg: TileConfig):
    """Blocks ``0..push_blocks-1`` push this rank's rows into every rank's gather buffer; the
    others compute ``C = gathered @ W.T`` tile by tile, own segment first, each tile waiting
    for its own row tile.

    Pushers and GEMM tiles are one kernel so that the pushers are resident: blocks are
    dispatched in index order, so the first blocks run before any GEMM block can fill the
    SMs with waits (a push kernel on a side stream could be starved by them, and was).
    Flags count per row tile (``flags[segment * m_tiles + row_tile]``): every pusher adds 1
    to a row tile's flag once it has pushed its share of that tile, so a GEMM tile starts as
    soon as its rows are in, and the first tiles of this rank's own segment wait only for
    the first rows of the local copy, not all of it.
    """
    bm = tile_cfg.block_M
    m_tiles = padded_rows // bm
    n_tiles = -(-N // tile_cfg.block_N)
    # Pushers move chunks of whole rows, about 16K elements each, that divide the shard and
    # the row tile (so a chunk belongs to one row tile).
    chunk_rows = 1
    while chunk_rows * 2 * K <= 16384 and rows % (chunk_rows * 2) == 0 and bm % (chunk_rows * 2) == 0:
        chunk_rows *= 2
    chunks = rows // chunk_rows
    tile_chunks = bm // chunk_rows
    # 16-byte stores, also when a chunk is not a whole number of vectors per thread.
    vector = 8 if K % 8 == 0 else 1

    @T.prim_func
    def main(x: T.Tensor((rows, K), dtype), gathered: T.Tensor((2 * world * padded_rows, K), dtype),
             W: T.Tensor((N, K), dtype), C: T.Tensor((world * padded_rows, N), dtype),
             flags: T.Tensor((world * m_tiles,), "int32"), state: T.Tensor((2,), "int32")):
        with T.Kernel(push_blocks + world * m_tiles * n_tiles, threads=tile_cfg.threads) as b:
            with T.Scale("device") as (rank, ranks):
                if b < push_blocks:
                    for p in T.serial(ranks):
                        # Own copy first: the GEMM starts on it. Rank r - p consumes this rank's
                        # segment p-th (its order is r - p, r - p + 1, ...): it gets it p-th.
                        peer = (rank + ranks - p) % ranks
                        for r in T.serial(m_tiles):
                            mine = T.max(T.min(tile_chunks, chunks - r * tile_chunks) - b, 0)
                            for t in T.serial(T.ceildiv(mine, push_blocks)):
                                row = (r * tile_chunks + b + t * push_blocks) * chunk_rows
                                dst = (_buffer_of(state) * world + rank) * padded_rows + row
                                T.copy(x[row:row + chunk_rows, 0:K], gathered[dst:dst + chunk_rows, 0:K],
                                       dst_pe=peer, coalesced_width=vector)
                            T.signal(flags[rank * m_tiles + r], 1, pe=peer, op="add")
                else:
                    # The tile index lives in a register: TVM 0.1.15's simplifier rewrote
                    # ``(rank + (b - push_blocks) // tiles) % world`` into a wrong closed form
                    # for even ranks (the wait then watched another segment's flag).
                    tile = T.alloc_local((1,), "int32")
                    tile[0] = b - push_blocks
                    if tile_cfg.panel:  # panel order within each segment, segments in turn
                        per_segment = m_tiles * n_tiles
                        segment = (rank + tile[0] // per_segment) % ranks
                        by, bx = tile_coords(tile[0] % per_segment, m_tiles, n_tiles, tile_cfg.panel)
                    else:
                        by, bx = tile[0] // n_tiles, tile[0] % n_tiles
                        segment = (rank + by // m_tiles) % ranks
                        by = by % m_tiles
                    T.wait(flags[segment * m_tiles + by], "ge", state[1])
                    row = segment * padded_rows + by * bm
                    col = bx * tile_cfg.block_N
                    gemm_tile(gathered, _buffer_of(state) * world * padded_rows + row, W, col, C, row, col, K, dtype,
                              tile_cfg.stages, tile_cfg)

    return main


@jit
def gemm_push_kernel(world: int, dtype: str, M: int, K: int, N: int, owners: int, tile_cfg: TileConfig, splits: int):
    """Partial ``a @ W.T``; each output tile goes to its row owner(s)' receive slot, then a signal.

    ``owners == world``: rows are split in ``world`` segments, tile rows of segment s go to
    rank s (reduce-scatter). ``owners == 1``: every tile goes to every rank (all-reduce).
    ``splits``: K is split in this many equal parts (``K % (splits * block_K) == 0``), each
    its own block, so that decode-sized outputs still give every SM a block; part ``s`` of
    rank ``r`` lands in slot ``r * splits + s`` and the reduction sums the slots.
    The epilogue signals per warp (``scope="warp"``): under warp specialisation only the
    consumer warps run it, so each block adds ``tile_cfg.threads // 32`` to the flag.
    """
    bm, bn, bk = tile_cfg.block_M, tile_cfg.block_N, tile_cfg.block_K
    seg_rows = M // owners
    padded = -(-seg_rows // bm) * bm
    m_tiles = padded // bm
    k_part = K // splits

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype),
             recv: T.Tensor((2 * world * splits * padded, N), dtype), flags: T.Tensor((world,), "int32"),
             state: T.Tensor((2,), "int32")):
        with T.Kernel(T.ceildiv(N, bn), owners * m_tiles * splits, threads=tile_cfg.threads) as (bx, by):
            with T.Scale("device") as (rank, ranks):
                T.use_swizzle(max(tile_cfg.panel, 1), enable=tile_cfg.panel > 0)
                tile_row, part = by // splits, by % splits
                seg = (rank + 1 + tile_row // m_tiles) % owners
                a = T.alloc_shared((bm, bk), dtype)
                w = T.alloc_shared((bn, bk), dtype)
                acc = T.alloc_fragment((bm, bn), "float32")
                out = T.alloc_shared((bm, bn), dtype)
                T.clear(acc)
                for k in T.Pipelined(T.ceildiv(k_part, bk), num_stages=tile_cfg.stages):
                    T.copy(A[seg * seg_rows + (tile_row % m_tiles) * bm, part * k_part + k * bk], a)
                    T.copy(W[bx * bn, part * k_part + k * bk], w)
                    T.gemm(a, w, acc, transpose_B=True, policy=tile_cfg.warp_policy)
                T.copy(acc, out)
                slot_row = ((_buffer_of(state) * world + rank) * splits + part) * padded + (tile_row % m_tiles) * bm
                if owners > 1:
                    T.copy(out, recv[slot_row, bx * bn], dst_pe=seg)
                    T.signal(flags[rank], 1, pe=seg, op="add", scope="warp")
                else:
                    for p in T.serial(ranks):
                        dst = (rank + 1 + p) % ranks
                        T.copy(out, recv[slot_row, bx * bn], dst_pe=dst)
                        T.signal(flags[rank], 1, pe=dst, op="add", scope="warp")

    return main


@jit
def all_reduce_gemm_kernel(world: int, dtype: str, M: int, K: int, N: int, tile_cfg: TileConfig):
    """``a @ W.T`` all-reduced in one kernel (decode): each block computes its output tile
    over the whole K, puts the partial (in ``dtype``) into its slot at every peer and
    signals it there, waits for the peers' partials of the same tile, and sums all ranks'
    partials in rank order, so every rank gets the same bits.

    A block waits for the same block of the other ranks, so every block must be resident:
    at most one tile per SM (``gemm_all_reduce`` picks this kernel only then). Under
    TileLang's warp specialisation only the consumer warps run the epilogue, so each of
    them signals and waits on its own (``scope="warp"``): a flag counts ``threads // 32``
    signals per peer and call.
    """
    bm, bn, bk = tile_cfg.block_M, tile_cfg.block_N, tile_cfg.block_K
    padded = -(-M // bm) * bm
    m_tiles, n_tiles = padded // bm, -(-N // bn)

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), recv: T.Tensor((2 * world * padded, N), dtype),
             out: T.Tensor((M, N), dtype), flags: T.Tensor((m_tiles * n_tiles,), "int32"),
             state: T.Tensor((2,), "int32")):
        with T.Kernel(n_tiles, m_tiles, threads=tile_cfg.threads) as (bx, by):
            with T.Scale("device") as (rank, ranks):
                a = T.alloc_shared((bm, bk), dtype)
                w = T.alloc_shared((bn, bk), dtype)
                acc = T.alloc_fragment((bm, bn), "float32")
                mine = T.alloc_shared((bm, bn), dtype)
                part = T.alloc_fragment((bm, bn), dtype)
                T.clear(acc)
                for k in T.Pipelined(T.ceildiv(K, bk), num_stages=tile_cfg.stages):
                    T.copy(A[by * bm, k * bk], a)
                    T.copy(W[bx * bn, k * bk], w)
                    T.gemm(a, w, acc, transpose_B=True, policy=tile_cfg.warp_policy)
                T.copy(acc, mine)
                for p in T.serial(ranks - 1):
                    dst = (rank + 1 + p) % ranks
                    T.copy(mine, recv[(_buffer_of(state) * world + rank) * padded + by * bm, bx * bn], dst_pe=dst)
                    T.signal(flags[by * n_tiles + bx], 1, pe=dst, op="add", scope="warp")
                T.wait(flags[by * n_tiles + bx], "ge", state[1], scope="warp")
                T.clear(acc)
                for p in T.serial(ranks):
                    if p == rank:
                        T.copy(mine, part)
                    else:
                        T.copy(recv[(_buffer_of(state) * world + p) * padded + by * bm, bx * bn], part)
                    for i, j in T.Parallel(bm, bn):
                        acc[i, j] += T.cast(part[i, j], "float32")
                T.copy(acc, out[by * bm, bx * bn])

    return main


@jit
def sum_received_kernel(world: int, slots: int, dtype: str, padded_elems: int, elems: int, sms: int):
    """``out = sum_s recv[s][:elems]`` over the ``slots`` received partials once every rank's
    have arrived (fp32 accumulation)."""
    tile = 4096
    grid = min(-(-elems // tile), sms)

    @T.prim_func
    def main(recv: T.Tensor((2 * slots, padded_elems), dtype), out: T.Tensor((1, elems), dtype),
             flags: T.Tensor((world,), "int32"), state: T.Tensor((2,), "int32")):
        with T.Kernel(grid, threads=THREADS) as bx:
            with T.Scale("device") as (rank, ranks):
                acc = T.alloc_fragment((1, tile), "float32")
                part = T.alloc_fragment((1, tile), dtype)
                for p in T.serial(ranks):
                    T.wait(flags[p], "ge", state[1])
                for t in T.serial(T.ceildiv(T.ceildiv(elems, tile) - bx, grid)):
                    base = (bx + t * grid) * tile
                    T.clear(acc)
                    for s in T.serial(slots):
                        T.copy(recv[_buffer_of(state) * slots + s, base], part)
                        for i, j in T.Parallel(1, tile):
                            acc[i, j] += T.cast(part[i, j], "float32")
                    T.copy(acc, part)
                    T.copy(part, out[0, base])

    return main


def _buffer_of(state):
    """Which of an exchange's two buffer sets the current call uses."""
    return state[0] % 2


@dataclass
class _Exchange:
    """Two sets of symmetric receive buffers (stacked along the rows), the flags, and on the
    device ``state``: the calls so far and the arrivals each flag has counted in them.

    Calls alternate between the two buffers, which is what lets a rank write into a peer
    without first meeting it in a barrier: when rank r starts call i + 2 (writing buffer
    i % 2 again), r's call i + 1 has finished, so it has seen the peer's call i + 1 writes,
    so the peer started call i + 1 after finishing call i (one stream), the last reader of
    buffer i % 2.
    """

    buffers: torch.Tensor
    flags: torch.Tensor
    state: torch.Tensor  # (2,) int32 on this rank's device: [calls, running total of arrivals per flag]
    steps: dict[int, torch.Tensor] = field(default_factory=dict)

    def advance(self, arrivals: int) -> None:
        """Count one more call, which adds ``arrivals`` to each flag (before its kernels, in stream order)."""
        step = self.steps.get(arrivals)
        if step is None:
            runtime.check_not_capturing(f"a TP GEMM call adding {arrivals} arrivals per flag")
            step = self.steps[arrivals] = torch.tensor([1, arrivals], dtype=torch.int32, device=self.state.device)
        self.state += step


def _exchange(state: GroupState, key: tuple, shape: tuple[int, ...], dtype: torch.dtype, flags: int) -> _Exchange:
    """The group's exchange of ``key`` (its buffers allocated, collectively, at first use)."""

    def create() -> _Exchange:
        runtime.check_not_capturing(f"TP GEMM exchange {key}")
        return _Exchange(allocate(state, (2 * shape[0], *shape[1:]), dtype), allocate(state, (flags,), torch.int32),
                         torch.zeros(2, dtype=torch.int32, device=runtime.device()))

    return state.exchange(("tp_gemm", *key), create)


def _check_pair(a: torch.Tensor, weight: torch.Tensor) -> None:
    check_input(a, "a")
    check_input(weight, "weight")
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise ValueError(f"need a (M, K) and weight (N, K); got {tuple(a.shape)} and {tuple(weight.shape)}")
    if a.dtype != weight.dtype:
        raise TypeError(f"a is {a.dtype} but weight is {weight.dtype}")
    tl_dtype(a)


def choose_tile(rows: int, n: int, split_k: bool = False) -> TileConfig:
    """The fused kernels' GEMM tile for a ``rows`` x ``n`` output (what one rank's kernel computes).

    ``WIDE`` (128x256, TileLang's fastest) where its tiles fill every SM at least once. Else,
    for the reduce-scatter and all-reduce GEMMs (``split_k``), ``NARROW`` (128x64) where the
    output is one row tile and its tiles give 90% of the SMs a block (decode), and otherwise
    ``WIDE`` with K split (:func:`k_splits`): each K part is its own partial tile that
    crosses the link, so splitting K in 4 sends 4x the bytes (on one H200 the two ran the
    M = 128 all-reduce GEMM in 80.5 and 82.0 us without any link). Else the 128x128
    ``DEFAULT``, whose twice as many tiles keep more SMs busy at decode sizes.

    Example::

        choose_tile(8192, 14336)                 # WIDE
        choose_tile(128, 8192, split_k=True)     # NARROW on a 132-SM H200 (128 tiles)
    """
    sms = sm_count()

    def tiles(cfg: TileConfig) -> int:
        return -(-rows // cfg.block_M) * -(-n // cfg.block_N)

    if tiles(WIDE) >= sms:
        return WIDE
    if split_k:
        return NARROW if rows <= NARROW.block_M and 10 * tiles(NARROW) >= 9 * sms else WIDE
    return DEFAULT


def _choose(plan: str | None, rows: int) -> str:
    """The plan: as asked, else ``TILESCALE_TP_PLAN``, else the measured better one for ``rows``
    output rows.

    On GPUs fused from ``FUSED_MIN_ROWS_GPU`` rows on (2x H200, ``benchmarks/tp_gemm.py``:
    0.95-1.11x NCCL + cuBLAS there over two runs, 0.91-0.95x below); elsewhere (the CPU path) from
    ``FUSED_MIN_ROWS``.
    """
    plan = plan or os.environ.get("TILESCALE_TP_PLAN") or None
    if plan not in (None, "fused", "unfused"):
        raise ValueError(f"plan must be 'fused', 'unfused' or None, got {plan!r}")
    threshold = FUSED_MIN_ROWS_GPU if runtime.device().type == "cuda" else FUSED_MIN_ROWS
    return plan or ("fused" if rows >= threshold else "unfused")


def all_gather_gemm(a_shard: torch.Tensor, weight: torch.Tensor, plan: str | None = None,
                    tile: TileConfig | None = None, push_blocks: int = PUSH_BLOCKS, *,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``all_gather(a_shard) @ weight.T`` with the gather overlapped with the GEMM.

    Example::

        y = ts.ops.all_gather_gemm(x_rows, w_cols)     # (world * rows, N_local)

    ``a_shard``: this rank's rows (M_local, K), the same shape on every rank; ``weight``:
    this rank's (N_local, K). ``tile``: the fused kernel's GEMM tile (:func:`choose_tile`);
    ``push_blocks``: its blocks that push rows to the peers (the rest compute). ``group``:
    the tensor-parallel process group (None: the whole job); ``world`` is its size.
    """
    _check_pair(a_shard, weight)
    if push_blocks < 1:
        raise ValueError(f"push_blocks must be positive, got {push_blocks}")
    state = runtime.group_state(group)
    world = state.size
    (m, k), n = a_shard.shape, weight.shape[0]
    check_same_across_ranks(state, "all_gather_gemm", [m, k, n, str(a_shard.dtype)])
    if _choose(plan, world * m) == "unfused":
        gathered = torch.empty(world * m, k, dtype=a_shard.dtype, device=a_shard.device)
        dist.all_gather_into_tensor(gathered, a_shard, group=group)
        return gathered @ weight.T
    tile = tile or choose_tile(world * m, n)
    padded = -(-m // tile.block_M) * tile.block_M
    ex = _exchange(state, ("ag", padded, k, a_shard.dtype, tile.block_M), (world * padded, k), a_shard.dtype,
                   world * padded // tile.block_M)
    out = torch.empty(world * padded, n, dtype=a_shard.dtype, device=a_shard.device)
    kernel = ag_gemm_kernel(world, tl_dtype(a_shard), m, padded, k, n, push_blocks, tile, group=group)
    ex.advance(push_blocks)  # every pusher signals every row tile once per call
    kernel(a_shard, ex.buffers, weight, out, ex.flags, ex.state, group=group)
    return out if padded == m else out.view(world, padded, n)[:, :m].reshape(world * m, n)


def k_splits(tiles: int, K: int, block_K: int) -> int:
    """Parts to split K into so that ``tiles`` output tiles give every SM a block (1, 2, 4 or
    8; only splits into whole K steps).

    Example::

        k_splits(32, 14336, 64)    # 4 on a 132-SM H200: 128 blocks
    """
    splits = 1
    while tiles * splits * 2 <= sm_count() and K % (splits * 2 * block_K) == 0 and splits < 8:
        splits *= 2
    return splits


def reduce_plan(m: int, k: int, n: int, owners: int, tile: TileConfig) -> tuple[int, int, int]:
    """(rows per owner padded to whole tiles, output tiles per owner, K splits) of the GEMM
    that ``gemm_reduce_scatter`` (``owners`` = world size) or ``gemm_all_reduce`` (1) runs for
    an (m, k) x (n, k) product with ``tile``.

    Example::

        reduce_plan(128, 14336, 8192, 1, WIDE)    # (128, 32, 4) on a 132-SM H200
    """
    padded = -(-(m // owners) // tile.block_M) * tile.block_M
    tiles = (padded // tile.block_M) * -(-n // tile.block_N)
    return padded, tiles, k_splits(owners * tiles, k, tile.block_K)


def _gemm_then_reduce(state: GroupState, a: torch.Tensor, weight: torch.Tensor, owners: int, tile: TileConfig,
                      plan: tuple[int, int, int]) -> torch.Tensor:
    """The GEMM pushing partial tiles, then the reduction kernel; ``plan`` is :func:`reduce_plan`'s."""
    world, group = state.size, state.process_group
    (m, k), n = a.shape, weight.shape[0]
    rows = m // owners
    padded, tiles, splits = plan
    slots = world * splits
    ex = _exchange(state, ("rs" if owners > 1 else "ar", padded, n, a.dtype, splits), (slots * padded, n), a.dtype,
                   world)
    ex.advance(tiles * splits * (tile.threads // 32))  # per block, its consumer warps (see gemm_push_kernel)
    dtype = tl_dtype(a)
    gemm_push_kernel(world, dtype, m, k, n, owners, tile, splits, group=group)(a, weight, ex.buffers, ex.flags,
                                                                                ex.state, group=group)
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    # Row r of a received block is contiguous in both views: padded rows come after it.
    reduce = sum_received_kernel(world, slots, dtype, padded * n, rows * n, sm_count(), group=group)
    reduce(ex.buffers.view(2 * slots, padded * n), out.view(1, rows * n), ex.flags, ex.state, group=group)
    return out


def gemm_reduce_scatter(a: torch.Tensor, weight: torch.Tensor, plan: str | None = None,
                        tile: TileConfig | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce-scatter over rows of ``a @ weight.T`` (row parallel), the sends overlapped with the GEMM.

    Example::

        y = ts.ops.gemm_reduce_scatter(h, w_rows)     # (M // world, N)

    ``a``: (M, K_local), M divisible by the world size and equal on every rank; ``weight``:
    (N, K_local). ``tile``: the fused kernel's GEMM tile (:func:`choose_tile`; K is split
    where its tiles are too few for the SMs, see :func:`k_splits`). ``group``: the
    tensor-parallel process group (None: the whole job); ``world`` is its size.
    """
    _check_pair(a, weight)
    state = runtime.group_state(group)
    world = state.size
    (m, k), n = a.shape, weight.shape[0]
    if m % world:
        raise ValueError(f"gemm_reduce_scatter needs M ({m}) divisible by the group size {world}")
    check_same_across_ranks(state, "gemm_reduce_scatter", [m, k, n, str(a.dtype)])
    if _choose(plan, m) == "unfused":
        out = torch.empty(m // world, n, dtype=a.dtype, device=a.device)
        dist.reduce_scatter_tensor(out, a @ weight.T, group=group)
        return out
    tile = tile or choose_tile(m, n, split_k=True)
    return _gemm_then_reduce(state, a, weight, world, tile, reduce_plan(m, k, n, world, tile))


def gemm_all_reduce(a: torch.Tensor, weight: torch.Tensor, plan: str | None = None,
                    tile: TileConfig | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``all_reduce(a @ weight.T)`` for small M (decode): partial tiles are pushed as they finish.

    Example::

        y = ts.ops.gemm_all_reduce(h, w_rows)          # (M, N) on every rank

    Fused, where every output tile fits on its own SM with K whole (decode shapes), one
    kernel does it all (:func:`all_reduce_gemm_kernel`); else a GEMM kernel pushes partial
    tiles (K split where the tiles are few) and a second kernel sums them. Every rank gets
    the same bits: partials are summed in rank order. ``group``: the tensor-parallel
    process group (None: the whole job).
    """
    _check_pair(a, weight)
    state = runtime.group_state(group)
    (m, k), n = a.shape, weight.shape[0]
    check_same_across_ranks(state, "gemm_all_reduce", [m, k, n, str(a.dtype)])
    # Unless asked, fused on the CPU path only: on 2x H200 the fused all-reduce lost to cuBLAS +
    # NCCL at M = 128 and 1024 (0.73x, 0.93x), the rows it is for (one row count for both).
    # That was the two-kernel plan with K split; the one-kernel plan below has run on one GPU
    # only (1.15x cuBLAS alone as a graph replay, no link traffic).
    if _choose(plan, FUSED_MIN_ROWS) == "unfused":
        out = a @ weight.T
        dist.all_reduce(out, group=group)
        return out
    tile = tile or choose_tile(m, n, split_k=True)
    padded, tiles, splits = reduce_plan(m, k, n, 1, tile)
    if splits > 1 or tiles > sm_count():  # one kernel needs whole K per tile and every tile resident
        return _gemm_then_reduce(state, a, weight, 1, tile, (padded, tiles, splits))
    world = state.size
    # Keyed by the tile count too: it is the number of flags (tiles of another height can pad alike).
    ex = _exchange(state, ("ar-in-gemm", padded, n, a.dtype, tiles), (world * padded, n), a.dtype, tiles)
    ex.advance((world - 1) * (tile.threads // 32))  # each peer's consumer warps signal each tile once per call
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    all_reduce_gemm_kernel(world, tl_dtype(a), m, k, n, tile, group=group)(a, weight, ex.buffers, out, ex.flags,
                                                                          ex.state, group=group)
    return out
