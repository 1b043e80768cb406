"""MoE dispatch/combine: CPU path with 2, 3 and 4 ranks against references; CUDA lowering and nvcc."""

import importlib
import re
import textwrap

import pytest
from cpu_jobs import run_cpu, run_python
from cuda_build import lower_cuda, needs_nvcc, nvcc

from tilescale.language import build_options
from tilescale.ops import moe
from tilescale.tir_fixes import coherent_reads


@pytest.mark.timeout(500)
# 1 rank: all 8 of a token's entries local (the combine sums them four rows at a time, in two
# loads); 6: more ranks than rows the combine loads at once.
@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_dispatch_combine_match_reference(n):
    # Six ranks on a two-core host took 286-307 s (2026-11-29): more time than one rank per core.
    proc = run_cpu("tests/ranks/moe_check.py", n, timeout=280 if n < 6 else 480)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # topk 1/2/8, skewed routing, low-latency mode, different counts per rank in both modes; every rank
    assert proc.stdout.count("MOE-OK") == 15 * n
    assert proc.stdout.count("uneven) tokens=0 ") == 2 and proc.stdout.count("uneven) tokens=") == 2 * n
    assert proc.stdout.count("(normal) tokens=11 topk=2 received 0 rows: MOE-OK") == n - 1  # skewed: only rank 0
    assert proc.stdout.count("FP8-OK") == 2 * n  # FP8 dispatch against the bf16 path, both modes
    assert proc.stdout.count("BUFFER-OK") == n  # reused for any count that fits, refused past it, released
    assert proc.stdout.count("INPLACE-OK") == 2 * n  # in place: gathered GEMMs (bf16, FP8), combine, two sets
    assert proc.stdout.count("FP8-LAYER-OK") == n  # ExpertParallelMoE(fp8_dispatch=True) against bf16
    assert proc.stdout.count("MASKED-OK") == 2 * n  # -1 ids name no expert (DeepEP's masked entries), both modes
    # an out-of-range expert id is a ValueError naming the rank and the ids
    experts = max(4, 8 // n) * n  # as moe_check.py spreads them
    for r in range(n):
        assert (f"rank {r}: ValueError: moe_dispatch: rank {r}: expert ids must be in [0, {experts}) or -1 (no "
                f"expert); got") in proc.stdout
    if n > 1:  # ranks that disagree on the mode
        assert proc.stdout.count("MODE-MISMATCH moe_dispatch: shapes differ across ranks") == n
        assert "'low_latency=True'" in proc.stdout and "'low_latency=False'" in proc.stdout


@pytest.mark.timeout(200)
def test_quantized_rows_are_the_dispatch_layout(tmp_path):
    # quantize_fp8 (one kernel) writes values and scales into one byte row per token (DeepEP's
    # layout, as the dispatch moves it), so the dispatch takes them without the packing copy;
    # the numbers are the bits of the torch expression (values / scale to e4m3, scale = block
    # amax / 448, a block of zeros the floor scale), and separate tensors of the same numbers
    # pack into the same bytes.
    script = tmp_path / "quantize.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        from tilescale.ops import moe

        ts.init(device="cpu")
        g = torch.Generator().manual_seed(7)
        # rows past one block's 32 and not a multiple of them; fp16 and float32 rows too
        for tokens, hidden, dtype in [(37, 384, torch.bfloat16), (5, 128, torch.float16), (64, 256, torch.float32)]:
            x = (torch.randn(tokens, hidden, generator=g) * 3).to(dtype)
            x[min(5, tokens - 1), :128] = 0
            values, scales = moe.quantize_fp8(x)
            blocks = x.float().view(tokens, hidden // 128, 128)
            want_scales = blocks.abs().amax(-1).clamp(min=1e-4) / moe.fp8.E4M3_MAX
            want_values = (blocks / want_scales[..., None]).view(tokens, hidden).to(torch.float8_e4m3fn)
            assert torch.equal(scales, want_scales), (tokens, hidden, dtype)
            assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)), (tokens, hidden, dtype)
            rows = moe.fp8.pack((values, scales))
            assert rows.data_ptr() == values.data_ptr() and rows.is_contiguous()  # the views' own bytes: no copy
            assert tuple(rows.shape) == (tokens, moe.fp8.packed_width(hidden))
            assert torch.equal(moe.fp8.pack((values.contiguous(), scales.contiguous())), rows)
            assert moe.fp8.pack((values, scales)) is rows  # unpack's pair: its rows at once
            assert moe.fp8.marked_rows((values, scales)) is rows  # what a direct dispatch sends
            # the layout a dispatch marks its grouped pair with, known before its views are made
            assert moe.fp8.pair_layout(tokens, hidden) == moe.fp8._layout(values, scales)
            assert moe.fp8.marked_rows((values.contiguous(), scales.contiguous())) is None
            reshaped, reshaped_scales = moe.quantize_fp8(x)
            reshaped.t_()  # no longer the layout unpack made: checked (and refused) as any other pair
            assert moe.fp8.marked_rows((reshaped, reshaped_scales)) is None
            try:
                moe.fp8.pack((reshaped, reshaped_scales))
                raise AssertionError("a transposed FP8 pair was packed")
            except ValueError as err:
                assert "FP8 scales must be" in str(err)
            other_values, other_scales = moe.quantize_fp8(x * 2)
            mixed = moe.fp8.pack((values, other_scales))  # views of two sets of rows: packed by copy
            assert mixed.data_ptr() not in (rows.data_ptr(), other_values.data_ptr())
            assert torch.equal(mixed[:, :hidden], rows[:, :hidden])
            assert torch.equal(mixed[:, hidden:], moe.fp8.pack((other_values, other_scales))[:, hidden:])
            assert torch.equal(moe.dequantize_fp8(values, scales), moe.dequantize_fp8(want_values, want_scales))
            # DeepEP's round_scale: each scale rounded up to a power of two, the values divided by it
            values, scales = moe.quantize_fp8(x, round_scale=True)
            pow2 = torch.exp2(torch.ceil(torch.log2(want_scales)))
            assert torch.equal(scales, pow2) and bool((torch.frexp(scales).mantissa == 0.5).all()), (tokens, hidden)
            assert bool((scales >= want_scales).all() and (scales < 2 * want_scales).all())
            want_values = (blocks / pow2[..., None]).view(tokens, hidden).to(torch.float8_e4m3fn)
            assert torch.equal(values.view(torch.uint8), want_values.view(torch.uint8)), (tokens, hidden, dtype)
        empty, empty_scales = moe.quantize_fp8(torch.empty(0, 256, dtype=torch.bfloat16))
        assert empty.shape == (0, 256) and empty_scales.shape == (0, 2)
        print("QUANTIZE-OK")
        ts.finalize()
    """))
    proc = run_python(script)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "QUANTIZE-OK" in proc.stdout


@pytest.mark.timeout(300)
def test_a_withdrawn_id_check_is_neither_read_nor_raised(tmp_path):
    # A direct dispatch queues its id check before the call; a call that goes nowhere withdraws it,
    # else the check (whose word no kernel would store) would hold back every later one.
    script = tmp_path / "withdraw.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts
        from tilescale.ops.moe import routing

        ts.init(device="cpu")
        bad = torch.full((2, 2), 99)
        routing.watch_ids(bad, 8, bad=torch.tensor([3], dtype=torch.int32))
        routing.withdraw_watch()
        assert not routing._id_checks
        routing.raise_bad_ids()  # nothing withdrawn is raised
        routing.watch_ids(bad, 8, bad=torch.tensor([3], dtype=torch.int32))
        try:
            routing.raise_bad_ids()
            raise AssertionError("a queued bad-id check was not raised")
        except ValueError as err:
            assert "expert ids must be in" in str(err)
        print("WITHDRAW-OK")
        ts.finalize()
    """))
    proc = run_python(script, timeout=200)
    assert "WITHDRAW-OK" in proc.stdout, proc.stdout + proc.stderr


