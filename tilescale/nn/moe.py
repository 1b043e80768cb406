"""An expert-parallel MoE layer: router, dispatch, grouped-GEMM experts, combine.

Example::

    moe = ts.nn.ExpertParallelMoE(hidden=1024, ffn_hidden=2048, num_experts=16, topk=2)
    y = moe(x)               # x, y: this rank's (tokens, hidden); experts live on their ranks

Trainable: dispatch, the grouped GEMMs and combine have backwards built from the same
operations (the backward of dispatch is a combine, that of combine a re-dispatch along the
same routes), so gradients reach the input, the router and the experts. Checked against a
single-process MoE with the same weights, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tilescale import ops, runtime


def moe_weights(hidden: int, ffn_hidden: int, num_experts: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The full fp32 (router, w1, w2) of every expert that ``ExpertParallelMoE(..., seed=seed)``
    starts from (each rank keeps its experts' slices).

    Example::

        router, w1, w2 = moe_weights(1024, 2048, num_experts=16, seed=0)
    """
    # On the host whatever torch's default device: the draw must not depend on it.
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=g, device="cpu") / hidden**0.5
    w1 = torch.randn(num_experts, ffn_hidden, hidden, generator=g, device="cpu") / hidden**0.5
    w2 = torch.randn(num_experts, hidden, ffn_hidden, generator=g, device="cpu") / ffn_hidden**0.5
    return router, w1, w2


class ExpertParallelMoE(nn.Module):
    """Top-k routed MoE with ``num_experts // world`` experts on each rank (GELU FFN experts).

    ``low_latency=True``: dispatch in low-latency mode (decode batches, see
    ``ts.ops.moe_dispatch``). The forward has no host synchronisation, so a decode step can
    be captured in a CUDA graph (``examples/moe_decode_graph.py``). ``group``: the
    expert-parallel process group whose ranks hold the experts (None: the whole job).
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, topk: int, *, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None, low_latency: bool = False,
                 group: dist.ProcessGroup | None = None):
        super().__init__()
        state = runtime.group_state(group)
        world, rank = state.size, state.rank
        self.group = group
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the world size {world}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, {num_experts}], got {topk}")
        self.num_experts, self.topk, self.low_latency = num_experts, topk, low_latency
        device = device or runtime.device()
        # Every rank draws the same full weights and keeps its experts: no broadcast needed.
        router, w1, w2 = moe_weights(hidden, ffn_hidden, num_experts, seed)
        mine = slice(rank * (num_experts // world), (rank + 1) * (num_experts // world))
        self.router = nn.Parameter(router.to(device=device, dtype=torch.float32))
        self.w1 = nn.Parameter(w1[mine].to(device=device, dtype=dtype).contiguous())
        self.w2 = nn.Parameter(w2[mine].to(device=device, dtype=dtype).contiguous())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of each token and their softmax weights (renormalised over the top k)."""
        probs = torch.softmax(x.float() @ self.router.T, dim=-1)
        weights, experts = probs.topk(self.topk, dim=-1)
        return experts, weights / weights.sum(-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        recv_x, recv_w, handle = _Dispatch.apply(x, weights, experts, self.num_experts, self.low_latency,
                                                    self.group)
        h = nn.functional.gelu(_GroupedGemm.apply(recv_x, self.w1, handle).float()).to(x.dtype)
        out = _GroupedGemm.apply(h, self.w2, handle)
        return _Combine.apply(out, recv_w, handle)


def _valid_rows(handle: ops.moe.DispatchHandle) -> torch.Tensor:
    """(rows, 1) mask of the grouped rows that hold a token: the others are never written."""
    return (handle.row_expert >= 0)[:, None]


class _Dispatch(torch.autograd.Function):
    """``moe_dispatch``; backward: each grouped row's gradient summed back to its token (a
    combine), and each routing weight's gradient sent back from the row that carried it."""

    @staticmethod
    def forward(ctx, x, weights, experts, num_experts, low_latency, group):  # noqa: ANN001, ANN205 - autograd signature
        recv_x, recv_w, _, handle = ops.moe_dispatch(x, experts, weights, num_experts, low_latency=low_latency,
                                                     group=group)
        ctx.handle = handle
        return recv_x, recv_w, handle

    @staticmethod
    def backward(ctx, d_recv_x, d_recv_w, _):  # noqa: ANN001, ANN205
        handle = ctx.handle
        valid = _valid_rows(handle)
        rows, topk = valid.shape[0], handle.position.shape[1]
        ones = valid[:, 0].float()
        d_x = ops.moe_combine(torch.where(valid, d_recv_x, 0).contiguous(), ones, handle)
        # Grouped row p carries the weight of one (token, k): put its gradient in column k,
        # and the same combine brings each token its topk gradients.
        target = torch.where(handle.position >= 0, handle.position, rows).long()
        padded = torch.cat([torch.where(valid[:, 0], d_recv_w, 0), d_recv_w.new_zeros(1)])
        by_k = torch.zeros(rows + 1, topk, dtype=torch.float32, device=d_recv_w.device)
        by_k[target, torch.arange(topk, device=target.device).expand_as(target)] = padded[target]
        d_weights = ops.moe_combine(by_k[:rows].contiguous(), ones, handle)
        return d_x, d_weights, None, None, None, None


class _Combine(torch.autograd.Function):
    """``moe_combine``; backward: the output gradient re-dispatched to the experts' rows."""

    @staticmethod
    def forward(ctx, expert_out, recv_w, handle):  # noqa: ANN001, ANN205
        ctx.save_for_backward(expert_out, recv_w)
        ctx.handle = handle
        return ops.moe_combine(expert_out, recv_w, handle)

    @staticmethod
    def backward(ctx, d_y):  # noqa: ANN001, ANN205
        expert_out, recv_w = ctx.saved_tensors
        valid = _valid_rows(ctx.handle)
        d_rows = torch.where(valid, ops.moe_redispatch(d_y.contiguous(), ctx.handle).float(), 0)
        d_out = (d_rows * recv_w[:, None]).to(expert_out.dtype)
        d_w = torch.where(valid[:, 0], (d_rows * expert_out.float()).sum(-1), 0)
        return d_out, d_w, None


class _GroupedGemm(torch.autograd.Function):
    """``grouped_gemm`` over the dispatch layout; backward: the input gradient by the same
    kernel with transposed weights, each expert's weight gradient over its rows."""

    @staticmethod
    def forward(ctx, x, w, handle):  # noqa: ANN001, ANN205
        ctx.save_for_backward(x, w)
        ctx.handle = handle
        return ops.grouped_gemm(x, w, handle.row_expert)

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        handle = ctx.handle
        valid = _valid_rows(handle)
        d_out = torch.where(valid, d_out, 0).contiguous()
        d_x = ops.grouped_gemm(d_out, w.transpose(1, 2).contiguous(), handle.row_expert)
        d_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        # One host read for the segment bounds: a weight gradient is one GEMM per expert.
        for e, (start, n) in enumerate(zip(handle.offsets.tolist(), handle.counts.tolist(), strict=True)):
            if n:
                d_w[e] = d_out[start:start + n].float().T @ x[start:start + n].float()
        return d_x, d_w.to(w.dtype), None
