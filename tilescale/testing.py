"""Helpers for examples and tests: compare a distributed op's output with a reference, time
an op the way the examples report it, and reference implementations to check layers against."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tilescale.runtime import barrier, device, is_initialized, synchronize


def assert_close(actual: torch.Tensor, expected: torch.Tensor, **kwargs: Any) -> None:
    """``torch.testing.assert_close``, once this rank's queued GPU work has finished and no
    device-side wait of it failed.

    A kernel whose wait timed out (a peer never signalled) or whose ranks disagreed runs to
    its end with undefined outputs, and on GPUs the host hears of it only at the next
    tilescale launch, ``ts.synchronize()`` or ``ts.barrier()``. Comparing such an output first
    would report wrong numbers; this raises the failure itself.

    Example::

        y = ts.ops.gemm_reduce_scatter(a, w)
        assert_close(y, reference, rtol=2e-2, atol=3e-1)

    Args:
        actual: What a tilescale op returned.
        expected: The reference.
        **kwargs: ``torch.testing.assert_close``'s (``rtol``, ``atol``, ...).

    Raises:
        ts.WaitTimeoutError: a device-side wait of this rank timed out.
        ts.ShapeMismatchError: ranks called a kernel with different shapes.
        AssertionError: the tensors differ beyond the tolerance.
    """
    if is_initialized():  # outside a job no kernel of tilescale's can have run
        synchronize()
    torch.testing.assert_close(actual, expected, **kwargs)


def do_bench(fn: Callable[[], object], *, warmup: int = 5, iters: int = 30) -> float:
    """Mean milliseconds per call of ``fn`` over ``iters`` back-to-back calls, after ``warmup``.

    Example::

        ms = do_bench(lambda: ts.ops.all_gather(x, out=out))

    All ranks start the timed loop together (a host barrier after the warm-up). Timed with
    CUDA events on GPUs; on the CPU path, whose interpreter's timings say nothing about a GPU,
    with the host clock over at most one warm-up and three timed calls (the same code paths:
    later calls reuse the first's plans and buffers). The benchmarks in ``benchmarks/`` report
    medians of single calls.

    Args:
        fn: the call to time (no arguments).
        warmup: untimed calls first.
        iters: timed calls.

    Returns:
        Milliseconds per call.
    """
    on_gpu = device().type == "cuda"
    if not on_gpu:
        warmup, iters = min(warmup, 1), min(iters, 3)
    for _ in range(warmup):
        fn()
    barrier()
    if not on_gpu:
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

    Args:
        x: the tokens (tokens, hidden).
        router: the router's weight (experts, hidden).
        w1: the experts' first weights (experts, ffn, hidden).
        w2: the experts' second weights (experts, hidden, ffn).
        topk: experts per token.

    Returns:
        The layer's output, like ``x``.
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


@contextlib.contextmanager
def moe_dispatch_in_place(in_place: bool) -> Iterator[None]:
    """Force ``ts.nn.ExpertParallelMoE``'s inference dispatch in place (``True``) or grouped
    (``False``) inside the block, whatever its tokens per expert (``IN_PLACE_ROWS``).

    Example::

        with moe_dispatch_in_place(False), torch.no_grad():
            y = layer(x)                       # grouped rows, the TMA expert GEMM

    Args:
        in_place: The dispatch mode to force.
    """
    from tilescale.nn import moe  # the layers load lazily

    default = moe.IN_PLACE_ROWS
    moe.IN_PLACE_ROWS = 2**62 if in_place else 0
    try:
        yield
    finally:
        moe.IN_PLACE_ROWS = default


def check_greedy(tokens: torch.Tensor, ref_tokens: torch.Tensor, ref_logits: torch.Tensor, atol: float) -> int:
    """Check greedy-decoded ``tokens`` (batch, length) against a reference model's ``ref_tokens``.

    Example::

        ties = check_greedy(tp_model.generate(...), ref_tokens, ref_model(ref_tokens).logits, atol=1e-4)

    Each sequence must equal its reference, except that it may part from it where the
    reference's choice was a near-tie: at the first position where they differ, the
    reference's logit of its own token (``ref_logits``: the reference's logits over
    ``ref_tokens``) may exceed that of ``tokens``' choice by at most ``atol``, the logits'
    tolerance (bf16 rounding can flip such a choice; everything after it differs).

    Args:
        tokens: the decoding to check (batch, length).
        ref_tokens: the reference's decoding of the same prompts, same shape.
        ref_logits: the reference's logits over ``ref_tokens`` (batch, length, vocabulary).
        atol: the logits' tolerance.

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


