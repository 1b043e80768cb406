"""The expert GEMMs of an MoE layer: ``ts.ops.grouped_gemm`` over a dispatch's grouped rows
against ``torch._grouped_mm`` (what a PyTorch user calls) on the same rows, one rank.

Both GEMMs of an expert FFN (``x @ w1.T``: K = hidden, N = FFN; ``h @ w2.T``: K = FFN,
N = hidden) at two layer shapes, with each tile ``grouped_gemm`` can take (``chosen``: its
default), each result checked against torch's first, then timed in interleaved rounds (CUDA
events, median of ``--iters`` per round, the median round reported). torch gets the valid
rows sorted by expert (no padding); ``grouped_gemm`` the dispatch's layout, each expert's
rows padded to 128-row tiles, so its time includes that padding. ``TFLOPs`` counts the
FLOPs of the rows that hold tokens. The first GEMM also runs on an FP8 dispatch's rows (what
``ExpertParallelMoE(fp8_dispatch=True)`` feeds it), dequantised as they load: grouped FP8
rows by TMA where K allows (``fp8 grouped``) and the same rows gathered through an identity
index by ``cp.async`` (``fp8 gathered``, every FP8 GEMM's path before the TMA one), both
checked against torch's GEMM of the dequantised rows.

    tilescale run -n 1 benchmarks/moe_grouped_gemm.py
    tilescale run -n 1 --cpu benchmarks/moe_grouped_gemm.py --small --iters 2
"""

import argparse

import torch
from harness import Report, check_close, time_fn
from moe import LAYER, SMALL_LAYER, routing, torch_grouped_mm

import tilescale as ts
from tilescale.ops._gemm import DEFAULT, WIDE, WIDE_192, WIDE_224

# A layer shape of DeepSeek-V3's proportions beside moe.py's (tokens, hidden, FFN, experts, top-k).
SHAPES = (LAYER, (2048, 7168, 2048, 32, 8))
TILES = {"chosen": None, "128x256": WIDE, "128x224": WIDE_224, "128x192": WIDE_192, "128x128": DEFAULT}
ROUNDS = 5


def gemm_rows(shape: tuple[int, int, int, int, int], iters: int) -> list[dict]:
    tokens, hidden, ffn, num_experts, topk = shape
    experts, weights = routing(tokens, num_experts, topk)
    x = torch.randn(tokens, hidden, device=ts.device(), dtype=torch.bfloat16)
    grouped, _, _, handle = ts.ops.moe_dispatch(x, experts, weights, num_experts)
    row_expert = handle.row_expert
    valid = row_expert >= 0
    order = torch.argsort(row_expert[valid], stable=True)
    ends = torch.cumsum(torch.bincount(row_expert[valid].long(), minlength=num_experts), 0).to(torch.int32)
    rows = []
    for gemm, k, n in (("x @ w1.T", hidden, ffn), ("h @ w2.T", ffn, hidden)):
        a = grouped if k == hidden else torch.randn(grouped.shape[0], k, device=ts.device(), dtype=torch.bfloat16)
        w = (torch.randn(num_experts, n, k, device=ts.device()) / k**0.5).to(torch.bfloat16)
        dense = a[valid][order].contiguous()
        plans = {"torch._grouped_mm": lambda d=dense, w=w: torch_grouped_mm(d, w, ends)}
        plans.update({f"grouped_gemm {label}": (lambda a=a, w=w, t=tile: ts.ops.grouped_gemm(a, w, row_expert, tile=t))
                      for label, tile in TILES.items()})
        wants = {label: plans["torch._grouped_mm"]().float() for label in plans if label != "torch._grouped_mm"}
        if k == hidden:  # FP8 rows as an FP8 dispatch groups them: the same layout as the bf16 dispatch's
            (values, scales), _, _, h8 = ts.ops.moe_dispatch(ts.ops.moe.quantize_fp8(x), experts, weights,
                                                             num_experts)
            identity = torch.arange(values.shape[0], dtype=torch.int32, device=ts.device())
            for label, index in (("grouped_gemm fp8 grouped", None), ("grouped_gemm fp8 gathered", identity)):
                plans[label] = (lambda w=w, v=values, s=scales, r=h8.row_expert, i=index:
                                ts.ops.grouped_gemm(v, w, r, scales=s, index=i))
            dequantised = ts.ops.moe.dequantize_fp8(values, scales)[valid][order].contiguous()
            wants["grouped_gemm fp8 grouped"] = wants["grouped_gemm fp8 gathered"] = \
                torch_grouped_mm(dequantised, w, ends).float()
        checks = {label: check_close(f"{gemm} {label}", plans[label]()[valid][order].float(), want, rtol=2e-2,
                                     atol=2e-2) for label, want in wants.items()}
        times = {label: [] for label in plans}
        for _ in range(ROUNDS):
            for label, fn in plans.items():
                times[label].append(time_fn(fn, iters=iters).median_ms * 1e3)
        median = {label: sorted(t)[ROUNDS // 2] for label, t in times.items()}
        flops = 2 * tokens * topk * k * n
        for label, us in median.items():
            rows.append({"gemm": gemm, "tokens": tokens, "K": k, "N": n, "experts": num_experts, "topk": topk,
                         "plan": label, "us": us, "TFLOPs": flops / us / 1e6,
                         "over_torch": us / median["torch._grouped_mm"], "rounds_us": times[label],
                         **({"check": checks[label]} if label in checks else {})})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    ts.init()
    if ts.world_size() != 1:
        raise SystemExit("a one-rank job: tilescale run -n 1 benchmarks/moe_grouped_gemm.py")
    report = Report("moe-grouped-gemm", columns=["gemm", "tokens", "K", "N", "experts", "topk", "plan", "us",
                                                 "TFLOPs", "over_torch"])
    for shape in (SMALL_LAYER,) if args.small else SHAPES:
        for row in gemm_rows(shape, args.iters):
            report.add(row)
    report.print_table()
    report.save()
    ts.finalize()


if __name__ == "__main__":
    main()
