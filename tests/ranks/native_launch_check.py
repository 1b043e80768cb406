"""Rank program (GPUs): ops' kernels launched from C++ (``tilescale.op_launch``) against TileLang's entry function.

Every op runs several calls with new inputs and new output addresses in mode ``check``: each
native launch's parameter bytes are compared with those the entry function makes for the
same arguments before it is launched from C++, and every result with torch's; then the same
calls in the default mode, and replayed from a CUDA graph. Prints the launches learned and
``NATIVE-OK`` at the end.

    tilescale run -n 2 --share-gpus tests/ranks/native_launch_check.py
    tilescale run -n 2 --share-gpus tests/ranks/native_launch_check.py collectives   # that section only

Sections: ``run`` (the TP GEMMs), ``moe``, ``collectives``, ``grouped`` (``grouped_gemm``'s four
variants, and on a dispatch's layouts) and ``waits`` (a native call made after a kernel recorded a
failed wait launches nothing and raises the runtime's message).
"""

import os
import sys

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale import op_launch
from tilescale.testing import assert_close

os.environ.setdefault("TILESCALE_TP_PLAN", "fused")
ts.init()
world, rank, dev = ts.world_size(), ts.rank(), ts.device()
torch.manual_seed(1234 + rank)
CALLS = 5


def summed(x: torch.Tensor) -> torch.Tensor:
    out = x.clone()
    dist.all_reduce(out)
    return out


