"""Collectives written in tilescale vs NCCL, side by side at every size.

all_gather (bytes = each rank's shard), reduce_scatter and all_reduce (bytes = each rank's
input), bf16. Before timing a size, each result is checked against NCCL's, bit for bit. Reported: median
time of each, the speed-up over NCCL, and NCCL-style bus bandwidth.

    tilescale run -n 2 benchmarks/collectives.py [--max-mib 256]
"""

import argparse

import torch
import torch.distributed as dist
from harness import Report, check_close, fmt_bytes, progress, size_sweep, time_fn

import tilescale as ts


def measure(op: str, nbytes: int, world: int, iters: int) -> dict:
    """Check ``op`` on ``nbytes`` of bf16 per rank against NCCL, then time both (also used by scaling.py)."""
    n = nbytes // 2  # sizes are powers of two: n splits evenly across 2, 4 or 8 ranks
    # Multiples of 1/8 in [-1, 1], different on every rank: all their partial sums over up to
    # 31 ranks are exact in bf16, so every summation order gives the same bits.
    g = torch.Generator(device=ts.device()).manual_seed(ts.rank())
    x = (torch.randint(-8, 9, (n,), device=ts.device(), generator=g) / 8).to(torch.bfloat16)
    if op == "all_gather":
        out = ts.empty((world * n,), dtype=torch.bfloat16)
        ref = torch.empty(world * n, device=ts.device(), dtype=torch.bfloat16)
        ours = lambda: ts.ops.all_gather(x, out=out)  # noqa: E731
        theirs = lambda: dist.all_gather_into_tensor(ref, x)  # noqa: E731
        ours(), theirs()
        check = check_close(op, out, ref, atol=0, rtol=0)
        bus = (world - 1) / world * n * 2 * world
    elif op == "reduce_scatter":
        xs = ts.empty((n,), dtype=torch.bfloat16)
        xs.copy_(x)
        ref = torch.empty(n // world, device=ts.device(), dtype=torch.bfloat16)
        ours = lambda: ts.ops.reduce_scatter(xs)  # noqa: E731
        theirs = lambda: dist.reduce_scatter_tensor(ref, xs)  # noqa: E731
        got = ours()
        theirs()
        check = check_close(op, got, ref, atol=0, rtol=0)
        bus = (world - 1) / world * n * 2
    else:  # in place, both; on a symmetric tensor, as a tilescale user would allocate it
        xs = ts.empty((n,), dtype=torch.bfloat16)
        xs.copy_(x)
        ref = x.clone()
        dist.all_reduce(ref)
        check = check_close(op, ts.ops.all_reduce(xs), ref, atol=0, rtol=0)
        ours = lambda: ts.ops.all_reduce(xs)  # noqa: E731
        theirs = lambda: dist.all_reduce(ref)  # noqa: E731
        bus = 2 * (world - 1) / world * n * 2
    t_ours = time_fn(ours, iters=iters, barrier=dist.barrier)
    t_nccl = time_fn(theirs, iters=iters, barrier=dist.barrier)
    return {
        "op": op, "bytes": n * 2, "size": fmt_bytes(n * 2),
        "tilescale_us": t_ours.median_ms * 1e3, "nccl_us": t_nccl.median_ms * 1e3,
        "speedup": t_nccl.median_ms / t_ours.median_ms,
        "tilescale_busbw_GBps": bus / t_ours.median_ms / 1e6, "nccl_busbw_GBps": bus / t_nccl.median_ms / 1e6,
        "checks": [check],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--ops", default="all_gather,reduce_scatter,all_reduce")
    args = parser.parse_args()
    ts.init()
    world = ts.world_size()
    report = Report("collectives", columns=["op", "size", "tilescale_us", "nccl_us", "speedup",
                                            "tilescale_busbw_GBps", "nccl_busbw_GBps"])
    sizes = size_sweep(args.min_kib * 1024, args.max_mib * 2**20, factor=4)
    for op in args.ops.split(","):
        for nbytes in progress(sizes, op, fmt=fmt_bytes):
            report.add(measure(op, nbytes, world, args.iters))
    ts.synchronize()
    report.print_table()
    path = report.save()
    for op in args.ops.split(","):
        rows = [r for r in report.rows if r["op"] == op]
        sub = Report(f"collectives-{op}", columns=report.columns)
        for r in rows:
            sub.add(r)
        sub.plot("bytes", ["tilescale_busbw_GBps", "nccl_busbw_GBps"], ylabel="bus bandwidth, GB/s",
                 path=path.with_name(path.stem + f"-{op}.png") if path else None, title=f"{op}, {world} ranks")
    ts.finalize()


if __name__ == "__main__":
    main()
