"""Torch modules built on tilescale's fused tensor-parallel operations."""

from tilescale.nn.moe import ExpertParallelMoE
from tilescale.nn.tensor_parallel import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    TensorParallelMLP,
)

__all__ = ["ColumnParallelLinear", "ExpertParallelMoE", "MergedColumnParallelLinear", "RowParallelLinear",
           "TensorParallelMLP"]
