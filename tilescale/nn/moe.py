"""An expert-parallel MoE layer: router, dispatch, grouped-GEMM experts, combine.

Example::

    moe = ts.nn.ExpertParallelMoE(hidden=1024, ffn_hidden=2048, num_experts=16, topk=2)
    y = moe(x)               # x, y: this rank's (tokens, hidden); experts live on their ranks

Forward only: the layer runs inference and is checked against a single-process MoE with
the same weights (``examples/moe_layer.py``); training needs a backward of dispatch and
combine, which is not written yet.
"""

from __future__ import annotations

import torch
from torch import nn

from tilescale import ops, runtime


class ExpertParallelMoE(nn.Module):
    """Top-k routed MoE with ``num_experts // world`` experts on each rank (GELU FFN experts)."""

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, topk: int, *, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None):
        super().__init__()
        world, rank = runtime.world_size(), runtime.rank()
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the world size {world}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, {num_experts}], got {topk}")
        self.num_experts, self.topk = num_experts, topk
        device = device or runtime.device()
        # Every rank draws the same full weights and keeps its experts: no broadcast needed.
        g = torch.Generator().manual_seed(seed)
        router = torch.randn(num_experts, hidden, generator=g) / hidden**0.5
        w1 = torch.randn(num_experts, ffn_hidden, hidden, generator=g) / hidden**0.5
        w2 = torch.randn(num_experts, hidden, ffn_hidden, generator=g) / ffn_hidden**0.5
        mine = slice(rank * (num_experts // world), (rank + 1) * (num_experts // world))
        self.router = nn.Parameter(router.to(device=device, dtype=torch.float32), requires_grad=False)
        self.w1 = nn.Parameter(w1[mine].to(device=device, dtype=dtype).contiguous(), requires_grad=False)
        self.w2 = nn.Parameter(w2[mine].to(device=device, dtype=dtype).contiguous(), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of each token and their softmax weights (renormalised over the top k)."""
        probs = torch.softmax(x.float() @ self.router.T, dim=-1)
        weights, experts = probs.topk(self.topk, dim=-1)
        return experts, weights / weights.sum(-1, keepdim=True)

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        recv_x, recv_w, counts, handle = ops.moe_dispatch(x, experts, weights, self.num_experts)
        h = nn.functional.gelu(ops.grouped_gemm(recv_x, self.w1, handle.row_expert).float()).to(x.dtype)
        out = ops.grouped_gemm(h, self.w2, handle.row_expert)
        return ops.moe_combine(out, recv_w, handle)
