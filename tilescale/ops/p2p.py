"""One-sided point-to-point transfers as tilescale kernels: put into and get from a peer."""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

from dataclasses import dataclass

import torch
import torch.distributed as dist

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit
from tilescale.ops._common import check_input, flat, layout_key, op_plans, sm_count, tl_dtype, vector_width


@dataclass(frozen=True)
class CopyPlan:
    """How a transfer kernel moves data.

    ``block`` elements per tile; ``threads`` per block; at most ``blocks_per_sm`` blocks
    per SM (more blocks keep more bytes in flight); ``staged`` tiles pass through shared
    memory (a TMA bulk copy where TileLang can use one), otherwise every thread moves
    16-byte vectors from global to global memory directly.
    """

    block: int = 8192
    threads: int = 128
    blocks_per_sm: int = 1
    staged: bool = True


# benchmarks/copy_plans.py on 2x H200: direct copies of 16384-element tiles, 256 threads, two
# blocks per SM, were within 1% of the fastest put and get at 64 MiB (311 and 284 GB/s).
DEFAULT_PLAN = CopyPlan(block=16384, threads=256, blocks_per_sm=2, staged=False)


@jit
def transfer_kernel(dtype: str, vec: int, plan: CopyPlan, sms: int, get: bool):
    """Copy ``src`` to ``dst`` with the peer's side remote: a put into rank ``peer``'s ``dst``, or
    (``get``) a get from rank ``peer``'s ``src``; no synchronisation.

    Args:
        dtype: TileLang dtype of the data.
        vec: Elements per 16-byte vector; the length is a multiple of it (a dynamic size).
        plan: Tile size, threads, blocks per SM and staging (:class:`CopyPlan`).
        sms: SMs of the GPU (at most ``sms * plan.blocks_per_sm`` blocks).
        get: Read from the peer instead of writing to it.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    n = T.dynamic("n_vectors") * vec
    grid = T.min(T.ceildiv(n, plan.block), sms * plan.blocks_per_sm)

    @T.prim_func
    def main(src: T.Tensor((n,), dtype), dst: T.Tensor((n,), dtype), peer: T.int32):
        with T.Kernel(grid, threads=plan.threads) as bx:
            tile = T.alloc_shared((plan.block,), dtype)
            for t in T.serial(T.ceildiv(T.ceildiv(n, plan.block) - bx, grid)):
                base = (bx + t * grid) * plan.block
                if plan.staged and get:
                    T.copy(src[base], tile, src_pe=peer)
                    T.copy(tile, dst[base])
                elif plan.staged:
                    T.copy(src[base], tile)
                    T.copy(tile, dst[base], dst_pe=peer)
                elif get:
                    T.copy(src[base:base + plan.block], dst[base:base + plan.block], src_pe=peer)
                else:
                    T.copy(src[base:base + plan.block], dst[base:base + plan.block], dst_pe=peer)

    return main


def _launch(src: torch.Tensor, dst: torch.Tensor, peer: int, plan: CopyPlan, get: bool,
            group: dist.ProcessGroup | None) -> None:
    # Everything but the launch is checked and resolved at the first call of a plan key (the
    # symmetric tensor's allocation and group by the kernel, at the first call of its address).
    key = ("get" if get else "put", layout_key(src), layout_key(dst), peer, plan, group)
    kernel = op_plans.get(key)
    if kernel is None:
        local, name = (dst, "dst") if get else (src, "src")
        check_input(local, name)
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"src {tuple(src.shape)} {src.dtype} and dst {tuple(dst.shape)} {dst.dtype} differ")
        state = runtime.group_state(group)
        if not 0 <= peer < state.size:
            raise IndexError(f"peer {peer} out of range for the {state.describe()} of size {state.size}")
        kernel = transfer_kernel(tl_dtype(src), vector_width(src.numel(), src), plan, sm_count(), get, group=group)
        op_plans.put(key, kernel)
    kernel(flat(src), flat(dst), peer, group=group)


def put(src: torch.Tensor, dst: torch.Tensor, peer: int, plan: CopyPlan = DEFAULT_PLAN, *,
        group: dist.ProcessGroup | None = None) -> None:
    """Write ``src`` into rank ``peer``'s copy of the symmetric tensor ``dst`` (no synchronisation).

    Example::

        ts.ops.put(x, y, peer=1); ts.barrier()        # y on rank 1 now holds x
        ts.ops.put(x, z, peer=0, group=tp)            # z symmetric over tp; peer 0 of tp

    ``peer`` is a rank within ``group`` (None: the whole job), the group ``dst`` was allocated over.

    Args:
        src: The local tensor to send: contiguous, on this rank's device.
        dst: A symmetric tensor over ``group`` with ``src``'s shape and dtype; rank ``peer``'s copy is written.
        peer: The destination's rank within ``group``.
        plan: How the kernel moves data (:class:`CopyPlan`; the default was fastest on 2x H200).
        group: The group ``dst`` was allocated over; None: the whole job.

    Returns:
        None. The write is ordered on this rank's stream; peers see it after a barrier or flag.

    Raises:
        ValueError: shapes or dtypes differ, or ``src`` is not contiguous on this rank's device.
        IndexError: ``peer`` is not a rank of ``group``.
        TypeError: the dtype is not one the kernels move.
    """
    _launch(src, dst, peer, plan, False, group)


def get(src: torch.Tensor, dst: torch.Tensor, peer: int, plan: CopyPlan = DEFAULT_PLAN, *,
        group: dist.ProcessGroup | None = None) -> None:
    """Read rank ``peer``'s copy of the symmetric tensor ``src`` into the local ``dst``.

    Example::

        ts.barrier(); ts.ops.get(y, x, peer=0)        # x now holds rank 0's y

    ``peer`` is a rank within ``group`` (None: the whole job), the group ``src`` was allocated over.

    Args:
        src: A symmetric tensor over ``group``; rank ``peer``'s copy is read.
        dst: The local tensor to fill: contiguous, on this rank's device, with ``src``'s shape and dtype.
        peer: The source's rank within ``group``.
        plan: How the kernel moves data (:class:`CopyPlan`).
        group: The group ``src`` was allocated over; None: the whole job.

    Returns:
        None; ``dst`` holds the peer's data once this rank's stream reaches that point.

    Raises:
        ValueError: shapes or dtypes differ, or ``dst`` is not contiguous on this rank's device.
        IndexError: ``peer`` is not a rank of ``group``.
        TypeError: the dtype is not one the kernels move.
    """
    _launch(src, dst, peer, plan, True, group)
