"""Tensor-parallel linear layers whose forward and backward passes are fused TP GEMMs.

Activations are sharded by rows between layers (sequence parallel), weights by the
parallel dimension:

* ``ColumnParallelLinear``: ``y = all_gather(x) @ W_r.T``; its backward reduce-scatters
  ``dy @ W_r`` with ``gemm_reduce_scatter``.
* ``RowParallelLinear``: ``y = reduce_scatter(x @ W_r.T)``; its backward is
  ``all_gather_gemm(dy, W_r.T)``.

So each layer's backward is the other layer's forward op. Example::

    mlp = ts.nn.TensorParallelMLP(hidden=1024, ffn=4096, dtype=torch.bfloat16)
    y = mlp(x_rows)           # x_rows: this rank's (rows, hidden); y: the same shape
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tilescale import ops, runtime


def _all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    out = torch.empty(runtime.group_size(group) * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return ops.all_gather_gemm(x.contiguous(), weight, group=group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ops.gemm_reduce_scatter(dy, weight.T.contiguous(), group=ctx.group)
        dw = dy.T @ _all_gather_rows(x, ctx.group)
        return dx, dw, None


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return ops.gemm_reduce_scatter(x.contiguous(), weight, group=group)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = ops.all_gather_gemm(dy, weight.T.contiguous(), group=ctx.group)
        dw = _all_gather_rows(dy, ctx.group).T @ x
        return dx, dw, None


def _shard_rows(full: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    state = runtime.group_state(group)
    world, rank = state.size, state.rank
    if full.shape[dim] % world:
        raise ValueError(f"dimension {dim} of the weight ({full.shape[dim]}) is not divisible by {world} ranks")
    return full.chunk(world, dim=dim)[rank].contiguous()


def _full_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    # Every rank draws the same full weight, then keeps its shard: no broadcast needed.
    g = torch.Generator().manual_seed(seed)
    bound = 1 / in_features**0.5
    return (torch.rand(out_features, in_features, generator=g) * 2 - 1) * bound


class _ParallelLinear(nn.Module):
    """``y = x @ W.T`` with this rank's shard of W (split along ``shard_dim``) and a fused op
    over the tensor-parallel process group ``group`` (None: the whole job)."""

    shard_dim: int
    function: type[torch.autograd.Function]

    def __init__(self, in_features: int, out_features: int, *, weight: torch.Tensor | None = None,
                 seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.group = group
        full = weight if weight is not None else _full_weight(out_features, in_features, seed)
        if tuple(full.shape) != (out_features, in_features):
            raise ValueError(f"weight must be ({out_features}, {in_features}), got {tuple(full.shape)}")
        shard = _shard_rows(full, self.shard_dim, group).to(dtype=dtype, device=device or runtime.device())
        self.weight = nn.Parameter(shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x, self.weight, self.group)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W.T`` with W split by output features; input rows sharded, output columns sharded.

    Example::

        layer = ColumnParallelLinear(1024, 4096, dtype=torch.bfloat16)
        y = layer(x_rows)         # (world * rows, 4096 // world)
    """

    shard_dim = 0
    function = _ColumnParallel


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W.T`` with W split by input features; input columns sharded, output rows sharded.

    Example::

        layer = RowParallelLinear(4096, 1024, dtype=torch.bfloat16)
        y = layer(h)              # h: (M, 4096 // world) -> y: (M // world, 1024)
    """

    shard_dim = 1
    function = _RowParallel


class TensorParallelMLP(nn.Module):
    """``down(gelu(up(x)))`` with ``up`` column parallel and ``down`` row parallel.

    Example::

        mlp = TensorParallelMLP(1024, 4096, dtype=torch.bfloat16)
        y = mlp(x_rows)           # x_rows, y: this rank's (rows, 1024)
    """

    def __init__(self, hidden: int, ffn: int, *, up: torch.Tensor | None = None, down: torch.Tensor | None = None,
                 seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        self.up = ColumnParallelLinear(hidden, ffn, weight=up, seed=seed, dtype=dtype, device=device, group=group)
        self.down = RowParallelLinear(ffn, hidden, weight=down, seed=seed + 1, dtype=dtype, device=device,
                                      group=group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))
