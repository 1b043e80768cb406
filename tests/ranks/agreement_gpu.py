"""Rank program (2 ranks, GPUs): ranks that disagree on a call's shape, found on the device.

One case per job (after a disagreement the job's synchronisation state is undefined, so a
real program ends; this one does too). Every rank first calls every shape of the case, so
the host's first-call check passes and only the device check can find the difference.

    tilescale run -n 2 --share-gpus tests/ranks/agreement_gpu.py eager
    cases: eager (all_reduce), eager_tp (copy-engine all_gather_gemm), direct (gemm_all_reduce
    calls made straight from C++, op_launch.Direct, each rank's shape learned), graph (all_reduce
    and gemm_all_reduce replayed from CUDA graphs), finalize (the last call disagrees, no check
    before ts.finalize(): the job must not exit 0)

Markers: ``CAUGHT case=<case> rank=<r> poisoned=<0|1> msg=<message>``.
"""

from __future__ import annotations

import sys

import torch

import tilescale as ts
from tilescale import op_launch


def caught(case: str, out: torch.Tensor | None = None) -> None:
    try:
        ts.synchronize()
    except ts.ShapeMismatchError as err:
        poisoned = int(out is not None and bool(torch.isnan(out).all()))
        print(f"CAUGHT case={case} rank={ts.rank()} poisoned={poisoned} msg={err}", flush=True)
    else:
        raise AssertionError(f"rank {ts.rank()}: {case}: no ShapeMismatchError")


def main(case: str) -> None:
    ts.init()
    rank, dev = ts.rank(), ts.device()
    mine = 8 if rank == 0 else 16
    for n in (8, 16):  # both shapes seen by every rank: the host check passes
        ts.ops.all_reduce(torch.ones(n, device=dev))
    if case == "eager":
        x = torch.full((mine,), 1.0 + rank, device=dev)
        ts.ops.all_reduce(x)
        caught(case, x)
    elif case == "eager_tp":
        w = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
        for rows in (200, 250):  # both pad to the same 256-row exchange
            ts.ops.all_gather_gemm(torch.randn(rows, 512, device=dev, dtype=torch.bfloat16), w, plan="fused",
                                   producer="copy_engine")
        ts.synchronize()
        a = torch.randn(200 if rank == 0 else 250, 512, device=dev, dtype=torch.bfloat16)
        ts.ops.all_gather_gemm(a, w, plan="fused", producer="copy_engine")
        caught(case)
    elif case == "direct":
        w = torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16)
        for m in (128, 256) * 3:  # each shape learned, then called from C++
            ts.ops.gemm_all_reduce(torch.randn(m, 2048, device=dev, dtype=torch.bfloat16), w, plan="fused")
        ts.synchronize()
        made = op_launch.counts()["direct calls"]
        out = ts.ops.gemm_all_reduce(torch.randn(128 if rank == 0 else 256, 2048, device=dev, dtype=torch.bfloat16),
                                     w, plan="fused")
        assert op_launch.counts()["direct calls"] == made + 1, "the disagreeing call was not a direct one"
        caught(case, out)
    elif case == "graph":
        w = torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16)
        for m in (128, 256):
            ts.ops.gemm_all_reduce(torch.randn(m, 2048, device=dev, dtype=torch.bfloat16), w, plan="fused")
        ts.synchronize()
        x = torch.ones(mine, device=dev)
        a = torch.randn(128 if rank == 0 else 256, 2048, device=dev, dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # each rank captures its own shapes
            ts.ops.all_reduce(x)
            ts.ops.gemm_all_reduce(a, w, plan="fused")
        ts.barrier()
        graph.replay()
        caught(case, x)
    elif case == "finalize":
        x = torch.ones(mine, device=dev)
        ts.ops.all_reduce(x)
        print(f"LAST-CALL-ISSUED rank={rank}", flush=True)
    else:
        raise SystemExit(f"unknown case {case!r}")
    ts.finalize()


if __name__ == "__main__":
    main(sys.argv[1])
