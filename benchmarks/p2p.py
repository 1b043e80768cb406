"""One-sided transfers between GPUs: tilescale put/get vs the copy engine vs NCCL send/recv.

Every rank moves ``size`` bytes to (or from) its right neighbour at the same time, so the
numbers are per-rank bandwidth with all links busy, the way collectives use them. Each
size is checked for correctness before it is timed. Also measured: the round trip of an
8 KiB put + signal between two ranks (one block ping-ponging), and a device-scope barrier.

Under the NVSHMEM backend the tilescale rows are measured twice: with the peer-address
lowering (the fast path, on the NVSHMEM heap) and with every remote operation an NVSHMEM
device call (``*_calls``: the path that crosses nodes).

    tilescale run -n 2 benchmarks/p2p.py [--max-mib 256]
    TILESCALE_BACKEND=nvshmem tilescale run -n 2 benchmarks/p2p.py
"""

import argparse
import contextlib

import torch
import torch.distributed as dist
from harness import Report, bandwidth_gbps, check_close, fmt_bytes, progress, size_sweep, time_fn

import tilescale as ts
import tilescale.language as T
from tilescale.language import build_options


@ts.jit
def pingpong(n: int, iters: int):
    @T.prim_func
    def main(src: T.Tensor((n,), "bfloat16"), buf: T.Tensor((n,), "bfloat16"), flags: T.Tensor((2,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                tile = T.alloc_shared((n,), "bfloat16")
                T.copy(src, tile)
                for i in T.serial(iters):
                    if rank == 1:
                        T.wait(flags[0], "ge", i + 1)
                    T.copy(tile, buf, dst_pe=1 - rank)
                    T.signal(flags[0], i + 1, pe=1 - rank)
                    if rank == 0:
                        T.wait(flags[0], "ge", i + 1)

    return main


@ts.jit
def barriers(grid: int, iters: int):
    @T.prim_func
    def main(unused: T.Tensor((1,), "int32")):
        with T.Kernel(grid, threads=128):
            with T.Scale("device"):
                for _ in T.serial(iters):
                    T.barrier()

    return main


def seeded(seed: int, numel: int) -> torch.Tensor:
    g = torch.Generator(device=ts.device()).manual_seed(seed)
    return torch.randn(numel, device=ts.device(), dtype=torch.bfloat16, generator=g)


def put_get(src: torch.Tensor, dst: torch.Tensor, got: torch.Tensor, right: int, left: int, iters: int,
            label: str = "") -> dict:
    """Check, then time, ``ts.ops.put`` of ``src`` into the right neighbour's ``dst`` and
    ``ts.ops.get`` of it back into ``got`` (as the enclosing build options lower them)."""
    dst.zero_()
    ts.barrier()
    ts.ops.put(src, dst, right)
    ts.barrier()
    check_close(f"put{label}", dst, seeded(left, src.numel()), atol=0, rtol=0)
    got.zero_()
    ts.ops.get(dst, got, right)  # right's dst holds what I put there
    ts.synchronize()
    check_close(f"get{label}", got, src, atol=0, rtol=0)
    return {"put": time_fn(lambda: ts.ops.put(src, dst, right), iters=iters, barrier=dist.barrier),
            "get": time_fn(lambda: ts.ops.get(dst, got, right), iters=iters, barrier=dist.barrier)}


def measure(nbytes: int, rank: int, right: int, left: int, iters: int) -> dict:
    """Check, then time, ``nbytes`` moved from every rank to its right neighbour four ways
    (six on the NVSHMEM backend: put and get also through NVSHMEM device calls)."""
    n = nbytes // 2
    src = seeded(rank, n)
    dst = ts.zeros((n,), dtype=torch.bfloat16)
    got = torch.empty_like(src)
    timings = put_get(src, dst, got, right, left, iters)
    if ts.backend_name() == "nvshmem":
        with nvshmem_calls():
            timings |= {f"{op}_calls": t for op, t in
                        put_get(src, dst, got, right, left, iters, " (NVSHMEM calls)").items()}

    peer_dst = ts.peer_view(dst, right)
    recv = torch.empty_like(src)

    def nccl() -> None:
        ops = [dist.P2POp(dist.isend, src, right), dist.P2POp(dist.irecv, recv, left)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    timings |= {
        "copy_engine": time_fn(lambda: peer_dst.copy_(src), iters=iters, barrier=dist.barrier),
        "nccl": time_fn(nccl, iters=iters, barrier=dist.barrier),
    }
    check_close("nccl", recv, seeded(left, n), atol=0, rtol=0)
    row = {"bytes": nbytes, "size": fmt_bytes(nbytes)}
    for name, t in timings.items():
        row[f"{name}_GBps"] = bandwidth_gbps(nbytes, t.median_ms)
        row[f"{name}_ms"] = t.median_ms
    row["put_vs_copy_engine"] = row["put_GBps"] / row["copy_engine_GBps"]
    if "put_calls" in timings:
        row["put_calls_vs_put"] = row["put_calls_GBps"] / row["put_GBps"]
    return row


def measure_latency(latency: Report, rank: int, world: int, lowering: str) -> None:
    """A put + signal round trip (two ranks) and device-scope barriers, in ``latency``."""
    if world == 2:
        n, iters = 4096, 1000
        src, buf = seeded(rank, n), ts.zeros((n,), dtype=torch.bfloat16)
        flags = ts.zeros((2,), dtype=torch.int32)
        kernel = pingpong(n, iters)

        def round_trips() -> None:
            flags.zero_()
            ts.barrier()
            kernel(src, buf, flags)

        kernel(src, buf, flags)
        ts.synchronize()
        check_close("pingpong", buf, seeded(1 - rank, n), atol=0, rtol=0)
        t = time_fn(round_trips, warmup=2, iters=10)
        latency.add({"what": "put+signal round trip (1 block)", "lowering": lowering, "bytes": 2 * n,
                     "us": t.median_ms * 1e3 / iters})
    sms = torch.cuda.get_device_properties(ts.device()).multi_processor_count
    unused = torch.zeros(1, dtype=torch.int32, device=ts.device())
    for grid in (1, sms):
        kernel = barriers(grid, 100)
        t = time_fn(lambda k=kernel: k(unused), warmup=2, iters=10, barrier=dist.barrier)
        latency.add({"what": f"T.barrier() ({grid} blocks per rank)", "lowering": lowering, "bytes": 0,
                     "us": t.median_ms * 1e3 / 100})


def nvshmem_calls() -> contextlib.AbstractContextManager:
    """Kernels built inside lower remote operations to NVSHMEM device calls."""
    return build_options(remote="nvshmem")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--min-kib", type=int, default=4)
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    sizes = size_sweep(args.min_kib * 1024, args.max_mib * 2**20, factor=4)

    calls = ["put_calls_GBps", "get_calls_GBps", "put_calls_vs_put"] if ts.backend_name() == "nvshmem" else []
    report = Report(f"p2p-{ts.backend_name()}", columns=["bytes", "size", "put_GBps", "get_GBps", *calls,
                                                         "copy_engine_GBps", "nccl_GBps", "put_vs_copy_engine",
                                                         "put_ms", "copy_engine_ms", "nccl_ms"])
    for nbytes in progress(sizes, "p2p", fmt=fmt_bytes):
        report.add(measure(nbytes, rank, right, left, args.iters))

    latency = Report(f"p2p-latency-{ts.backend_name()}", columns=["what", "lowering", "bytes", "us"])
    measure_latency(latency, rank, world, "peer addresses")
    if ts.backend_name() == "nvshmem":
        with nvshmem_calls():
            measure_latency(latency, rank, world, "NVSHMEM calls")
    ts.synchronize()
    report.print_table()
    latency.print_table()
    path = report.save()
    latency.save()
    report.plot("bytes", ["put_GBps", "get_GBps", *calls[:2], "copy_engine_GBps", "nccl_GBps"], ylabel="GB/s per rank",
                title=f"one-sided transfers, {world} ranks, every rank sending at once")
    if path:
        print(f"results: {path}")
    ts.finalize()


if __name__ == "__main__":
    main()
