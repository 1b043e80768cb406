"""Rank program: MoE dispatch/combine against a single-process reference: skewed routing, different
token counts per rank (a rank with none, one with the most), dispatches back to back, masked entries,
CUDA-graph replays, FP8 rows, in place, an explicit buffer reused and released, bad ids and modes.

Sections by name, all by default in the order below: ``moe_check.py fp8 in-place`` runs those two
(a GPU run short of time picks the ones a longer run did not reach)."""

import sys

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.ops._common import call_board
from tilescale.testing import assert_close, moe_dispatch_in_place

ts.init()
torch.set_default_device(ts.device())  # the same program checks the GPU path
rank, world = ts.rank(), ts.world_size()
per_rank = max(4, 8 // world)  # top-8 needs 8 experts, also in a one-rank job
num_experts = per_rank * world
hidden = 40
# (tokens, topk, low_latency, max_tokens); max_tokens set: rank 0 sends none, the last rank the
# most, the others a few.
cases = [(13, 1, False, None), (29, 2, False, None), (17, 8, False, None), (11, 2, False, None), (13, 2, True, None),
         (9, 8, True, None), (13, 2, True, None), (None, 2, False, 19), (None, 8, True, 12)]
# Rows longer than the block's threads x 16 bytes and not a multiple of it (gpt-oss's 2880): the
# kernels' row copies and the combine's padded row registers end in guarded 16-byte vectors.
cases += [(7, 2, False, None, 2880), (5, 8, True, None, 2880)]


def uneven(max_tokens: int) -> int:
    return 0 if rank == 0 else max_tokens if rank == world - 1 else max_tokens // 3


def combine_and_check(case, x, topk_idx, topk_w, recv_x, recv_w, counts, handle) -> None:
    """A dispatch's grouped rows and counts against every rank's tokens (collective), and its
    combine through experts that multiply by (e + 1), against torch."""
    scale = (rank * per_rank + torch.arange(per_rank) + 1).float()
    expert_out = (recv_x.float() * scale[handle.row_expert.long()][:, None]).to(torch.bfloat16)
    y = ts.ops.moe_combine(expert_out, recv_w, handle)

    everyone = [None] * world
    dist.all_gather_object(everyone, (topk_idx.cpu(), x.cpu()))
    everyone_idx = [idx.to(ts.device()) for idx, _ in everyone]
    everyone_x = [xs.to(ts.device()) for _, xs in everyone]
    expected_counts = torch.zeros(per_rank, dtype=torch.long)
    for idx in everyone_idx:
        local = idx - rank * per_rank
        hit = (local >= 0) & (local < per_rank)
        for row, mask in zip(local, hit, strict=True):
            for e in set(row[mask].tolist()):
                expected_counts[e] += 1
    assert torch.equal(counts.long(), expected_counts), (case, counts, expected_counts)
    # Each expert's rows: its segment, starting on a 128-row tile, holding the rows sent to it.
    for e in range(per_rank):
        start, n = int(handle.offsets[e]), int(counts[e])
        assert start % 128 == 0 and bool((handle.row_expert[start:start + n] == e).all()), (case, e)
        got = recv_x[start:start + n].float().sum(1).sort().values
        sent = torch.cat([xs[(idx == rank * per_rank + e).any(1)]
                          for xs, idx in zip(everyone_x, everyone_idx, strict=True)])
        assert_close(got, sent.float().sum(1).sort().values, rtol=0, atol=0)
    reference = (x.float()[:, None, :] * (topk_w * (topk_idx + 1).float())[:, :, None]).sum(1)
    assert_close(y.float(), reference, rtol=3e-2, atol=3e-2)


def explicit_buffers() -> None:
    """An explicit ``ts.ops.moe.Buffer``: reused across counts and shapes, refusing calls that do
    not fit, released; one set of receive rows; any token count building no kernel."""
    # An explicit buffer: one allocation serves calls of any count up to its size, on each rank its
    # own; a call that does not fit is refused; after release() it is gone.
    buf = ts.ops.moe.Buffer(None, max_tokens=24, hidden=hidden, topk=2, num_experts=num_experts)
    call_board(ts.group_state())  # the group's own, made at its first call (run alone: the buffer's first)
    allocations = len(ts.group_state().allocations)
    for step, tokens in enumerate((24, 0 if rank == 0 else 3, 11 + rank)):
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        topk_w, topk_idx = torch.rand(tokens, num_experts).topk(2, dim=1)
        recv_x, recv_w, counts, handle = buf.dispatch(x, topk_idx, topk_w, low_latency=step == 1)
        y = buf.combine(recv_x, recv_w, handle)  # identity experts
        assert_close(y.float(), x.float() * topk_w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
        assert len(ts.group_state().allocations) == allocations, "the buffer allocated again"
    # Calls of one shape reuse the first one's plan (kernels, output sizes) and the buffer's
    # memory; each call's results are right for its own routing (a token naming one expert twice
    # in the second), and an earlier handle's outputs stay as they were (they are the caller's).
    scale = (rank * (num_experts // world) + torch.arange(num_experts // world) + 1).float()
    for step in range(3):
        g = torch.Generator(device=ts.device()).manual_seed(700 + 10 * step + rank)
        x = torch.randn(24, hidden, generator=g).to(torch.bfloat16)
        topk_w, topk_idx = torch.rand(24, num_experts, generator=g).topk(2, dim=1)
        if step == 1:
            topk_idx[:, 1] = topk_idx[:, 0]
        recv_x, recv_w, counts, handle = buf.dispatch(x, topk_idx, topk_w, low_latency=True)
        expert_out = (recv_x.float() * scale[handle.row_expert.long()][:, None]).to(torch.bfloat16)
        y = buf.combine(expert_out, recv_w, handle)
        want = x.float() * (topk_w * (topk_idx + 1).float()).sum(1, keepdim=True)
        assert_close(y.float(), want, rtol=2e-2, atol=2e-2)
        if step == 0:
            # tokens, hidden, dtype, low_latency, id dtype, in place
            key = (24, hidden, torch.bfloat16, True, torch.int64, False)
            plans, plan = len(buf._plans), buf._plans.get(key)
            kept = [handle.row_expert, handle.source_row, handle.counts, handle.position, handle.dest, handle.slot,
                    handle.expert_slot, recv_w]
            then = [t.clone() for t in kept]
        assert len(buf._plans) == plans and buf._plans.get(key) is plan, "plan not reused"
        assert len(ts.group_state().allocations) == allocations, "the buffer allocated again"
    assert all(map(torch.equal, kept, then)), "a later call overwrote an earlier handle's outputs"
    for what, call in (("25 tokens", lambda: buf.dispatch(torch.randn(25, hidden).to(torch.bfloat16),
                                                          torch.zeros(25, 2, dtype=torch.long), torch.ones(25, 2))),
                       ("top-1", lambda: buf.dispatch(torch.randn(4, hidden).to(torch.bfloat16),
                                                      torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1)))):
        try:
            call()
            raise AssertionError(f"rank {rank}: {what}: no error")
        except ValueError as err:
            assert "do not fit Buffer(max_tokens=24" in str(err), err
    buf.release()
    assert len(ts.group_state().allocations) < allocations, "release() kept the buffers"
    try:
        buf.dispatch(x, topk_idx, topk_w)
        raise AssertionError(f"rank {rank}: a released buffer dispatched")
    except RuntimeError as err:
        assert "is released" in str(err), err
    # in_place=False: one set of receive rows (half the memory); dispatches that group work, an
    # in-place one is refused.
    one_set = ts.ops.moe.Buffer(None, max_tokens=24, hidden=hidden, topk=2, num_experts=num_experts, in_place=False)
    assert one_set._rows_in[(hidden, torch.bfloat16)].shape[0] == 1
    for _ in range(3):  # consecutive calls reuse the one set
        x = torch.randn(11 + rank, hidden).to(torch.bfloat16)
        topk_w, topk_idx = torch.rand(11 + rank, num_experts).topk(2, dim=1)
        recv_x, recv_w, counts, handle = one_set.dispatch(x, topk_idx, topk_w)
        y = one_set.combine(recv_x, recv_w, handle)  # identity experts
        assert_close(y.float(), x.float() * topk_w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    try:
        one_set.dispatch(x, topk_idx, topk_w, in_place=True)
        raise AssertionError(f"rank {rank}: an in-place dispatch through one set of receive rows")
    except ValueError as err:
        assert "in place needs a buffer with two sets" in str(err), err
    one_set.release()
    # Kernels take the token count at run time: once a count of each routing class (a decode batch;
    # chunks of 32 tokens) has built them, every other count, on any rank, in either mode, builds
    # none, each call right for its own tokens. Ranks pass different counts at every step.
    wide = ts.ops.moe.Buffer(None, max_tokens=200, hidden=hidden, topk=2, num_experts=num_experts)
    moe = ts.ops.moe
    factories = (moe.route_count_kernel, moe.route_finish_kernel, moe.dispatch_kernel, moe.combine_kernel)
    for step, tokens in enumerate((5, 129, 77 + rank, 0, 200 - rank, 1, 150 + 7 * rank, 128 + rank)):
        if step == 2:  # both routing classes, both modes built
            built = [len(f._compiled) for f in factories]
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        topk_w, topk_idx = torch.rand(tokens, num_experts).topk(2, dim=1)
        recv_x, recv_w, counts, handle = wide.dispatch(x, topk_idx, topk_w, low_latency=step % 2 == 1)
        combine_and_check(f"any count {tokens}", x, topk_idx, topk_w, recv_x, recv_w, counts, handle)
    assert [len(f._compiled) for f in factories] == built, ("a new token count built kernels", built)
    wide.release()
    print(f"rank {rank}: BUFFER-OK", flush=True)


# Dispatches back to back through one buffer, nothing between them that waits for the other
# ranks (each mode's first call, which checks on the host that the ranks agree, comes before):
# a rank with few tokens may run a call ahead of one with many, writing the other set of its
# receive buffers while that one still reads its set. Every call's rows, counts and combine are
# right, checked after all of them.
def routed_batch(call: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=ts.device()).manual_seed(1000 + 10 * call + rank)
    x = torch.randn(3 if rank == 0 else 23, hidden, generator=g).to(torch.bfloat16)
    topk_w, topk_idx = torch.rand(x.shape[0], num_experts, generator=g).topk(2, dim=1)
    return x, topk_idx, topk_w


def back_to_back() -> None:
    modes = (False, True, False, False, True, True, False)
    for low_latency in (False, True):
        x, topk_idx, topk_w = routed_batch(-1)
        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts,
                                                             low_latency=low_latency, max_tokens=23)
        combine_and_check("first of its mode", x, topk_idx, topk_w, recv_x, recv_w, counts, handle)
    calls = []
    for call, low_latency in enumerate(modes):
        batch = routed_batch(call)
        calls.append((*batch, *ts.ops.moe_dispatch(*batch, num_experts, low_latency=low_latency, max_tokens=23)))
    for call, (x, topk_idx, topk_w, recv_x, recv_w, counts, handle) in enumerate(calls):
        combine_and_check(f"back to back {call}", x, topk_idx, topk_w, recv_x, recv_w, counts, handle)
    print(f"rank {rank}: {len(calls)} dispatches back to back: MOE-OK", flush=True)


def reference_cases() -> None:
    """``cases``: topk 1, 2 and 8, skewed routing, both modes, uneven counts, long rows."""
    for case, (tokens, topk, low_latency, max_tokens, *row) in enumerate(cases):
        tokens = uneven(max_tokens) if max_tokens else tokens
        g = torch.Generator(device=ts.device()).manual_seed(100 * case + rank)
        x = torch.randn(tokens, row[0] if row else hidden, generator=g).to(torch.bfloat16)
        scores = torch.rand(tokens, num_experts, generator=g)
        if case == 3:  # skewed: every token goes to rank 0's experts only; other ranks receive nothing
            scores[:, per_rank:] = -1
        topk_w, topk_idx = scores.topk(topk, dim=1)
        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, low_latency=low_latency,
                                                             max_tokens=max_tokens)

        combine_and_check(case, x, topk_idx, topk_w, recv_x, recv_w, counts, handle)
        mode = ("low-latency" if low_latency else "normal") + (", uneven" if max_tokens else "")
        print(f"rank {rank}: case {case} ({mode}) tokens={tokens} topk={topk} received {int(counts.sum())} "
              "rows: MOE-OK", flush=True)


# Entries of id -1 name no expert (DeepEP's masked entries: dropped or padding tokens): not
# sent for, not an error; a token with no other entry goes nowhere and combines to zeros.
def masked() -> None:
    for low_latency in (False, True):
        g = torch.Generator(device=ts.device()).manual_seed(500 + rank)
        x = torch.randn(15, hidden, generator=g).to(torch.bfloat16)
        topk_w, topk_idx = torch.rand(15, num_experts, generator=g).topk(4, dim=1)
        topk_idx[::3, 1] = -1
        topk_idx[4] = -1  # every entry masked
        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, low_latency=low_latency)
        combine_and_check(f"masked, low_latency={low_latency}", x, topk_idx, topk_w, recv_x, recv_w, counts, handle)
        # in place: the rows as they landed, gathered through the index into the grouped order
        recv, recv_w, _, h = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, low_latency=low_latency,
                                                 in_place=True)
        assert torch.equal(h.position, handle.position) and torch.equal(h.row_expert, handle.row_expert)
        rows = h.source_row.long()
        grouped = torch.where((rows >= 0)[:, None], recv[rows.clamp(min=0)].float(), 0.0)
        scale = (rank * per_rank + torch.arange(per_rank) + 1).float()
        y = ts.ops.moe_combine((grouped * scale[h.row_expert.long()][:, None]).to(torch.bfloat16), recv_w, h)
        assert_close(y.float(), (x.float()[:, None, :] * (topk_w * (topk_idx + 1).float())[:, :, None]).sum(1),
                     rtol=3e-2, atol=3e-2)
        print(f"rank {rank}: masked entries, low_latency={low_latency}: MASKED-OK", flush=True)


