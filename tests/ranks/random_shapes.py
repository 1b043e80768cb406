"""Rank program: the TP GEMMs and the MoE exchange at random shapes none of the other checks name.

Every rank draws the same cases from one seed (``--seed``, ``--cases``): TP GEMMs of random
rows, K and N (multiples of 8, as TMA rows need 16 bytes; rows any count) in fp16 / bf16, each
op on its fused plan and on its default plan, against torch.distributed + torch; MoE dispatch
+ combine of random token counts per rank (0 included), hidden sizes, top-k, expert counts,
modes, FP8 and in place, checked through experts that scale their rows, against torch; and
``ts.nn.ExpertParallelMoE`` (SwiGLU experts of random sizes, forward with and without
autograd, FP8 dispatch) against every token through its experts in float32; and
``ts.nn.TensorParallelMLP`` (sequence parallel, random rows per rank and sizes: output and
input gradient) and a ``ColumnParallelLinear`` with bias on a replicated input, against the
whole layer in float32. Each case prints
``CASE-OK <n> <what>``; a mismatch raises on the rank that saw it (the job fails).

    tilescale run -n 2 --share-gpus tests/ranks/random_shapes.py --cases 12 --seed 1
    tilescale run -n 2 --cpu tests/ranks/random_shapes.py --cases 4 --small
    tilescale run -n 4 --share-gpus tests/ranks/random_shapes.py --kinds moe,layer   # the MoE cases only
"""

import argparse
import random

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.testing import assert_close

parser = argparse.ArgumentParser()
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--cases", type=int, default=8, help="cases of each kind (TP, MoE)")
parser.add_argument("--small", action="store_true", help="sizes the CPU path runs in seconds")
parser.add_argument("--kinds", default="tp,moe,layer,tp-layer", help="which kinds of case to run, in this order")
args = parser.parse_args()

ts.init()
torch.set_default_device(ts.device())
rank, world = ts.rank(), ts.world_size()
draw = random.Random(args.seed)  # the same on every rank: every rank runs the same cases
data = torch.Generator(device=ts.device()).manual_seed(1000 * args.seed + rank)
big = 1 if args.small else 8


def tp_case(n: int) -> None:
    m = draw.randint(1, 320 * big)
    k, cols = 8 * draw.randint(2, 48 * big), 8 * draw.randint(2, 48 * big)
    dtype = draw.choice((torch.float16, torch.bfloat16))
    a = torch.randn(m, k, generator=data).to(dtype)
    w = (torch.randn(cols, k, generator=data) / k ** 0.5).to(dtype)
    tol = {"rtol": 2e-2, "atol": 5e-2}
    full = torch.empty(world * m, k, dtype=dtype)
    dist.all_gather_into_tensor(full, a)
    rows = torch.randn(world * m, k, generator=data).to(dtype)
    part = rows.float() @ w.float().T
    scattered = torch.empty(m, cols)
    dist.reduce_scatter_tensor(scattered, part.clone())
    summed = part.clone()
    dist.all_reduce(summed)
    for plan in ("fused", None):
        assert_close(ts.ops.all_gather_gemm(a, w, plan=plan).float(), full.float() @ w.float().T, **tol)
        assert_close(ts.ops.gemm_reduce_scatter(rows, w, plan=plan).float(), scattered, **tol)
        assert_close(ts.ops.gemm_all_reduce(rows, w, plan=plan).float(), summed, **tol)
        # A decode batch: one rank's rows, all-reduced (the one-kernel plan up to 256 rows).
        decode = rows[:m]
        expected = decode.float() @ w.float().T
        dist.all_reduce(expected)
        assert_close(ts.ops.gemm_all_reduce(decode, w, plan=plan).float(), expected, **tol)
    print(f"CASE-OK {n} tp m={m} k={k} n={cols} {dtype}", flush=True)


def moe_case(n: int) -> None:
    per_rank = draw.choice((1, 2, 3, 4, 8, 16))
    experts = per_rank * world
    topk = draw.randint(1, min(8, experts))
    hidden = 128 * draw.randint(1, 8 * big) if draw.random() < 0.5 else 8 * draw.randint(1, 128 * big)
    fp8 = hidden % 128 == 0 and draw.random() < 0.4
    low_latency = draw.random() < 0.4
    in_place = draw.random() < 0.3
    max_tokens = draw.randint(1, 96 * big)
    counts = [draw.randint(0, max_tokens) for _ in range(world)]
    tokens = counts[rank]
    x = torch.randn(tokens, hidden, generator=data).to(torch.bfloat16)
    scores = torch.rand(tokens, experts, generator=data)
    topk_w, topk_idx = scores.topk(topk, dim=1)
    sent = ts.ops.moe.quantize_fp8(x) if fp8 else x
    recv, recv_w, _, handle = ts.ops.moe_dispatch(sent, topk_idx, topk_w, experts, low_latency=low_latency,
                                                  in_place=in_place, max_tokens=max_tokens)
    rows = ts.ops.moe.dequantize_fp8(*recv) if fp8 else recv
    if in_place:  # the received rows as they landed, the grouped layout an index into them
        rows = rows[handle.source_row.clamp(min=0).long()]
    scale = (rank * per_rank + torch.arange(per_rank) + 1).float()
    expert_out = (rows.float() * scale[handle.row_expert.clamp(min=0).long()][:, None]).to(torch.bfloat16)
    y = ts.ops.moe_combine(expert_out, recv_w, handle)
    source = ts.ops.moe.dequantize_fp8(*sent) if fp8 else x
    reference = (source.float()[:, None, :] * (topk_w * (topk_idx + 1).float())[:, :, None]).sum(1)
    assert_close(y.float(), reference, rtol=3e-2, atol=2e-2 * experts)
    print(f"CASE-OK {n} moe tokens={counts} max={max_tokens} hidden={hidden} top-{topk} of {experts} "
          f"{'fp8' if fp8 else 'bf16'}{' low-latency' if low_latency else ''}{' in-place' if in_place else ''}",
          flush=True)


