"""Helpers for examples and tests: time a distributed op the way the examples report it."""

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