# A handle still held keeps its own outputs, unchanged by the dispatches after it (each call's
# are new: one allocation for its small ones, tilescale.op_launch.Output(packed=True)).
def checked_step(call: int, low_latency: bool) -> None:
    x, topk_idx, topk_w = routed_batch(100 + call)
    recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, low_latency=low_latency,
                                                         max_tokens=23)
    combine_and_check(f"step {call}", x, topk_idx, topk_w, recv_x, recv_w, counts, handle)


def held_handles() -> None:
    for low_latency in (False, True):
        x, topk_idx, topk_w = routed_batch(99)
        held = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, low_latency=low_latency, max_tokens=23)
        kept = [t.clone() for t in (held[3].position, held[3].source_row, held[2], held[1])]
        for call in range(4):
            checked_step(call, low_latency)
        for got, want in zip((held[3].position, held[3].source_row, held[2], held[1]), kept, strict=True):
            assert torch.equal(got, want), "a held handle's outputs changed"
        combine_and_check("held through later steps", x, topk_idx, topk_w, *held)
        print(f"rank {rank}: a held handle through later steps ({'low-latency' if low_latency else 'normal'}): MOE-OK",
              flush=True)
        del held


def graphs() -> None:
    """A dispatch + combine step captured once, replayed on new tokens (GPUs)."""
    if ts.device().type != "cuda":  # the CPU path captures nothing
        return

    def step(x, topk_idx, topk_w, low_latency, in_place):  # noqa: ANN001, ANN202 - identity experts
        recv_x, recv_w, _, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, low_latency=low_latency,
                                                        max_tokens=21, in_place=in_place)
        if in_place:  # the rows gathered into grouped rows, as a grouped GEMM reads them
            recv_x = recv_x[handle.source_row.clamp(min=0).long()]
        return ts.ops.moe_combine(recv_x, recv_w, handle)

    for low_latency, in_place in ((False, False), (True, False), (False, True), (True, True)):
        tokens, topk = 21 if rank == 0 else 5, 2  # different counts per rank, up to 21
        x = torch.randn(tokens, hidden).to(torch.bfloat16)
        topk_w, topk_idx = torch.rand(tokens, num_experts).topk(topk, dim=1)
        step(x, topk_idx, topk_w, low_latency, in_place)  # builds the kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step(x, topk_idx, topk_w, low_latency, in_place)
        for _ in range(3):  # each replay alternates the buffer sets on the device
            x.copy_(torch.randn(tokens, hidden))
            graph.replay()
            assert_close(y.float(), x.float() * topk_w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
        mode = ("low-latency" if low_latency else "normal") + (", in place" if in_place else "")
        print(f"rank {rank}: CUDA graph ({mode}), 3 replays: MOE-OK", flush=True)


# FP8 dispatch (DeepEP's layout) against the bf16 path, counts differing per rank: the same
# routes and grouping; each row arrives as exactly its quantised values and scales, within
# e4m3's precision of the bf16 row; the bf16 combine and the grouped GEMM consume them.
moe = ts.ops.moe
fp8_hidden, ffn = 256, 64


def routed(low_latency: bool) -> tuple:
    """Uneven counts of random bf16 rows, their top-2 routes and their (grouped) bf16 dispatch."""
    tokens = uneven(16)
    x = (torch.randn(tokens, fp8_hidden) * 3).to(torch.bfloat16)
    topk_w, topk_idx = torch.rand(tokens, num_experts).topk(2, dim=1)
    return tokens, x, topk_w, topk_idx, ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, low_latency=low_latency,
                                                            max_tokens=16)



