"""Helpers for examples and tests: time a distributed op the way the examples report it, and
reference implementations to check layers against."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from tilescale.runtime import barrier, device


def do_bench(fn: Callable[[], object], *, warmup: int = 5, iters: int = 30) -> float:
    """Mean milliseconds per call of ``fn`` over ``iters`` back-to-back calls, after ``warmup``.

    Example::

        ms = do_bench(lambda: ts.ops.all_gather(x, out=out))

    All ranks start the timed loop together (a host barrier after the warm-up). Timed with
    CUDA events on GPUs, with the host clock on the CPU path; the benchmarks in
    ``benchmarks/`` report medians of single calls.
    """
    for _ in range(warmup):
        fn()
    barrier()
    if device().type != "cuda":
        begin = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - begin) * 1e3 / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def reference_moe(x: torch.Tensor, router: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                  topk: int) -> torch.Tensor:
    """A top-k routed MoE of GELU experts in one process, every expert local (differentiable).

    Example::

        y = reference_moe(x.float().cpu(), *ts.nn.moe.moe_weights(hidden, ffn, experts, seed), topk)

    ``router`` (experts, hidden), ``w1`` (experts, ffn, hidden), ``w2`` (experts, hidden, ffn),
    the routing as ``ts.nn.ExpertParallelMoE`` does it (softmax, top-k, renormalised).
    """
    probs = torch.softmax(x @ router.T, dim=-1)
    weights, experts = probs.topk(topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for k in range(topk):
        for e in range(router.shape[0]):
            rows = (experts[:, k] == e).nonzero(as_tuple=True)[0]
            if len(rows):
                h = torch.nn.functional.gelu(x[rows] @ w1[e].T)
                out = out.index_add(0, rows, weights[rows, k, None] * (h @ w2[e].T))
    return out


def check_greedy(tokens: torch.Tensor, ref_tokens: torch.Tensor, ref_logits: torch.Tensor, atol: float) -> int:
    """Check greedy-decoded ``tokens`` (batch, length) against a reference model's ``ref_tokens``.

    Example::

        ties = check_greedy(tp_model.generate(...), ref_tokens, ref_model(ref_tokens).logits, atol=1e-4)

    Each sequence must equal its reference, except that it may part from it where the
    reference's choice was a near-tie: at the first position where they differ, the
    reference's logit of its own token (``ref_logits``: the reference's logits over
    ``ref_tokens``) may exceed that of ``tokens``' choice by at most ``atol``, the logits'
    tolerance (bf16 rounding can flip such a choice; everything after it differs).

    Returns:
        The number of sequences that parted at a near-tie. Raises AssertionError otherwise.
    """
    assert tokens.shape == ref_tokens.shape, f"token shapes {tuple(tokens.shape)} != {tuple(ref_tokens.shape)}"
    differs = tokens != ref_tokens
    ties = 0
    for b in differs.any(1).nonzero()[:, 0].tolist():
        p = int(differs[b].int().argmax())  # the first position where they part
        assert p > 0, f"sequence {b}: the prompts differ"
        ours, theirs = int(tokens[b, p]), int(ref_tokens[b, p])
        margin = float(ref_logits[b, p - 1, theirs] - ref_logits[b, p - 1, ours])
        assert margin <= atol, (f"sequence {b} parts from the reference at position {p}: token {ours} instead of "
                                f"{theirs}, whose reference logit is {margin:.3g} higher (tolerance {atol:g})")
        ties += 1
    return ties
