"""Rank program (GPUs): launch templates against TileLang's entry function.

Every op runs several calls with new inputs and new output addresses, in mode ``check``:
each templated launch's parameter bytes are compared with those the entry function makes
for the same arguments (``tilescale.launches``), and every result with torch's. It prints
how many kernels were templated, ``TEMPLATES-OK`` at the end.

    tilescale run -n 2 --share-gpus tests/ranks/launch_templates_check.py
"""

import os

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale import launches
from tilescale.testing import assert_close

os.environ.setdefault("TILESCALE_TP_PLAN", "fused")
ts.init()
launches.set_mode("check")
world, rank, dev = ts.world_size(), ts.rank(), ts.device()
torch.manual_seed(1234 + rank)
CALLS = 5


def gathered(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(world * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x)
    return out


def summed(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def tp_ops() -> None:
    for m, k, n in ((128, 1024, 1024), (40, 512, 768)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        for _ in range(CALLS):
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = ts.ops.gemm_all_reduce(a, w)
            assert_close(y.float(), summed(a.float() @ w.float().T), atol=0.05, rtol=0.02)
    for m, k, n in ((256, 512, 512), (4096 // world, 512, 1024)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        for _ in range(CALLS):
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = ts.ops.all_gather_gemm(a, w)
            assert_close(y.float(), gathered(a).float() @ w.float().T, atol=0.05, rtol=0.02)
    for m, k, n in ((1024, 1024, 512),):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        for _ in range(CALLS):
            a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            y = ts.ops.gemm_reduce_scatter(a, w)
            full = summed(a.float() @ w.float().T)
            assert_close(y.float(), full[rank * m // world:(rank + 1) * m // world], atol=0.05, rtol=0.02)


def collectives() -> None:
    for n in (1024, 3000):
        for _ in range(CALLS):
            x = torch.randn(n, device=dev)
            assert_close(ts.ops.all_gather(x), gathered(x))
            y = x.clone()
            assert_close(ts.ops.all_reduce(y), summed(x), atol=1e-5, rtol=1e-5)
            z = torch.randn(world * n, device=dev)
            assert_close(ts.ops.reduce_scatter(z), summed(z)[rank * n:(rank + 1) * n], atol=1e-5, rtol=1e-5)


def moe_ops() -> None:
    hidden, topk, experts = 512, 4, 8 * world
    for low_latency, tokens in ((True, 64), (False, 200)):
        for call in range(CALLS):
            t = tokens - (call % 2) * 3 * rank  # the ranks' counts differ on some calls
            x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
            idx = torch.stack([torch.randperm(experts, device=dev)[:topk] for _ in range(t)])
            w = torch.rand(t, topk, device=dev)
            recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, idx, w, experts, low_latency=low_latency)
            y = ts.ops.moe_combine(recv_x, recv_w, handle)  # identity experts: the weighted sum of x
            assert_close(y.float(), x.float() * w.sum(1, keepdim=True), atol=0.05, rtol=0.02)


tp_ops()
collectives()
moe_ops()
made = launches.made()
print(f"[rank {rank}] templates: {made}", flush=True)
assert made["templates"] > 0 and made["templated launches"] > 0, "no kernel was launched from a template"
dist.barrier()
print(f"[rank {rank}] TEMPLATES-OK", flush=True)
ts.finalize()