def fp8() -> None:
    for low_latency in (False, True):
        tokens, x, topk_w, topk_idx, (ref_x, ref_w, ref_counts, ref) = routed(low_latency)
        (values, scales), recv_w, counts, h = ts.ops.moe_dispatch(moe.quantize_fp8(x), topk_idx, topk_w, num_experts,
                                                                  low_latency=low_latency, max_tokens=16)
        assert values.dtype == torch.float8_e4m3fn and tuple(scales.shape) == (values.shape[0], fp8_hidden // 128)
        assert moe.fp8.marked_rows((values, scales)) is not None  # marked in the layout its views have: no pack copy
        valid = h.row_expert >= 0
        assert torch.equal(h.row_expert, ref.row_expert) and torch.equal(counts, ref_counts), low_latency
        assert torch.equal(recv_w, ref_w) and torch.equal(h.source_row, ref.source_row), low_latency
        got = moe.dequantize_fp8(values[valid], scales[valid])
        assert torch.equal(got, moe.dequantize_fp8(*moe.quantize_fp8(ref_x[valid]))), low_latency
        # quantize_fp8's pair is views of the rows the dispatch moves; separate tensors are packed first: same rows
        separate = tuple(t.contiguous() for t in moe.quantize_fp8(x))
        (values2, scales2), _, _, h2 = ts.ops.moe_dispatch(separate, topk_idx, topk_w, num_experts,
                                                           low_latency=low_latency, max_tokens=16)
        assert torch.equal(h2.row_expert, h.row_expert) and torch.equal(scales2[valid], scales[valid]), low_latency
        assert torch.equal(values2[valid].view(torch.uint8), values[valid].view(torch.uint8)), low_latency
        error = (got.float() - ref_x[valid].float()).norm() / ref_x[valid].float().norm().clamp(min=1e-6)
        assert error < 0.04, float(error)  # e4m3: 3 mantissa bits
        y = ts.ops.moe_combine(moe.dequantize_fp8(values, scales), recv_w, h)  # bf16 back
        y_ref = ts.ops.moe_combine(ref_x, ref_w, ref)
        assert (y.float() - y_ref.float()).norm() <= 0.04 * y_ref.float().norm() + 1e-3, low_latency
        w = (torch.randn(per_rank, ffn, fp8_hidden) / 16).to(torch.bfloat16)
        out = ts.ops.grouped_gemm(values, w, h.row_expert, scales=scales)[valid].float()
        out_ref = ts.ops.grouped_gemm(ref_x, w, ref.row_expert)[valid].float()
        assert (out - out_ref).norm() <= 0.05 * out_ref.norm() + 1e-3, low_latency
        mode = "low-latency" if low_latency else "normal"
        print(f"rank {rank}: FP8 ({mode}) tokens={tokens} error {float(error):.4f}: FP8-OK", flush=True)


def gemms() -> None:
    # The gathered GEMM alone, against torch: any index into any rows (-1: a row of no token, left
    # out), K = 40 (a partial K step: the guarded loads), two experts' 128-row tiles and a tile of none.
    g = torch.Generator(device=ts.device()).manual_seed(900 + rank)
    rows_x = torch.randn(50, 40, generator=g).to(torch.bfloat16)
    index = torch.randint(-1, 50, (384,), generator=g, dtype=torch.int32)
    tile_expert = torch.tensor([1, -1, 0], dtype=torch.int32).repeat_interleave(128)
    w_small = (torch.randn(2, 24, 40, generator=g) / 8).to(torch.bfloat16)
    got = ts.ops.grouped_gemm(rows_x, w_small, tile_expert, index=index)
    kept = (index >= 0) & (tile_expert >= 0)
    want = torch.einsum("rk,rnk->rn", rows_x[index.clamp(min=0).long()].float(),
                        w_small[tile_expert.clamp(min=0).long()].float())
    assert_close(got[kept].float(), want[kept], rtol=2e-2, atol=2e-2)

    # Grouped FP8 rows whose K makes TMA boxes (a multiple of 512): values and scales arrive by TMA
    # and are scaled in the pipeline; the result is the bf16 GEMM of the dequantised rows.
    rows8 = (torch.randn(384, 512, generator=g) * 2).to(torch.bfloat16)
    values8, scales8 = moe.quantize_fp8(rows8)
    w8 = (torch.randn(2, 40, 512, generator=g) / 16).to(torch.bfloat16)
    got = ts.ops.grouped_gemm(values8, w8, tile_expert, scales=scales8)
    want = ts.ops.grouped_gemm(moe.dequantize_fp8(values8, scales8), w8, tile_expert)
    assert_close(got[tile_expert >= 0].float(), want[tile_expert >= 0].float(), rtol=1e-2, atol=1e-2)
    # Few rows per expert (rows_per_expert <= 64): 64-row tiles, grouped and gathered. Expert 0's
    # 40 rows leave the second half of its segment all padding (that tile is skipped); expert 1's
    # 100 rows fill one half and part of the other.
    seg_expert = torch.tensor([0] * 40 + [-1] * 88 + [1] * 100 + [-1] * 28, dtype=torch.int32)
    seg_x = torch.randn(256, 40, generator=g).to(torch.bfloat16)
    held = seg_expert >= 0
    seg_index = torch.where(held, torch.randint(0, 50, (256,), generator=g, dtype=torch.int32), -1).to(torch.int32)
    for rows, index in ((seg_x, None), (rows_x, seg_index)):
        a = rows if index is None else rows[index.clamp(min=0).long()]
        want = torch.einsum("rk,rnk->rn", a.float(), w_small[seg_expert.clamp(min=0).long()].float())
        for hint in (16.0, None):
            got = ts.ops.grouped_gemm(rows, w_small, seg_expert, index=index, rows_per_expert=hint)
            assert_close(got[held].float(), want[held], rtol=2e-2, atol=2e-2)
    print(f"rank {rank}: grouped FP8 GEMM by TMA, 64-row tiles for few rows per expert: MOE-OK", flush=True)


def in_place() -> None:
    # In place: the received rows stay where they land. The layout (experts, counts, weights) is
    # the grouped dispatch's, row source_row[i] of recv_x is grouped row i, the grouped GEMM
    # gathering through that index (bf16, and FP8 dequantised as it loads) gives the grouped
    # GEMM's rows, and the combine takes its outputs. Two calls in a row write the two sets.
    for low_latency in (False, True):
        tokens, x, topk_w, topk_idx, (ref_x, ref_w, ref_counts, ref) = routed(low_latency)
        valid = ref.row_expert >= 0
        w = (torch.randn(per_rank, ffn, fp8_hidden) / 16).to(torch.bfloat16)
        out_ref = ts.ops.grouped_gemm(ref_x, w, ref.row_expert)
        y_ref = ts.ops.moe_combine(out_ref, ref_w, ref)
        out8_ref = ts.ops.grouped_gemm(moe.dequantize_fp8(*moe.quantize_fp8(ref_x)), w, ref.row_expert)
        bases, handles = [], []
        for _ in range(2):
            recv, recv_w, counts, h = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, low_latency=low_latency,
                                                          max_tokens=16, in_place=True)
            handles.append(h)
            assert tuple(recv.shape) == (2 * world * 16, fp8_hidden), tuple(recv.shape)
            assert torch.equal(h.row_expert, ref.row_expert) and torch.equal(counts, ref_counts), low_latency
            assert torch.equal(recv_w, ref_w) and torch.equal(h.position, ref.position), low_latency
            assert torch.equal(h.source_row >= 0, valid) and torch.equal(recv[h.source_row[valid].long()], ref_x[valid])
            bases.append({int(b) for b in (h.source_row[valid] - ref.source_row[valid]).unique()})
            out = ts.ops.grouped_gemm(recv, w, h.row_expert, index=h.source_row)
            assert_close(out[valid].float(), out_ref[valid].float(), rtol=1e-2, atol=1e-2)
            y = ts.ops.moe_combine(out, recv_w, h)
            assert_close(y.float(), y_ref.float(), rtol=1e-2, atol=1e-2)
            (values, scales), _, _, h8 = ts.ops.moe_dispatch(moe.quantize_fp8(x), topk_idx, topk_w, num_experts,
                                                             low_latency=low_latency, max_tokens=16, in_place=True)
            out8 = ts.ops.grouped_gemm(values, w, h8.row_expert, scales=scales, index=h8.source_row)
            assert_close(out8[valid].float(), out8_ref[valid].float(), rtol=1e-2, atol=1e-2)
        if bool(valid.any()):  # each call's rows in one set, consecutive calls in the two sets
            assert len(bases[0]) == len(bases[1]) == 1 and bases[0] | bases[1] == {0, world * 16}, bases
        try:  # the first call's rows after the second dispatch through the same buffer: refused
            ts.ops.grouped_gemm(recv, w, handles[0].row_expert, index=handles[0].source_row)
            raise AssertionError("grouped_gemm took the rows of an earlier in-place dispatch")
        except RuntimeError as e:
            assert "no longer valid: 1 later dispatch(es)" in str(e), e
        for bad in (h.source_row.long(), h.source_row[:-128]):  # the index: int32, one per output row
            try:
                ts.ops.grouped_gemm(recv, w, h.row_expert, index=bad)
                raise AssertionError("grouped_gemm took a bad index")
            except ValueError as e:
                assert "index must be" in str(e), e
        mode = "low-latency" if low_latency else "normal"
        print(f"rank {rank}: in place ({mode}) tokens={tokens}: INPLACE-OK", flush=True)


