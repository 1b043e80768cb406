"""MoE dispatch and combine: tilescale vs the all_to_all_single pipeline a PyTorch user writes.

Baseline, per direction: permute rows by destination rank (one row per token and
destination rank, as tilescale sends), exchange the counts (``all_to_all_single`` on the
counts, then a host read of the split sizes), exchange rows and routing metadata with
``all_to_all_single``, and on the way back sum each token's rows. The baseline does not
group rows by local expert, which tilescale's dispatch does: it is favoured.
Bandwidth counts as DeepEP counts it: bytes of token rows received / time. On GPUs the
``graph_*`` columns time tilescale's calls captured once in a CUDA graph and replayed (the
baseline cannot be captured: it reads the split sizes on the host).

    tilescale run -n 2 benchmarks/moe.py                  # DeepEP's size and a decode batch
    tilescale run -n 2 benchmarks/moe.py --rows bf16,fp8  # which rows to dispatch (bf16, fp8, in-place)
    tilescale run -n 2 --cpu benchmarks/moe.py --small
    tilescale run -n 1 benchmarks/moe.py --floor          # each step's own cost beside its floor
    tilescale run -n 1 benchmarks/moe.py --floor --cases low-latency=128x7168x8x256   # those exchanges alone
    tilescale run -n 2 benchmarks/moe.py --cases normal=2048x4096x6x64 --layer 1024x2048x768x32x4   # other sizes

``--floor`` (a one-rank job: no link, every expert local) times each step eagerly and as a CUDA
graph replay (alone, and ``in_graph_us``: one of ``IN_GRAPH`` calls in one graph, as inside a
decode step's graph, without the graph's own launch), bf16 and FP8 dispatch, beside the step's
floor: the bytes it must move over the copy bandwidth measured in the same run (``torch`` copy
of 1 GiB), and for the layer its FLOPs over the bf16 GEMM rate measured likewise (``torch.mm``
at 8192^3). A dispatch also shows torch's own kernel for its bytes (``torch_same_bytes_us``:
the rows gathered in expert order by ``index_select``, as the torch pipeline groups them; in
place a copy), replayed: what this GPU reaches on that traffic, writes eight times the reads.
"""

import argparse
import functools
from collections.abc import Iterator

import torch
import torch.distributed as dist
from harness import Report, check_close, graphed, named_sizes, time_fn, time_interleaved

import tilescale as ts
from tilescale.ops._gemm import DEFAULT
from tilescale.testing import moe_dispatch_in_place

CASES = {"normal": (4096, 7168, 8, 256), "low-latency": (128, 7168, 8, 256)}
SMALL = {"normal": (64, 128, 4, 16), "low-latency": (8, 128, 4, 16)}  # hidden: whole FP8 scale blocks
# Calls captured in one graph for ``in_graph_us`` (``--floor``): a lone replay adds the graph's own launch.
IN_GRAPH = 20


def routing(tokens: int, num_experts: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=ts.device()).manual_seed(ts.rank())
    scores = torch.rand(tokens, num_experts, device=ts.device(), generator=g)
    weights, experts = scores.topk(topk, dim=1)
    return experts, weights