@dataclass
class ShardedComparison:
    """What :func:`compare_sharded_model` measured (the checks themselves passed)."""

    tokens: torch.Tensor
    """The sharded model's greedy decoding, prompt included: (batch, prompt length + new tokens)."""
    new_tokens: torch.Tensor
    """Only the generated part of ``tokens``."""
    ties: int
    """Sequences that parted from the reference at a near-tie (see :func:`check_greedy`)."""
    ms: float
    """Prefill milliseconds of the sharded model (:func:`do_bench`)."""
    ref_ms: float
    """Prefill milliseconds of the original model."""

    def describe_tokens(self) -> str:
        """``greedy tokens: [[...], ...]``, naming the sequences that parted at a near-tie.

        Returns:
            The line the examples print on rank 0.
        """
        ties = f" ({self.ties} sequences part from the reference at a near-tie)" if self.ties else ""
        return f"greedy tokens: {self.new_tokens.tolist()}{ties}"


def compare_sharded_model(model: torch.nn.Module, prompt: torch.Tensor, shard: Callable[[torch.nn.Module], None],
                          new_tokens: int = 4) -> ShardedComparison:
    """Check that ``shard`` (which replaces parts of ``model`` in place) keeps a causal LM's outputs.

    Example::

        def shard(model):
            for layer in model.model.layers:
                layer.mlp = TensorParallelMLP(layer.mlp)

        result = compare_sharded_model(model, prompt, shard)     # every rank, the same model and prompt
        if ts.rank() == 0:
            print(result.describe_tokens())

    The logits of ``prompt`` must match the original's within the tolerance of the model's
    dtype (absolute 5e-2 in bfloat16, 1e-4 otherwise), and ``new_tokens`` greedy tokens (a
    Hugging Face ``generate``: no sampling, no stop at an end-of-sequence token) must equal the
    original's but where :func:`check_greedy` allows a near-tie. Both models' prefills are
    timed (fewer iterations on the CPU path, which interprets the kernels).

    Args:
        model: the unsharded model, in eval mode, the same on every rank.
        prompt: token ids (batch, length) on the model's device.
        shard: called once with ``model`` between the reference run and the sharded one.
        new_tokens: how many tokens to decode greedily.

    Returns:
        The sharded model's tokens and the timings. Raises AssertionError where a check fails.
    """
    atol = 5e-2 if next(model.parameters()).dtype == torch.bfloat16 else 1e-4
    bench = dict(warmup=5, iters=20) if prompt.device.type == "cuda" else dict(warmup=1, iters=2)

    def generate() -> torch.Tensor:
        return model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                              max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)

    with torch.no_grad():
        ref_logits = model(prompt).logits
        ref_tokens = generate()
        ref_token_logits = model(ref_tokens).logits  # where a choice was a near-tie (see check_greedy)
        ref_ms = do_bench(lambda: model(prompt), **bench)
        shard(model)
        logits = model(prompt).logits
        tokens = generate()
        ms = do_bench(lambda: model(prompt), **bench)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=atol)
    ties = check_greedy(tokens, ref_tokens, ref_token_logits, atol)
    return ShardedComparison(tokens, tokens[:, prompt.shape[1]:], ties, ms, ref_ms)