def fp8_layer() -> None:
    # The layer with FP8 dispatch (inference): within e4m3's precision of the same layer's bf16
    # forward; with a gradient to record it refuses rather than train on another path.
    layers = {fp8: ts.nn.ExpertParallelMoE(fp8_hidden, ffn, num_experts, 2, seed=21, max_tokens=16, fp8_dispatch=fp8)
              for fp8 in (False, True)}
    x = torch.randn(uneven(16), fp8_hidden).to(torch.bfloat16)
    for in_place in (True, False):  # FP8 rows dispatched in place (gathered by the first GEMM), then grouped
        with moe_dispatch_in_place(in_place), torch.no_grad():
            y, y8 = layers[False](x).float(), layers[True](x).float()
        error = float((y8 - y).norm() / y.norm().clamp(min=1e-6)) if y.numel() else 0.0
        assert error < 0.05, (in_place, error)
    try:
        layers[True](x.requires_grad_())
        raise AssertionError("an FP8-dispatch layer recorded a gradient")
    except RuntimeError as e:
        assert "is for inference" in str(e), e
    print(f"rank {rank}: layer with FP8 dispatch, error {error:.4f} against bf16: FP8-LAYER-OK", flush=True)


def errors() -> None:
    """A bad expert id; ranks disagreeing on the mode."""
    try:
        ts.ops.moe_dispatch(torch.randn(4, hidden), torch.full((4, 1), num_experts), torch.ones(4, 1), num_experts)
    except ValueError as err:
        print(f"rank {rank}: ValueError: {err}", flush=True)
    if world > 1:  # the ranks' dispatch kernels follow one plan: one rank alone in low-latency mode is refused
        try:
            ts.ops.moe_dispatch(torch.randn(6, hidden), torch.zeros(6, 1, dtype=torch.long), torch.ones(6, 1),
                                num_experts, low_latency=rank == 0)
        except ValueError as err:
            print(f"rank {rank}: MODE-MISMATCH {err}", flush=True)


# Sections by name, all by default (the module docstring).
named = {"back-to-back": back_to_back, "cases": reference_cases, "masked": masked, "held": held_handles,
         "graphs": graphs, "fp8": fp8, "gemms": gemms, "in-place": in_place, "fp8-layer": fp8_layer,
         "buffers": explicit_buffers, "errors": errors}
for name in sys.argv[1:] or list(named):
    named[name]()
ts.finalize()