class AllToAllBaseline:
    """Dispatch and combine with torch.distributed.all_to_all_single."""

    def __init__(self, experts: torch.Tensor, weights: torch.Tensor, num_experts: int):
        world = ts.world_size()
        tokens = experts.shape[0]
        per_rank = num_experts // world
        goes = torch.zeros(tokens, world, dtype=torch.bool, device=experts.device)
        goes.scatter_(1, experts // per_rank, True)
        self.dest, self.token = goes.T.nonzero(as_tuple=True)  # sorted by destination rank
        self.send_counts = goes.sum(0)
        self.experts, self.weights = experts, weights

    def dispatch(self, x: torch.Tensor):
        recv_counts = torch.empty_like(self.send_counts)
        dist.all_to_all_single(recv_counts, self.send_counts)
        send_splits, recv_splits = self.send_counts.tolist(), recv_counts.tolist()
        rows = x[self.token]
        received = x.new_empty(sum(recv_splits), x.shape[1])
        dist.all_to_all_single(received, rows, recv_splits, send_splits)
        meta = torch.cat([self.experts[self.token].float(), self.weights[self.token]], dim=1)
        recv_meta = meta.new_empty(sum(recv_splits), meta.shape[1])
        dist.all_to_all_single(recv_meta, meta, recv_splits, send_splits)
        self.splits = (send_splits, recv_splits)
        return received, recv_meta

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        send_splits, recv_splits = self.splits
        back = rows.new_empty(sum(send_splits), rows.shape[1])
        dist.all_to_all_single(back, rows, send_splits, recv_splits)
        out = torch.zeros(self.experts.shape[0], rows.shape[1], dtype=torch.float32, device=rows.device)
        out.index_add_(0, self.token, back.float())
        return out.to(rows.dtype)


# Rows a dispatch sends: (FP8, in place). FP8 and in-place dispatches are timed alone: their
# combine is the bf16 grouped one, timed in the bf16 row.
VARIANTS = {"bf16": (False, False), "fp8": (True, False), "in-place": (False, True)}


def measure(case: str, tokens: int, hidden: int, topk: int, num_experts: int, iters: int,
            variant: str = "bf16") -> dict:
    """Check, then time, dispatch and combine against the all_to_all_single baseline (also used by scaling.py).

    ``variant`` (``VARIANTS``): FP8 rows are compared with the baseline exchanging the same
    packed FP8 bytes; an in-place dispatch with the baseline as for bf16.
    """
    fp8, in_place = VARIANTS[variant]
    low_latency = case == "low-latency"
    experts, weights = routing(tokens, num_experts, topk)
    x = torch.randn(tokens, hidden, device=ts.device(), dtype=torch.bfloat16)
    rows_in = ts.ops.moe.quantize_fp8(x) if fp8 else x
    baseline = AllToAllBaseline(experts, weights, num_experts)

    def dispatch():
        return ts.ops.moe_dispatch(rows_in, experts, weights, num_experts, low_latency=low_latency, in_place=in_place)

    sent = ts.ops.moe.fp8.pack(rows_in) if fp8 else x  # the baseline exchanges the same bytes
    recv_x, recv_w, counts, handle = dispatch()
    received, meta = baseline.dispatch(sent)
    if fp8:
        received = ts.ops.moe.dequantize_fp8(*ts.ops.moe.fp8.unpack(received, hidden))
        recv_x = ts.ops.moe.dequantize_fp8(*recv_x)
    valid = handle.source_row >= 0
    if in_place:  # rows stay where they land: group them as a grouped dispatch would
        grouped = torch.zeros(handle.source_row.shape[0], hidden, dtype=torch.bfloat16, device=x.device)
        grouped[valid] = recv_x[handle.source_row[valid].long()]
        recv_x = grouped
    # The same rows arrive, in other orders, and grouped by expert tilescale repeats a row
    # for each local expert it goes to: compare the sorted row sums of the distinct rows.
    distinct, which = torch.unique(handle.source_row[valid], return_inverse=True)
    ours = torch.zeros(len(distinct), device=x.device).scatter_(0, which, recv_x[valid].float().sum(1))
    checks = [check_close(f"{case} {variant} dispatch", ours.sort().values, received.float().sum(1).sort().values,
                          rtol=1e-3, atol=1e-3)]
    # Identity experts: each token comes back as its rows times the sum of its routing weights.
    per_rank = num_experts // ts.world_size()
    local = (meta[:, :topk].long() // per_rank) == ts.rank()
    weighted = (received.float() * (meta[:, topk:] * local).sum(1, keepdim=True)).to(received.dtype)
    combined = ts.ops.moe_combine(recv_x, recv_w, handle)
    checks.append(check_close(f"{case} {variant} combine", combined, baseline.combine(weighted),
                              rtol=2e-2, atol=2e-2))
    t_disp = time_fn(dispatch, iters=iters, barrier=dist.barrier)
    b_disp = time_fn(lambda: baseline.dispatch(sent), iters=iters, barrier=dist.barrier)
    width = ts.ops.moe.fp8.packed_width(hidden) if fp8 else 2 * hidden
    nbytes = received.shape[0] * width
    row = {"case": case, "rows": variant, "tokens": tokens, "hidden": hidden, "topk": topk, "experts": num_experts,
           "dispatch_us": t_disp.median_ms * 1e3, "a2a_dispatch_us": b_disp.median_ms * 1e3,
           "dispatch_GBps": nbytes / t_disp.median_ms / 1e6, "recv_bytes": nbytes, "checks": checks}
    if variant == "bf16":
        # Each combine answers a dispatch: time the pair and subtract the dispatch alone.
        def round_trip():
            rx, rw, _, h = dispatch()
            return ts.ops.moe_combine(rx, rw, h)

        pair = time_fn(round_trip, iters=iters, barrier=dist.barrier).median_ms
        b_comb = time_fn(lambda: baseline.combine(weighted), iters=iters, barrier=dist.barrier)
        row.update({"combine_us": (pair - t_disp.median_ms) * 1e3, "a2a_combine_us": b_comb.median_ms * 1e3,
                    "combine_GBps": nbytes / max(pair - t_disp.median_ms, 1e-6) / 1e6})
    if x.is_cuda:  # the baseline reads split sizes on the host, so it cannot be captured
        row["graph_dispatch_us"] = time_fn(graphed(dispatch), iters=iters, barrier=dist.barrier).median_ms * 1e3
        if variant == "bf16":
            graph_pair, graph_check = graph_timings(round_trip, combined, iters)
            row["graph_combine_us"] = graph_pair - row["graph_dispatch_us"]
            checks.append(graph_check)
    return row


def graph_timings(round_trip, expected: torch.Tensor, iters: int) -> tuple[float, dict]:
    """Dispatch + combine captured once in a CUDA graph and replayed: its median (us) and the
    check of the replay's output."""
    outputs = []
    replay_pair = graphed(lambda: outputs.append(round_trip()))
    replay_pair()
    check = check_close("combine, CUDA graph replay", outputs[-1], expected, rtol=2e-2, atol=2e-2)
    return time_fn(replay_pair, iters=iters, barrier=dist.barrier).median_ms * 1e3, check


LAYER = (4096, 4096, 1408, 64, 6)  # tokens per rank, hidden, expert FFN, experts, top-k (DeepSeek-V2-Lite-like)
SMALL_LAYER = (32, 128, 96, 8, 2)  # hidden: whole FP8 scale blocks


def torch_grouped_mm(rows: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``rows`` sorted by expert (expert i's end at ``ends[i]``), each times its expert's
    ``w[i].T``: torch's grouped GEMM where it has one (CUDA), else a loop over the experts."""
    if rows.is_cuda and hasattr(torch, "_grouped_mm"):
        return torch._grouped_mm(rows, w.transpose(-2, -1), offs=ends)
    bounds = [0, *ends.tolist()]
    return torch.cat([rows[s:e] @ w[i].T for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))])


def _expert_ffn(rows: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """The local experts over rows sorted by expert (``sizes`` rows each)."""
    ends = torch.cumsum(sizes, 0).to(torch.int32)
    # GELU on the GEMM's dtype: one kernel computing in float32 (as the layer's).
    return torch_grouped_mm(torch.nn.functional.gelu(torch_grouped_mm(rows, w1, ends)), w2, ends)


def torch_pipeline_layer(moe: "ts.nn.ExpertParallelMoE", x: torch.Tensor) -> torch.Tensor:
    """The same layer as a PyTorch user builds it: all_to_all_single there and back, experts as
    torch grouped GEMMs over rows sorted by expert."""
    world, rank = ts.world_size(), ts.rank()
    per_rank = moe.num_experts // world
    experts, weights = moe.route(x)
    baseline = AllToAllBaseline(experts, weights, moe.num_experts)
    received, meta = baseline.dispatch(x)
    topk = experts.shape[1]
    local = meta[:, :topk].long() - rank * per_rank
    hit = (local >= 0) & (local < per_rank)
    row, k = hit.nonzero(as_tuple=True)
    expert = local[row, k]
    order = torch.argsort(expert, stable=True)
    row, k, expert = row[order], k[order], expert[order]
    sizes = torch.bincount(expert, minlength=per_rank)
    y = _expert_ffn(received[row], moe.w1, moe.w2, sizes)
    summed = torch.zeros(received.shape, dtype=torch.float32, device=x.device)
    summed.index_add_(0, row, y.float() * meta[row, topk + k][:, None])
    return baseline.combine(summed.to(x.dtype))


def measure_layer(shape: tuple[int, int, int, int, int], iters: int) -> dict:
    """The EP MoE layer forward (tilescale) vs the same layer on the torch pipeline, same weights."""
    tokens, hidden, ffn, num_experts, topk = shape
    moe = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=3)
    g = torch.Generator(device=ts.device()).manual_seed(ts.rank())
    x = torch.randn(tokens, hidden, device=ts.device(), generator=g).to(torch.bfloat16)
    checks = [check_close("moe layer", moe(x), torch_pipeline_layer(moe, x), rtol=3e-2, atol=3e-2)]
    ours = time_fn(lambda: moe(x), iters=iters, barrier=dist.barrier)
    theirs = time_fn(lambda: torch_pipeline_layer(moe, x), iters=iters, barrier=dist.barrier)
    graphed_layer = {}
    if x.is_cuda:  # the torch pipeline reads split sizes on the host: it cannot be captured
        outputs = []
        replay = graphed(lambda: outputs.append(moe(x)))
        replay()
        checks.append(check_close("moe layer, CUDA graph replay", outputs[-1], moe(x)))
        graphed_layer["graph_layer_ms"] = time_fn(replay, iters=iters, barrier=dist.barrier).median_ms
    return {**graphed_layer, "case": "layer", "tokens": tokens, "hidden": hidden, "ffn": ffn, "experts": num_experts,
            "topk": topk, "layer_ms": ours.median_ms, "torch_layer_ms": theirs.median_ms,
            "layer_speedup": theirs.median_ms / ours.median_ms, "checks": checks}


def copy_bandwidth(iters: int, small: bool) -> float:
    """Bytes per second a device-to-device copy moves (read + write), 1 GiB (8 MiB ``small``)."""
    src = torch.empty(2**22 if small else 2**29, dtype=torch.bfloat16, device=ts.device())
    dst = torch.empty_like(src)
    return 2 * src.nbytes / (time_fn(lambda: dst.copy_(src), iters=iters).median_ms / 1e3)


def gemm_rate(iters: int, small: bool) -> float:
    """bf16 FLOP per second of ``torch.mm`` at 8192^3 (cuBLAS; 512^3 ``small``)."""
    n = 512 if small else 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=ts.device())
    return 2 * n**3 / (time_fn(lambda: a @ a, iters=iters).median_ms / 1e3)


def floor_case(case: str, fp8: bool, shape: tuple[int, int, int, int], bandwidth: float, iters: int,
               in_place: bool = False) -> list[dict]:
    """One dispatch and its combine on one rank, eager and replayed, beside their HBM floors."""
    tokens, hidden, topk, num_experts = shape
    experts, weights = routing(tokens, num_experts, topk)
    x = torch.randn(tokens, hidden, device=ts.device(), dtype=torch.bfloat16)
    rows_in = ts.ops.moe.quantize_fp8(x) if fp8 else x

    def dispatch():
        return ts.ops.moe_dispatch(rows_in, experts, weights, num_experts, low_latency=case == "low-latency",
                                   in_place=in_place)

    recv, recv_w, _, handle = dispatch()
    expert_out = ts.ops.moe.dequantize_fp8(*recv) if fp8 else recv
    if in_place:  # identity experts over the gathered rows: grouped rows, as a grouped GEMM leaves them
        valid = handle.source_row >= 0
        expert_out = torch.zeros(handle.source_row.shape[0], hidden, dtype=torch.bfloat16, device=x.device)
        expert_out[valid] = (ts.ops.moe.dequantize_fp8(*recv) if fp8 else recv)[handle.source_row[valid].long()]

    def combine():
        return ts.ops.moe_combine(expert_out, recv_w, handle)

    # Identity experts: each token comes back as its rows (as sent: FP8 rows dequantised) times its weights' sum.
    sent = ts.ops.moe.dequantize_fp8(*rows_in) if fp8 else x
    checks = [check_close(f"{case}{' fp8' if fp8 else ''} combine (identity experts)", combine().float(),
                          sent.float() * weights.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)]
    # Bytes each step must move: the dispatch reads every token row once and writes one
    # grouped row per entry (in place: one row per token, its receive row); the combine reads
    # the entries' rows and writes, reads back and writes each token's row.
    width = ts.ops.moe.fp8.packed_width(hidden) if fp8 else 2 * hidden
    entries = tokens * topk
    moved = {"dispatch": (tokens + (tokens if in_place else entries)) * width,
             "combine": (entries + 3 * tokens) * 2 * hidden}
    rows = []
    steps = (("dispatch", dispatch),) if in_place else (("dispatch", dispatch), ("combine", combine))
    for step, fn in steps:
        eager = time_fn(fn, iters=iters).median_ms * 1e3
        replay = time_fn(graphed(fn), iters=iters).median_ms * 1e3 if x.is_cuda else float("nan")
        # One call inside a larger graph (a decode step's): IN_GRAPH calls per replay.
        inside = (time_fn(graphed(fn, IN_GRAPH), iters=iters).median_ms * 1e3 / IN_GRAPH if x.is_cuda
                  else float("nan"))
        floor = moved[step] / bandwidth * 1e6
        rows.append({"step": f"{case} {step}{' fp8' if fp8 else ''}{' in place' if in_place else ''}",
                     "tokens": tokens, "hidden": hidden,
                     "topk": topk, "experts": num_experts, "eager_us": eager, "graph_us": replay,
                     "in_graph_us": inside, "floor_us": floor, "graph_over_floor": replay / floor,
                     "bytes": moved[step], **({"checks": checks} if step == steps[-1][0] else {})})
    # What torch's own copy kernels take for the dispatch's bytes, replayed the same way: the
    # rows gathered in expert order, as the torch all_to_all pipeline groups them (index_select;
    # in place one copy of the rows), 8-byte elements.
    packed = ts.ops.moe.fp8.pack(rows_in) if fp8 else x
    words = packed.view(torch.int64 if width % 8 == 0 else torch.uint8)
    order = experts.flatten().argsort(stable=True) // topk
    same_bytes = (lambda: words.clone()) if in_place else (lambda: words.index_select(0, order))
    assert same_bytes().shape[0] == (tokens if in_place else entries)
    torch_us = time_fn(graphed(same_bytes), iters=iters).median_ms * 1e3 if x.is_cuda else float("nan")
    rows[0].update({"torch_same_bytes_us": torch_us, "graph_over_torch": rows[0]["graph_us"] / torch_us})
    return rows


def expert_gemm_rows(shape: tuple[int, int, int, int, int], rate: float, iters: int) -> list[dict]:
    """The layer's first expert GEMM over a dispatch's grouped rows (the chosen tile, and the
    128x128 one), and gathering the rows of an in-place dispatch through its index (bf16 and
    FP8), and torch's grouped GEMM over the same rows unpadded (where CUDA has it), checked
    against each other, timed taking turns, beside the tensor-core floor of the FLOPs of the
    rows that hold tokens."""
    tokens, hidden, ffn, num_experts, topk = shape
    experts, weights = routing(tokens, num_experts, topk)
    x = torch.randn(tokens, hidden, device=ts.device(), dtype=torch.bfloat16)
    w = (torch.randn(num_experts, ffn, hidden, device=ts.device()) / hidden**0.5).to(torch.bfloat16)
    grouped, _, _, h = ts.ops.moe_dispatch(x, experts, weights, num_experts)
    fp8 = ts.ops.moe.quantize_fp8(x)
    plans = {"grouped rows": lambda: ts.ops.grouped_gemm(grouped, w, h.row_expert),
             # the 128x128 tile the grouped GEMM had before it took the TP GEMMs' tile choice
             "grouped rows, 128x128": lambda: ts.ops.grouped_gemm(grouped, w, h.row_expert, tile=DEFAULT)}
    for label, rows_in in (("gathered", x), ("gathered fp8", fp8)):
        recv, _, _, h_in = ts.ops.moe_dispatch(rows_in, experts, weights, num_experts, in_place=True)
        values, scales = recv if label.endswith("fp8") else (recv, None)
        plans[label] = (lambda v=values, s=scales, hh=h_in: ts.ops.grouped_gemm(v, w, hh.row_expert, scales=s,
                                                                               index=hh.source_row))
    valid = h.row_expert >= 0
    if torch.cuda.is_available() and hasattr(torch, "_grouped_mm"):
        # What a user would pick instead: torch's grouped GEMM over the same rows, sorted by expert
        # with no padding (its cost beside the grouped layout's 128-row tiles).
        sorted_rows = grouped[valid].contiguous()
        ends = torch.cumsum(torch.bincount(h.row_expert[valid].long(), minlength=num_experts), 0).to(torch.int32)
        plans["torch._grouped_mm"] = lambda: torch_grouped_mm(sorted_rows, w, ends)
    # FP8 against the grouped GEMM of the same rows quantised and dequantised (per row, as sent).
    quantised = ts.ops.moe.dequantize_fp8(*ts.ops.moe.quantize_fp8(grouped))
    want = {"gathered": plans["grouped rows"]()[valid].float(),
            "grouped rows, 128x128": plans["grouped rows"]()[valid].float(),
            "gathered fp8": ts.ops.grouped_gemm(quantised, w, h.row_expert)[valid].float()}
    checks = [check_close(f"expert GEMM {label}", plans[label]()[valid].float(), ref, rtol=2e-2, atol=2e-2)
              for label, ref in want.items()]
    if "torch._grouped_mm" in plans:
        checks.append(check_close("expert GEMM torch._grouped_mm", plans["torch._grouped_mm"]().float(),
                                  want["gathered"], rtol=2e-2, atol=2e-2))
    timings = time_interleaved(plans, rounds=min(5, iters), iters=iters)
    times = {label: t.median_ms * 1e3 for label, t in timings.items()}
    floor = 2 * tokens * topk * hidden * ffn / rate * 1e6
    return [{"step": f"expert GEMM, {label}", "tokens": tokens, "hidden": hidden, "topk": topk,
             "experts": num_experts, "eager_us": t, "graph_us": float("nan"), "floor_us": floor,
             "graph_over_floor": float("nan"), "eager_over_grouped": t / times["grouped rows"],
             **({"checks": checks} if label == "grouped rows" else {})} for label, t in times.items()]


def floor_rows(iters: int, small: bool, cases: dict[str, tuple[int, ...]] | None = None) -> Iterator[dict]:
    """One rank: dispatch (bf16, FP8, low-latency), combine and the layer, each eager and
    replayed, beside the HBM / tensor-core floor of what it must move or compute; rows are
    yielded as they are measured. ``cases`` (``--cases``): those exchanges alone, no layer."""
    if ts.world_size() != 1:
        raise SystemExit("--floor is a one-rank job: tilescale run -n 1 benchmarks/moe.py --floor")
    bandwidth, rate = copy_bandwidth(iters, small), gemm_rate(iters, small)
    context = {"copy_GBps": bandwidth / 1e9, "gemm_TFLOPs": rate / 1e12}
    for case, shape in (cases or (SMALL if small else CASES)).items():
        for fp8 in (False, True):
            for in_place in (False, True):
                for row in floor_case(case, fp8, shape, bandwidth, iters, in_place=in_place):
                    yield {**row, **context}
    if cases:
        return
    for row in expert_gemm_rows(SMALL_LAYER if small else LAYER, rate, iters):
        yield {**row, **context}
    shape = SMALL_LAYER if small else LAYER
    tokens, hidden, _, num_experts, topk = shape
    with torch.no_grad():
        layer = measure_layer(shape, iters)
    flops = layer_flops(tokens, shape)
    floor = layer_floor_us(tokens, shape, rate, bandwidth)
    yield {"step": "layer forward", "tokens": tokens, "hidden": hidden, "topk": topk, "experts": num_experts,
           "eager_us": layer["layer_ms"] * 1e3, "graph_us": layer.get("graph_layer_ms", float("nan")) * 1e3,
           "floor_us": floor, "graph_over_floor": layer.get("graph_layer_ms", float("nan")) * 1e3 / floor,
           "torch_layer_us": layer["torch_layer_ms"] * 1e3, "flops": flops, "checks": layer["checks"], **context}
    yield {**fp8_layer_row(shape, floor, iters), **context}
    for row in layer_dispatch_rows(shape, rate, bandwidth, iters):
        yield {**row, **context}


def layer_flops(tokens: int, shape: tuple[int, int, int, int, int]) -> int:
    """The FLOPs of the layer's two expert GEMMs at ``tokens`` tokens (each routed ``topk`` times)."""
    _, hidden, ffn, _, topk = shape
    return 2 * tokens * topk * 2 * hidden * ffn


def layer_floor_us(tokens: int, shape: tuple[int, int, int, int, int], rate: float, bandwidth: float) -> float:
    """The layer forward's floor at ``tokens`` tokens: its expert GEMMs' FLOPs at the tensor-core
    rate, or reading every expert's weights once at the copy bandwidth, whichever is longer (few
    tokens per expert: the weights; 512 tokens of the layer's shape read 1.48 GB for 71 GFLOP)."""
    _, hidden, ffn, num_experts, _ = shape
    weights = 2 * num_experts * ffn * hidden * 2  # w1 and w2, bf16
    return max(layer_flops(tokens, shape) / rate, weights / bandwidth) * 1e6


def layer_dispatch_rows(shape: tuple[int, int, int, int, int], rate: float, bandwidth: float,
                        iters: int) -> list[dict]:
    """The layer's inference forward with its dispatch forced in place (the first expert GEMM
    gathering the received rows) and grouped (the TMA GEMM over grouped rows), one after the
    other, eager and replayed, at the layer's tokens and an eighth of them: what
    ``ts.nn.moe.IN_PLACE_ROWS`` (in place only for few rows per expert) is chosen from."""
    tokens, hidden, ffn, num_experts, topk = shape
    layer = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=3)
    rows = []
    for n in (tokens, max(tokens // 8, 1)):
        floor = layer_floor_us(n, shape, rate, bandwidth)
        x = torch.randn(n, hidden, device=ts.device(), dtype=torch.bfloat16)
        forward, outputs = functools.partial(layer, x), {}
        for mode in ("in place", "grouped"):
            with moe_dispatch_in_place(mode == "in place"), torch.no_grad():
                outputs[mode] = forward()
                eager = time_fn(forward, iters=iters).median_ms * 1e3
                replay = time_fn(graphed(forward), iters=iters).median_ms * 1e3 if x.is_cuda else float("nan")
            rows.append({"step": f"layer forward, dispatch {mode}", "tokens": n, "hidden": hidden, "topk": topk,
                         "experts": num_experts, "eager_us": eager, "graph_us": replay,
                         "floor_us": floor, "graph_over_floor": replay / floor})
        rows[-1]["checks"] = [check_close(f"layer {n} tokens, in place vs grouped", outputs["in place"],
                                          outputs["grouped"])]
    return rows


def fp8_layer_row(shape: tuple[int, int, int, int, int], floor: float, iters: int) -> dict:
    """The layer forward with FP8 dispatch (inference), eager and replayed, checked against the
    bf16 layer of the same weights (e4m3's precision: 5% relative L2)."""
    tokens, hidden, ffn, num_experts, topk = shape
    layers = [ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=3, fp8_dispatch=fp8)
              for fp8 in (False, True)]
    g = torch.Generator(device=ts.device()).manual_seed(ts.rank())
    x = torch.randn(tokens, hidden, device=ts.device(), generator=g).to(torch.bfloat16)
    with torch.no_grad():
        y, y8 = (layer(x).float() for layer in layers)
        error = float((y8 - y).norm() / y.norm())
        if error >= 0.05:
            raise AssertionError(f"FP8-dispatch layer: relative L2 error {error:.3f} against bf16")
        eager = time_fn(lambda: layers[1](x), iters=iters).median_ms * 1e3
        replay = time_fn(graphed(lambda: layers[1](x)), iters=iters).median_ms * 1e3 if x.is_cuda else float("nan")
    return {"step": "layer forward fp8 dispatch", "tokens": tokens, "hidden": hidden, "topk": topk,
            "experts": num_experts, "eager_us": eager, "graph_us": replay, "floor_us": floor,
            "graph_over_floor": replay / floor, "checks": [{"name": "fp8 layer vs bf16", "rel_l2_err": error,
                                                            "ok": True}]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--floor", action="store_true", help="one rank: each step's own cost beside its floor")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rows", default="bf16,fp8,in-place", help=f"dispatched rows, of {', '.join(VARIANTS)}")
    parser.add_argument("--cases", default="", help="other sizes: case=TOKENSxHIDDENxTOPKxEXPERTS,... (case: "
                        "normal, low-latency; the cases named only; with --floor: their exchanges alone, no layer)")
    parser.add_argument("--layer", default="", help="the layer's size: TOKENSxHIDDENxFFNxEXPERTSxTOPK")
    args = parser.parse_args()
    named = dict(named_sizes(args.cases, CASES, 4))
    cases = named or (SMALL if args.small else CASES)
    layer_shape = dict(named_sizes(f"layer={args.layer}" if args.layer else "", ("layer",), 5)).get(
        "layer", SMALL_LAYER if args.small else LAYER)
    ts.init()
    if args.floor:
        report = Report("moe-floor", columns=["step", "tokens", "hidden", "topk", "experts", "eager_us", "graph_us",
                                              "in_graph_us", "floor_us", "graph_over_floor", "eager_over_grouped",
                                              "torch_same_bytes_us", "graph_over_torch", "torch_layer_us"])
        for row in floor_rows(args.iters, args.small, named):
            report.add(row)
            report.save()  # after every step: a job cut off at its time limit keeps what it measured
        report.print_table()
        report.save()
        ts.finalize()
        return
    report = Report("moe", columns=["case", "rows", "tokens", "hidden", "topk", "experts", "dispatch_us",
                                    "a2a_dispatch_us", "combine_us", "a2a_combine_us", "graph_dispatch_us",
                                    "graph_combine_us", "dispatch_GBps", "combine_GBps"])
    for case, (tokens, hidden, topk, experts) in cases.items():
        for variant in args.rows.split(","):
            report.add(measure(case, tokens, hidden, topk, experts, args.iters, variant))
            report.save()  # after every row: a job cut off at its time limit keeps what it measured
    report.print_table()
    layer = Report("moe-layer", columns=["tokens", "hidden", "ffn", "experts", "topk", "layer_ms", "torch_layer_ms",
                                         "layer_speedup", "graph_layer_ms"])
    with torch.no_grad():  # inference: both layers without autograd bookkeeping
        layer.add(measure_layer(layer_shape, args.iters))
    layer.print_table()
    layer.save()
    report.save()
    ts.finalize()


if __name__ == "__main__":
    main()
