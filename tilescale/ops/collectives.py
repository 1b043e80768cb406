"""Collectives as tilescale kernels: every byte moves through remote tile copies over NVLink.

``all_gather`` pushes each rank's shard into every peer's output; ``reduce_scatter`` and
``all_reduce`` pull peers' data and reduce in fp32. All three bracket the exchange with
device-scope barriers: the first says every rank's buffers are ready to be written or read,
the second that every exchange has landed (and that inputs may be reused). Peers are
visited starting at ``rank + 1`` so that no rank is read or written by everyone at once.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import torch

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit
from tilescale.ops._common import check_input, sm_count, symmetric_or_staged, tl_dtype, vector_width, workspace
from tilescale.symmetric import is_symmetric

# Elements per tile: 16 KiB of 16-bit data, moved as one contiguous (TMA bulk) copy.
BLOCK = 8192
# One-shot all-reduce (every rank reduces everything) up to this many bytes, two-shot above.
ONE_SHOT_MAX_BYTES = 256 * 1024


@jit
def all_gather_kernel(world: int, dtype: str, vec: int, block: int, sms: int):
    # Rows of ``out`` are ranks: a tile that runs past the end of a row is cut at the row's
    # end by TileLang's bounds checks instead of spilling into the next rank's row.
    n = T.dynamic("n_vectors") * vec
    grid = T.min(T.ceildiv(n, block), sms)

    @T.prim_func
    def main(x: T.Tensor((1, n), dtype), out: T.Tensor((world, n), dtype)):
        with T.Kernel(grid, threads=128) as bx:
            with T.Scale("device") as (rank, ranks):
                tile = T.alloc_shared((1, block), dtype)
                T.barrier()
                for t in T.serial(T.ceildiv(T.ceildiv(n, block) - bx, grid)):
                    base = (bx + t * grid) * block
                    T.copy(x[0, base], tile)
                    for p in T.serial(ranks):
                        T.copy(tile, out[rank, base], dst_pe=(rank + 1 + p) % ranks)
                T.barrier()

    return main


@jit
def reduce_kernel(rows: int, dtype: str, vec: int, block: int, sms: int, push: bool):
    """Sum row ``r`` of ``src`` over all ranks, where r is this rank (``rows > 1``) or 0.

    ``rows == world``: rank r owns row r (reduce-scatter, or the first half of a two-shot
    all-reduce, which with ``push`` writes the sum into row r of every rank's ``out``).
    ``rows == 1``: every rank reduces everything into its own ``out`` (one-shot all-reduce).
    """
    out_rows = rows if push else 1
    cols = T.dynamic("col_vectors") * vec
    grid = T.min(T.ceildiv(cols, block), sms)

    @T.prim_func
    def main(src: T.Tensor((rows, cols), dtype), out: T.Tensor((out_rows, cols), dtype)):
        with T.Kernel(grid, threads=256) as bx:
            with T.Scale("device") as (rank, ranks):
                acc = T.alloc_fragment((1, block), "float32")
                part = T.alloc_fragment((1, block), dtype)
                tile = T.alloc_shared((1, block), dtype)
                row = rank % rows
                T.barrier()
                for t in T.serial(T.ceildiv(T.ceildiv(cols, block) - bx, grid)):
                    base = (bx + t * grid) * block
                    T.clear(acc)
                    for p in T.serial(ranks):
                        T.copy(src[row, base], part, src_pe=(rank + p) % ranks)
                        for i, j in T.Parallel(1, block):
                            acc[i, j] += T.cast(part[i, j], "float32")
                    T.copy(acc, tile)
                    if push:
                        for p in T.serial(ranks):
                            T.copy(tile, out[row, base], dst_pe=(rank + 1 + p) % ranks)
                    else:
                        T.copy(tile, out[0, base])
                T.barrier()

    return main


def all_gather(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, like ``dist.all_gather_into_tensor``.

    Example::

        y = ts.ops.all_gather(x)             # (world * x.shape[0], *x.shape[1:])

    ``out`` (optional) must be symmetric; without it a cached symmetric buffer is used and a
    fresh tensor returned.
    """
    check_input(x, "x")
    world = runtime.world_size()
    shape = (world * x.shape[0], *x.shape[1:]) if x.dim() else (world,)
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype or not is_symmetric(out)):
        raise ValueError(f"out must be a symmetric {x.dtype} tensor of shape {shape}")
    n = x.numel()
    target = out if out is not None else workspace("all_gather.out", world * n, x.dtype)
    all_gather_kernel(world, tl_dtype(x), vector_width(n, x), BLOCK, sm_count())(x.view(1, n), target.view(world, n))
    return out if out is not None else target.view(shape).clone()


def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over ranks and return this rank's slice of dim 0, like ``dist.reduce_scatter_tensor``.

    Example::

        y = ts.ops.reduce_scatter(x)         # (x.shape[0] // world, *x.shape[1:])
    """
    check_input(x, "x")
    world = runtime.world_size()
    if x.dim() == 0 or x.shape[0] % world:
        raise ValueError(f"reduce_scatter needs dim 0 ({tuple(x.shape)}) divisible by the world size {world}")
    src = symmetric_or_staged(x, "reduce_scatter.in")
    chunk = x.numel() // world
    out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
    kernel = reduce_kernel(world, tl_dtype(x), vector_width(chunk, x), BLOCK, sm_count(), False)
    kernel(src.view(world, chunk), out.view(1, chunk))
    return out


def all_reduce(x: torch.Tensor, algorithm: str | None = None) -> torch.Tensor:
    """Sum ``x`` over ranks (fp32 accumulation), returning a new tensor on every rank.

    Example::

        y = ts.ops.all_reduce(x)                      # one-shot when small, two-shot when large
        y = ts.ops.all_reduce(x, algorithm="two_shot")
    """
    check_input(x, "x")
    world = runtime.world_size()
    algorithm = algorithm or ("one_shot" if x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES else "two_shot")
    if algorithm not in ("one_shot", "two_shot"):
        raise ValueError(f"algorithm must be 'one_shot' or 'two_shot', got {algorithm!r}")
    n = x.numel()
    if algorithm == "one_shot":
        src = symmetric_or_staged(x, "all_reduce.in")
        out = torch.empty_like(x)
        reduce_kernel(1, tl_dtype(x), vector_width(n, x), BLOCK, sm_count(), False)(src.view(1, n), out.view(1, n))
        return out
    # Two-shot: rank r reduces chunk r and pushes it to everyone. The staging buffer is padded
    # to world equal chunks; the padding is never read back.
    chunk = -(-n // world)
    src = workspace("all_reduce.in", world * chunk, x.dtype)
    src[:n].copy_(x.reshape(-1))
    target = workspace("all_reduce.out", world * chunk, x.dtype)
    kernel = reduce_kernel(world, tl_dtype(x), vector_width(chunk, x), BLOCK, sm_count(), True)
    kernel(src.view(world, chunk), target.view(world, chunk))
    return target[:n].view(x.shape).clone()