def test_dispatches_back_to_back_under_scheduling_jitter():
    # Blocks sleep up to 50 ms after each signal (TILESCALE_CPU_JITTER_S), so a rank runs calls
    # ahead of its peers as a GPU's schedule lets it. With the two sets of receive buffers merged
    # into one, this failed 4 runs in 4 (wrong rows, or a flag lost and a wait timing out); 2
    # ranks met that window in 1 run of 3 with the jitter, 0 of 6 without.
    proc = run_cpu("tests/ranks/moe_check.py", 3, env={"TILESCALE_CPU_JITTER_S": "0.05"}, args=("back-to-back",))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("dispatches back to back: MOE-OK") == 3


def test_the_explicit_buffer_section_runs_alone():
    # GPU runs short of time check it alone (moe_check.py buffers); the full run reaches it last.
    proc = run_cpu("tests/ranks/moe_check.py", 2, args=("buffers",))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("BUFFER-OK") == 2 and "MOE-OK" not in proc.stdout, proc.stdout[-2000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_moe_layer_gradients_match_autograd(n):
    proc = run_cpu("tests/ranks/moe_backward_check.py", n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # input, router, both expert weights, every rank; the same counts, then rank 0 none and the last rank 24
    assert proc.stdout.count("MOE-GRAD-OK") == 2 * n


# Entry by entry: the routing kernel over several scan chunks (with repeated and out-of-range
# ids), each grouped row's source, weight, data and order, and a bad id reported by the call
# that passed it while the exchange still ran on every rank.
LAYOUT_CHECK = textwrap.dedent("""
    import torch
    import torch.distributed as dist

    import tilescale as ts
    from tilescale.ops import moe

    ts.init()
    torch.set_default_device(ts.device())
    rank, world = ts.rank(), ts.world_size()
    per_rank, topk, hidden = 3, 3, 24
    num_experts = per_rank * world


    def draw(tokens, seed):
        g = torch.Generator(device=ts.device()).manual_seed(seed)
        idx = torch.randint(0, num_experts, (tokens, topk), generator=g)  # ids may repeat within a token
        return idx, torch.rand(tokens, topk, generator=g), torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)


    def slots(idx, d):  # the slot of each token at rank d, -1 if it does not go there
        goes = ((idx >= d * per_rank) & (idx < (d + 1) * per_rank)).any(1)
        return torch.where(goes, goes.int().cumsum(0) - 1, -1)


    i32 = dict(dtype=torch.int32)
    # Past MAX_CHUNKS chunks (64-token chunks, each block summing 64 earlier ones), a few chunks,
    # and a decode batch: one chunk, its bins (302 + world) in ten groups of blocks.
    for tokens, experts_here in ((moe.routing.CHUNK_TOKENS * moe.routing.MAX_CHUNKS + 37, num_experts),
                                 (150, num_experts), (100, 302 // world * world)):
        g = torch.Generator(device=ts.device()).manual_seed(7 + rank)
        idx = torch.randint(0, experts_here, (tokens, topk), generator=g)  # ids may repeat within a token
        idx[::97, 1] = idx[::97, 0]
        # int64 ids, read as passed: three out of range (-5 too), and -1, which names no expert (no error)
        idx[3, 2], idx[4, 0], idx[tokens - 1, 0], idx[5, 1] = -1, -5, experts_here, 2**32 + 1
        route = moe.router(world, tokens, topk, experts_here, "int64")
        dest, slot = torch.empty(world, tokens, **i32), torch.empty(world, tokens, **i32)
        send_counts, expert_slot = torch.empty(world, **i32), torch.empty(tokens, topk, **i32)
        expert_counts, bad = torch.empty(experts_here, **i32), torch.empty(1, **i32)
        ids = torch.empty(tokens, topk, **i32)
        counts = torch.empty(moe.chunk_counts_shape(world, tokens, experts_here), **i32)
        route(idx, dest, slot, send_counts, expert_slot, expert_counts, bad, ids, counts, 0)
        flat, valid = idx.flatten(), (idx.flatten() >= 0) & (idx.flatten() < experts_here)
        assert torch.equal(ids.flatten().long(), torch.where(valid, flat, -1))  # what the dispatch sends
        order = torch.full_like(flat, -1)
        for e in range(experts_here):
            hits = (flat == e).nonzero()[:, 0]
            order[hits] = torch.arange(len(hits))
        assert torch.equal(expert_slot.flatten().long(), order), tokens  # -1 for ids out of range and -1
        assert torch.equal(expert_counts.long(), torch.bincount(flat[valid], minlength=experts_here))
        assert int(bad[0]) == 3
        per = experts_here // world
        for d in range(world):
            goes = ((idx >= d * per) & (idx < (d + 1) * per)).any(1)
            want = torch.where(goes, goes.int().cumsum(0) - 1, -1)
            assert torch.equal(slot[d].long(), want), (tokens, d)
            assert torch.equal(dest[d].long(), torch.where(goes, d, -1)), (tokens, d)
            assert int(send_counts[d]) == int(goes.sum())
    print(f"rank {rank}: ROUTE-OK", flush=True)

    # The same layout whether rows are announced in groups or one by one, and whether the
    # routing kernels run first or (a decode batch) the dispatch kernel routes its own tokens.
    for tokens, low_latency in ((150, False), (150, True), (100, True)):
        idx, w, x = draw(tokens, 100 + rank)
        idx[::5, 1] = idx[::5, 0]  # a token naming an expert twice has two entries, two grouped rows
        recv_x, recv_w, counts, h = ts.ops.moe_dispatch(x, idx, w, num_experts, low_latency=low_latency)
        everyone = [None] * world
        dist.all_gather_object(everyone, (idx.cpu(), w.cpu(), x.cpu()))
        end = 0
        for e in range(per_rank):
            # Entries of local expert e in (source, token, k) order, each one grouped row.
            entries = [(src, t, k) for src, (i, _, _) in enumerate(everyone) for t in range(tokens) for k in range(topk)
                       if int(i[t, k]) == rank * per_rank + e]
            start = int(h.offsets[e])
            assert start == end and int(counts[e]) == len(entries), (e, start, end, int(counts[e]), len(entries))
            for n, (src, t, k) in enumerate(entries):
                p, s = start + n, int(slots(everyone[src][0], rank)[t])
                assert int(h.source_row[p]) == src * tokens + s and int(h.position[src * tokens + s, k]) == p, (e, n)
                assert int(h.row_expert[p]) == e and float(recv_w[p]) == float(everyone[src][1][t, k]), (e, n)
                assert torch.equal(recv_x[p].cpu(), everyone[src][2][t]), (e, n)
            end = start + -(-len(entries) // 128) * 128
            assert bool((h.row_expert[start + len(entries):end] == -1).all())
            assert bool((h.source_row[start + len(entries):end] == -1).all())
            assert bool((recv_w[start + len(entries):end] == 0).all())
        assert bool((h.row_expert[end:] == -1).all()) and bool((h.source_row[end:] == -1).all())
        assert bool((recv_w[end:] == 0).all()) and int((h.position >= 0).sum()) == int(counts.sum())
        # Identity experts: each token times its weights' sum, whichever buffer set each call used.
        for _ in range(3):
            y = ts.ops.moe_combine(recv_x, recv_w, h)
            torch.testing.assert_close(y.float(), x.float() * w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
        print(f"rank {rank}: LAYOUT-OK", flush=True)

    for tokens, low_latency in ((150, False), (100, True)):  # counted by the routing kernels, by the dispatch's
        idx, w, x = draw(tokens, 200 + rank)
        if rank == 0:
            idx[5, 1] = -3
        try:
            ts.ops.moe_dispatch(x, idx, w, num_experts, low_latency=low_latency)
            print(f"rank {rank}: no error", flush=True)
        except ValueError as err:
            print(f"rank {rank}: ValueError: {err}", flush=True)
    idx[5, 1] = 0
    recv_x, recv_w, counts, h = ts.ops.moe_dispatch(x, idx, w, num_experts, low_latency=True)
    y = ts.ops.moe_combine(recv_x, recv_w, h)
    torch.testing.assert_close(y.float(), x.float() * w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    print(f"rank {rank}: RECOVERED-OK", flush=True)

    # Handles stay valid whatever came after: three dispatches (through both buffer sets and
    # back), then their combines out of order, each answering with its own tokens.
    steps = [draw(tokens, 300 + 10 * i + rank) for i in range(3)]
    handles = [ts.ops.moe_dispatch(x, idx, w, num_experts, low_latency=i == 1) for i, (idx, w, x) in enumerate(steps)]
    for i in (2, 0, 1):
        (idx, w, x), (recv_x, recv_w, _, h) = steps[i], handles[i]
        y = ts.ops.moe_combine(recv_x, recv_w, h)
        torch.testing.assert_close(y.float(), x.float() * w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    print(f"rank {rank}: OUT-OF-ORDER-OK", flush=True)
    ts.finalize()
""")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 3])
def test_grouped_layout_entry_by_entry(n, tmp_path):
    program = tmp_path / "layout_check.py"
    program.write_text(LAYOUT_CHECK)
    proc = run_cpu(str(program), n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for marker, times in (("ROUTE-OK", 1), ("LAYOUT-OK", 3), ("RECOVERED-OK", 1), ("OUT-OF-ORDER-OK", 1)):
        assert proc.stdout.count(marker) == times * n, marker
    # The rank with the bad id raises in that call (the CPU path finishes the device check at
    # once), in both modes; the others are unaffected, and every rank goes on.
    assert proc.stdout.count("rank 0: ValueError: moe_dispatch: rank 0: expert ids must be in [0, ") == 2
    assert proc.stdout.count("got -3..") == 2 and proc.stdout.count("(1 out of range, not sent)") == 2
    assert proc.stdout.count("no error") == 2 * (n - 1)


def test_dispatch_plan_shares_sms_by_row_size():
    # Up to three blocks per SM while their tiles of four rows fit 120 KB: bf16 rows of 7168
    # (57 KB a tile) two, packed FP8 rows of 7168 and bf16 rows of 4096 three, bf16 rows of
    # 16384 (128 KB) one; low-latency groups are single rows, but blocks follow the same rule.
    assert [moe.dispatch.blocks_per_sm(b) for b in (2 * 7168, moe.fp8.packed_width(7168), 2 * 4096, 2 * 16384)] \
        == [2, 3, 3, 1]
    assert moe.dispatch_plan(8, 4096, 132, False, 2 * 7168) == (256, 16, 4, 4)  # 16 tokens a block, 4 groups of 4
    assert moe.dispatch_plan(8, 4096, 132, False, 2 * 16384) == (128, 32, 4, 8)  # one block per SM
    assert moe.dispatch_plan(2, 128, 132, True, 2 * 7168) == (128, 1, 1, 1)  # a decode batch: a block per token
    assert moe.dispatch_plan(8, 1, 132, False, 2 * 7168)[0] == 8  # never fewer blocks than ranks


WIDER_ROWS = textwrap.dedent("""
    import torch
    import tilescale as ts
    from tilescale.ops.moe.dispatch import blocks_per_sm
    ts.init()
    rank = ts.rank()
    # bf16 rows of 4096 get three blocks per SM, float32 rows of 4096 one: a re-dispatch of
    # the float32 rows through the bf16 buffer runs another plan, with flags of its own.
    assert blocks_per_sm(2 * 4096) == 3 and blocks_per_sm(4 * 4096) == 1
    buf = ts.ops.moe.Buffer(None, max_tokens=16, hidden=4096, topk=2, num_experts=4)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        tokens = 16 - 5 * rank - step
        x = torch.randn(tokens, 4096, generator=g).to(torch.bfloat16)
        idx = torch.randint(0, 4, (tokens, 2), generator=g)
        idx[:, 1] = (idx[:, 0] + 1) % 4
        w = torch.rand(tokens, 2, generator=g)
        recv_x, recv_w, counts, h = buf.dispatch(x, idx, w)
        wide = buf.redispatch(x.float() * 3, h)
        held = h.source_row >= 0
        torch.testing.assert_close(wide[held], recv_x[held].float() * 3, rtol=0, atol=0)
        y = buf.combine(recv_x, recv_w, h)
        torch.testing.assert_close(y.float(), x.float() * w.sum(1, keepdim=True), rtol=2e-2, atol=2e-2)
    print(f"rank {rank}: plans {sorted(k[1] for k in buf._flags)} WIDER-OK", flush=True)
    buf.release()
    ts.finalize()
""")


@pytest.mark.timeout(300)
def test_redispatch_of_wider_rows_runs_its_own_plan(tmp_path):
    program = tmp_path / "wider_rows.py"
    program.write_text(WIDER_ROWS)
    proc = run_cpu(str(program), 2)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # The CPU path has 4 "SMs": 16 slots in 8 blocks of 2 (bf16) and in 4 blocks of 4 (float32).
    assert proc.stdout.count("plans [4, 8, 8] WIDER-OK") == 2, proc.stdout[-2000:]


# DeepEP's normal size on 8 ranks: 4096 tokens, hidden 7168, top-8 of 256 experts (32 per rank).
W, TOKENS, HIDDEN, TOPK, PER_RANK = 8, 4096, 7168, 8, 32
ROWS = 266240  # grouped_rows(4096, 8, 32) with 8 ranks: 8 * 4096 * 8 hits + 32 * 127 padding, in tiles
LL_ROWS = 12288  # grouped_rows(128, 8, 32) with 8 ranks


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize(("name", "tokens", "low_latency", "in_place", "sets", "route_ids"), [
    ("dispatch", TOKENS, False, False, 2, None), ("dispatch", 128, True, False, 2, None),
    ("dispatch", 128, True, False, 2, "int64"), ("dispatch", TOKENS, False, True, 2, None),
    ("dispatch", 128, True, False, 1, None), ("combine", TOKENS, False, False, 2, None)])
def test_kernels_lower_and_compile(name, tokens, low_latency, in_place, sets, route_ids, tmp_path):
    rows = ROWS if tokens == TOKENS else LL_ROWS
    with build_options(world_size=W):
        func = (moe.dispatch_kernel.__wrapped__(W, tokens, HIDDEN, TOPK, PER_RANK, rows, "bfloat16", 132, low_latency,
                                                in_place=in_place, sets=sets, route_ids=route_ids)
                if name == "dispatch"
                else moe.combine_kernel.__wrapped__(W, tokens, HIDDEN, TOPK, rows, "bfloat16", 132))
    with coherent_reads():  # as ts.jit builds it
        src = lower_cuda(func)
    if name == "combine":
        # One closing barrier, no opening one: the buffer set comes from a device-side count,
        # read before the barrier and advanced after it (no host value, so a CUDA graph can
        # replay it). The barrier also compares the ranks' calls (T.agree).
        assert src.count("tilescale::grid_barrier(") == 0 and src.count("tilescale::grid_agree(") == 1
        assert src.index("combines[0]") < src.index("tilescale::grid_agree(") < src.index("combines[0] = ")
    else:
        # The call's number (its set of receive buffers, its flag values) from T.count_call; a
        # closing barrier only with one set: with two, a peer a call ahead writes the other set,
        # and one two calls ahead waited for this rank's next call, which follows this one.
        assert src.count("tilescale::count_call(sends,") == 1 and "tilescale::grid_agree(" not in src
        assert src.count("tilescale::grid_barrier(") == (sets == 1)
    assert "uint4" in src  # rows move as 16-byte vectors
    if name == "dispatch":
        # A group of rows is read once, for the peers and this rank's experts alike.
        assert src.count("*(uint4*)(x + ") == 1
        # What peers write during the launch is read through plain pointers (tir_fixes.coherent_reads).
        # (In place this rank's receive rows are only written, by TMA: a descriptor, not a pointer.)
        assert ("bfloat16_t* recv_x," in src) != in_place and "int* recv_expert_counts," in src
        assert "__restrict__" not in src
        # Every source's counts (equal to its dispatch count + 1), then each peer group's progress.
        assert "tilescale::block_wait((&(arrived[" in src and "tilescale::block_wait((&(progress[" in src
        # The layout, in every block: the sources' counts summed by a loop over sources (no
        # column-by-column warp scan), the experts' segments by a scan.
        assert "CumSum2D<128, 0" not in src and re.search(rf"for \(int src\w* = 1; src\w* < {W};", src)
        assert "CumSum1D<128, false>" in src
        # A decode batch routed in the dispatch kernel (no routing launch): the ids as passed,
        # scans along the tokens (ranks, the entries' experts), rank b's experts counted by
        # shared-memory atomics, the bad ids' count stored for the host.
        assert ("int64_t* __restrict__ topk_idx" in src or "int64_t* topk_idx" in src) == (route_ids == "int64")
        assert (src.count("tl::CumSum2D<128, 1, false>::run(") == 2) == (route_ids is not None)
        assert ("AtomicAdd((&(((int*)hist)[" in src) == (route_ids is not None)
        assert ("bad_host" in src) == (route_ids is not None)
        # Rows are stored by TMA: into the grouped rows, or in place (no grouped row written)
        # only this rank's own rows, into its own receive rows.
        assert ("out_desc" in src) != in_place and ("tl::tma_store(recv_x_desc" in src) == in_place
        # Registers for every block of the plan to be resident together (two per SM for these rows).
        assert "__launch_bounds__(128, 2)" in src and moe.dispatch.blocks_per_sm(2 * HIDDEN) == 2
    if name == "combine":
        # Four expert rows loaded (56 bf16 a thread each) before their sum, two blocks per SM:
        # one row at a time kept too few bytes in flight (1.64x the HBM floor on one H100; now 1.19x).
        assert "__launch_bounds__(128, 2)" in src and "bfloat16_t part[224];" in src
        assert src.count("*(uint4*)(expert_out + ") == 1  # one unrolled load loop over the four rows
    proc = nvcc(src, tmp_path / f"{name}.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize(("name", "hidden", "dtype"), [
    ("dispatch", moe.fp8.packed_width(7168), "uint8"), ("dispatch", 2880, "bfloat16"), ("combine", 2880, "bfloat16"),
    ("combine", 3584, "bfloat16")])
