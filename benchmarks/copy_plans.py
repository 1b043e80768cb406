"""Which CopyPlan moves bytes to a peer fastest? Put and get at a large and a medium size.

Each plan is checked for correctness, then timed beside the copy engine. The default plan
of ``tilescale.ops.put/get`` is chosen from this table.

    tilescale run -n 2 benchmarks/copy_plans.py
"""

import torch
import torch.distributed as dist
from harness import Report, bandwidth_gbps, check_close, fmt_bytes, time_fn

import tilescale as ts
from tilescale.ops.p2p import CopyPlan

PLANS = [
    CopyPlan(block=8192, threads=128, blocks_per_sm=1, staged=True),
    CopyPlan(block=8192, threads=128, blocks_per_sm=2, staged=True),
    CopyPlan(block=8192, threads=128, blocks_per_sm=4, staged=True),
    CopyPlan(block=16384, threads=256, blocks_per_sm=2, staged=True),
    CopyPlan(block=16384, threads=256, blocks_per_sm=1, staged=False),
    CopyPlan(block=16384, threads=256, blocks_per_sm=2, staged=False),
    CopyPlan(block=16384, threads=256, blocks_per_sm=4, staged=False),
    CopyPlan(block=8192, threads=128, blocks_per_sm=4, staged=False),
    CopyPlan(block=8192, threads=256, blocks_per_sm=8, staged=False),
]


def main() -> None:
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    report = Report("copy-plans", columns=["size", "plan", "put_GBps", "get_GBps", "copy_engine_GBps"])
    for nbytes in (2**20, 64 * 2**20):
        n = nbytes // 2
        src = torch.randn(n, device=ts.device(), dtype=torch.bfloat16)
        dst = ts.zeros((n,), dtype=torch.bfloat16)
        got = torch.empty_like(src)
        everyone = [torch.empty_like(src) for _ in range(world)]
        dist.all_gather(everyone, src)
        peer = ts.peer_view(dst, right)
        ce = time_fn(lambda p=peer, s=src: p.copy_(s), barrier=dist.barrier)
        for plan in PLANS:
            ts.barrier()
            ts.ops.put(src, dst, right, plan)
            ts.barrier()
            check_close("put", dst, everyone[left], atol=0, rtol=0)
            ts.ops.get(dst, got, right, plan)
            ts.synchronize()
            check_close("get", got, src, atol=0, rtol=0)
            t_put = time_fn(lambda p=plan, s=src, d=dst: ts.ops.put(s, d, right, p), barrier=dist.barrier)
            t_get = time_fn(lambda p=plan, d=dst, g=got: ts.ops.get(d, g, right, p), barrier=dist.barrier)
            report.add({"size": fmt_bytes(nbytes), "plan": f"{'staged' if plan.staged else 'direct'} "
                        f"block={plan.block} threads={plan.threads} per_sm={plan.blocks_per_sm}",
                        "put_GBps": bandwidth_gbps(nbytes, t_put.median_ms),
                        "get_GBps": bandwidth_gbps(nbytes, t_get.median_ms),
                        "copy_engine_GBps": bandwidth_gbps(nbytes, ce.median_ms)})
    report.print_table()
    report.save()
    ts.finalize()


if __name__ == "__main__":
    main()