def layer_case(n: int) -> None:
    per_rank = draw.choice((1, 2, 4))
    experts = per_rank * world
    topk = draw.randint(1, min(4, experts))
    hidden, ffn = 8 * draw.randint(2, 24 * big), 8 * draw.randint(2, 24 * big)
    fp8 = draw.random() < 0.3
    if fp8:
        hidden = 128 * draw.randint(1, 2 * big)
    low_latency = draw.random() < 0.3
    tokens = draw.randint(1, 48 * big)  # every rank the same count (the layer's default: no max_tokens)
    params = torch.Generator(device=ts.device()).manual_seed(args.seed * 100 + n)  # the same weights on every rank
    router = torch.randn(experts, hidden, generator=params)
    gate_up = torch.randn(experts, 2 * ffn, hidden, generator=params) / hidden ** 0.5
    down = torch.randn(experts, hidden, ffn, generator=params) / ffn ** 0.5

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = torch.softmax(x.float() @ router.to(x.device).T, -1).topk(topk, -1)
        return ids, weights / weights.sum(-1, keepdim=True)

    moe = ts.nn.ExpertParallelMoE.from_weights(route, gate_up.to(torch.bfloat16), down.to(torch.bfloat16), topk,
                                               low_latency=low_latency, fp8_dispatch=fp8)
    x = torch.randn(tokens, hidden, generator=data).to(torch.bfloat16)
    ids, weights = route(x)
    want = torch.zeros(tokens, hidden)
    xf = x.float()
    for k in range(topk):
        for e in range(experts):
            sel = (ids[:, k] == e).nonzero(as_tuple=True)[0]
            g, u = (xf[sel] @ gate_up[e].to(xf).T).chunk(2, -1)
            expert = (torch.nn.functional.silu(g) * u) @ down[e].to(xf).T
            want = want.index_add(0, sel, weights[sel, k, None] * expert)
    tol = 0.08 if fp8 else 0.03  # bf16 weights and activations; e4m3 rows
    with torch.no_grad():
        outputs = {"inference": moe(x)}
    if not fp8:  # FP8 dispatch is an inference path
        outputs["autograd"] = moe(x.requires_grad_())
    for what, y in outputs.items():
        error = float((y.float() - want).norm() / want.norm())
        assert error < tol, f"rank {rank}: layer case {n} {what}: relative error {error:.3f}"
    print(f"CASE-OK {n} layer tokens={tokens} hidden={hidden} ffn={ffn} top-{topk} of {experts}"
          f"{' fp8' if fp8 else ''}{' low-latency' if low_latency else ''}", flush=True)


def tp_layer_case(n: int) -> None:
    hidden, ffn = 8 * draw.randint(2, 32 * big), 8 * world * draw.randint(1, 16 * big)
    rows = draw.randint(1, 40 * big)  # this rank's rows; the same count on every rank
    params = torch.Generator(device=ts.device()).manual_seed(args.seed * 100 + 50 + n)  # the same on every rank
    up = torch.randn(ffn, hidden, generator=params) / hidden ** 0.5
    down = torch.randn(hidden, ffn, generator=params) / ffn ** 0.5
    bias = torch.randn(ffn, generator=params)
    mlp = ts.nn.TensorParallelMLP(hidden, ffn, up=up.to(torch.bfloat16), down=down.to(torch.bfloat16))
    x = torch.randn(rows, hidden, generator=data).to(torch.bfloat16)
    dy = torch.randn(rows, hidden, generator=data).to(torch.bfloat16)
    everyone, grads = torch.empty(world * rows, hidden, dtype=x.dtype), torch.empty(world * rows, hidden, dtype=x.dtype)
    dist.all_gather_into_tensor(everyone, x)
    dist.all_gather_into_tensor(grads, dy)
    full = everyone.float().requires_grad_()
    want = torch.nn.functional.gelu(full @ up.to(full).T) @ down.to(full).T
    (want * grads.float()).sum().backward()
    mine = slice(rank * rows, (rank + 1) * rows)

    def close(what: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        error = float((got.float() - ref).norm() / ref.norm())
        assert error < 0.03, f"rank {rank}: tp layer case {n} {what}: relative error {error:.3f}"

    with torch.no_grad():
        close("MLP inference", mlp(x), want.detach()[mine])
    xg = x.clone().requires_grad_()
    y = mlp(xg)
    close("MLP forward", y, want.detach()[mine])
    (y.float() * dy.float()).sum().backward()
    close("MLP dx", xg.grad, full.grad[mine])
    # Column parallel on a replicated input (sequence_parallel=False), with a bias: this rank's columns.
    column = ts.nn.ColumnParallelLinear(hidden, ffn, weight=up.to(torch.bfloat16), bias=bias.to(torch.bfloat16),
                                        sequence_parallel=False)
    cols = slice(rank * ffn // world, (rank + 1) * ffn // world)
    with torch.no_grad():
        close("column", column(x), (x.float() @ up.to(full).T + bias.to(full))[:, cols])
    print(f"CASE-OK {n} tp-layer rows={rows} hidden={hidden} ffn={ffn}", flush=True)


KINDS = {"tp": tp_case, "moe": moe_case, "layer": layer_case, "tp-layer": tp_layer_case}
cases = [KINDS[kind] for kind in args.kinds.split(",")]
for n in range(args.cases):
    for case in cases:
        case(n)
ts.finalize()
