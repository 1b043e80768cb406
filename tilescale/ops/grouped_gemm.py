"""Grouped GEMM for the experts of an MoE layer, over ``moe_dispatch``'s grouped row layout."""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import torch

import tilescale.language as T
from tilescale.jit import jit
from tilescale.ops._common import check_input, tl_dtype
from tilescale.ops._gemm import BLOCK_M, BLOCK_N, STAGES, THREADS, gemm_tile
from tilescale.ops.moe.fp8 import dequantize_fp8


@jit
def grouped_gemm_kernel(experts: int, rows: int, K: int, N: int, dtype: str):
    """Row tile ``by`` belongs to expert ``row_expert[by * BLOCK_M]``; tiles of none are skipped.

    Args:
        experts: Experts whose weights ``w`` stacks, (experts * N, K).
        rows: Rows of ``x`` and ``out``, a multiple of ``BLOCK_M``.
        K: Input features.
        N: Output features per expert.
        dtype: TileLang dtype of ``x``, ``w`` and ``out``.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """

    @T.prim_func
    def main(x: T.Tensor((rows, K), dtype), w: T.Tensor((experts * N, K), dtype),
             row_expert: T.Tensor((rows,), "int32"), out: T.Tensor((rows, N), dtype)):
        with T.Kernel(T.ceildiv(N, BLOCK_N), rows // BLOCK_M, threads=THREADS) as (bx, by):
            if row_expert[by * BLOCK_M] >= 0:
                # A last, partial column tile reads the next expert's rows of w: the columns
                # they give fall past N and are cut off when stored.
                gemm_tile(x, by * BLOCK_M, w, row_expert[by * BLOCK_M] * N + bx * BLOCK_N, out, by * BLOCK_M,
                          bx * BLOCK_N, K, dtype, STAGES)

    return main


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, row_expert: torch.Tensor,
                 scales: torch.Tensor | None = None) -> torch.Tensor:
    """``out[i] = x[i] @ w[row_expert[i]].T`` for rows grouped by expert in 128-row tiles.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts)
        h = ts.ops.grouped_gemm(recv_x, w1, handle.row_expert)   # (rows, K) x (experts, N, K)

    Every 128-row tile of ``x`` belongs to one expert (the expert of its first row; -1:
    no expert, the tile's output rows are left undefined), as ``moe_dispatch`` lays rows out.

    Args:
        x: (rows, K) rows in ``w``'s dtype, or FP8 rows (``torch.float8_e4m3fn``, e.g. an FP8
            dispatch's grouped values) with their ``scales``.
        w: (experts, N, K) expert weights.
        row_expert: (rows,) expert of each row.
        scales: (rows, K // 128) float32 scales of FP8 ``x`` (``ts.ops.moe.quantize_fp8``):
            the rows are dequantised to ``w``'s dtype first (one pass over them, not yet inside
            the GEMM's loads).

    Returns:
        (rows, N) in ``w``'s dtype.
    """
    if x.dtype == torch.float8_e4m3fn:
        if scales is None:
            raise ValueError("grouped_gemm: FP8 rows need their scales")
        x = dequantize_fp8(x, scales, w.dtype)
    check_input(x, "x")
    check_input(w, "w")
    check_input(row_expert, "row_expert")
    rows, k = x.shape
    experts = w.shape[0]
    if w.dim() != 3 or w.shape[2] != k or w.dtype != x.dtype:
        raise ValueError(f"w must be (experts, N, {k}) {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    if rows % BLOCK_M or row_expert.shape != (rows,):
        raise ValueError(f"x needs a multiple of {BLOCK_M} rows ({rows}) and row_expert one entry per row "
                         f"({tuple(row_expert.shape)})")
    n = w.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    kernel = grouped_gemm_kernel(experts, rows, k, n, tl_dtype(x))
    kernel(x, w.view(experts * n, k), row_expert.to(torch.int32), out)
    return out
