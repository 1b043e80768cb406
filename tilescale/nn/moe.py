"""An expert-parallel MoE layer: router, dispatch, grouped-GEMM experts, combine.

Example::

    moe = ts.nn.ExpertParallelMoE(hidden=1024, ffn_hidden=2048, num_experts=16, topk=2)
    y = moe(x)               # x, y: this rank's (tokens, hidden); experts live on their ranks
    # a Hugging Face Mixtral block (transformers 5 layout), each rank keeping its experts:
    moe = ts.nn.ExpertParallelMoE.from_weights(block.gate.weight, block.experts.gate_up_proj,
                                               block.experts.down_proj, topk=block.top_k)

Trainable: dispatch, the grouped GEMMs and combine have backwards built from the same
operations (the backward of dispatch is a combine, that of combine a re-dispatch along the
same routes), so gradients reach the input, the router and the experts. Checked against a
single-process MoE with the same weights, forward and backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from tilescale import ops, runtime
from tilescale.nn._group import world_and_rank

# Inference dispatches in place (no grouping copy) while an expert receives at most this many
# rows on average: the first GEMM then gathers them at about the grouped GEMM's speed (1.04x
# at 96 rows an expert), while at 384-1024 rows the gathered GEMM (cp.async, no TMA) costs
# 1.3-1.6x the grouped one, more than the grouping copy saves (one H100, 2026-11-26).
IN_PLACE_ROWS = 128


def moe_weights(hidden: int, ffn_hidden: int, num_experts: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The full fp32 (router, w1, w2) of every expert that ``ExpertParallelMoE(..., seed=seed)``
    starts from (each rank keeps its experts' slices).

    Example::

        router, w1, w2 = moe_weights(1024, 2048, num_experts=16, seed=0)

    Args:
        hidden: The model dimension.
        ffn_hidden: Each expert's hidden dimension.
        num_experts: Experts in total (over all ranks).
        seed: Seed of the CPU generator the weights are drawn from.

    Returns:
        tuple[torch.Tensor, ...]: On the CPU, fp32: router (num_experts, hidden), w1 (num_experts,
        ffn_hidden, hidden), w2 (num_experts, hidden, ffn_hidden); the same on every rank for one seed.
    """
    # On the host whatever torch's default device: the draw must not depend on it.
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(num_experts, hidden, generator=g, device="cpu") / hidden**0.5
    w1 = torch.randn(num_experts, ffn_hidden, hidden, generator=g, device="cpu") / hidden**0.5
    w2 = torch.randn(num_experts, hidden, ffn_hidden, generator=g, device="cpu") / ffn_hidden**0.5
    return router, w1, w2


def _gelu(h: torch.Tensor) -> torch.Tensor:
    """GELU in ``h``'s dtype: torch computes it in float32 and rounds once, one kernel (the same
    values as ``gelu(h.float()).to(h.dtype)``, which writes and reads float32 twice more)."""
    return nn.functional.gelu(h)


def _silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Mixtral, Qwen-MoE, DeepSeek): each row's first half is the gate, its second the up
    projection; float32 math, rounded once to ``h``'s dtype. One kernel (``ts.ops.silu_and_mul``)
    where no gradient is recorded, torch's ops (autograd) where one is."""
    if torch.is_grad_enabled() and h.requires_grad:
        gate, up = h.chunk(2, -1)
        return (nn.functional.silu(gate.float()) * up.float()).to(h.dtype)
    return ops.silu_and_mul(h)


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"gelu": _gelu, "silu_and_mul": _silu_and_mul}


