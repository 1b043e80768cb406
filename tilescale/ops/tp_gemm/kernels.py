"""The fused TP GEMMs' kernels (``@jit`` factories): the all-gather GEMM's own-segment and
peer-segment kernels, the reduce-scatter GEMM with its reduction in the owner's tiles, the
one-kernel decode all-reduce GEMM, and the push-then-sum pair where K is split. The host
side that picks and launches them is in ``all_gather.py`` and ``reduce.py``; the protocol
(flags that only grow, per-sender flags, the call board) in the package's docstring.

Each call's first kernel counts the call on the device (``T.count_call`` on its exchange's
``state``): its blocks get the call's number (its buffer set: the number's parity) and flag
target, and its last block advances ``state``; a call's second kernel reads the advanced
``state`` itself.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import tilescale.language as T
from tilescale.jit import jit
from tilescale.ops._gemm import THREADS, TileConfig, accumulate_tile, check_unswapped, gemm_tile, tile_coords


@jit
def ag_own_gemm_kernel(world: int, dtype: str, rows: int, padded_rows: int, K: int, N: int, push_blocks: int,
                       tile_cfg: TileConfig):
    """The all-gather GEMM's first kernel: this rank's own segment of ``C`` (``C[rank]``, of
    shape (world, rows, N): a segment's last row tile is clipped at its end, so the output
    needs no padding), read straight from ``x`` (no copy of it, no wait), and, in blocks
    ``0..push_blocks-1``, the pushers that put this rank's rows into every peer's gather
    buffer (``push_blocks == 0``: the copy engines do).

    Pushers and tiles are one kernel so that the pushers are resident: blocks are dispatched
    in index order, so the first blocks run before the GEMM blocks take the SMs. Peers in
    ``rank - 1, rank - 2, ...`` order (rank r - p computes this rank's segment p-th). Every
    pusher adds 1 to a row tile's flag at the peer once it has pushed its share of that tile
    (``flags[rank * m_tiles + row_tile]``), so the peer's tiles start as soon as their rows
    are in, and announces the call on ``board`` first (the peers' waits check it). The
    pushers count the call (``T.count_call``: each adds ``push_blocks`` arrivals to every
    flag). Nothing here waits, so the peers' second kernels always get their rows.

    Args:
        world: Ranks of the group the kernel is built for.
        dtype: TileLang dtype of the operands and outputs (``"bfloat16"``, ...).
        rows: This rank's rows (M_local).
        padded_rows: ``rows`` padded to whole row tiles.
        K: Input features.
        N: This rank's output columns.
        push_blocks: Pushing blocks (0: the copy engines move the rows).
        tile_cfg: The GEMM tile (:class:`TileConfig`).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    check_unswapped(tile_cfg, "ag_own_gemm_kernel")
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
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                if push_blocks and b < push_blocks:  # no pusher code at all without pushers
                    call = T.alloc_local((2,), "int32")  # this call's number and flag target
                    T.count_call(state, push_blocks, call, push_blocks)  # every pusher signals every row tile
                    T.announce(board, ident)  # before this block's signals, which release it
                    for p in T.serial(world - 1):
                        peer = (rank + world - 1 - p) % world
                        for r in T.serial(m_tiles):
                            mine = T.max(T.min(tile_chunks, chunks - r * tile_chunks) - b, 0)
                            for t in T.serial(T.ceildiv(mine, push_blocks)):
                                row = (r * tile_chunks + b + t * push_blocks) * chunk_rows
                                dst = (_buffer_of(call[0]) * world + rank) * padded_rows + row
                                T.copy(x[row:row + chunk_rows, 0:K], gathered[dst:dst + chunk_rows, 0:K],
                                       dst_pe=peer, coalesced_width=vector)
                            T.signal(flags[rank * m_tiles + r], 1, pe=peer, op="add")
                else:
                    tile = T.alloc_local((1,), "int32")  # in a register, as ag_peer_gemm_kernel's
                    tile[0] = b - push_blocks
                    by, bx = tile_coords(tile[0], m_tiles, n_tiles, tile_cfg.panel)
                    gemm_tile(x, by * bm, W, bx * bn, C, by * bm, bx * bn, K, dtype, tile_cfg.stages, tile_cfg,
                              c_segment=rank)

    if push_blocks:

        @T.prim_func
        def main(x: T.Tensor((rows, K), dtype), gathered: T.Tensor((2 * world * padded_rows, K), dtype),
                 W: T.Tensor((N, K), dtype), C: T.Tensor((world, rows, N), dtype),
                 flags: T.Tensor((world * m_tiles,), "int32"), state: T.Tensor((3,), "int32"),
                 board: T.Tensor((2 * world,), "int64"), ident: T.int64):
            own_kernel(x, gathered, W, C, flags, state, board, ident)

        return main

    @T.prim_func
    def gemm_only(x: T.Tensor((rows, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((world, rows, N), dtype)):
        own_kernel(x, None, W, C, None, None, None, None)

    return gemm_only


def _peer_tile(tile, rank, world, m_tiles: int, n_tiles: int, panel: int):
    """(segment, row tile, column tile) of the peer-segment GEMM's linear ``tile`` index:
    segments ``rank + 1, rank + 2, ...``, each in panel order (:func:`tile_coords`) or row-major."""
    if panel:
        per_segment = m_tiles * n_tiles
        by, bx = tile_coords(tile % per_segment, m_tiles, n_tiles, panel)
        return (rank + 1 + tile // per_segment) % world, by, bx
    by, bx = tile // n_tiles, tile % n_tiles
    return (rank + 1 + by // m_tiles) % world, by % m_tiles, bx


@jit
def ag_peer_gemm_kernel(world: int, dtype: str, rows: int, padded_rows: int, K: int, N: int, chunk_tiles: int,
                        tile_cfg: TileConfig, target: str):
    """The all-gather GEMM's second kernel: the peers' segments of ``C = gathered @ W.T``
    (``C`` of shape (world, rows, N), as :func:`ag_own_gemm_kernel`'s), each output tile
    waiting until the chunk of rows it reads has arrived.

    Rows arrive in chunks of ``chunk_tiles`` row tiles, each with a flag (``flags[segment *
    chunks + chunk]``). ``target="state"``: the flags count pusher arrivals and the tile
    waits for the flag target ``state[1]``, in the buffer set ``state[0]`` names (the
    call :func:`ag_own_gemm_kernel`'s pushers counted; CUDA-graph safe). ``target="epoch"``: the copy
    engines set each flag to the call's ``epoch`` (:func:`_copy_engine_gather`), and
    ``gathered`` is the call's buffer set. The thread-block index goes through a register:
    TVM 0.1.15's simplifier rewrote ``(rank + 1 + b // tiles) % world`` into a wrong closed
    form for even ranks (the wait then watched another segment's flag). The waits check the
    senders' announcements on ``board`` (``T.wait(..., agree=)``): a sender whose call differs
    ends them with a ShapeMismatchError.

    Args:
        world: Ranks of the group the kernel is built for.
        dtype: TileLang dtype of the operands and outputs (``"bfloat16"``, ...).
        rows: A segment's rows (M_local).
        padded_rows: ``rows`` padded to whole row tiles (a segment's rows in ``gathered``).
        K: Input features.
        N: This rank's output columns.
        chunk_tiles: Row tiles per arrival flag (:func:`chunk_tiles`).
        tile_cfg: The GEMM tile (:class:`TileConfig`).
        target: ``"state"`` (SM pushers) or ``"epoch"`` (copy engines), as above.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    check_unswapped(tile_cfg, "ag_peer_gemm_kernel")
    bm, bn = tile_cfg.block_M, tile_cfg.block_N
    m_tiles = padded_rows // bm
    n_tiles = -(-N // bn)
    chunks = -(-m_tiles // chunk_tiles)

    @T.macro
    def peer_tiles(gathered, W, C, flags, state, epoch, board, ident):
        with T.Kernel((world - 1) * m_tiles * n_tiles, threads=tile_cfg.threads) as b:
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                tile = T.alloc_local((1,), "int32")
                tile[0] = b
                segment, by, bx = _peer_tile(tile[0], rank, world, m_tiles, n_tiles, tile_cfg.panel)
                T.wait(flags[segment * chunks + by // chunk_tiles], "ge", epoch if state is None else state[1],
                       agree=(board, ident))
                first = 0 if state is None else _buffer_of(state[0]) * world * padded_rows
                gemm_tile(gathered, first + segment * padded_rows + by * bm, W, bx * bn, C, by * bm, bx * bn, K, dtype,
                          tile_cfg.stages, tile_cfg, c_segment=segment)

    if target == "state":

        @T.prim_func
        def counted(gathered: T.Tensor((2 * world * padded_rows, K), dtype), W: T.Tensor((N, K), dtype),
                    C: T.Tensor((world, rows, N), dtype), flags: T.Tensor((world * chunks,), "int32"),
                    state: T.Tensor((3,), "int32"), board: T.Tensor((2 * world,), "int64"), ident: T.int64):
            peer_tiles(gathered, W, C, flags, state, None, board, ident)

        return counted

    @T.prim_func
    def epoch_set(gathered: T.Tensor((world * padded_rows, K), dtype), W: T.Tensor((N, K), dtype),
                  C: T.Tensor((world, rows, N), dtype), flags: T.Tensor((world * chunks,), "int32"),
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
    block counts the call (``T.count_call``) and announces it on ``board`` first
    (:func:`sum_received_kernel`'s waits check it).

    Args:
        world: Ranks of the group the kernel is built for.
        dtype: TileLang dtype of the operands and outputs (``"bfloat16"``, ...).
        M: Rows of ``A``.
        K: This rank's input features.
        N: Output columns.
        owners: ``world`` (reduce-scatter) or 1 (all-reduce), as above.
        tile_cfg: The GEMM tile (:class:`TileConfig`).
        splits: Parts K is split into (:func:`k_splits`).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    check_unswapped(tile_cfg, "gemm_push_kernel")
    bm, bn = tile_cfg.block_M, tile_cfg.block_N
    seg_rows = M // owners
    padded = -(-seg_rows // bm) * bm
    m_tiles = padded // bm
    k_part = K // splits
    # A sender's flag at an owner gains, per call, a signal per consumer warp of each of its
    # blocks for that owner.
    arrivals = m_tiles * -(-N // bn) * splits * (tile_cfg.threads // 32)

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype),
             recv: T.Tensor((2 * world * splits * padded, N), dtype), flags: T.Tensor((world,), "int32"),
             state: T.Tensor((3,), "int32"), board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(T.ceildiv(N, bn), owners * m_tiles * splits, threads=tile_cfg.threads) as (bx, by):
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                T.use_swizzle(max(tile_cfg.panel, 1), enable=tile_cfg.panel > 0)
                T.announce(board, ident)  # before this block's signals, which release it
                call = T.alloc_local((2,), "int32")  # this call's number and flag target
                # Synchronises the block: thread 0 announced; the consumer warps signal (release) after it.
                T.count_call(state, arrivals, call)
                tile_row, part = by // splits, by % splits
                seg = (rank + 1 + tile_row // m_tiles) % owners
                acc = T.alloc_fragment((bm, bn), "float32")
                out = T.alloc_shared((bm, bn), dtype)
                T.clear(acc)
                accumulate_tile(A, seg * seg_rows + (tile_row % m_tiles) * bm, W, bx * bn, acc, part * k_part, k_part,
                                dtype, tile_cfg.stages, tile_cfg)
                T.copy(acc, out)
                slot_row = ((_buffer_of(call[0]) * world + rank) * splits + part) * padded + (tile_row % m_tiles) * bm
                if owners > 1:
                    T.copy(out, recv[slot_row, bx * bn], dst_pe=seg)
                    T.signal(flags[rank], 1, pe=seg, op="add", scope="warp")
                else:
                    for p in T.serial(world):
                        dst = (rank + 1 + p) % world
                        T.copy(out, recv[slot_row, bx * bn], dst_pe=dst)
                        T.signal(flags[rank], 1, pe=dst, op="add", scope="warp")

    return main


@jit
def gemm_reduce_scatter_kernel(world: int, dtype: str, M: int, K: int, N: int, tile_cfg: TileConfig, panel: int,
                               gather: bool = False):
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
    Every block counts the call (``T.count_call``: a peer's consumer warps signal each flag
    once per call) and announces it on ``board`` before its signals; the own tiles' waits
    check the peers' announcements (a peer whose call differs: ShapeMismatchError).

    ``gather`` (the all-reduce of :func:`gather_segments_kernel`): ``out`` holds all ``M`` rows
    and an own tile, once summed, also goes to every peer's final slot (slots ``world +
    rank``, flags after the partials'), from which the peer's next kernel copies it.

    Args:
        world: Ranks of the group the kernel is built for.
        dtype: TileLang dtype of the operands and outputs (``"bfloat16"``, ...).
        M: Rows of ``A``, divisible by ``world``.
        K: This rank's input features.
        N: Output columns.
        tile_cfg: The GEMM tile (:class:`TileConfig`).
        panel: Tile rows of the panel order (0: row-major), dividing a segment's row tiles.
        gather: Also send each summed own tile to every peer (default False), as above.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    check_unswapped(tile_cfg, "gemm_reduce_scatter_kernel")
    bm, bn = tile_cfg.block_M, tile_cfg.block_N
    seg_rows = M // world
    padded = -(-seg_rows // bm) * bm
    m_tiles, n_tiles = padded // bm, -(-N // bn)
    slots = 2 * world if gather else world  # per buffer set: the partials, then the gathered finals

    tiles = m_tiles * n_tiles

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), recv: T.Tensor((2 * slots * padded, N), dtype),
             out: T.Tensor((M if gather else seg_rows, N), dtype), flags: T.Tensor((slots * tiles,), "int32"),
             state: T.Tensor((3,), "int32"), board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(n_tiles, world * m_tiles, threads=tile_cfg.threads) as (bx, by):
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                T.use_swizzle(panel, enable=panel > 1)
                T.announce(board, ident)  # before the peer tiles' signals, which release it
                call = T.alloc_local((2,), "int32")  # this call's number and flag target
                # Synchronises the block: thread 0 announced; the consumer warps signal (release) after it.
                T.count_call(state, tile_cfg.threads // 32, call)
                seg, row = (rank + 1 + by // m_tiles) % world, by % m_tiles
                acc = T.alloc_fragment((bm, bn), "float32")
                tile_out = T.alloc_shared((bm, bn), dtype)
                T.clear(acc)
                accumulate_tile(A, seg * seg_rows + row * bm, W, bx * bn, acc, 0, K, dtype, tile_cfg.stages, tile_cfg)
                if seg == rank:
                    part = T.alloc_fragment((bm, bn), dtype)
                    for p in T.serial(world - 1):
                        src = (rank + 1 + p) % world
                        # A flag per sender: a peer already in its next call adds to its own flag only.
                        T.wait(flags[src * tiles + row * n_tiles + bx], "ge", call[1], scope="warp",
                               agree=(board, ident))
                        T.copy(recv[(_buffer_of(call[0]) * slots + src) * padded + row * bm, bx * bn], part)
                        for i, j in T.Parallel(bm, bn):
                            acc[i, j] += T.cast(part[i, j], "float32")
                    T.copy(acc, tile_out)  # through shared memory: whole-row (TMA) stores
                    # With gather, rows past a ragged segment's end land in the next segment's,
                    # which the next kernel (stream order) writes over; past M they are clipped.
                    T.copy(tile_out, out[(rank * seg_rows if gather else 0) + row * bm, bx * bn])
                    if gather:
                        for p in T.serial(world - 1):
                            dst = (rank + 1 + p) % world
                            T.copy(tile_out, recv[(_buffer_of(call[0]) * slots + world + rank) * padded + row * bm,
                                                  bx * bn], dst_pe=dst)
                            T.signal(flags[(world + rank) * tiles + row * n_tiles + bx], 1, pe=dst, op="add",
                                     scope="warp")
                else:
                    T.copy(acc, tile_out)
                    T.copy(tile_out, recv[(_buffer_of(call[0]) * slots + rank) * padded + row * bm, bx * bn],
                           dst_pe=seg)
                    T.signal(flags[rank * tiles + row * n_tiles + bx], 1, pe=seg, op="add", scope="warp")

    return main


@jit
def gather_segments_kernel(world: int, dtype: str, M: int, N: int, tile_cfg: TileConfig):
    """The all-reduce GEMM's second kernel (after :func:`gemm_reduce_scatter_kernel` with
    ``gather``): every peer's summed segment, tile by tile as its flag says it has landed in
    this rank's final slots, copied into its rows of ``out`` (rows past a ragged segment's
    end are not copied: they belong to the next segment). Only waits: the tiles it waits
    for come from kernels that wait only for partials this rank's GEMM already sent. The
    waits check the senders' announcements on ``board``; the call's number and flag target
    are ``state`` as the GEMM kernel before it (stream order) advanced it.

    Args:
        world: Ranks of the group the kernel is built for.
        dtype: TileLang dtype of the operands and outputs (``"bfloat16"``, ...).
        M: Rows of ``out``, divisible by ``world``.
        N: Output columns.
        tile_cfg: The GEMM tile (:class:`TileConfig`).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    check_unswapped(tile_cfg, "gather_segments_kernel")
    bm, bn = tile_cfg.block_M, tile_cfg.block_N
    seg_rows = M // world
    padded = -(-seg_rows // bm) * bm
    m_tiles, n_tiles = padded // bm, -(-N // bn)
    tiles = m_tiles * n_tiles

    @T.prim_func
    def main(recv: T.Tensor((4 * world * padded, N), dtype), out: T.Tensor((M, N), dtype),
             flags: T.Tensor((2 * world * tiles,), "int32"), state: T.Tensor((3,), "int32"),
             board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(n_tiles, (world - 1) * m_tiles, threads=THREADS) as (bx, by):
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                src, row = (rank + 1 + by // m_tiles) % world, by % m_tiles
                tile = T.alloc_shared((bm, bn), dtype)
                T.wait(flags[(world + src) * tiles + row * n_tiles + bx], "ge", state[1], agree=(board, ident))
                T.copy(recv[(_buffer_of(state[0]) * 2 * world + world + src) * padded + row * bm, bx * bn], tile)
                for i, j in T.Parallel(bm, bn):
                    if row * bm + i < seg_rows and bx * bn + j < N:
                        out[src * seg_rows + row * bm + i, bx * bn + j] = tile[i, j]

    return main


def _panel_dividing(m_tiles: int, panel: int) -> int:
    """The largest power of two <= ``panel`` that divides ``m_tiles`` (1 at least)."""
    p = 1
    while p * 2 <= panel and m_tiles % (p * 2) == 0:
        p *= 2
    return p


@jit
def all_reduce_gemm_kernel(world: int, dtype: str, padded_rows: int, K: int, N: int, tile_cfg: TileConfig,
                           splits: int = 1, slot_rows: int = 0):
    """``a @ W.T`` all-reduced in one kernel (decode): each block computes its output tile
    over K (or, with ``splits`` > 1, over its ``1 / splits`` of K), puts its share of the
    tile (in ``dtype``) into its slot at every peer and signals it there, then waits for the
    peers' shares of the same tile and sums them in rank order, so every rank gets the same
    bits.

    With K split, the tile's K parts first meet on this rank: block ``s`` stores its fp32
    partial in ``parts`` (local: a rank's own K parts never cross the link) and signals its
    own flag; once all of them have, it sums row slice ``s`` of the tile over the parts in
    K-part order, rounds it once (as a whole-K partial is rounded) and puts only that slice
    to the peers. The link carries one output per peer whatever the split, and the final
    sum is spread over the same blocks: no second kernel runs.

    A block waits for the other blocks of its tile, on every rank, so every block must be
    resident: at most one block per SM (``gemm_all_reduce`` picks this kernel only then).
    Under TileLang's warp specialisation only the consumer warps run the epilogue, so each
    of them signals and waits on its own (``scope="warp"``): a flag per (sender, tile)
    counts ``splits * threads // 32`` signals per call. Every block counts the call
    (``T.count_call``) and announces it on ``board`` before its signals, and the waits check
    the peers' announcements.

    The rows of ``A`` are a dynamic size: one kernel serves every row count that rounds up
    to ``padded_rows`` (whole row tiles), so a server whose decode batch changes every step
    builds one kernel per row-tile count, not one per batch size; ``slot_rows`` lets the
    kernels of several such counts share one exchange (the slots laid out for the largest).

    Args:
        world: Ranks of the group the kernel is built for.
        dtype: TileLang dtype of the operands and outputs (``"bfloat16"``, ...).
        padded_rows: Rows of ``A`` rounded up to whole ``tile_cfg.block_M`` tiles (:func:`reduce_grid`);
            the kernel takes the rows M with ``padded_rows - block_M < M <= padded_rows``.
        K: This rank's input features.
        N: Output columns.
        tile_cfg: The GEMM tile (:class:`TileConfig`).
        splits: Parts K is split into (default 1; :func:`k_splits`).
        slot_rows: Rows of each sender's slot of ``recv`` (and of each K part's of ``parts``), at least
            ``padded_rows`` (default 0: ``padded_rows``).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    bm, bn = tile_cfg.block_M, tile_cfg.block_N
    if padded_rows % bm:
        raise ValueError(f"all_reduce_gemm_kernel: padded_rows {padded_rows} is not a multiple of block_M {bm}")
    slot_rows = slot_rows or padded_rows
    if slot_rows < padded_rows:
        raise ValueError(f"all_reduce_gemm_kernel: slot_rows {slot_rows} is less than padded_rows {padded_rows}")
    swap = tile_cfg.swap_ab
    M, padded = T.dynamic("rows"), padded_rows
    m_tiles, n_tiles = padded // bm, -(-N // bn)
    k_part, rows = K // splits, bm // splits

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype),
             recv: T.Tensor((2 * world * slot_rows, N), dtype), out: T.Tensor((M, N), dtype),
             parts: T.Tensor(parts_shape(splits, slot_rows, N, bn), "float32"),
             flags: T.Tensor((world * m_tiles * n_tiles,), "int32"), state: T.Tensor((3,), "int32"),
             board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(n_tiles, m_tiles * splits, threads=tile_cfg.threads) as (bx, bz):
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                T.announce(board, ident)  # before this block's signals, which release it
                call = T.alloc_local((2,), "int32")  # this call's number and flag target
                # Synchronises the block: thread 0 announced; the consumer warps signal (release) after it.
                T.count_call(state, splits * (tile_cfg.threads // 32), call)
                by, s = bz // splits, bz % splits
                acc = T.alloc_fragment((bn, bm) if swap else (bm, bn), "float32")  # swapped: transposed
                mine = T.alloc_shared((rows, bn), dtype)  # this block's share of the tile, as the peers get it
                total = T.alloc_fragment((rows, bn), "float32")
                part = T.alloc_fragment((rows, bn), dtype)
                T.clear(acc)
                accumulate_tile(A, by * bm, W, bx * bn, acc, s * k_part, k_part, dtype, tile_cfg.stages, tile_cfg)
                if splits == 1:
                    if swap:
                        for j, i in T.Parallel(bn, bm):
                            mine[i, j] = T.cast(acc[j, i], dtype)
                    else:
                        T.copy(acc, mine)
                else:
                    # The K parts meet in this rank's own flag: each block's fp32 partial, then
                    # the sum of its row slice over them, rounded once.
                    if swap:
                        for j, i in T.Parallel(bn, bm):
                            parts[s * slot_rows + by * bm + i, bx * bn + j] = acc[j, i]
                    else:
                        T.copy(acc, parts[s * slot_rows + by * bm, bx * bn])
                    own = (rank * m_tiles + by) * n_tiles + bx
                    T.signal(flags[own], 1, op="add", scope="warp")  # this rank's: GPU-scope release
                    T.wait(flags[own], "ge", call[1], scope="warp", agree=(board, ident))
                    k_sum = T.alloc_fragment((rows, bn), "float32")
                    T.clear(k_sum)
                    for q in T.serial(splits):
                        for i, j in T.Parallel(rows, bn):
                            k_sum[i, j] += parts[q * slot_rows + by * bm + s * rows + i, bx * bn + j]
                    T.copy(k_sum, mine)
                share = by * bm + s * rows  # the first row of this block's share in a sender's slot
                for p in T.serial(world - 1):
                    dst = (rank + 1 + p) % world
                    T.copy(mine, recv[(_buffer_of(call[0]) * world + rank) * slot_rows + share, bx * bn], dst_pe=dst)
                    T.signal(flags[(rank * m_tiles + by) * n_tiles + bx], 1, pe=dst, op="add", scope="warp")
                T.clear(total)
                for p in T.serial(world):
                    if p == rank:
                        T.copy(mine, part)
                    else:
                        # A flag per sender: with 3+ ranks a peer may already be in its next
                        # call and signal again; one shared count could pass before a slower
                        # peer's tile had landed.
                        T.wait(flags[(p * m_tiles + by) * n_tiles + bx], "ge", call[1], scope="warp",
                               agree=(board, ident))
                        T.copy(recv[(_buffer_of(call[0]) * world + p) * slot_rows + share, bx * bn], part)
                    for i, j in T.Parallel(rows, bn):
                        total[i, j] += T.cast(part[i, j], "float32")
                if share < M:  # a slice of padding rows writes nothing
                    T.copy(total, out[share, bx * bn])

    return main


def parts_shape(splits: int, slot_rows: int, N: int, block_N: int) -> tuple[int, int]:
    """Shape of :func:`all_reduce_gemm_kernel`'s fp32 K-part buffer: a slot of ``slot_rows``
    per K part, the columns in whole tiles (a partial tile is stored whole); one element
    where K is not split (the kernel does not touch it)."""
    if splits == 1:
        return (1, 1)
    return (splits * slot_rows, -(-N // block_N) * block_N)


@jit
def sum_received_kernel(world: int, slots: int, dtype: str, padded_elems: int, elems: int, sms: int):
    """``out = sum_s recv[s][:elems]`` over the ``slots`` received partials once every rank's
    have arrived (fp32 accumulation); the waits check the senders' announcements on ``board``.
    The call's number and flag target are ``state`` as :func:`gemm_push_kernel` before it
    (stream order) advanced it.

    Args:
        world: Ranks of the group the kernel is built for.
        slots: Partials summed per element (``world * splits``).
        dtype: TileLang dtype of the operands and outputs (``"bfloat16"``, ...).
        padded_elems: Elements of one slot of ``recv``.
        elems: Elements of ``out`` (the first ``elems`` of each slot).
        sms: Most blocks to launch.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    tile = 4096
    grid = min(-(-elems // tile), sms)

    @T.prim_func
    def main(recv: T.Tensor((2 * slots, padded_elems), dtype), out: T.Tensor((1, elems), dtype),
             flags: T.Tensor((world,), "int32"), state: T.Tensor((3,), "int32"), board: T.Tensor((2 * world,), "int64"),
             ident: T.int64):
        with T.Kernel(grid, threads=THREADS) as bx:
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                acc = T.alloc_fragment((1, tile), "float32")
                part = T.alloc_fragment((1, tile), dtype)
                for p in T.serial(world):
                    T.wait(flags[p], "ge", state[1], agree=(board, ident))
                for t in T.serial(T.ceildiv(T.ceildiv(elems, tile) - bx, grid)):
                    base = (bx + t * grid) * tile
                    T.clear(acc)
                    for s in T.serial(slots):
                        T.copy(recv[_buffer_of(state[0]) * slots + s, base], part)
                        for i, j in T.Parallel(1, tile):
                            acc[i, j] += T.cast(part[i, j], "float32")
                    T.copy(acc, part)
                    T.copy(part, out[0, base])

    return main


def _buffer_of(call):
    """Which of an exchange's two buffer sets call number ``call`` uses (calls alternate)."""
    return call % 2

