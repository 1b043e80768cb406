"""Where moe_dispatch's time goes: each of its kernels timed alone, then the whole call.
``--kernels``: a dispatch and a combine, kernel by kernel (torch.profiler: each kernel's own
GPU time). ``--layer``: the same for an ``ExpertParallelMoE`` forward.

    tilescale run -n 8 benchmarks/moe_profile.py                  # DeepEP's normal size, any world size
    tilescale run -n 2 --cpu benchmarks/moe_profile.py --small
    tilescale run -n 1 benchmarks/moe_profile.py --case low-latency --kernels
    tilescale run -n 1 benchmarks/moe_profile.py --layer          # moe.py's layer (4096 tokens, hidden 4096)

Each step is timed as ``benchmarks/moe.py`` times a call (CUDA events around single calls,
median of ``--iters``, ranks released together by a barrier), eagerly and on GPUs also as a
CUDA-graph replay (``graph_us``: its GPU time without the host's launch path), on the inputs
the steps before it left; the table shows the slowest rank's median. ``send + group`` (the dispatch
kernel) also shows the rate of the rows it puts on other ranks (bytes out of this rank over
NVLink / time). Where ranks send at most a decode batch (``moe.routing.routes_in_dispatch``),
``moe_dispatch`` is one kernel that routes its own tokens: ``route`` and ``send + group`` then
time the two-kernel path it replaced, and their sum against the call says what the one launch gains.
"""

import argparse
import collections
from collections.abc import Callable

import torch
import torch.distributed as dist
from harness import Report, graphed, time_fn
from moe import CASES, LAYER, SMALL, SMALL_LAYER, routing

import tilescale as ts
from tilescale.ops import moe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--case", choices=sorted(CASES), default="normal")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--kernels", action="store_true", help="a dispatch and a combine, kernel by kernel")
    parser.add_argument("--layer", action="store_true", help="profile moe.py's EP layer forward instead")
    args = parser.parse_args()
    ts.init()
    if args.layer:
        layer_profile(SMALL_LAYER if args.small else LAYER, args.iters)
        ts.finalize()
        return
    tokens, hidden, topk, num_experts = (SMALL if args.small else CASES)[args.case]
    low_latency = args.case == "low-latency"
    world, rank = ts.world_size(), ts.rank()
    experts, weights = routing(tokens, num_experts, topk)
    x = torch.randn(tokens, hidden, device=ts.device(), dtype=torch.bfloat16)
    if args.kernels:
        exchange_profile(x, experts, weights, num_experts, low_latency, args.iters)
        ts.finalize()
        return

    # One whole call builds every kernel and leaves the outputs the steps below overwrite.
    _, _, _, h = ts.ops.moe_dispatch(x, experts, weights, num_experts, low_latency=low_latency)
    bad = torch.empty(1, dtype=torch.int32, device=x.device)
    route = moe.router(world, tokens, topk, num_experts, str(experts.dtype).removeprefix("torch."))
    chunk_counts = torch.empty(moe.chunk_counts_shape(world, tokens, num_experts), dtype=torch.int32,
                               device=x.device)
    ids = torch.empty_like(h.topk_idx)
    # The dispatch kernel alone: its plan along known routes (a re-dispatch's), on the dispatch's routes.
    send = h.buffer._plan(tokens, x, low_latency, None)
    routes = (h.topk_idx, h.topk_w, h.expert_slot, h.slot, h.send_counts, h.expert_send_counts)
    steps = {
        "route": lambda: route(experts, h.dest, h.slot, h.send_counts, h.expert_slot, h.expert_send_counts, bad, ids,
                               chunk_counts, 0),
        "send + group": lambda: h.buffer._send(send, (x, *routes)),
    }
    steps["moe_dispatch"] = lambda: ts.ops.moe_dispatch(x, experts, weights, num_experts, low_latency=low_latency)
    medians = torch.tensor([time_fn(fn, iters=args.iters, barrier=dist.barrier).median_ms * 1e3
                            for fn in steps.values()], device=x.device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    # The same steps as CUDA-graph replays: GPU time without the host's launch path.
    replays = torch.tensor([time_fn(graphed(fn), iters=args.iters, barrier=dist.barrier).median_ms * 1e3
                            if x.is_cuda else float("nan") for fn in steps.values()], device=x.device)
    dist.all_reduce(replays, op=dist.ReduceOp.MAX)
    remote_bytes = (int(h.send_counts.sum()) - int(h.send_counts[rank])) * hidden * x.element_size()
    total = float(medians[-1])
    report = Report("moe-profile", columns=["step", "us", "share", "graph_us", "GBps"])
    for (name, _), us, replay in zip(steps.items(), medians.tolist(), replays.tolist(), strict=True):
        report.add({"case": args.case, "step": name, "us": us, "share": us / total, "graph_us": replay,
                    "GBps": remote_bytes / us / 1e3 if name == "send + group" else None})
    report.add({"case": args.case, "step": "sum of steps", "us": float(medians[:-1].sum()),
                "share": float(medians[:-1].sum()) / total, "graph_us": float(replays[:-1].sum())})
    if rank == 0:
        print(f"world {world}, {tokens} tokens/rank, hidden {hidden}, top-{topk} of {num_experts} experts "
              f"({args.case}); rank 0 sends {remote_bytes / 1e6:.1f} MB to other ranks")
        if moe.routing.routes_in_dispatch(tokens):
            print("moe_dispatch routes in its kernel (one launch); route + send + group: the two-kernel path")
    report.print_table()
    report.save()
    ts.finalize()


def exchange_profile(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                     low_latency: bool, iters: int) -> None:
    """Each kernel's time per dispatch + combine round trip (``time_fn``'s warm-up builds the kernels)."""

    def round_trip() -> None:
        recv_x, recv_w, _, h = ts.ops.moe_dispatch(x, experts, weights, num_experts, low_latency=low_latency)
        ts.ops.moe_combine(recv_x, recv_w, h)

    kernel_table("moe-kernels", round_trip, iters,
                 f"dispatch + combine, world {ts.world_size()}: {x.shape[0]} tokens/rank, hidden {x.shape[1]}, "
                 f"top-{experts.shape[1]} of {num_experts} experts, low_latency={low_latency}")


def layer_profile(shape: tuple[int, int, int, int, int], iters: int) -> None:
    """Each kernel's time per forward of the EP layer (inference, ``torch.no_grad``)."""
    tokens, hidden, ffn, num_experts, topk = shape
    layer = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=3)
    x = torch.randn(tokens, hidden, device=ts.device(), dtype=torch.bfloat16)
    with torch.no_grad():
        kernel_table("moe-layer-profile", lambda: layer(x), iters,
                     f"EP layer forward, world {ts.world_size()}: {tokens} tokens/rank, hidden {hidden}, FFN {ffn}, "
                     f"top-{topk} of {num_experts} experts")


