"""Grouped GEMM for the experts of an MoE layer: ``out[e, :counts[e]] = x[e, :counts[e]] @ w[e].T``."""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import torch

import tilescale.language as T
from tilescale.jit import jit
from tilescale.ops._common import check_input, tl_dtype
from tilescale.ops._gemm import BLOCK_M, BLOCK_N, STAGES, THREADS, gemm_tile


@jit
def grouped_gemm_kernel(experts: int, rows: int, K: int, N: int, dtype: str):
    """Row tiles at or past an expert's count are skipped: their output rows stay as they were."""

    @T.prim_func
    def main(x: T.Tensor((experts * rows, K), dtype), w: T.Tensor((experts * N, K), dtype),
             counts: T.Tensor((experts,), "int32"), out: T.Tensor((experts * rows, N), dtype)):
        with T.Kernel(T.ceildiv(N, BLOCK_N), rows // BLOCK_M, experts, threads=THREADS) as (bx, by, bz):
            if by * BLOCK_M < counts[bz]:
                row = bz * rows + by * BLOCK_M
                # A last, partial column tile reads the next expert's rows of w: the columns
                # they give fall past N and are cut off when stored.
                gemm_tile(x, row, w, bz * N + bx * BLOCK_N, out, row, bx * BLOCK_N, K, dtype, STAGES)

    return main


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out[e, :counts[e]] = x[e, :counts[e]] @ w[e].T`` for every expert e; other rows are zero.

    Example::

        h = ts.ops.grouped_gemm(recv_x, w1, counts)   # (experts, rows, K) x (experts, N, K)

    ``x``'s rows per expert must be a multiple of 128 (``moe_dispatch`` lays them out so).
    """
    check_input(x, "x")
    check_input(w, "w")
    experts, rows, k = x.shape
    if w.dim() != 3 or w.shape[0] != experts or w.shape[2] != k or w.dtype != x.dtype:
        raise ValueError(f"w must be ({experts}, N, {k}) {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    if rows % BLOCK_M:
        raise ValueError(f"rows per expert ({rows}) must be a multiple of {BLOCK_M}")
    n = w.shape[1]
    out = torch.zeros(experts, rows, n, dtype=x.dtype, device=x.device)
    kernel = grouped_gemm_kernel(experts, rows, k, n, tl_dtype(x))
    kernel(x.view(experts * rows, k), w.view(experts * n, k), counts.to(torch.int32).contiguous(),
           out.view(experts * rows, n))
    return out