class ExpertParallelMoE(nn.Module):
    """Top-k routed MoE with ``num_experts // world`` experts on each rank.

    The constructor draws GELU FFN experts from ``seed`` (:func:`moe_weights`);
    :meth:`from_weights` takes a model's router and expert weights (SwiGLU by default).
    Inputs: this rank's tokens, any leading dimensions (``(..., hidden)``), the same number
    of tokens on every rank unless ``max_tokens`` is given.

    ``low_latency=True``: dispatch in low-latency mode (decode batches, see
    ``ts.ops.moe_dispatch``). ``max_tokens``: the most tokens any rank passes, the same on
    every rank; each rank then passes its own count, 0 included, building no kernel per count
    (None: the same count on every rank, and each distinct count gets MoE buffers and
    kernels of its own, kept until the group's release: pass ``max_tokens`` where the
    count changes from step to step). The forward has no host synchronisation, so a decode step can
    be captured in a CUDA graph (``examples/moe_decode_graph.py``). ``group``: the ranks the
    experts are split over (None: the job). ``fp8_dispatch=True`` (inference): tokens travel
    as FP8 (DeepEP's layout: e4m3 values, a float32 scale per 128 channels; half the bytes of
    bf16), the first expert GEMM dequantises them as it loads them; the combine stays in the
    layer's dtype. Without a gradient recorded and with few rows per expert (``IN_PLACE_ROWS``)
    the dispatch is in place (``moe_dispatch``'s ``in_place``: no grouping copy, the first GEMM
    gathers the received rows). The expert GEMMs take the handle's ``rows_per_expert``: at most
    64 rows per expert, 64-row tiles (``grouped_gemm``).

    Args:
        hidden: The model dimension.
        ffn_hidden: Each expert's hidden dimension.
        num_experts: Experts in total, divisible by the group size.
        topk: Experts per token.
        seed: Seed of the drawn weights (default 0).
        dtype: The experts' dtype (default bfloat16).
        device: Where the layer lives; None: this rank's device.
        low_latency: Dispatch in low-latency mode (default False).
        group: The ranks the experts are split over; None: the whole job.
        max_tokens: The most tokens any rank passes, or None (every rank passes the same count).
        fp8_dispatch: Dispatch FP8 rows (inference only; hidden a multiple of 128).

    Raises:
        ValueError: ``num_experts`` is not divisible by the group size, or FP8 rows of a hidden
            size that is not a multiple of 128.
    """

    def __init__(self, hidden: int, ffn_hidden: int, num_experts: int, topk: int, *, seed: int = 0,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | None = None, low_latency: bool = False,
                 group: dist.ProcessGroup | None = None, max_tokens: int | None = None, fp8_dispatch: bool = False):
        super().__init__()
        # Every rank draws the same full weights and keeps its experts: no broadcast needed.
        router, w1, w2 = moe_weights(hidden, ffn_hidden, num_experts, seed)
        self._setup(router, w1.to(dtype), w2.to(dtype), topk, activation="gelu", normalize_topk=True,
                    device=device, low_latency=low_latency, group=group, max_tokens=max_tokens,
                    fp8_dispatch=fp8_dispatch)

    @classmethod
    def from_weights(cls, router: torch.Tensor | Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                     gate_up: torch.Tensor, down: torch.Tensor, topk: int, *, activation: str = "silu_and_mul",
                     normalize_topk: bool = True, group: dist.ProcessGroup | None = None,
                     low_latency: bool = False, device: torch.device | None = None,
                     max_tokens: int | None = None, fp8_dispatch: bool = False) -> ExpertParallelMoE:
        """The layer of a model's router and experts, in Hugging Face Mixtral's / Qwen-MoE's layout.

        Example::

            block = model.model.layers[i].mlp                  # transformers 5: MixtralSparseMoeBlock
            moe = ExpertParallelMoE.from_weights(block.gate.weight, block.experts.gate_up_proj,
                                                 block.experts.down_proj, topk=block.top_k)

        Args:
            router: the router weight (experts, hidden): softmax over ``x @ router.T``
                (computed in the router's dtype, softmax in fp32), top-k, renormalised over
                the top k when ``normalize_topk`` (Mixtral's routing). Or a callable
                ``router(x) -> (topk_idx, topk_weights)``, each (tokens, topk), for other
                schemes (e.g. DeepSeek's grouped sigmoid routing); an ``nn.Module`` becomes
                a submodule (its parameters train with the layer).
            gate_up: (experts, 2 * ffn, hidden) for ``"silu_and_mul"`` (rows ``:ffn`` the
                gate projection, ``ffn:`` the up projection, as ``.chunk(2, -1)`` splits the
                product), (experts, ffn, hidden) for ``"gelu"``.
            down: (experts, hidden, ffn).
            topk: experts per token.
            activation: ``"silu_and_mul"`` (SwiGLU) or ``"gelu"``.
            normalize_topk: renormalise the top-k routing weights to sum to 1.
            group, low_latency, max_tokens, fp8_dispatch: as the constructor's.
            device: where the layer lives (default: this rank's device).

        Every rank may pass the full weights: each keeps (copies) its experts' slices. The
        experts keep the weights' dtype, the router its own.

        Returns:
            The layer; its forward takes this rank's tokens ``(..., hidden)``.
        """
        moe = cls.__new__(cls)
        nn.Module.__init__(moe)
        moe._setup(router, gate_up, down, topk, activation=activation, normalize_topk=normalize_topk, device=device,
                   low_latency=low_latency, group=group, max_tokens=max_tokens, fp8_dispatch=fp8_dispatch)
        return moe

    def _setup(self, router: torch.Tensor | Callable, w1: torch.Tensor, w2: torch.Tensor, topk: int, *,
               activation: str, normalize_topk: bool, device: torch.device | None, low_latency: bool,
               group: dist.ProcessGroup | None, max_tokens: int | None = None, fp8_dispatch: bool = False) -> None:
        world, rank = world_and_rank(group)
        num_experts, hidden = w2.shape[0], w2.shape[1]
        if fp8_dispatch and hidden % ops.moe.fp8.BLOCK:
            raise ValueError(f"fp8_dispatch needs hidden divisible by {ops.moe.fp8.BLOCK}, got {hidden}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        gated = 2 if activation.endswith("_and_mul") else 1
        if w1.dim() != 3 or w2.dim() != 3 or tuple(w1.shape) != (num_experts, gated * w2.shape[2], hidden):
            raise ValueError(f"expert weights must be (experts, {gated} x ffn, hidden) and (experts, hidden, ffn) "
                             f"for {activation!r}; got {tuple(w1.shape)} and {tuple(w2.shape)}")
        if w1.dtype != w2.dtype:
            raise TypeError(f"expert weights differ in dtype: {w1.dtype} and {w2.dtype}")
        if num_experts % world:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the group size {world}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in [1, {num_experts}], got {topk}")
        self.num_experts, self.topk, self.low_latency, self.group = num_experts, topk, low_latency, group
        self.world_size = world
        self.max_tokens, self.fp8_dispatch = max_tokens, fp8_dispatch
        self.activation, self.normalize_topk = activation, normalize_topk
        device = device or runtime.device()
        if isinstance(router, torch.Tensor):
            if tuple(router.shape) != (num_experts, hidden):
                raise ValueError(f"router must be (experts={num_experts}, hidden={hidden}), got {tuple(router.shape)}")
            self.router = nn.Parameter(router.detach().to(device=device, copy=True))
            self.router_fn = None
        else:
            self.router, self.router_fn = None, router
        mine = slice(rank * (num_experts // world), (rank + 1) * (num_experts // world))
        # Copies: the layer does not keep the full tensors alive.
        self.w1 = nn.Parameter(w1.detach()[mine].to(device=device, copy=True).contiguous())
        self.w2 = nn.Parameter(w2.detach()[mine].to(device=device, copy=True).contiguous())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k experts of each token (rows of ``x``) and their routing weights.

        Args:
            x: (tokens, hidden) rows.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: ``(topk_idx, topk_weights)``, each (tokens, topk): the
            router callable's, or softmax-top-k of the router weight (renormalised when ``normalize_topk``).
        """
        if self.router_fn is not None:
            return self.router_fn(x)
        logits = nn.functional.linear(x.to(self.router.dtype), self.router)
        if self.normalize_topk:  # the top k probabilities renormalised are the softmax of the top k logits
            top, experts = logits.topk(self.topk, dim=-1)
            return experts, torch.softmax(top, dim=-1, dtype=torch.float32)
        weights, experts = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.topk, dim=-1)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route this rank's tokens, run them through their experts' ranks and combine them back.

        Args:
            x: This rank's tokens, ``(..., hidden)``.

        Returns:
            torch.Tensor: ``x``'s shape: each token's routing-weighted sum of its experts' outputs.
        """
        lead, x = x.shape[:-1], x.reshape(-1, x.shape[-1])
        experts, weights = self.route(x)
        route = (weights, experts, self.num_experts, self.low_latency, self.group, self.max_tokens)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, self.w1, self.w2)):
            if self.fp8_dispatch:
                raise RuntimeError("ExpertParallelMoE(fp8_dispatch=True) is for inference: run it under "
                                   "torch.no_grad() (or without parameters that require gradients)")
            gemm, combine = _GroupedGemm.apply, _Combine.apply
            recv_x, recv_w, handle = _Dispatch.apply(x, *route)  # grouped rows: the backward reads them
            h = gemm(recv_x, self.w1, handle)
        else:
            # Nothing to differentiate: no autograd nodes (their host time is most of a decode
            # step's). Few rows per expert: the received rows stay where they land, gathered by
            # the first GEMM; many: grouped once by the dispatch, for the TMA GEMM (see IN_PLACE_ROWS).
            gemm, combine = _grouped_gemm, ops.moe_combine
            rows = ops.moe.quantize_fp8(x) if self.fp8_dispatch else x
            in_place = x.shape[0] * self.topk * self.world_size <= IN_PLACE_ROWS * self.num_experts
            recv_x, recv_w, handle = _dispatch(rows, *route, in_place=in_place)
            values, scales = recv_x if self.fp8_dispatch else (recv_x, None)
            h = ops.grouped_gemm(values, self.w1, handle.row_expert, scales=scales,
                                 index=handle.source_row if in_place else None, rows_per_expert=handle.rows_per_expert)
        out = gemm(_ACTIVATIONS[self.activation](h), self.w2, handle)
        return combine(out, recv_w, handle).reshape(*lead, out.shape[-1])


def _dispatch(x: ops.moe.fp8.Rows, weights: torch.Tensor, experts: torch.Tensor, num_experts: int,
              low_latency: bool, group: dist.ProcessGroup | None, max_tokens: int | None, in_place: bool = False,
              ) -> tuple[ops.moe.fp8.Rows, torch.Tensor, ops.moe.DispatchHandle]:
    """``moe_dispatch`` as the layer uses it: rows, weights and the handle."""
    recv_x, recv_w, _, handle = ops.moe_dispatch(x, experts, weights, num_experts, low_latency=low_latency,
                                                 group=group, max_tokens=max_tokens, in_place=in_place)
    return recv_x, recv_w, handle


def _grouped_gemm(x: torch.Tensor, w: torch.Tensor, handle: ops.moe.DispatchHandle) -> torch.Tensor:
    """``grouped_gemm`` over the dispatch layout."""
    return ops.grouped_gemm(x, w, handle.row_expert, rows_per_expert=handle.rows_per_expert)


def _valid_rows(handle: ops.moe.DispatchHandle) -> torch.Tensor:
    """(rows, 1) mask of the grouped rows that hold a token: the others are never written."""
    return (handle.row_expert >= 0)[:, None]


class _Dispatch(torch.autograd.Function):
    """``moe_dispatch``; backward: each grouped row's gradient summed back to its token (a
    combine), and each routing weight's gradient sent back from the row that carried it."""

    @staticmethod
    def forward(ctx, x, weights, experts, num_experts, low_latency, group, max_tokens):  # noqa: ANN001, ANN205
        recv_x, recv_w, handle = _dispatch(x, weights, experts, num_experts, low_latency, group, max_tokens)
        ctx.handle = handle  # remembers the group: the combines of the backward run over it
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
        return d_x, d_weights, None, None, None, None, None


class _Combine(torch.autograd.Function):
    """``moe_combine``; backward: the output gradient re-dispatched to the experts' rows (both
    over the dispatch's group, which the handle remembers)."""

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
        return _grouped_gemm(x, w, handle)

    @staticmethod
    def backward(ctx, d_out):  # noqa: ANN001, ANN205
        x, w = ctx.saved_tensors
        handle = ctx.handle
        valid = _valid_rows(handle)
        d_out = torch.where(valid, d_out, 0).contiguous()
        d_x = ops.grouped_gemm(d_out, w.transpose(1, 2).contiguous(), handle.row_expert,
                               rows_per_expert=handle.rows_per_expert)
        d_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        # One host read for the segment bounds: a weight gradient is one GEMM per expert.
        for e, (start, n) in enumerate(zip(handle.offsets.tolist(), handle.counts.tolist(), strict=True)):
            if n:
                d_w[e] = d_out[start:start + n].float().T @ x[start:start + n].float()
        return d_x, d_w.to(w.dtype), None