def gathered(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(world * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x)
    return out


def cases():
    """(name, op on a, reference on a, a's shape, weight)."""
    # Decode shapes (one kernel); more tiles than SMs: the gathering plan (reduce-scatter GEMM,
    # then the peers' segments copied in), and with rows the ranks do not divide (two ranks) the
    # GEMM pushing partials, then the reduction kernel.
    for m, k, n in ((128, 1024, 1024), (40, 512, 768), (16, 4096, 1024), (2048, 1024, 2048), (2049, 512, 2048)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        yield (f"gemm_all_reduce {m}x{k}x{n}", lambda a, w=w: ts.ops.gemm_all_reduce(a, w),
               lambda a, w=w: summed(a.float() @ w.float().T), (m, k))
    for m, k, n in ((1024, 1024, 512), (world * 96, 512, 640)):  # K split (two kernels) where tiles are few
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5

        def rs_ref(a, w=w, m=m):
            return summed(a.float() @ w.float().T)[rank * m // world:(rank + 1) * m // world]
        yield f"gemm_reduce_scatter {m}x{k}x{n}", lambda a, w=w: ts.ops.gemm_reduce_scatter(a, w), rs_ref, (m, k)
    for m, k, n in ((256, 512, 512), (1000, 512, 1024)):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        yield (f"all_gather_gemm {m}x{k}x{n}", lambda a, w=w: ts.ops.all_gather_gemm(a, w),
               lambda a, w=w: gathered(a).float() @ w.float().T, (m, k))


def run(mode: str) -> None:
    """Each TP case's calls with new inputs (from its third call on, in mode ``1``, made straight from
    C++: ``op_launch.Direct``), then one more of every case in turn (new weights, the same layouts),
    then a CUDA graph's replays, every result against torch."""
    op_launch.set_mode(mode)
    direct = op_launch.counts()["direct calls"]
    for _name, op, ref, shape in cases():
        for _ in range(CALLS):
            a = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
            keep = op(a)  # kept: the next call's output lands elsewhere
            assert_close(keep.float(), ref(a), atol=0.05, rtol=0.02)
    for name, op, ref, shape in cases():  # the layouts interleaved, each a learned site's by now
        a = torch.randn(*shape, device=dev, dtype=torch.bfloat16)
        assert_close(op(a).float(), ref(a), atol=0.05, rtol=0.02)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = op(a)
        for _ in range(3):
            a.copy_(torch.randn(*shape, device=dev, dtype=torch.bfloat16))
            graph.replay()
            assert_close(y.float(), ref(a), atol=0.05, rtol=0.02)
        print(f"[rank {rank}] {mode} {name} ok", flush=True)
    made = op_launch.counts()["direct calls"] - direct
    assert (made > 0) == (mode == "1"), (mode, made)  # only learned programs' calls go direct
    print(f"[rank {rank}] {mode} TP GEMMs ok, {made} direct calls", flush=True)


def moe(mode: str) -> None:
    """Dispatch + combine with identity experts: the combine gives each token's weighted sum back.
    Low-latency and normal mode (routing in one and in several chunks), grouped and in place,
    bf16 and FP8 rows, a re-dispatch along the same routes; the ranks' counts differ on some
    calls, and one rank passes none on others. In mode ``1`` a call whose layouts were learned
    goes straight to its program (``op_launch.Direct``), among the others' op-path calls; the
    second call's ids are not contiguous (converted on the op's path: not learned)."""
    op_launch.set_mode(mode)
    direct = op_launch.counts()["direct calls"]
    hidden, topk, experts = 512, 4, 8 * world
    for low_latency, tokens in ((True, 64), (False, 200)):
        for variant in ("grouped", "in place", "fp8"):
            for call in range(CALLS + 2):
                t = (tokens - (call % 2) * 3 * rank) if call != CALLS else tokens * (rank != 1)
                x = torch.randn(t, hidden, device=dev, dtype=torch.bfloat16)
                idx = torch.rand(t, experts, device=dev).argsort(dim=1)[:, :topk]  # distinct experts per token
                idx = idx if call == 1 else idx.contiguous()
                w = torch.rand(t, topk, device=dev)
                sent = ts.ops.moe.quantize_fp8(x) if variant == "fp8" else x
                recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(sent, idx, w, experts, low_latency=low_latency,
                                                                      max_tokens=tokens, in_place=variant == "in place")
                if variant == "fp8":  # the grouped pair marked in its views' layout (a later pack: no copy)
                    assert ts.ops.moe.fp8.marked_rows(recv_x) is not None
                    x, recv_x = ts.ops.moe.dequantize_fp8(*sent), ts.ops.moe.dequantize_fp8(*recv_x)
                elif variant == "in place":
                    recv_x = recv_x[handle.source_row.clamp(min=0).long()]  # grouped rows through the index
                y = ts.ops.moe_combine(recv_x, recv_w, handle)
                assert_close(y.float(), x.float() * w.sum(1, keepdim=True), atol=0.05, rtol=0.02)
                if variant == "grouped":
                    x2 = torch.randn(t, 256, device=dev, dtype=torch.bfloat16)
                    y2 = ts.ops.moe_combine(ts.ops.moe_redispatch(x2, handle), recv_w, handle)
                    assert_close(y2.float(), x2.float() * w.sum(1, keepdim=True), atol=0.05, rtol=0.02)
            print(f"[rank {rank}] {mode} moe low_latency={low_latency} {variant} ok {op_launch.counts()}", flush=True)
    made = op_launch.counts()["direct calls"] - direct
    assert (made > 0) == (mode == "1"), (mode, made)
    print(f"[rank {rank}] {mode} moe ok, {made} direct calls", flush=True)


def collectives(mode: str) -> None:
    """``all_gather`` (into its workspace, and into a symmetric ``out``), ``reduce_scatter`` and
    ``all_reduce`` (one-shot and two-shot; a plain input, staged; a symmetric one, read in place),
    several calls each, new inputs each time."""
    op_launch.set_mode(mode)
    out = ts.empty((world * 64, 8), dtype=torch.float32)
    sym = ts.empty((world * 32, 8), dtype=torch.bfloat16)
    for _ in range(CALLS):
        x = torch.randn(64, 8, device=dev)
        assert_close(ts.ops.all_gather(x), gathered(x))
        ts.ops.all_gather(x, out)
        assert_close(out, gathered(x))
        for y in (torch.randn(world * 48, 16, device=dev), sym.copy_(torch.randn_like(sym))):
            want = summed(y.float())[rank * y.shape[0] // world:(rank + 1) * y.shape[0] // world]
            assert_close(ts.ops.reduce_scatter(y).float(), want, atol=0.05, rtol=0.02)
            for algorithm in ("one_shot", "two_shot"):
                z = y.clone() if y is not sym else sym.copy_(torch.randn_like(sym))
                want = summed(z.float())
                assert ts.ops.all_reduce(z, algorithm) is z
                assert_close(z.float(), want, atol=0.05, rtol=0.02)
    print(f"[rank {rank}] {mode} collectives ok {op_launch.counts()}", flush=True)


def grouped(mode: str) -> None:
    """``grouped_gemm`` over a layout of the caller's own: bf16 rows grouped and gathered through an
    index, FP8 rows (grouped rows by TMA, K a multiple of 512; gathered), new rows each call,
    against torch; then replayed from a CUDA graph."""
    op_launch.set_mode(mode)
    experts, rows, k, n = 3, 384, 512, 256
    row_expert = torch.tensor([0] * 128 + [2] * 100 + [-1] * 28 + [1] * 128, device=dev, dtype=torch.int32)
    index = torch.randperm(rows, device=dev).to(torch.int32)
    w = torch.randn(experts, n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
    valid = row_expert >= 0

    def want(x: torch.Tensor, idx: torch.Tensor | None) -> torch.Tensor:
        a = (x if idx is None else x[idx.long()]).float()
        return torch.einsum("rk,rnk->rn", a[valid], w.float()[row_expert[valid].long()])

    def fp8(x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        values, scales = ts.ops.moe.quantize_fp8(x)  # views of the byte rows the GEMM reads: no copy
        return ts.ops.grouped_gemm(values, w, row_expert, scales=scales, index=idx)

    def fp8_want(x: torch.Tensor, idx: torch.Tensor | None = None) -> torch.Tensor:
        return want(ts.ops.moe.dequantize_fp8(*ts.ops.moe.quantize_fp8(x)), idx)

    variants = {
        "bf16 grouped": (lambda x: ts.ops.grouped_gemm(x, w, row_expert), lambda x: want(x, None)),
        "bf16 gathered": (lambda x: ts.ops.grouped_gemm(x, w, row_expert, index=index), lambda x: want(x, index)),
        "fp8 grouped": (fp8, fp8_want),
        "fp8 gathered": (lambda x: fp8(x, index), lambda x: fp8_want(x, index)),
    }
    for name, (op, ref) in variants.items():
        for _ in range(CALLS):
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            assert_close(op(x)[valid].float(), ref(x), atol=0.05, rtol=0.02)
        x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = op(x)
        for _ in range(3):
            x.copy_(torch.randn(rows, k, device=dev, dtype=torch.bfloat16))
            graph.replay()
            assert_close(y[valid].float(), ref(x), atol=0.05, rtol=0.02)
        print(f"[rank {rank}] {mode} grouped_gemm {name} ok", flush=True)
    # A dispatch's grouped rows and layout, new at every call (from the third on, in mode 1, a
    # call made straight from C++: op_launch.Direct), two token counts interleaved.
    direct = op_launch.counts()["direct calls"]
    num_experts, hidden = 8 * world, 256
    expert_w = torch.randn(num_experts // world, n, hidden, device=dev, dtype=torch.bfloat16) / hidden ** 0.5
    for tokens in (96, 40) * CALLS:
        x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
        weights, ids = torch.rand(tokens, num_experts, device=dev).topk(2, dim=1)
        recv_x, _, _, handle = ts.ops.moe_dispatch(x, ids, weights, num_experts, max_tokens=96)
        got = ts.ops.grouped_gemm(recv_x, expert_w, handle.row_expert)
        held = handle.row_expert >= 0
        expected = torch.einsum("rk,rnk->rn", recv_x[held].float(), expert_w.float()[handle.row_expert[held].long()])
        assert_close(got[held].float(), expected, atol=0.05, rtol=0.02)
    made = op_launch.counts()["direct calls"] - direct
    assert (made > 0) == (mode == "1"), (mode, made)
    print(f"[rank {rank}] {mode} grouped_gemm on dispatch layouts ok, {made} direct calls", flush=True)
    # In place: the received rows through the dispatch's index (direct from the third call in mode
    # 1), and the index of an earlier dispatch refused once a later one went through the buffer.
    direct = op_launch.counts()["direct calls"]
    for tokens in (96, 40) * CALLS:
        x = torch.randn(tokens, hidden, device=dev, dtype=torch.bfloat16)
        weights, ids = torch.rand(tokens, num_experts, device=dev).topk(2, dim=1)
        recv_x, _, _, handle = ts.ops.moe_dispatch(x, ids, weights, num_experts, max_tokens=96, in_place=True)
        got = ts.ops.grouped_gemm(recv_x, expert_w, handle.row_expert, index=handle.source_row)
        held = handle.row_expert >= 0
        rows_in = recv_x[handle.source_row[held].long()].float()
        expected = torch.einsum("rk,rnk->rn", rows_in, expert_w.float()[handle.row_expert[held].long()])
        assert_close(got[held].float(), expected, atol=0.05, rtol=0.02)
    made = op_launch.counts()["direct calls"] - direct
    assert (made > 0) == (mode == "1"), (mode, made)
    ts.ops.moe_dispatch(x, ids, weights, num_experts, max_tokens=96, in_place=True)  # the rows above: stale
    try:
        ts.ops.grouped_gemm(recv_x, expert_w, handle.row_expert, index=handle.source_row)
        raise AssertionError("grouped_gemm read in-place rows a later dispatch may have overwritten")
    except RuntimeError as e:
        assert "no longer valid" in str(e), e
    print(f"[rank {rank}] {mode} grouped_gemm through in-place indexes ok, {made} direct calls", flush=True)


def waits(mode: str) -> None:
    """A learned launch made once a kernel has recorded a failed wait: the C++ program reads the
    group's wait-status record first, launches nothing, and the call raises the runtime's message."""
    op_launch.set_mode(mode)
    w = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    for _ in range(3):  # learned at the first two calls
        ts.ops.gemm_all_reduce(torch.randn(64, 512, device=dev, dtype=torch.bfloat16), w)
    record = ts.group_state(None).wait_status
    record.copy_(torch.tensor([1, rank, 7, 0x1000, 0, 1, 0, 0]))  # state, rank, block, address, ...: a T.wait
    launched = op_launch.counts()["native launches"]
    try:
        ts.ops.gemm_all_reduce(torch.randn(64, 512, device=dev, dtype=torch.bfloat16), w)
        raise AssertionError("a call after a failed wait went through")
    except ts.WaitTimeoutError as e:
        assert "block 7" in str(e), e
    assert op_launch.counts()["native launches"] == launched  # nothing launched
    record.zero_()
    ts.runtime.current().failure_reported = False
    torch.cuda.synchronize()
    print(f"[rank {rank}] {mode} waits ok", flush=True)


# Sections by name (all by default): ``native_launch_check.py collectives`` runs that one only.
named = {"run": run, "moe": moe, "collectives": collectives, "grouped": grouped, "waits": waits}
sections = [named[name] for name in sys.argv[1:]] or list(named.values())
for mode in ("check", "1"):
    for section in sections:
        section(mode)
counts = op_launch.counts()
print(f"[rank {rank}] native launches: {counts}", flush=True)
if os.environ.get("TILESCALE_NATIVE_LAUNCH") != "0":  # the control run: every launch through the entry function
    assert counts["learned"] > 0 and counts["native launches"] > 0 and counts.get("checked launches", 0) > 0, counts
    assert not [reason for reason in counts if reason.startswith("entry:")], counts  # every kernel learned
dist.barrier()
print(f"[rank {rank}] NATIVE-OK", flush=True)
ts.finalize()
