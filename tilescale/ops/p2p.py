"""One-sided point-to-point transfers as tilescale kernels: put into and get from a peer."""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import torch

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit
from tilescale.ops._common import check_input, sm_count, tl_dtype, vector_width

BLOCK = 8192


@jit
def put_kernel(dtype: str, vec: int, block: int, sms: int):
    n = T.dynamic("n_vectors") * vec
    grid = T.min(T.ceildiv(n, block), sms)

    @T.prim_func
    def main(src: T.Tensor((n,), dtype), dst: T.Tensor((n,), dtype), peer: T.int32):
        with T.Kernel(grid, threads=128) as bx:
            tile = T.alloc_shared((block,), dtype)
            for t in T.serial(T.ceildiv(T.ceildiv(n, block) - bx, grid)):
                base = (bx + t * grid) * block
                T.copy(src[base], tile)
                T.copy(tile, dst[base], dst_pe=peer)

    return main


@jit
def get_kernel(dtype: str, vec: int, block: int, sms: int):
    n = T.dynamic("n_vectors") * vec
    grid = T.min(T.ceildiv(n, block), sms)

    @T.prim_func
    def main(src: T.Tensor((n,), dtype), dst: T.Tensor((n,), dtype), peer: T.int32):
        with T.Kernel(grid, threads=128) as bx:
            tile = T.alloc_shared((block,), dtype)
            for t in T.serial(T.ceildiv(T.ceildiv(n, block) - bx, grid)):
                base = (bx + t * grid) * block
                T.copy(src[base], tile, src_pe=peer)
                T.copy(tile, dst[base])

    return main


def _check_peer(peer: int) -> None:
    world = runtime.world_size()
    if not 0 <= peer < world:
        raise IndexError(f"peer {peer} out of range for world size {world}")


def put(src: torch.Tensor, dst: torch.Tensor, peer: int) -> None:
    """Write ``src`` into rank ``peer``'s copy of the symmetric tensor ``dst`` (no synchronisation).

    Example::

        ts.ops.put(x, y, peer=1); ts.barrier()        # y on rank 1 now holds x
    """
    check_input(src, "src")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} differ")
    _check_peer(peer)
    put_kernel(tl_dtype(src), vector_width(src.numel(), src), BLOCK, sm_count())(src.reshape(-1), dst.reshape(-1), peer)


def get(src: torch.Tensor, dst: torch.Tensor, peer: int) -> None:
    """Read rank ``peer``'s copy of the symmetric tensor ``src`` into the local ``dst``.

    Example::

        ts.barrier(); ts.ops.get(y, x, peer=0)        # x now holds rank 0's y
    """
    check_input(dst, "dst")
    if src.shape != dst.shape or src.dtype != dst.dtype:
        raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} differ")
    _check_peer(peer)
    get_kernel(tl_dtype(src), vector_width(src.numel(), src), BLOCK, sm_count())(src.reshape(-1), dst.reshape(-1), peer)
