"""Library kernels written in the tilescale language, with torch tensors in and out."""

from tilescale.ops.activation import silu_and_mul
from tilescale.ops.collectives import all_gather, all_reduce, reduce_scatter
from tilescale.ops.grouped_gemm import grouped_gemm
from tilescale.ops.moe import moe_combine, moe_dispatch, moe_redispatch
from tilescale.ops.p2p import get, put
from tilescale.ops.tp_gemm import all_gather_gemm, gemm_all_reduce, gemm_reduce_scatter

__all__ = [
    "all_gather",
    "all_gather_gemm",
    "all_reduce",
    "gemm_all_reduce",
    "gemm_reduce_scatter",
    "get",
    "grouped_gemm",
    "moe_combine",
    "moe_dispatch",
    "moe_redispatch",
    "put",
    "reduce_scatter",
    "silu_and_mul",
]
