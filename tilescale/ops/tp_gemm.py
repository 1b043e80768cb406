"""Tensor-parallel GEMMs with communication overlapped tile by tile.

``all_gather_gemm(a_shard, weight)``: ``all_gather(a_shard) @ weight.T`` (column parallel).
A first kernel computes this rank's own row segment straight from ``a_shard`` while its rows
go to the peers, by the copy engines (copies on a side stream, each chunk followed by a
stream-ordered write of the call's epoch to the chunk's flag at the peer) or by pusher blocks
at the head of that kernel; a second kernel computes the peers' segments (``rank + 1, rank +
2, ...``), each tile waiting for the chunk of rows it reads. Segments are padded to whole row
tiles, so a tile never reads rows that have not arrived.

``gemm_reduce_scatter(a, weight)``: one kernel. A tile of a peer's row segment goes, as a
partial, into that peer's receive buffer with a signal; the tiles of this rank's own segment
come last and add the peers' partials to their accumulators before the one store.
``gemm_all_reduce(a, weight)``, decode sizes: one kernel in which each tile's blocks exchange
partials with every rank and sum them (K split across blocks where the tiles are few). Where
that does not fit (K split for the reduce-scatter, large M for the all-reduce), a GEMM kernel
pushes partial tiles and a reduction kernel sums them once its flags say they have landed.

Flags only grow: each call adds one "epoch" of arrivals, and waits compare against the
running total, so no flag is ever reset between calls (which would race with a fast peer);
flags are per sender, so a peer already in its next call cannot stand in for a slow one.
The call count and that total live on the device, advanced in stream order before each
call's kernels, so a call captured in a CUDA graph advances them on every replay (the
copy-engine all-gather counts on the host, so captures take the pushers' plan).
Every fused call announces itself (op, shapes, tile, plan: its signature, and a call number)
on the job's call board before it signals, and its waits check the peers' announcements:
ranks whose calls differ get ``ts.ShapeMismatchError``, not each other's data (README "When
ranks disagree"). Zero rows on every rank give an empty result without a kernel.
Each op picks ``plan="fused"`` or the non-overlapped ``plan="unfused"`` (torch.distributed
collective + torch matmul): on GPUs by the GEMM's waves against the collective's bytes
(``_fused_wins``), elsewhere from the shape; pass ``plan`` to force one.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import contextlib
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import tilescale.language as T
from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.jit import jit, kernel_lowering
from tilescale.language.scale import ADDRESS
from tilescale.ops._common import call_identity, check_input, check_same_across_ranks, signature, sm_count, tl_dtype
from tilescale.ops._gemm import DEFAULT, NARROW, THREADS, WIDE, TileConfig, gemm_tile, tile_coords
from tilescale.symmetric import allocate, peer_ptrs, peer_view

# Pusher blocks of the SM-pusher all-gather plan (the rest of its first kernel computes the own
# rows): with the earlier one-kernel design on 2x H200, 32 beat 8 and 16 at three of the four
# benchmark shapes (benchmarks/results/tp-gemm-nvidia-h200-x2-20261122-235927.json).
PUSH_BLOCKS = 32
# The CPU path's default: fused from this many output rows on (GPUs decide by _fused_wins).
FUSED_MIN_ROWS = 1024
# The link arithmetic of the GPU default (_fused_wins): what the unfused plan's NCCL collective
# moves per rank per second and its fixed cost (all_gather 225 GB/s on 2x H200 NV18, DESIGN.md),
# a GEMM's rate, and what a fused call pays besides its GEMM (its first chunk or last tiles).
NCCL_GBPS = 225.0
NCCL_US = 20.0
GEMM_TFLOPS = 750.0
FUSED_US = 10.0


@jit
def ag_own_gemm_kernel(world: int, dtype: str, rows: int, padded_rows: int, K: int, N: int, push_blocks: int,
                       tile_cfg: TileConfig):
    """The all-gather GEMM's first kernel: this rank's own segment of ``C``, read straight from
    ``x`` (no copy of it, no wait), and, in blocks ``0..push_blocks-1``, the pushers that put
    this rank's rows into every peer's gather buffer (``push_blocks == 0``: the copy engines do).

    Pushers and tiles are one kernel so that the pushers are resident: blocks are dispatched
    in index order, so the first blocks run before the GEMM blocks take the SMs. Peers in
    ``rank - 1, rank - 2, ...`` order (rank r - p computes this rank's segment p-th). Every
    pusher adds 1 to a row tile's flag at the peer once it has pushed its share of that tile
    (``flags[rank * m_tiles + row_tile]``), so the peer's tiles start as soon as their rows
    are in, and announces the call on ``board`` first (the peers' waits check it). Nothing
    here waits, so the peers' second kernels always get their rows.
    """
    bm, bn = tile_cfg.block_M, tile_cfg.block_N
    m_tiles = padded_rows // bm
    n_tiles = -(-N // bn)
    # Pushers move chunks of whole rows, about 16K elements each, that divide the shard and
    # the row tile (so a chunk belongs to one row tile).
    chunk_rows = 1
    while chunk_rows * 2 * K <= 16384 and rows % (chunk_rows * 2) == 0 and bm % (chunk_rows * 2) == 0:
        chunk_rows *= 2
    chunks = rows // chunk_rows
    tile_chunks = bm // chunk_rows
    # 16-byte stores, also when a chunk is not a whole number of vectors per thread.
    vector = 8 if K % 8 == 0 else 1

    @T.macro
    def own_kernel(x, gathered, W, C, flags, state, board, ident):
        with T.Kernel(push_blocks + m_tiles * n_tiles, threads=tile_cfg.threads) as b:
            with T.Scale("device") as (rank, ranks):
                if push_blocks and b < push_blocks:  # no pusher code at all without pushers
                    T.announce(board, ident)  # before this block's signals, which release it
                    for p in T.serial(ranks - 1):
                        peer = (rank + ranks - 1 - p) % ranks
                        for r in T.serial(m_tiles):
                            mine = T.max(T.min(tile_chunks, chunks - r * tile_chunks) - b, 0)
                            for t in T.serial(T.ceildiv(mine, push_blocks)):
                                row = (r * tile_chunks + b + t * push_blocks) * chunk_rows
                                dst = (_buffer_of(state) * world + rank) * padded_rows + row
                                T.copy(x[row:row + chunk_rows, 0:K], gathered[dst:dst + chunk_rows, 0:K],
                                       dst_pe=peer, coalesced_width=vector)
                            T.signal(flags[rank * m_tiles + r], 1, pe=peer, op="add")
                else:
                    tile = T.alloc_local((1,), "int32")  # in a register, as ag_peer_gemm_kernel's
                    tile[0] = b - push_blocks
                    by, bx = tile_coords(tile[0], m_tiles, n_tiles, tile_cfg.panel)
                    gemm_tile(x, by * bm, W, bx * bn, C, rank * padded_rows + by * bm, bx * bn, K, dtype,
                              tile_cfg.stages, tile_cfg)

    if push_blocks:

        @T.prim_func
        def main(x: T.Tensor((rows, K), dtype), gathered: T.Tensor((2 * world * padded_rows, K), dtype),
                 W: T.Tensor((N, K), dtype), C: T.Tensor((world * padded_rows, N), dtype),
                 flags: T.Tensor((world * m_tiles,), "int32"), state: T.Tensor((2,), "int32"),
                 board: T.Tensor((2 * world,), "int64"), ident: T.int64):
            own_kernel(x, gathered, W, C, flags, state, board, ident)

        return main

    @T.prim_func
    def gemm_only(x: T.Tensor((rows, K), dtype), W: T.Tensor((N, K), dtype),
                  C: T.Tensor((world * padded_rows, N), dtype)):
        own_kernel(x, None, W, C, None, None, None, None)

    return gemm_only


def _peer_tile(tile, rank, ranks, m_tiles: int, n_tiles: int, panel: int):
    """(segment, row tile, column tile) of the peer-segment GEMM's linear ``tile`` index:
    segments ``rank + 1, rank + 2, ...``, each in panel order (:func:`tile_coords`) or row-major."""
    if panel:
        per_segment = m_tiles * n_tiles
        by, bx = tile_coords(tile % per_segment, m_tiles, n_tiles, panel)
        return (rank + 1 + tile // per_segment) % ranks, by, bx
    by, bx = tile // n_tiles, tile % n_tiles
    return (rank + 1 + by // m_tiles) % ranks, by % m_tiles, bx


@jit
def ag_peer_gemm_kernel(world: int, dtype: str, padded_rows: int, K: int, N: int, chunk_tiles: int,
                        tile_cfg: TileConfig, target: str):
    """The all-gather GEMM's second kernel: the peers' segments of ``C = gathered @ W.T``, each
    output tile waiting until the chunk of rows it reads has arrived.

    Rows arrive in chunks of ``chunk_tiles`` row tiles, each with a flag (``flags[segment *
    chunks + chunk]``). ``target="state"``: the flags count pusher arrivals and the tile
    waits for the running total ``state[1]``, in the buffer set ``state[0]`` names
    (:func:`ag_own_gemm_kernel`'s pushers; CUDA-graph safe). ``target="epoch"``: the copy
    engines set each flag to the call's ``epoch`` (:func:`_copy_engine_gather`), and
    ``gathered`` is the call's buffer set. The thread-block index goes through a register:
    TVM 0.1.15's simplifier rewrote ``(rank + 1 + b // tiles) % world`` into a wrong closed
    form for even ranks (the wait then watched another segment's flag). The waits check the
    senders' announcements on ``board`` (``T.wait(..., agree=)``): a sender whose call differs
    ends them with a ShapeMismatchError.
    """
    bm, bn = tile_cfg.block_M, tile_cfg.block_N
    m_tiles = padded_rows // bm
    n_tiles = -(-N // bn)
    chunks = -(-m_tiles // chunk_tiles)

    @T.macro
    def peer_tiles(gathered, W, C, flags, state, epoch, board, ident):
        with T.Kernel((world - 1) * m_tiles * n_tiles, threads=tile_cfg.threads) as b:
            with T.Scale("device") as (rank, ranks):
                tile = T.alloc_local((1,), "int32")
                tile[0] = b
                segment, by, bx = _peer_tile(tile[0], rank, ranks, m_tiles, n_tiles, tile_cfg.panel)
                T.wait(flags[segment * chunks + by // chunk_tiles], "ge", epoch if state is None else state[1],
                       agree=(board, ident))
                row = segment * padded_rows + by * bm
                first = 0 if state is None else _buffer_of(state) * world * padded_rows
                gemm_tile(gathered, first + row, W, bx * bn, C, row, bx * bn, K, dtype, tile_cfg.stages, tile_cfg)

    if target == "state":

        @T.prim_func
        def counted(gathered: T.Tensor((2 * world * padded_rows, K), dtype), W: T.Tensor((N, K), dtype),
                    C: T.Tensor((world * padded_rows, N), dtype), flags: T.Tensor((world * chunks,), "int32"),
                    state: T.Tensor((2,), "int32"), board: T.Tensor((2 * world,), "int64"), ident: T.int64):
            peer_tiles(gathered, W, C, flags, state, None, board, ident)

        return counted

    @T.prim_func
    def epoch_set(gathered: T.Tensor((world * padded_rows, K), dtype), W: T.Tensor((N, K), dtype),
                  C: T.Tensor((world * padded_rows, N), dtype), flags: T.Tensor((world * chunks,), "int32"),
                  epoch: T.int32, board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        peer_tiles(gathered, W, C, flags, None, epoch, board, ident)

    return epoch_set


@jit
def announce_kernel(world: int):
    """One block that announces a call on the job's call board (``T.announce``), for a producer
    that is not a kernel: the copy-engine all-gather runs it on its side stream before its
    copies, so that each flag that stream writes afterwards (with a system-wide fence first)
    comes after the announcement, which the receiving waits check once the flag holds."""

    @T.prim_func
    def main(board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(1, threads=32):
            with T.Scale("device"):
                T.announce(board, ident)

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
    consumer warps run it, so each block adds ``tile_cfg.threads // 32`` to the flag. Every
    block announces the call on ``board`` first (:func:`sum_received_kernel`'s waits check it).
    """
    bm, bn, bk = tile_cfg.block_M, tile_cfg.block_N, tile_cfg.block_K
    seg_rows = M // owners
    padded = -(-seg_rows // bm) * bm
    m_tiles = padded // bm
    k_part = K // splits

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype),
             recv: T.Tensor((2 * world * splits * padded, N), dtype), flags: T.Tensor((world,), "int32"),
             state: T.Tensor((2,), "int32"), board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(T.ceildiv(N, bn), owners * m_tiles * splits, threads=tile_cfg.threads) as (bx, by):
            with T.Scale("device") as (rank, ranks):
                T.use_swizzle(max(tile_cfg.panel, 1), enable=tile_cfg.panel > 0)
                T.announce(board, ident)  # before this block's signals, which release it
                T.sync_threads()  # thread 0 announced; the consumer warps signal (release) after it
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
def gemm_reduce_scatter_kernel(world: int, dtype: str, M: int, K: int, N: int, tile_cfg: TileConfig, panel: int):
    """Reduce-scatter over rows of ``a @ W.T`` in one kernel, the reduction in the owner's GEMM.

    Rows are split in ``world`` segments; segment s belongs to rank s. A block computes one
    output tile over the whole K. For a peer's segment it puts the partial (in ``dtype``) into
    its slot at the owner and signals the tile's flag there; for this rank's own segment it
    waits for the peers' partials of the same tile, adds them to its own fp32 accumulator and
    writes the result: no pass over the partials after the GEMM, and with one rank, nothing
    but the GEMM. Own-segment tiles come last in every rank's block order (segments in
    ``rank + 1, rank + 2, ...`` order), so the tiles they wait for never wait themselves.
    ``panel`` (tile rows of the panel order) divides the segment's row tiles, so no panel mixes
    own and peer tiles. Each consumer warp signals and waits on its own (``scope="warp"``).
    Every block announces the call on ``board`` before its signals; the own tiles' waits check
    the peers' announcements (a peer whose call differs: ShapeMismatchError).
    """
    bm, bn, bk = tile_cfg.block_M, tile_cfg.block_N, tile_cfg.block_K
    seg_rows = M // world
    padded = -(-seg_rows // bm) * bm
    m_tiles, n_tiles = padded // bm, -(-N // bn)

    tiles = m_tiles * n_tiles

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), recv: T.Tensor((2 * world * padded, N), dtype),
             out: T.Tensor((seg_rows, N), dtype), flags: T.Tensor((world * tiles,), "int32"),
             state: T.Tensor((2,), "int32"), board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(n_tiles, world * m_tiles, threads=tile_cfg.threads) as (bx, by):
            with T.Scale("device") as (rank, ranks):
                T.use_swizzle(panel, enable=panel > 1)
                T.announce(board, ident)  # before the peer tiles' signals, which release it
                T.sync_threads()  # thread 0 announced; the consumer warps signal (release) after it
                seg, row = (rank + 1 + by // m_tiles) % ranks, by % m_tiles
                a = T.alloc_shared((bm, bk), dtype)
                w = T.alloc_shared((bn, bk), dtype)
                acc = T.alloc_fragment((bm, bn), "float32")
                tile_out = T.alloc_shared((bm, bn), dtype)
                T.clear(acc)
                for k in T.Pipelined(T.ceildiv(K, bk), num_stages=tile_cfg.stages):
                    T.copy(A[seg * seg_rows + row * bm, k * bk], a)
                    T.copy(W[bx * bn, k * bk], w)
                    T.gemm(a, w, acc, transpose_B=True, policy=tile_cfg.warp_policy)
                if seg == rank:
                    part = T.alloc_fragment((bm, bn), dtype)
                    for p in T.serial(ranks - 1):
                        src = (rank + 1 + p) % ranks
                        # A flag per sender: a peer already in its next call adds to its own flag only.
                        T.wait(flags[src * tiles + row * n_tiles + bx], "ge", state[1], scope="warp",
                               agree=(board, ident))
                        T.copy(recv[(_buffer_of(state) * world + src) * padded + row * bm, bx * bn], part)
                        for i, j in T.Parallel(bm, bn):
                            acc[i, j] += T.cast(part[i, j], "float32")
                    T.copy(acc, tile_out)  # through shared memory: whole-row (TMA) stores
                    T.copy(tile_out, out[row * bm, bx * bn])
                else:
                    T.copy(acc, tile_out)
                    T.copy(tile_out, recv[(_buffer_of(state) * world + rank) * padded + row * bm, bx * bn], dst_pe=seg)
                    T.signal(flags[rank * tiles + row * n_tiles + bx], 1, pe=seg, op="add", scope="warp")

    return main


def _panel_dividing(m_tiles: int, panel: int) -> int:
    """The largest power of two <= ``panel`` that divides ``m_tiles`` (1 at least)."""
    p = 1
    while p * 2 <= panel and m_tiles % (p * 2) == 0:
        p *= 2
    return p


@jit
def all_reduce_gemm_kernel(world: int, dtype: str, M: int, K: int, N: int, tile_cfg: TileConfig, splits: int = 1):
    """``a @ W.T`` all-reduced in one kernel (decode): each block computes its output tile
    over K (or, with ``splits`` > 1, over its ``1 / splits`` of K), puts the partial (in
    ``dtype``) into its slot at every rank and signals it there, then waits for all partials
    of the same tile and sums them in rank order (and K-part order), so every rank gets the
    same bits. With K split, block ``s`` of a tile sums and writes row slice ``s`` of it: the
    reduction is spread over the same blocks, and no second kernel runs.

    A block waits for the other blocks of its tile, on every rank, so every block must be
    resident: at most one block per SM (``gemm_all_reduce`` picks this kernel only then).
    Under TileLang's warp specialisation only the consumer warps run the epilogue, so each
    of them signals and waits on its own (``scope="warp"``): a flag per (sender, tile)
    counts ``splits * threads // 32`` signals per call. Every block announces the call on
    ``board`` before its signals, and the waits check the peers' announcements.
    """
    bm, bn, bk = tile_cfg.block_M, tile_cfg.block_N, tile_cfg.block_K
    padded = -(-M // bm) * bm
    m_tiles, n_tiles = padded // bm, -(-N // bn)
    k_part, rows = K // splits, bm // splits

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype),
             recv: T.Tensor((2 * world * splits * padded, N), dtype), out: T.Tensor((M, N), dtype),
             flags: T.Tensor((world * m_tiles * n_tiles,), "int32"), state: T.Tensor((2,), "int32"),
             board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(n_tiles, m_tiles * splits, threads=tile_cfg.threads) as (bx, bz):
            with T.Scale("device") as (rank, ranks):
                T.announce(board, ident)  # before this block's signals, which release it
                T.sync_threads()  # thread 0 announced; the consumer warps signal (release) after it
                by, s = bz // splits, bz % splits
                a = T.alloc_shared((bm, bk), dtype)
                w = T.alloc_shared((bn, bk), dtype)
                acc = T.alloc_fragment((bm, bn), "float32")
                mine = T.alloc_shared((bm, bn), dtype)
                total = T.alloc_fragment((rows, bn), "float32")
                part = T.alloc_fragment((rows, bn), dtype)
                T.clear(acc)
                for k in T.Pipelined(T.ceildiv(k_part, bk), num_stages=tile_cfg.stages):
                    T.copy(A[by * bm, s * k_part + k * bk], a)
                    T.copy(W[bx * bn, s * k_part + k * bk], w)
                    T.gemm(a, w, acc, transpose_B=True, policy=tile_cfg.warp_policy)
                T.copy(acc, mine)
                # Whole K: the own partial stays in shared memory. Split K: it goes to this
                # rank's own slot too, where the tile's other blocks read it.
                for p in T.serial(ranks - 1 if splits == 1 else ranks):
                    dst = (rank + 1 + p) % ranks
                    T.copy(mine, recv[((_buffer_of(state) * world + rank) * splits + s) * padded + by * bm, bx * bn],
                           dst_pe=dst)
                    T.signal(flags[(rank * m_tiles + by) * n_tiles + bx], 1, pe=dst, op="add", scope="warp")
                T.clear(total)
                for p in T.serial(ranks):
                    if splits == 1:
                        if p == rank:
                            T.copy(mine, part)
                        else:
                            # A flag per sender: with 3+ ranks a peer may already be in its next
                            # call and signal again; one shared count could pass before a slower
                            # peer's tile had landed.
                            T.wait(flags[(p * m_tiles + by) * n_tiles + bx], "ge", state[1], scope="warp",
                                   agree=(board, ident))
                            T.copy(recv[(_buffer_of(state) * world + p) * padded + by * bm, bx * bn], part)
                        for i, j in T.Parallel(rows, bn):
                            total[i, j] += T.cast(part[i, j], "float32")
                    else:
                        T.wait(flags[(p * m_tiles + by) * n_tiles + bx], "ge", state[1], scope="warp",
                               agree=(board, ident))
                        for q in T.serial(splits):
                            slot = ((_buffer_of(state) * world + p) * splits + q) * padded + by * bm
                            T.copy(recv[slot + s * rows, bx * bn], part)
                            for i, j in T.Parallel(rows, bn):
                                total[i, j] += T.cast(part[i, j], "float32")
                if by * bm + s * rows < M:  # a slice of padding rows writes nothing
                    T.copy(total, out[by * bm + s * rows, bx * bn])

    return main


@jit
def sum_received_kernel(world: int, slots: int, dtype: str, padded_elems: int, elems: int, sms: int):
    """``out = sum_s recv[s][:elems]`` over the ``slots`` received partials once every rank's
    have arrived (fp32 accumulation); the waits check the senders' announcements on ``board``."""
    tile = 4096
    grid = min(-(-elems // tile), sms)

    @T.prim_func
    def main(recv: T.Tensor((2 * slots, padded_elems), dtype), out: T.Tensor((1, elems), dtype),
             flags: T.Tensor((world,), "int32"), state: T.Tensor((2,), "int32"), board: T.Tensor((2 * world,), "int64"),
             ident: T.int64):
        with T.Kernel(grid, threads=THREADS) as bx:
            with T.Scale("device") as (rank, ranks):
                acc = T.alloc_fragment((1, tile), "float32")
                part = T.alloc_fragment((1, tile), dtype)
                for p in T.serial(ranks):
                    T.wait(flags[p], "ge", state[1], agree=(board, ident))
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

    def step(self, arrivals: int) -> torch.Tensor:
        """The device-side increment of a call adding ``arrivals`` to each flag (made at first use)."""
        step = self.steps.get(arrivals)
        if step is None:
            runtime.check_not_capturing(f"a TP GEMM call adding {arrivals} arrivals per flag")
            step = self.steps[arrivals] = torch.tensor([1, arrivals], dtype=torch.int32, device=self.state.device)
        return step

    def advance(self, arrivals: int) -> None:
        """Count one more call, which adds ``arrivals`` to each flag (before its kernels, in stream order)."""
        self.state += self.step(arrivals)


def _exchange(state: GroupState, key: tuple, shape: tuple[int, ...], dtype: torch.dtype, flags: int) -> _Exchange:
    """The group's exchange of ``key`` (its buffers allocated, collectively, at first use)."""

    def create() -> _Exchange:
        runtime.check_not_capturing(f"TP GEMM exchange {key}")
        return _Exchange(allocate(state, (2 * shape[0], *shape[1:]), dtype), allocate(state, (flags,), torch.int32),
                         torch.zeros(2, dtype=torch.int32, device=runtime.device()))

    return state.exchange(("tp_gemm", *key), create)


class _StreamWrites:
    """``cuStreamWriteValue32``: a 32-bit store that a stream performs once its earlier work is
    complete (with a system-scope fence first), done by the GPU's front end, not by an SM, so
    it lands even while a GEMM holds every SM waiting for it."""

    def __init__(self) -> None:
        import ctypes

        self._ctypes = ctypes
        lib = ctypes.CDLL("libcuda.so.1")
        self._write = getattr(lib, "cuStreamWriteValue32_v2", None) or lib.cuStreamWriteValue32
        self._write.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        self._write.restype = ctypes.c_int

    def __call__(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        err = self._write(self._ctypes.c_void_p(stream.cuda_stream), address, value, 0)
        if err:
            raise RuntimeError(f"cuStreamWriteValue32 failed with CUresult {err}")


_stream_writes: _StreamWrites | None = None


@dataclass
class _GatherExchange:
    """The copy-engine all-gather's buffers: two sets of gathered rows (stacked along the rows),
    one flag per (segment, chunk), and the calls so far, counted on the host.

    A call's flags are set to its call count (``epoch``): flags only grow, so none is reset.
    Calls alternate between the two sets, as :class:`_Exchange`'s do and for the same reason.
    The host counts the calls, so a CUDA graph could only replay one epoch: captured calls
    take the SM pushers' plan instead (:func:`all_gather_gemm`).
    """

    buffers: torch.Tensor
    flags: torch.Tensor
    peer_buffers: list[torch.Tensor]
    peer_flags: list[torch.Tensor]
    stream: torch.cuda.Stream | None
    calls: int = 0


def _gather_exchange(state: GroupState, key: tuple, rows: int, k: int, dtype: torch.dtype,
                     flags: int) -> _GatherExchange:
    """The group's copy-engine exchange of ``key`` (allocated, collectively, at first use)."""

    def create() -> _GatherExchange:
        runtime.check_not_capturing(f"TP GEMM exchange {key}")
        buffers, flag = allocate(state, (2 * rows, k), dtype), allocate(state, (flags,), torch.int32)
        stream = None
        if buffers.is_cuda:  # high priority: its copies and flag writes go first where kernels wait for them
            stream = torch.cuda.Stream(buffers.device, priority=-1)
        return _GatherExchange(buffers, flag, [peer_view(buffers, p) for p in range(state.size)],
                               [peer_view(flag, p) for p in range(state.size)], stream)

    return state.exchange(("tp_gemm", *key), create)


def chunk_tiles(m_tiles: int, k: int, block_M: int, elem_bytes: int) -> int:
    """Row tiles per copy of the copy-engine all-gather: about 8 MB each, at least 2 copies per
    segment where it has 2 row tiles, so the first tiles of a segment start after a part landed.

    Example::

        chunk_tiles(64, 8192, 128, 2)     # 4: 512 rows of 8192 bf16 = 8 MB
    """
    return max(1, min(-(-m_tiles // 2), (8 << 20) // (block_M * k * elem_bytes)))


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


def wave_efficiency(tiles: list[int], sms: int) -> float:
    """Share of the SMs' time that kernels of ``tiles[i]`` one-SM blocks each, run one after
    another, keep busy: each kernel's last, partial wave leaves SMs idle.

    The fused kernels' one-rank floor follows it (one H100, 20261124-191930): 1024 x 14336
    outputs in 128x256 tiles are 448 tiles, 3.4 waves of 132 SMs, 0.85 busy: 1.21x cuBLAS.

    Example::

        wave_efficiency([448], 132)     # 0.848
    """
    return sum(tiles) / (sum(-(-t // sms) for t in tiles) * sms)


def _fused_wins(flops: float, tiles: list[int], collective_bytes: float) -> bool:
    """Whether the fused plan should beat NCCL + cuBLAS on GPUs: the fused GEMM loses its
    waves' idle share (:func:`wave_efficiency`) plus ``FUSED_US``; the unfused plan waits for
    a collective of ``collective_bytes`` per rank after a GEMM at full rate."""
    gemm_us = flops / (GEMM_TFLOPS * 1e6)
    fused = gemm_us / wave_efficiency(tiles, sm_count()) + FUSED_US
    return fused < gemm_us + collective_bytes / (NCCL_GBPS * 1e3) + NCCL_US


def _choose(plan: str | None, rows: int, fused_wins: bool) -> str:
    """The plan: as asked, else ``TILESCALE_TP_PLAN``, else on GPUs ``fused_wins`` (the op's
    :func:`_fused_wins`, NVLink's arithmetic: where ranks talk through NVSHMEM calls, across
    nodes, NCCL + cuBLAS), elsewhere (the CPU path) fused from ``FUSED_MIN_ROWS`` output rows on.
    """
    plan = plan or os.environ.get("TILESCALE_TP_PLAN") or None
    if plan not in (None, "fused", "unfused"):
        raise ValueError(f"plan must be 'fused', 'unfused' or None, got {plan!r}")
    if runtime.device().type == "cuda":
        return plan or ("fused" if fused_wins and kernel_lowering() in (None, ADDRESS) else "unfused")
    return plan or ("fused" if rows >= FUSED_MIN_ROWS else "unfused")


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
    tile = tile or choose_tile(world * m, n)
    padded = -(-m // tile.block_M) * tile.block_M
    seg_tiles = padded // tile.block_M * -(-n // tile.block_N)  # own segment, then the peers' in a second kernel
    wins = _fused_wins(2 * world * m * k * n, [seg_tiles, (world - 1) * seg_tiles],
                       (world - 1) * m * k * a_shard.element_size())
    if _choose(plan, world * m, wins) == "unfused":
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
                      plan: tuple[int, int, int], ident: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The GEMM pushing partial tiles, then the reduction kernel; ``plan`` is :func:`reduce_plan`'s,
    ``ident`` the call's board and identity (:func:`call_identity`)."""
    world, group = state.size, state.process_group
    (m, k), n = a.shape, weight.shape[0]
    rows = m // owners
    padded, tiles, splits = plan
    slots = world * splits
    ex = _exchange(state, ("rs" if owners > 1 else "ar", padded, n, a.dtype, splits), (slots * padded, n), a.dtype,
                   world)
    ex.advance(tiles * splits * (tile.threads // 32))  # per block, its consumer warps (see gemm_push_kernel)
    dtype = tl_dtype(a)
    push = gemm_push_kernel(world, dtype, m, k, n, owners, tile, splits, group=group)
    push(a, weight, ex.buffers, ex.flags, ex.state, *ident, group=group)
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    # Row r of a received block is contiguous in both views: padded rows come after it.
    reduce = sum_received_kernel(world, slots, dtype, padded * n, rows * n, sm_count(), group=group)
    reduce(ex.buffers.view(2 * slots, padded * n), out.view(1, rows * n), ex.flags, ex.state, *ident, group=group)
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

    Fused calls whose ranks differ (shapes, dtype, tile, K split) raise
    ``ts.ShapeMismatchError`` on every rank; zero rows on every rank give an empty result.
    """
    _check_pair(a, weight)
    state = runtime.group_state(group)
    world = state.size
    (m, k), n = a.shape, weight.shape[0]
    if m % world:
        raise ValueError(f"gemm_reduce_scatter needs M ({m}) divisible by the group size {world}")
    check_same_across_ranks(state, "gemm_reduce_scatter", [m, k, n, str(a.dtype)], every_call=m == 0)
    if m == 0:
        return a.new_empty(0, n)
    tile = tile or choose_tile(m, n, split_k=True)
    padded, tiles, splits = reduce_plan(m, k, n, world, tile)
    wins = _fused_wins(2 * m * k * n, [world * tiles * splits], (world - 1) * m * n * a.element_size() / world)
    if _choose(plan, m, wins) == "unfused":
        out = torch.empty(m // world, n, dtype=a.dtype, device=a.device)
        dist.reduce_scatter_tensor(out, a @ weight.T, group=group)
        return out
    # Remote writes go only to the peers' copies of this call's own exchange (symmetric, sized
    # alike on every rank), so a peer whose call differs is not written out of bounds.
    ident = call_identity(state, signature("gemm_reduce_scatter", a, f"N={n}", tile, f"splits={splits}"))
    if splits > 1:  # K parts are separate partial tiles: the reduction kernel sums them
        return _gemm_then_reduce(state, a, weight, world, tile, (padded, tiles, splits), ident)
    ex = _exchange(state, ("rs-in-gemm", padded, n, a.dtype, tiles, tile.threads), (world * padded, n), a.dtype,
                   world * tiles)
    ex.advance(tile.threads // 32)  # a peer's consumer warps signal its flag of each tile once per call
    out = torch.empty(m // world, n, dtype=a.dtype, device=a.device)
    panel = _panel_dividing(padded // tile.block_M, tile.panel)
    kernel = gemm_reduce_scatter_kernel(world, tl_dtype(a), m, k, n, tile, panel, group=group)
    kernel(a, weight, ex.buffers, out, ex.flags, ex.state, *ident, group=group)
    return out


def gemm_all_reduce(a: torch.Tensor, weight: torch.Tensor, plan: str | None = None,
                    tile: TileConfig | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``all_reduce(a @ weight.T)`` for small M (decode): partial tiles are pushed as they finish.

    Example::

        y = ts.ops.gemm_all_reduce(h, w_rows)          # (M, N) on every rank

    Fused, where every block has an SM of its own (decode shapes: output tiles times K
    splits, :func:`k_splits`), one kernel does it all (:func:`all_reduce_gemm_kernel`);
    else a GEMM kernel pushes partial tiles and a second kernel sums them. Every rank gets
    the same bits: partials are summed in rank order. ``group``: the tensor-parallel
    process group (None: the whole job).

    Fused calls whose ranks differ (shapes, dtype, tile, plan) raise ``ts.ShapeMismatchError``
    on every rank; zero rows on every rank give an empty result.
    """
    _check_pair(a, weight)
    state = runtime.group_state(group)
    (m, k), n = a.shape, weight.shape[0]
    check_same_across_ranks(state, "gemm_all_reduce", [m, k, n, str(a.dtype)], every_call=m == 0)
    if m == 0:
        return a.new_empty(0, n)
    tile = tile or choose_tile(m, n, split_k=True)
    padded, tiles, splits = reduce_plan(m, k, n, 1, tile)
    # On GPUs fused where the one-kernel plan applies (decode): as graph replays its floor is
    # 4-20 us over cuBLAS at the decode shapes of benchmarks/tp_gemm.py --floor (one H100),
    # while NCCL's all-reduce of those megabytes took 75 us (M = 128, N = 8192, 2x H200).
    # Above, NCCL + cuBLAS (the two-kernel plan adds a pass over world x M x N partials).
    one_kernel = tiles * splits <= sm_count()  # one kernel needs every block resident
    if _choose(plan, FUSED_MIN_ROWS, one_kernel) == "unfused":
        out = a @ weight.T
        dist.all_reduce(out, group=group)
        return out
    ident = call_identity(state, signature("gemm_all_reduce", a, f"N={n}", tile, f"splits={splits}",
                                    "one kernel" if one_kernel else "two kernels"))
    if not one_kernel:
        return _gemm_then_reduce(state, a, weight, 1, tile, (padded, tiles, splits), ident)
    world = state.size
    # Keyed by the tile count too: it is the number of flags (tiles of another height can pad alike).
    ex = _exchange(state, ("ar-in-gemm", padded, n, a.dtype, tiles, tile.threads, splits), (world * splits * padded, n),
                   a.dtype, world * tiles)
    ex.advance(splits * (tile.threads // 32))  # a sender's blocks of a tile signal once per consumer warp
    out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    kernel = all_reduce_gemm_kernel(world, tl_dtype(a), m, k, n, tile, splits, group=group)
    kernel(a, weight, ex.buffers, out, ex.flags, ex.state, *ident, group=group)
    return out
