"""Rank program (2+ ranks): one rank builds every kernel much slower than its peers.

Rank 1 sleeps ``TILESCALE_TEST_BUILD_DELAY_S`` before building each kernel (as a rank compiling
on a busy host, or with a cold cache while its peers' is warm), longer than the job's wait
bound (the test sets ``TILESCALE_WAIT_TIMEOUT_S`` below it). The collective ops, fused TP
GEMMs and the MoE dispatch and combine must still give the right result on every rank: their
first call of a shape waits on the host until every rank has built its kernels, so no
device-side wait runs while a peer is still compiling. Marker per op and rank:
``SKEW-OK <op> rank=<r>``.
"""

from __future__ import annotations

import importlib
import os
import time

import torch

import tilescale as ts
from tilescale.testing import assert_close

DELAY_S = float(os.environ.get("TILESCALE_TEST_BUILD_DELAY_S", "3"))


def main() -> None:
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    if rank == 1:
        jit_module = importlib.import_module("tilescale.jit")  # ts.jit is the decorator
        build = jit_module._build

        def slow_build(*args, **kwargs):
            time.sleep(DELAY_S)
            return build(*args, **kwargs)

        jit_module._build = slow_build
    # Operands made alike on every rank (on the CPU, then moved): bf16 GEMMs on GPUs, float32 on the CPU path.
    dev = ts.device()
    gemm_dtype, tol = (torch.bfloat16, dict(rtol=2e-2, atol=0.3)) if dev.type == "cuda" else \
        (torch.float32, dict(rtol=1e-4, atol=1e-3))
    exact = dict(rtol=0, atol=0)  # sums of small integers in fp32
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(24, 64, generator=g).to(gemm_dtype) for _ in range(world)]  # rank r's rows
    w = torch.randn(40, 64, generator=g).to(gemm_dtype)
    partial = [torch.randn(48, 64, generator=g).to(gemm_dtype) for _ in range(world)]  # rank r's (M, K_local)
    vectors = [torch.arange(96.0) + r for r in range(world)]  # rank r's collective input
    full = torch.cat(rows).float() @ w.float().T
    summed = sum(p.float() @ w.float().T for p in partial)
    x, a_rows, a_part, w_dev = vectors[rank].to(dev), rows[rank].to(dev), partial[rank].to(dev), w.to(dev)
    # MoE: 8 tokens per rank, top-2 of 4 experts, weights 0.5: identity experts combine to the tokens.
    tokens = torch.randn(8, 64, generator=g).to(gemm_dtype).to(dev)
    experts = torch.randint(0, 4, (8, 2), generator=torch.Generator().manual_seed(rank)).to(dev)
    halves = torch.full((8, 2), 0.5, device=dev)

    def moe_round_trip() -> torch.Tensor:
        recv_x, recv_w, _, handle = ts.ops.moe_dispatch(tokens, experts, halves, 4)
        return ts.ops.moe_combine(recv_x, recv_w, handle)

    checks = {
        "all_gather": (lambda: ts.ops.all_gather(x), torch.cat(vectors), exact),
        "all_reduce": (lambda: ts.ops.all_reduce(x.clone()), sum(vectors), exact),
        "reduce_scatter": (lambda: ts.ops.reduce_scatter(x), sum(vectors).view(world, -1)[rank], exact),
        "all_gather_gemm": (lambda: ts.ops.all_gather_gemm(a_rows, w_dev, plan="fused"), full, tol),
        "gemm_reduce_scatter": (lambda: ts.ops.gemm_reduce_scatter(a_part, w_dev, plan="fused"),
                                summed.view(world, -1, 40)[rank], tol),
        "gemm_all_reduce": (lambda: ts.ops.gemm_all_reduce(a_part, w_dev, plan="fused"), summed, tol),
        "moe_dispatch_combine": (moe_round_trip, tokens.float().cpu(), tol),
    }
    for name, (call, expected, tolerance) in checks.items():
        assert_close(call().float().cpu(), expected, **tolerance)
        print(f"SKEW-OK {name} rank={rank}", flush=True)
    ts.finalize()


if __name__ == "__main__":
    main()
