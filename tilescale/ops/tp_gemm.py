"""Tensor-parallel GEMMs with communication overlapped tile by tile.

``all_gather_gemm(a_shard, weight)``: ``all_gather(a_shard) @ weight.T`` (column parallel).
A communication kernel pushes this rank's rows into every peer's gather buffer and, block
by block, adds to the peer's arrival flag for this rank's segment; the GEMM kernel (on the
compute stream, concurrently) computes this rank's own segment first and then each peer's
segment in ``rank + 1, rank + 2, ...`` order, waiting for that segment's flag before its
first tile. Segments are padded to whole row tiles, so a tile never reads rows of a
segment that has not arrived.

``gemm_reduce_scatter(a, weight)`` and ``gemm_all_reduce(a, weight)``: each rank's GEMM
kernel writes every finished output tile straight into the receive buffer of the rank(s)
that need it (the tile's row owner, or every rank) and signals it there; a reduction kernel
sums the received partial tiles once its flags say they have all landed. Tiles are visited
so that ranks send to different peers first.

Flags only grow: each call adds one "epoch" of arrivals, and waits compare against the
running total, so no flag is ever reset between calls (which would race with a fast peer).
Each op picks ``plan="fused"`` or the non-overlapped ``plan="unfused"`` (torch.distributed
collective + torch matmul) from the shape; pass ``plan`` to force one.
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
from tilescale.jit import jit
from tilescale.ops._common import check_input, sm_count, tl_dtype
from tilescale.ops._gemm import BLOCK_K, BLOCK_M, BLOCK_N, STAGES, THREADS, gemm_tile
from tilescale.symmetric import zeros

# Blocks of the all-gather communication kernel (few: it must stay resident beside the GEMM).
PUSH_BLOCKS = 16
# Below this many output rows, overlapping cannot hide anything worth its synchronisation.
FUSED_MIN_ROWS = 1024


@jit
def ag_push_kernel(world: int, dtype: str, shard: int, padded: int, blocks: int):
    """Push this rank's ``shard`` elements into row ``rank`` of every rank's gather buffer."""
    tile = 16384

    @T.prim_func
    def main(x: T.Tensor((1, shard), dtype), gathered: T.Tensor((world, padded), dtype),
             flags: T.Tensor((world,), "int32")):
        with T.Kernel(blocks, threads=THREADS) as bx:
            with T.Scale("device") as (rank, ranks):
                T.barrier()  # every rank's GEMM of the previous call is done reading its buffer
                for p in T.serial(ranks):
                    peer = (rank + p) % ranks  # own copy first: the GEMM starts on it
                    for t in T.serial(T.ceildiv(T.ceildiv(shard, tile) - bx, blocks)):
                        base = (bx + t * blocks) * tile
                        T.copy(x[0:1, base:base + tile], gathered[rank:rank + 1, base:base + tile], dst_pe=peer)
                    T.signal(flags[rank], 1, pe=peer, op="add")

    return main


@jit
def ag_gemm_kernel(world: int, dtype: str, rows: int, padded_rows: int, K: int, N: int, stages: int):
    """``C = gathered @ W.T`` over padded segments, own segment first, waiting per segment."""
    m_tiles = padded_rows // BLOCK_M

    @T.prim_func
    def main(gathered: T.Tensor((world * padded_rows, K), dtype), W: T.Tensor((N, K), dtype),
             C: T.Tensor((world * padded_rows, N), dtype), flags: T.Tensor((world,), "int32"),
             arrived: T.int32):
        with T.Kernel(T.ceildiv(N, BLOCK_N), world * m_tiles, threads=THREADS) as (bx, by):
            with T.Scale("device") as (rank, ranks):
                segment = (rank + by // m_tiles) % ranks
                T.wait(flags[segment], "ge", arrived)
                row = segment * padded_rows + (by % m_tiles) * BLOCK_M
                gemm_tile(gathered, row, W, bx * BLOCK_N, C, row, bx * BLOCK_N, K, dtype, stages)

    return main


@jit
def gemm_push_kernel(world: int, dtype: str, M: int, K: int, N: int, owners: int, stages: int):
    """Partial ``a @ W.T``; each output tile goes to its row owner(s)' ``recv[rank]``, then a signal.

    ``owners == world``: rows are split in ``world`` segments, tile rows of segment s go to
    rank s (reduce-scatter). ``owners == 1``: every tile goes to every rank (all-reduce).
    """
    seg_rows = M // owners
    padded = -(-seg_rows // BLOCK_M) * BLOCK_M
    m_tiles = padded // BLOCK_M

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype),
             recv: T.Tensor((world * padded, N), dtype), flags: T.Tensor((world,), "int32")):
        with T.Kernel(T.ceildiv(N, BLOCK_N), owners * m_tiles, threads=THREADS) as (bx, by):
            with T.Scale("device") as (rank, ranks):
                seg = (rank + 1 + by // m_tiles) % owners
                a = T.alloc_shared((BLOCK_M, BLOCK_K), dtype)
                w = T.alloc_shared((BLOCK_N, BLOCK_K), dtype)
                acc = T.alloc_fragment((BLOCK_M, BLOCK_N), "float32")
                out = T.alloc_shared((BLOCK_M, BLOCK_N), dtype)
                T.clear(acc)
                for k in T.Pipelined(T.ceildiv(K, BLOCK_K), num_stages=stages):
                    T.copy(A[seg * seg_rows + (by % m_tiles) * BLOCK_M, k * BLOCK_K], a)
                    T.copy(W[bx * BLOCK_N, k * BLOCK_K], w)
                    T.gemm(a, w, acc, transpose_B=True)
                T.copy(acc, out)
                if owners > 1:
                    T.copy(out, recv[rank * padded + (by % m_tiles) * BLOCK_M, bx * BLOCK_N], dst_pe=seg)
                    T.signal(flags[rank], 1, pe=seg, op="add")
                else:
                    for p in T.serial(ranks):
                        dst = (rank + 1 + p) % ranks
                        T.copy(out, recv[rank * padded + (by % m_tiles) * BLOCK_M, bx * BLOCK_N], dst_pe=dst)
                        T.signal(flags[rank], 1, pe=dst, op="add")

    return main


@jit
def sync_kernel():
    """All ranks meet: nobody pushes into a buffer a peer may still be reading."""

    @T.prim_func
    def main(unused: T.Tensor((1,), "int32")):
        with T.Kernel(1, threads=32):
            with T.Scale("device"):
                T.barrier()

    return main


@jit
def sum_received_kernel(world: int, dtype: str, padded_elems: int, elems: int, sms: int):
    """``out = sum_p recv[p][:elems]`` once every rank's tiles have arrived (fp32 accumulation)."""
    tile = 4096
    grid = min(-(-elems // tile), sms)

    @T.prim_func
    def main(recv: T.Tensor((world, padded_elems), dtype), out: T.Tensor((1, elems), dtype),
             flags: T.Tensor((world,), "int32"), arrived: T.int32):
        with T.Kernel(grid, threads=THREADS) as bx:
            with T.Scale("device") as (rank, ranks):
                acc = T.alloc_fragment((1, tile), "float32")
                part = T.alloc_fragment((1, tile), dtype)
                for p in T.serial(ranks):
                    T.wait(flags[p], "ge", arrived)
                for t in T.serial(T.ceildiv(T.ceildiv(elems, tile) - bx, grid)):
                    base = (bx + t * grid) * tile
                    T.clear(acc)
                    for p in T.serial(ranks):
                        T.copy(recv[p, base], part)
                        for i, j in T.Parallel(1, tile):
                            acc[i, j] += T.cast(part[i, j], "float32")
                    T.copy(acc, part)
                    T.copy(part, out[0, base])

    return main


@dataclass
class _Exchange:
    """Symmetric buffers, flags and the arrival count of one op at one shape (reused by calls)."""

    buffer: torch.Tensor
    flags: torch.Tensor
    calls: int = 0
    stream: torch.cuda.Stream | None = field(default=None)


_exchanges: dict[tuple, _Exchange] = {}


def _exchange(key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> _Exchange:
    if key not in _exchanges:
        world = runtime.world_size()
        ex = _Exchange(zeros(shape, dtype=dtype), zeros((world,), dtype=torch.int32))
        if runtime.device().type == "cuda":
            ex.stream = torch.cuda.Stream()
        _exchanges[key] = ex
    return _exchanges[key]


def _check_pair(a: torch.Tensor, weight: torch.Tensor) -> None:
    check_input(a, "a")
    check_input(weight, "weight")
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise ValueError(f"need a (M, K) and weight (N, K); got {tuple(a.shape)} and {tuple(weight.shape)}")
    if a.dtype != weight.dtype:
        raise TypeError(f"a is {a.dtype} but weight is {weight.dtype}")
    tl_dtype(a)


_verified: set[tuple] = set()


def _check_same_across_ranks(what: str, value: list) -> None:
    """Ranks must agree on the shapes: checked at a shape's first call (a host round trip).

    A later call in which one rank alone switches to a new shape is still caught, by the
    bounded waits (TimeoutError naming the rank, or WaitTimeoutError), not by this check.
    """
    key = (what, *value)
    if key in _verified:
        return
    rt = runtime.current()
    values = rt.group.exchange(rt.group.next_tag(what), value)
    _verified.add(key)
    if any(v != value for v in values):
        detail = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        _verified.discard(key)
        raise ValueError(f"{what}: shapes differ across ranks ({detail})")


def _choose(plan: str | None, rows: int) -> str:
    """The plan: as asked, else ``TILESCALE_TP_PLAN``, else fused from ``FUSED_MIN_ROWS`` rows on."""
    plan = plan or os.environ.get("TILESCALE_TP_PLAN") or None
    if plan not in (None, "fused", "unfused"):
        raise ValueError(f"plan must be 'fused', 'unfused' or None, got {plan!r}")
    return plan or ("fused" if rows >= FUSED_MIN_ROWS else "unfused")


def _side_stream(ex: _Exchange):
    """The communication kernel's stream: after everything queued so far on the compute stream."""
    if ex.stream is None:
        return contextlib.nullcontext()
    ex.stream.wait_stream(torch.cuda.current_stream())
    return torch.cuda.stream(ex.stream)


def all_gather_gemm(a_shard: torch.Tensor, weight: torch.Tensor, plan: str | None = None) -> torch.Tensor:
    """``all_gather(a_shard) @ weight.T`` with the gather overlapped with the GEMM.

    Example::

        y = ts.ops.all_gather_gemm(x_rows, w_cols)     # (world * rows, N_local)

    ``a_shard``: this rank's rows (M_local, K), the same shape on every rank; ``weight``:
    this rank's (N_local, K).
    """
    _check_pair(a_shard, weight)
    world = runtime.world_size()
    (m, k), n = a_shard.shape, weight.shape[0]
    _check_same_across_ranks("all_gather_gemm", [m, k, n, str(a_shard.dtype)])
    if _choose(plan, world * m) == "unfused":
        gathered = torch.empty(world * m, k, dtype=a_shard.dtype, device=a_shard.device)
        dist.all_gather_into_tensor(gathered, a_shard)
        return gathered @ weight.T
    padded = -(-m // BLOCK_M) * BLOCK_M
    ex = _exchange(("ag", padded, k, a_shard.dtype), (world * padded, k), a_shard.dtype)
    ex.calls += 1
    dtype = tl_dtype(a_shard)
    with _side_stream(ex):
        push = ag_push_kernel(world, dtype, m * k, padded * k, PUSH_BLOCKS)
        push(a_shard.view(1, m * k), ex.buffer.view(world, padded * k), ex.flags)
    out = torch.empty(world * padded, n, dtype=a_shard.dtype, device=a_shard.device)
    gemm = ag_gemm_kernel(world, dtype, m, padded, k, n, STAGES)
    gemm(ex.buffer, weight, out, ex.flags, ex.calls * PUSH_BLOCKS)
    if ex.stream is not None:
        torch.cuda.current_stream().wait_stream(ex.stream)
    return out if padded == m else out.view(world, padded, n)[:, :m].reshape(world * m, n)


def _gemm_then_reduce(a: torch.Tensor, weight: torch.Tensor, owners: int) -> torch.Tensor:
    world = runtime.world_size()
    (m, k), n = a.shape, weight.shape[0]
    rows = m // owners
    padded = -(-rows // BLOCK_M) * BLOCK_M
    ex = _exchange(("rs" if owners > 1 else "ar", padded, n, a.dtype), (world * padded, n), a.dtype)
    ex.calls += 1
    dtype = tl_dtype(a)
    tiles = (padded // BLOCK_M) * -(-n // BLOCK_N)
    sync_kernel()(ex.flags[:1])
    gemm_push_kernel(world, dtype, m, k, n, owners, STAGES)(a, weight, ex.buffer, ex.flags)
    out = torch.empty(rows, n, dtype=a.dtype, device=a.device)
    # Row r of the received block is contiguous in both views: padded rows come after it.
    reduce = sum_received_kernel(world, dtype, padded * n, rows * n, sm_count())
    reduce(ex.buffer.view(world, padded * n), out.view(1, rows * n), ex.flags, ex.calls * tiles)
    return out


def gemm_reduce_scatter(a: torch.Tensor, weight: torch.Tensor, plan: str | None = None) -> torch.Tensor:
    """Reduce-scatter over rows of ``a @ weight.T`` (row parallel), the sends overlapped with the GEMM.

    Example::

        y = ts.ops.gemm_reduce_scatter(h, w_rows)     # (M // world, N)

    ``a``: (M, K_local), M divisible by the world size and equal on every rank; ``weight``:
    (N, K_local).
    """
    _check_pair(a, weight)
    world = runtime.world_size()
    (m, k), n = a.shape, weight.shape[0]
    if m % world:
        raise ValueError(f"gemm_reduce_scatter needs M ({m}) divisible by the world size {world}")
    _check_same_across_ranks("gemm_reduce_scatter", [m, k, n, str(a.dtype)])
    if _choose(plan, m) == "unfused":
        out = torch.empty(m // world, n, dtype=a.dtype, device=a.device)
        dist.reduce_scatter_tensor(out, a @ weight.T)
        return out
    return _gemm_then_reduce(a, weight, world)


def gemm_all_reduce(a: torch.Tensor, weight: torch.Tensor, plan: str | None = None) -> torch.Tensor:
    """``all_reduce(a @ weight.T)`` for small M (decode): partial tiles are pushed as they finish.

    Example::

        y = ts.ops.gemm_all_reduce(h, w_rows)          # (M, N) on every rank
    """
    _check_pair(a, weight)
    (m, k), n = a.shape, weight.shape[0]
    _check_same_across_ranks("gemm_all_reduce", [m, k, n, str(a.dtype)])
    # Decode-sized M is what the fused all-reduce is for: fused unless asked otherwise.
    if _choose(plan, FUSED_MIN_ROWS) == "unfused":
        out = a @ weight.T
        dist.all_reduce(out)
        return out
    return _gemm_then_reduce(a, weight, 1)
