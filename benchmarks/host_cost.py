"""Host cost of an eager call: every ``ts.ops`` op and ``ts.nn`` layer forward at a small size.

For each call the table gives the host time per call of back-to-back calls with no
synchronisation (small sizes, so the host sets the pace), the number of kernels and copies
the call launches (counted by the CUDA profiler over one call), the budget the host-path
goal allows (``1.3 x torch launch x kernels``; ``vs_budget`` is the median over the rounds of
the call's time against the budget of a torch launch timed just before it, so a drift of the
host's speed cancels), the time of one eager call between CUDA
events (``eager_us``) and, where the call can be captured in a CUDA graph, that of a replay
(``graph_us``), and their ratio. A torch kernel launch (``x.add_(0)``) and the raw TileLang
kernel under a ``DistributedKernel`` are measured in the same run, interleaved with the rest:
as ``JITKernel.__call__``, as the compiled module's entry function that ``DistributedKernel``
calls (``tilescale.jit._fastest_launch``), and compiled by TileLang's cython backend. The
goals of the host-path issue are printed at the end. The TP ops and layers run their fused
plans (``TILESCALE_TP_PLAN=fused`` unless set), as over several ranks. Each call's host time is
also measured with every kernel launched through TileLang's entry function (``entry_host_us``:
native launches off, ``tilescale.op_launch``), in the same rounds.

    tilescale run -n 1 benchmarks/host_cost.py            # one rank: the host path alone
    tilescale run -n 1 benchmarks/host_cost.py --calls 500 --rounds 9   # a noisy host: more rounds
    tilescale run -n 1 benchmarks/host_cost.py --breakdown     # where each op's host time goes
    tilescale run -n 1 benchmarks/host_cost.py --only moe      # the calls naming "moe" (and torch's launches)

``--only``: the calls whose names contain one of the words, beside torch's launches (the budget),
and only their result checks: a GPU session short of time builds no other op's kernels.

``--breakdown`` splits each ``ts.ops`` call's host time with native launches off, in interleaved
rounds: the whole call, the ``DistributedKernel`` calls it makes (replayed with the arguments one
call passed them), and those kernels' TileLang entry functions with the hidden arguments filled
in; the differences are the op's own Python (checks, plan lookup, allocations) and
``DistributedKernel``'s. With native launches on, likewise: the whole call, the ``OpLaunch`` calls
it makes and their C++ programs called directly; the first difference is the op's own Python.
"""

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from harness import Report, graphed, time_fn
from torch.profiler import ProfilerActivity, profile

import tilescale as ts
from tilescale import op_launch
from tilescale.jit import DistributedKernel, _fastest_launch
from tilescale.ops import p2p
from tilescale.ops._common import sm_count

BF16 = torch.bfloat16