def test_rows_of_any_length_move_in_16_byte_vectors(name, hidden, dtype, tmp_path):
    # Packed FP8 rows (7392 bytes) and bf16 rows of 2880 or 3584 are no multiple of 128 threads
    # x 16 bytes: TileLang's own split moved them in 1-8 byte pieces (FP8 dispatch at 0.46x the
    # bf16 one on 2x H100), and the combine's (1, 2880) registers found no layout at all.
    with build_options(world_size=2):
        func = (moe.dispatch_kernel.__wrapped__(2, 256, hidden, 8, 4, 256 * 8 + 4 * 128, dtype, 132, False)
                if name == "dispatch" else moe.combine_kernel.__wrapped__(2, 256, hidden, 8, 256 * 8 + 4 * 128, dtype,
                                                                           132))
    with coherent_reads():
        src = lower_cuda(func)
    element = "uchar" if dtype == "uint8" else "bfloat16_t"
    # Every row access a 16-byte vector: peers' rows, grouped rows, inputs (not the NaN fill of
    # a combine whose ranks disagreed, a constant store).
    access = rf"\*\((\w+)\*\)\(\({element}\*\)|\*\((\w+)\*\)\((?:x|expert_out|back|out) \+"
    widths = {a or b for line in src.splitlines() if "quiet_NaN" not in line and "make_uint" not in line
              for a, b in re.findall(access, line)}
    assert widths == {"uint4"}, widths
    proc = nvcc(src, tmp_path / f"{name}.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


# (hidden, experts, top-k) of MoE models users run: Mixtral, Qwen3-30B-A3B, gpt-oss, Qwen2-57B, DeepSeek-V3, OLMoE.
MODELS = {"mixtral": (4096, 8, 2), "qwen3-30b-a3b": (2048, 128, 8), "gpt-oss": (2880, 32, 4),
          "qwen2-57b": (3584, 64, 8), "deepseek-v3": (7168, 256, 8), "olmoe": (2048, 64, 8)}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_kernels_build_for_real_models(model):
    # Routing, dispatch (bf16, and FP8 where hidden has whole 128-channel blocks) and combine
    # of each model's expert layer at EP 8 lower through TileLang (the combine did not at 2880).
    hidden, experts, topk = MODELS[model]
    per, tokens = experts // W, 512
    rows = W * tokens * min(topk, per) + per * 128
    with build_options(world_size=W):
        chunk, max_chunks = moe.route_class(tokens)
        kernels = [moe.route_count_kernel.__wrapped__(W, chunk, max_chunks, topk, experts),
                   moe.route_finish_kernel.__wrapped__(W, chunk, topk, experts),
                   moe.dispatch_kernel.__wrapped__(W, tokens, hidden, topk, per, rows, "bfloat16", 132, False),
                   moe.combine_kernel.__wrapped__(W, tokens, hidden, topk, rows, "bfloat16", 132)]
        if hidden % 128 == 0:
            kernels.append(moe.dispatch_kernel.__wrapped__(W, tokens, moe.fp8.packed_width(hidden), topk, per, rows,
                                                           "uint8", 132, False))
    for func in kernels:
        with coherent_reads():
            assert "__global__" in lower_cuda(func)


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
def test_grouped_gemm_lowers_to_wgmma_and_compiles(tmp_path):
    from tilescale.ops.grouped_gemm import grouped_gemm_kernel

    src = lower_cuda(grouped_gemm_kernel.__wrapped__(8, 1024, 7168, 2048, "bfloat16"))
    assert "wgmma" in src and "row_expert[" in src  # tensor cores; each row tile's expert looked up
    proc = nvcc(src, tmp_path / "grouped.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize("gathered", [False, True])
def test_few_rows_per_expert_take_64_row_tiles_that_compile(gathered, tmp_path):
    """At most 64 rows per expert on average: one warpgroup's 64-row tile (m64n128 grouped by
    TMA, m64n256 gathered by cp.async), which skips a segment's second half where it is padding."""
    import tilelang
    from cuda_build import TARGET

    gg = importlib.import_module("tilescale.ops.grouped_gemm")  # the package's name is the function's
    assert gg._tile(11264, 2816, True, gathered) == (gg.SMALL_SEGMENT_GATHERED_TILE if gathered
                                                      else gg.SMALL_SEGMENT_TILE)
    if gathered:
        func = gg.gathered_gemm_kernel.__wrapped__(8, 1024, 4096, 2816, "bfloat16", 4096,
                                                   cfg=gg.SMALL_SEGMENT_GATHERED_TILE)
        with tilelang.tvm.target.Target(TARGET), tilelang.tvm.transform.PassContext(opt_level=3, config=gg._CP_ASYNC):
            src = tilelang.lower(func, target=TARGET).kernel_source
    else:
        src = lower_cuda(gg.grouped_gemm_kernel.__wrapped__(8, 1024, 4096, 2816, "bfloat16", gg.SMALL_SEGMENT_TILE))
    assert ("64, 256, 16" if gathered else "64, 128, 16") in src and "row_expert[(((int)blockIdx.y) * 64)]" in src
    proc = nvcc(src, tmp_path / "grouped64.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize(("K", "fp8", "wide"), [(7168, False, False), (1000, False, False), (7168, True, False),
                                               (4096, False, True), (4096, True, True)])
def test_gathered_gemm_loads_through_the_index_with_cp_async_and_compiles(K, fp8, wide, tmp_path):
    import tilelang
    from cuda_build import TARGET

    from tilescale.ops._gemm import DEFAULT, WIDE
    from tilescale.ops.grouped_gemm import _CP_ASYNC, gathered_gemm_kernel

    func = gathered_gemm_kernel.__wrapped__(8, 1024, K, 2048, "bfloat16", 4096, fp8, WIDE if wide else DEFAULT)
    with tilelang.tvm.target.Target(TARGET), tilelang.tvm.transform.PassContext(opt_level=3, config=_CP_ASYNC):
        lowered = tilelang.lower(func, target=TARGET)
    src = lowered.kernel_source
    # What the block asks for fits an sm_90 SM (227 KiB): the pipeline's stages and the
    # shared epilogue of a 128x256 tile included.
    (kernel,) = lowered.device_mod.functions.values()
    assert int(kernel.attrs["dyn_shared_memory_buf"]) <= 227 * 1024
    assert ("64, 256, 16" in src) == wide  # one m64n256 wgmma per warpgroup in the wide tile
    # Tensor cores, no TMA; each tile's rows looked up once, then the A rows loaded through
    # them in the pipeline (cp.async, STAGES deep) unless K needs a guarded tail.
    assert "wgmma" in src and "tma_load" not in src and "= max(index[" in src
    gathered = "cp_async_gs_conditional<16>((&(((bfloat16_t*)a)" if not fp8 else "__tl_cvt_fp8x2_to_float2"
    assert (gathered in src) == (K % 64 == 0), K
    if fp8:  # the e4m3 bytes and each row's scale land by cp.async, then scale into the bf16 tile
        assert "cp_async_gs_conditional<4>((&(((float*)s)" in src and "fp8_e4_t* __restrict__ x" in src
    proc = nvcc(src, tmp_path / "gathered.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
def test_quantize_kernel_lowers_and_compiles(tmp_path):
    src = lower_cuda(moe.fp8.quantize_fp8_kernel.__wrapped__(7168, "bfloat16"))
    assert "__nv_fp8" in src or "fp8_e4" in src  # the e4m3 cast on the device
    proc = nvcc(src, tmp_path / "quantize.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounded = lower_cuda(moe.fp8.quantize_fp8_kernel.__wrapped__(7168, "bfloat16", True))
    assert "exp2" in rounded and "ceil" in rounded and "log2" in rounded and "exp2" not in src
    proc = nvcc(rounded, tmp_path / "quantize_rounded.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize("K", [4096, 7168])
def test_grouped_fp8_gemm_loads_values_and_scales_by_tma_and_compiles(K, tmp_path):
    import tilelang
    from cuda_build import TARGET

    from tilescale.ops._gemm import WIDE
    from tilescale.ops.grouped_gemm import grouped_fp8_gemm_kernel, tma_rows

    assert tma_rows(K) and not tma_rows(K + 128) and not tma_rows(2880)  # packed rows of 16-byte multiples
    func = grouped_fp8_gemm_kernel.__wrapped__(8, 1024, K, 2048, "bfloat16", WIDE)
    with tilelang.tvm.target.Target(TARGET), tilelang.tvm.transform.PassContext(opt_level=3):
        lowered = tilelang.lower(func, target=TARGET)
    src = lowered.kernel_source
    (kernel,) = lowered.device_mod.functions.values()
    assert int(kernel.attrs["dyn_shared_memory_buf"]) <= 227 * 1024  # stages and the wide tile's epilogue
    # The producer warps load the values, four scale columns and the weights by TMA; the
    # consumers (their registers raised) scale the e4m3 tile into bf16, then one m64n256 wgmma.
    assert src.count("tl::tma_load(") == 3 and "warpgroup_reg_alloc" in src
    assert "__tl_cvt_fp8x2_to_float2" in src and "64, 256, 16" in src
    proc = nvcc(src, tmp_path / "grouped_fp8.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize(("tokens", "id_dtype"), [(TOKENS, "int32"), (128, "int64")])
def test_route_kernels_lower_and_compile(tokens, id_dtype, tmp_path):
    chunk, chunks = moe.route_class(tokens)
    with build_options(world_size=W):
        funcs = [moe.route_count_kernel.__wrapped__(W, chunk, chunks, TOPK, W * PER_RANK, id_dtype)]
        if chunks > 1:  # a decode batch: one chunk, one kernel
            funcs.append(moe.route_finish_kernel.__wrapped__(W, chunk, TOPK, W * PER_RANK))
    assert (chunks > 1) == (tokens > moe.routing.DECODE_TOKENS)
    for n, func in enumerate(funcs):
        src = lower_cuda(func)
        if n == 0:  # the scan of each bin's hits along the chunk's tokens: a warp per bin
            threads = min(512, moe.routing.THREADS_PER_TOKEN * chunk)
            assert f"CumSum2D<{threads}, 1, false>" in src
        proc = nvcc(src, tmp_path / f"route{n}.cubin")
        assert proc.returncode == 0, proc.stderr[-3000:]