def kernel_table(name: str, fn: Callable[[], object], iters: int, title: str) -> None:
    """Print and save each kernel's time per call of ``fn`` (torch.profiler; on the CPU path its
    top-level ops), beside the whole call's (CUDA events)."""
    on_cuda = ts.device().type == "cuda"
    call_us = time_fn(fn, iters=iters, barrier=dist.barrier).median_ms * 1e3
    activities = [torch.profiler.ProfilerActivity.CUDA if on_cuda else torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        if on_cuda:
            torch.cuda.synchronize()
    events = []
    for event in prof.events():
        on_gpu = event.device_type == torch.autograd.DeviceType.CUDA
        if on_cuda == on_gpu and (on_gpu or event.cpu_parent is None):  # CPU: top-level ops only
            events.append((event.time_range.start, event.name.split("(")[0].split("<")[0].strip(),
                           event.device_time if on_gpu else event.cpu_time_total))
    # TileLang names every kernel main_kernel: GPU kernels launched more than once a call are
    # told apart by their place among those of their name (#1 the first of the call).
    launches = collections.Counter(name for _, name, _ in events)
    seen: collections.Counter = collections.Counter()
    per_kernel: dict[str, list[float]] = {}
    for _, kernel, us in sorted(events):
        per_call = launches[kernel] // iters
        label = f"{kernel} #{seen[kernel] % per_call + 1}" if per_call > 1 and on_cuda else kernel
        seen[kernel] += 1
        stats = per_kernel.setdefault(label, [0, 0.0])
        stats[0] += 1
        stats[1] += us
    total = sum(us for _, us in per_kernel.values()) / iters
    report = Report(name, columns=["kernel", "calls", "us", "share"])
    for kernel, (calls, us) in per_kernel.items():  # in order of first launch
        report.add({"kernel": kernel, "calls": calls / iters, "us": us / iters, "share": us / iters / total})
    report.add({"kernel": "sum of kernels", "us": total, "share": 1.0})
    report.add({"kernel": "call (CUDA events)" if on_cuda else "call", "us": call_us})
    if ts.rank() == 0:
        print(f"{title}; per call, median of {iters} (profiled: mean)")
    report.print_table()
    report.save()


if __name__ == "__main__":
    main()