def host_us(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the host time per call of ``calls`` back-to-back calls."""
    samples = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def launches(fn: Callable[[], object]) -> int:
    """Kernels, copies and fills one call puts on the GPU (CUDA activity seen by the profiler)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def capturable(fn: Callable[[], object]) -> Callable[[], object] | None:
    """``fn`` as a CUDA-graph replay, or None if it cannot be captured (host reads, say)."""
    try:
        return graphed(fn)
    except RuntimeError:
        torch.cuda.synchronize()
        return None


def check_results(measured: Callable[[str], bool]) -> int:
    """The ops whose host path runs on cached plans, checked against torch.distributed at the
    benchmark's sizes, each called twice with new inputs (the second call runs on the plan the
    first built), the decode GEMM all-reduce also replayed from a CUDA graph; those of them
    whose calls are ``measured`` (by name). Returns the checks."""
    dev, world, rank = ts.device(), ts.world_size(), ts.rank()
    close = {"rtol": 2e-2, "atol": 2e-2}
    checks = 0
    dst = ts.zeros((2048,), dtype=BF16)  # once: freeing symmetric memory drops every plan
    for _ in range(2):
        x = torch.randn(2048, device=dev, dtype=BF16)
        w = torch.randn(1024, 1024, device=dev, dtype=BF16) / 32  # new each time: a cached plan takes it
        if measured("ops.all_gather 4 KiB"):
            ref = torch.empty(world * 2048, device=dev, dtype=BF16)
            dist.all_gather_into_tensor(ref, x)
            torch.testing.assert_close(ts.ops.all_gather(x), ref, rtol=0, atol=0)
            checks += 1
        for algorithm in ("one_shot", "two_shot"):
            if measured("ops.all_reduce 4 KiB" if algorithm == "one_shot" else "ops.all_reduce two_shot 4 KiB"):
                y, want = x.clone(), x.float()
                dist.all_reduce(want)
                ts.ops.all_reduce(y, algorithm=algorithm)
                torch.testing.assert_close(y.float(), want, **close)
                checks += 1
        if measured("ops.reduce_scatter 4 KiB"):
            want = torch.empty(2048 // world, device=dev)
            dist.reduce_scatter_tensor(want, x.float())
            torch.testing.assert_close(ts.ops.reduce_scatter(x).float(), want, **close)
            checks += 1
        if measured("ops.put 4 KiB") or measured("ops.get 4 KiB"):
            got = torch.empty_like(x)
            ts.ops.put(x, dst, (rank + 1) % world)
            ts.barrier()
            ts.ops.get(dst, got, (rank + 1) % world)  # the right neighbour's copy holds my x
            torch.testing.assert_close(got, x, rtol=0, atol=0)
            ts.barrier()
            checks += 1
        if measured("ops.gemm_all_reduce 128x1024x1024"):
            a = torch.randn(128, 1024, device=dev, dtype=BF16)
            want = a.float() @ w.float().T
            dist.all_reduce(want)
            torch.testing.assert_close(ts.ops.gemm_all_reduce(a, w, plan="fused").float(), want, **close)
            checks += 1
        if measured("ops.gemm_reduce_scatter fused"):
            rows = torch.randn(world * 64, 1024, device=dev, dtype=BF16)
            want = torch.empty(64, 1024, device=dev)
            dist.reduce_scatter_tensor(want, rows.float() @ w.float().T)
            torch.testing.assert_close(ts.ops.gemm_reduce_scatter(rows, w, plan="fused").float(), want, **close)
            checks += 1
    if measured("ops.gemm_all_reduce 128x1024x1024"):
        static = torch.randn(128, 1024, device=dev, dtype=BF16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = ts.ops.gemm_all_reduce(static, w, plan="fused")
        for _ in range(2):
            static.copy_(torch.randn_like(static))
            graph.replay()
            want = static.float() @ w.float().T
            dist.all_reduce(want)
            torch.testing.assert_close(replayed.float(), want, **close)
            checks += 1
    torch.cuda.synchronize()
    ts.barrier()
    return checks


def calls_to_measure() -> dict[str, Callable[[], object]]:
    """One small call of every op and layer (inputs made once, outside the timed calls)."""
    dev = ts.device()
    world, rank = ts.world_size(), ts.rank()
    right = (rank + 1) % world
    x4k = torch.randn(2048, device=dev, dtype=BF16)
    y4k = ts.zeros((2048,), dtype=BF16)
    rows = torch.randn(64, 1024, device=dev, dtype=BF16)
    big = torch.randn(world * 64, 1024, device=dev, dtype=BF16)
    w = torch.randn(1024, 1024, device=dev, dtype=BF16) / 32
    decode = torch.randn(128, 1024, device=dev, dtype=BF16)
    tokens, hidden, topk, experts = 128, 1024, 8, 64
    moe_x = torch.randn(tokens, hidden, device=dev, dtype=BF16)
    scores = torch.rand(tokens, experts, device=dev)
    moe_w, moe_idx = scores.topk(topk, dim=1)
    recv_x, recv_w, _, handle = ts.ops.moe_dispatch(moe_x, moe_idx, moe_w, experts, low_latency=True)
    moe_fp8 = ts.ops.moe.quantize_fp8(moe_x)  # views of the byte rows the FP8 dispatch moves
    local_w = torch.randn(experts // world, hidden, hidden, device=dev, dtype=BF16) / 32
    mlp = ts.nn.TensorParallelMLP(1024, 4096, dtype=BF16)
    moe = ts.nn.ExpertParallelMoE(hidden, 512, experts, topk, dtype=BF16, low_latency=True)
    kernel = p2p.transfer_kernel("bfloat16", 8, p2p.DEFAULT_PLAN, sm_count(), False)
    table = ts.peer_ptrs(y4k)
    entry = _fastest_launch(kernel.kernel)
    column = ts.nn.ColumnParallelLinear(1024, 1024, dtype=BF16)
    merged = ts.nn.MergedColumnParallelLinear(1024, [1024, 1024], dtype=BF16)
    row = ts.nn.RowParallelLinear(1024, 1024, dtype=BF16, sequence_parallel=False)
    redispatch_x = torch.randn(tokens, hidden, device=dev, dtype=BF16)
    gate_up = torch.randn(tokens, 2 * 512, device=dev, dtype=BF16)  # the EP layer's first GEMM output, ffn 512

    def dispatch_combine():
        rx, rw, _, h = ts.ops.moe_dispatch(moe_x, moe_idx, moe_w, experts, low_latency=True)
        return ts.ops.moe_combine(rx, rw, h)

    def in_place_gemm():  # the decode layer's first GEMM: the received rows where they landed, through the index
        rx, _, _, h = ts.ops.moe_dispatch(moe_x, moe_idx, moe_w, experts, low_latency=True, in_place=True)
        return ts.ops.grouped_gemm(rx, local_w, h.row_expert, index=h.source_row)

    def three_adds():
        x4k.add_(0)
        x4k.add_(0)
        x4k.add_(0)

    calls = {
        "torch add_ (one launch)": lambda: x4k.add_(0),
        # What the eager / replay goals ask of the ops, asked of torch's own launches.
        "torch add_ x3 (three launches)": three_adds,
        "tilelang JITKernel (put)": lambda: kernel.kernel(x4k, y4k, right, table),
        "tilelang entry function (put)": lambda: entry(x4k, y4k, right, table),
    }
    try:  # TileLang's other host launch path, for comparison (it needs a host compiler here)
        cython = ts.jit(execution_backend="cython")(p2p.transfer_kernel.__wrapped__)(
            "bfloat16", 8, p2p.DEFAULT_PLAN, sm_count(), False).kernel
        calls["tilelang cython backend (put)"] = lambda: cython(x4k, y4k, right, table)
    except Exception as err:  # noqa: BLE001 - reported, the rest still measured
        print(f"cython backend not measured: {type(err).__name__}: {err}", flush=True)
    return calls | {
        "DistributedKernel (put)": lambda: kernel(x4k, y4k, right),
        "ops.put 4 KiB": lambda: ts.ops.put(x4k, y4k, right),
        "ops.get 4 KiB": lambda: ts.ops.get(y4k, x4k, right),
        "ops.all_gather 4 KiB": lambda: ts.ops.all_gather(x4k),
        "ops.reduce_scatter 4 KiB": lambda: ts.ops.reduce_scatter(x4k),
        "ops.all_reduce 4 KiB": lambda: ts.ops.all_reduce(x4k),
        "ops.all_reduce two_shot 4 KiB": lambda: ts.ops.all_reduce(x4k, algorithm="two_shot"),
        "ops.all_gather_gemm fused 64x1024x1024": lambda: ts.ops.all_gather_gemm(rows, w, plan="fused"),
        "ops.gemm_reduce_scatter fused": lambda: ts.ops.gemm_reduce_scatter(big, w, plan="fused"),
        "ops.gemm_all_reduce 128x1024x1024": lambda: ts.ops.gemm_all_reduce(decode, w, plan="fused"),
        "ops.moe_dispatch low-latency 128 tok": lambda: ts.ops.moe_dispatch(moe_x, moe_idx, moe_w, experts,
                                                                            low_latency=True),
        "ops.moe_dispatch low-latency 128 tok fp8": lambda: ts.ops.moe_dispatch(moe_fp8, moe_idx, moe_w, experts,
                                                                                low_latency=True),
        "ops.moe_combine low-latency 128 tok": lambda: ts.ops.moe_combine(recv_x, recv_w, handle),
        "ops.moe dispatch + combine": dispatch_combine,
        "ops.moe_redispatch 128 tok": lambda: ts.ops.moe_redispatch(redispatch_x, handle),
        "ops.grouped_gemm": lambda: ts.ops.grouped_gemm(recv_x, local_w, handle.row_expert),
        "ops.moe_dispatch in place + grouped_gemm through its index": in_place_gemm,
        "ops.silu_and_mul 128 rows": lambda: ts.ops.silu_and_mul(gate_up),
        "nn.ColumnParallelLinear forward 64 rows": lambda: column(rows),
        "nn.MergedColumnParallelLinear forward 64 rows": lambda: merged(rows),
        "nn.RowParallelLinear forward 128 rows (all-reduce)": lambda: row(decode),
        "nn.TensorParallelMLP forward 64 rows": lambda: mlp(rows),
        "nn.ExpertParallelMoE forward 128 tok": lambda: moe(moe_x),
    }


def print_goals(rows: dict[str, dict]) -> None:
    """The host-path issue's goals, as this run measured them (those whose calls it measured)."""
    if "DistributedKernel (put)" in rows and "tilelang JITKernel (put)" in rows:
        ratio = rows["DistributedKernel (put)"]["host_us"] / rows["tilelang JITKernel (put)"]["host_us"]
        print(f"GOAL DistributedKernel <= 1.05x TileLang's call: {ratio:.2f}x {'met' if ratio <= 1.05 else 'MISSED'}")
    over = [f"{name} {row['vs_budget']:.2f}x" for name, row in rows.items()
            if name.startswith("ops.") and row["vs_budget"] > 1.0]
    print(f"GOAL ops <= 1.3 x torch launch x kernels: {'met' if not over else 'MISSED by ' + ', '.join(over)}")
    for name, limit, torch_alike in (("ops.moe dispatch + combine", 1.5, "torch add_ x3 (three launches)"),
                                     ("ops.gemm_all_reduce 128x1024x1024", 1.2, "torch add_ (one launch)")):
        if name not in rows:
            continue
        found = rows[name]["eager_vs_graph"]
        verdict = "not captured" if found is None else f"{found:.2f}x {'met' if found <= limit else 'MISSED'}"
        alike = rows[torch_alike]["eager_vs_graph"]
        beside = f" (torch's {torch_alike}: {alike:.2f}x in this run)" if alike else ""
        print(f"GOAL {name} eager <= {limit}x its replay: {verdict}{beside}")


def kernel_calls(fn: Callable[[], object]) -> list[tuple[DistributedKernel, tuple, object]]:
    """The kernel calls one call of ``fn`` makes through TileLang's entry functions (native launches
    off): (kernel, arguments, group), from ``DistributedKernel`` calls and ops' ``OpLaunch`` calls."""
    calls = []
    originals = {"__call__": DistributedKernel.__call__, "prepare": DistributedKernel.prepare}

    def recorder(name: str) -> Callable[..., object]:
        def recording(kernel: DistributedKernel, *args: object, group: object = None) -> object:
            calls.append((kernel, args, group))
            return originals[name](kernel, *args, group=group)
        return recording

    for name in originals:
        setattr(DistributedKernel, name, recorder(name))
    try:
        entry_path(fn)()
    finally:
        for name, original in originals.items():
            setattr(DistributedKernel, name, original)
    return calls


def op_launch_calls(fn: Callable[[], object]) -> list[tuple[op_launch.OpLaunch, tuple, tuple]]:
    """The ``OpLaunch`` calls one call of ``fn`` makes (native launches on): (launch, tensors, scalars)."""
    calls = []
    original = op_launch.OpLaunch.__call__

    def recording(launch: op_launch.OpLaunch, tensors: tuple, scalars: tuple = ()) -> object:
        calls.append((launch, tuple(tensors), tuple(scalars)))
        return original(launch, tensors, scalars)

    op_launch.OpLaunch.__call__ = recording
    try:
        fn()
    finally:
        op_launch.OpLaunch.__call__ = original
    return calls


def programs(calls: list[tuple[op_launch.OpLaunch, tuple, tuple]]) -> Callable[[], None] | None:
    """The C++ programs of ``calls`` (learned launches) called directly, as those calls make them;
    None if one of them has none."""
    stream = torch._C._cuda_getCurrentRawStream(ts.device().index)
    found = [launch._natives.get(launch._key(tensors)) for launch, tensors, _ in calls]
    if not calls or any(f is None for f in found):
        return None
    made = [(f[0], tensors, list(scalars)) for f, (_, tensors, scalars) in zip(found, calls, strict=True)]
    return lambda: [program.call(tensors, scalars, stream) for program, tensors, scalars in made]


def entries(calls: list[tuple[DistributedKernel, tuple, object]]) -> Callable[[], None]:
    """The TileLang entry functions of ``calls`` with their hidden arguments, as a call launches them."""
    launches_ = [kernel.prepare(*args, group=group) for kernel, args, group in calls]
    return lambda: [launch(*a) for launch, a in launches_]


def entry_path(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` with every kernel launched through TileLang's entry function (native launches off)."""
    def call() -> object:
        previous = op_launch.set_mode("0")
        try:
            return fn()
        finally:
            op_launch.set_mode(previous)
    return call


def breakdown(fns: dict[str, Callable[[], object]], calls: int) -> None:
    """Print and save where each op's host time goes (see the module's docstring)."""
    layers = {}
    for name, fn in fns.items():
        if name.startswith("ops."):
            recorded = kernel_calls(fn)
            layers[name] = {"op": entry_path(fn), "op, native launches": fn, "kernels": len(recorded)}
            if recorded:  # an op launching its kernels another way (cuBLAS, TileLang's own call) is not split
                layers[name] |= {"kernel calls": lambda r=recorded: [k(*a, group=g) for k, a, g in r],
                                 "entry functions": entries(recorded)}
            launched = op_launch_calls(fn)
            direct = programs(launched)
            if direct is not None:  # the native call split: its OpLaunch calls, their programs
                layers[name] |= {"op launches": lambda r=launched: [launch(t, s) for launch, t, s in r],
                                 "programs": direct}
    layers["torch add_"] = {"op": fns["torch add_ (one launch)"]}
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(3):  # rounds interleaved
        for name, parts in layers.items():
            for part, fn in parts.items():
                if part != "kernels":
                    samples.setdefault((name, part), []).append(host_us(fn, calls))
    report = Report("host_breakdown", columns=["call", "kernels", "op_us", "kernel_calls_us", "entries_us",
                                               "op_python_us", "kernel_python_us", "op_native_us",
                                               "op_launches_us", "programs_us", "native_python_us"])
    for name, parts in layers.items():
        us = {part: statistics.median(samples[(name, part)]) for part in parts if part != "kernels"}
        kc, en = us.get("kernel calls"), us.get("entry functions")
        native, launched = us.get("op, native launches"), us.get("op launches")
        report.add({"call": name, "kernels": parts.get("kernels", 1), "op_us": us["op"], "kernel_calls_us": kc,
                    "entries_us": en, "op_python_us": us["op"] - kc if kc is not None else None,
                    "kernel_python_us": kc - en if kc is not None else None,
                    "op_native_us": native, "op_launches_us": launched, "programs_us": us.get("programs"),
                    "native_python_us": native - launched if launched is not None else None,
                    "rounds": {part: samples[(name, part)] for part in us}})
    report.print_table()
    report.save()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="back-to-back calls per host-time sample")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; each row gives their median")
    parser.add_argument("--breakdown", action="store_true", help="split each op's host time (module docstring)")
    parser.add_argument("--only", nargs="+", metavar="WORD",
                        help="measure the calls whose names contain one of these words (and torch's launches)")
    args = parser.parse_args()

    def measured(name: str) -> bool:
        return not args.only or name.startswith("torch add_") or any(word in name for word in args.only)

    # The TP ops and layers on their fused plans, as they run over several ranks (a group of one
    # rank would run the GEMM alone), unless the environment asks for another plan.
    os.environ.setdefault("TILESCALE_TP_PLAN", "fused")
    ts.init()
    if ts.device().type != "cuda":
        raise SystemExit("host_cost.py measures the GPU launch path: run it on a GPU (without --cpu)")
    with torch.no_grad():
        print(f"RESULTS-OK {check_results(measured)} checks against torch.distributed", flush=True)
    fns = {name: fn for name, fn in calls_to_measure().items() if measured(name)}
    with torch.no_grad():
        for fn in fns.values():  # kernels built, buffers allocated, before anything is timed
            fn()
        if args.breakdown:
            breakdown(fns, args.calls)
            ts.finalize()
            return
        counts = {name: launches(fn) for name, fn in fns.items()}
        host: dict[str, list[float]] = {name: [] for name in fns}
        entry: dict[str, list[float]] = {name: [] for name in fns}  # every kernel through TileLang's entry
        beside: dict[str, list[float]] = {name: [] for name in fns}  # torch add_, timed just before each
        torch_add = fns["torch add_ (one launch)"]
        for _ in range(args.rounds):  # interleaved rounds: a drift of clocks moves every row alike
            for name, fn in fns.items():
                entry[name].append(host_us(entry_path(fn), args.calls))
                beside[name].append(host_us(torch_add, args.calls))
                host[name].append(host_us(fn, args.calls))
        torch_launch = statistics.median(host["torch add_ (one launch)"])
        report = Report("host_cost", columns=["call", "kernels", "host_us", "entry_host_us", "budget_us",
                                              "vs_budget", "eager_us", "graph_us", "eager_vs_graph"])
        for name, fn in fns.items():
            us = statistics.median(host[name])
            budget = 1.3 * torch_launch * max(counts[name], 1)
            eager = time_fn(fn, warmup=3, iters=50).median_ms * 1e3
            replay = capturable(fn) if name.startswith(("ops.", "nn.", "torch")) else None
            graph = time_fn(replay, warmup=3, iters=50).median_ms * 1e3 if replay is not None else None
            # Against the budget of the torch launch timed just before it, round by round: the host's
            # speed drifts within a run (and between runs) more than the rounds' median hides.
            paired = [h / (1.3 * t * max(counts[name], 1)) for h, t in zip(host[name], beside[name], strict=True)]
            report.add({"call": name, "kernels": counts[name], "host_us": us,
                        "entry_host_us": statistics.median(entry[name]), "budget_us": budget,
                        "vs_budget": statistics.median(paired), "eager_us": eager, "graph_us": graph,
                        "eager_vs_graph": eager / graph if graph else None, "host_us_rounds": host[name],
                        "entry_host_us_rounds": entry[name], "torch_add_us_before_rounds": beside[name],
                        "vs_budget_rounds": paired})
    print(f"native launches: {op_launch.counts()}", flush=True)
    report.print_table()
    report.save()
    print_goals({row["call"]: row for row in report.rows})
    ts.finalize()


if __name__ == "__main__":
    main()
