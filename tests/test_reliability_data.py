"""Issue 19, data side: no op returns wrong data without an error.

* Ranks that pass different shapes (or ops, dtypes, algorithms) to a collective op, after
  every shape has been seen, get a ShapeMismatchError on every rank from the call's own
  kernels (``T.agree``, ``T.announce`` + ``T.wait(agree=)``), not stale data.
* Integer all-reduce and reduce-scatter are exact.
* MoE expert ids: integer dtypes only, and no cast wraps an id into range.
* Zero rows / tokens give empty results; zero rows on one rank only is an error, not a hang.
* A constant peer index out of range is a short error.
* A grouped GEMM row layout of the caller's own that breaks the contract (expert id out of
  range, a tile mixing experts, an index past x's rows) raises GroupedLayoutError, found on
  the device without a synchronisation; a dispatch's layout is not checked again.

CPU path, real processes (tests/ranks/*), two ranks; the changed kernels also lower to CUDA
and compile with nvcc (also through NVSHMEM's device calls).
"""

import importlib.util
import re
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from cpu_jobs import RANKS, run_cpu, run_python
from cuda_build import lower_cuda, needs_nvcc, nvcc


def markers(out: str, name: str) -> dict[tuple[str, int], str]:
    """``{(case, rank): rest of line}`` of the ``name case=... rank=...`` lines."""
    found = {}
    for case, rank, rest in re.findall(rf"{name} case=(\S+) rank=(\d) (.*)", out):
        found[case, int(rank)] = rest
    return found


@pytest.fixture(scope="module")
def collectives_job():
    return run_cpu(str(RANKS / "shape_agreement.py"), 2)


@pytest.mark.parametrize("case", ["all_reduce", "all_reduce_two_shot", "all_reduce_symmetric", "all_gather",
                                  "reduce_scatter", "algorithm", "operation"])
def test_collective_shape_disagreement_raises_on_every_rank(collectives_job, case):
    """The issue's reproduction: every rank calls 8 and 16 elements, then rank 0 passes 8 and
    rank 1 16. Before: rank 0 got [201.0] * 8, rank 1 [202.0] * 16, exit 0."""
    proc = collectives_job
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = markers(proc.stdout, "MISMATCH")
    for rank in (0, 1):
        line = found[case, rank]
        assert f"rank {rank}: " in line and f"rank {1 - rank}: " in line, line
        assert "that call's output is not a result" in line
    if case in ("all_reduce", "all_gather", "reduce_scatter"):
        op = case.split("_two")[0]
        assert f"rank 0: {op} (8,) float32" in found[case, 0]
        assert f"rank 1: {op} (16,) float32" in found[case, 0]
    if case == "all_reduce_symmetric":  # reduced in place: left NaN, not a plausible sum
        assert all(found[case, r].startswith("poisoned=1") for r in (0, 1))
    if case == "operation":
        assert "all_gather (8,) float32" in found[case, 0] and "all_reduce (8,) float32" in found[case, 0]


def test_integer_reductions_are_exact(collectives_job):
    """int32 16777217 + 16777218 is 33554435 (fp32 accumulation gave 33554432), int64 near 2**40
    and 2**53 exact, in both all-reduce algorithms and reduce-scatter, equal to gloo's."""
    proc = collectives_job
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        assert f"INT-OK rank={rank} checks=21" in proc.stdout


def test_fused_tp_gemm_row_disagreement_raises_on_every_rank():
    """all_gather_gemm with 72 rows on rank 0 and 80 on rank 1 (both padded to one 128-row
    tile, so the same buffers and flags): before, both returned, zeros in rank 1's rows. So
    for both all-gather producers (copy engines: announced on their stream before the flags),
    the reduce-scatter in its GEMM and with K split, the all-reduce in one kernel (K whole or
    split) and in two (64-row tiles: other buffers per row count, the waits end at the peer's
    announcement); for the same rows with another tile or producer; and for an all-reduce of
    64 rows against 72 (the 64-row tile against a 128-row one: other kernels and buffers)."""
    proc = run_cpu(str(RANKS / "tp_gemm_agreement.py"), 2, env={"TILESCALE_TEST_CASE": "mismatch"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = markers(proc.stdout, "MISMATCH")
    for case, op, rows, k in (("all_gather_gemm", "all_gather_gemm", (72, 80), 64),
                              ("all_gather_gemm_sm", "all_gather_gemm", (72, 80), 64),
                              ("gemm_reduce_scatter", "gemm_reduce_scatter", (144, 160), 64),
                              ("gemm_reduce_scatter_split_k", "gemm_reduce_scatter", (144, 160), 128),
                              ("gemm_all_reduce", "gemm_all_reduce", (72, 80), 64),
                              ("gemm_all_reduce_split_k", "gemm_all_reduce", (72, 80), 128),
                              ("gemm_all_reduce_two_kernels", "gemm_all_reduce", (72, 80), 64),
                              ("gemm_all_reduce_tiles", "gemm_all_reduce", (64, 72), 64)):
        for rank in (0, 1):
            line = found[case, rank]
            assert f"rank 0: {op} ({rows[0]}, {k}) float32" in line and f"rank 1: {op} ({rows[1]}, {k}) float32" in line
    for rank in (0, 1):  # the same rows, another tile (the same buffers) or another producer (other buffers)
        tiles = found["all_gather_gemm_tile", rank]
        assert "rank 0: all_gather_gemm (64, 64) float32 N=32 TileConfig(block_M=128, block_N=128," in tiles
        assert "rank 1: all_gather_gemm (64, 64) float32 N=32 TileConfig(block_M=128, block_N=256," in tiles
        producers = found["all_gather_gemm_producer", rank]
        assert re.search(r"rank 0: all_gather_gemm [^;]* copy_engine[;)]", producers), producers
        assert re.search(r"rank 1: all_gather_gemm [^;]* sm push_blocks=32[;)]", producers), producers
    for rank in (0, 1):  # zero rows on every rank: empty results, no kernel
        assert f"EMPTY-OK rank={rank}" in proc.stdout


def test_zero_rows_on_one_rank_is_an_error_not_a_hang():
    """Rank 0 passes zero rows (it launches nothing), rank 1 64: both raise within the timeouts."""
    start = time.monotonic()
    proc = run_cpu(str(RANKS / "tp_gemm_agreement.py"), 2,
                   env={"TILESCALE_TEST_CASE": "zero-on-one-rank", "TILESCALE_WAIT_TIMEOUT_S": "3",
                        "TILESCALE_COLLECTIVE_TIMEOUT_S": "3"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = dict(re.findall(r"ZERO-ROWS-ERROR rank=(\d) type=(\w+)", proc.stdout))
    assert errors == {"0": "TimeoutError", "1": "WaitTimeoutError"}, proc.stdout[-2000:]
    assert "ranks [1] did not reach 'all_gather_gemm" in proc.stdout
    assert time.monotonic() - start < 120


@pytest.fixture(scope="module")
def moe_job():
    return run_cpu(str(RANKS / "moe_agreement.py"), 2)


@pytest.mark.parametrize(("case", "kind", "message"), [
    ("int64-wraps", "ValueError",
     r"expert ids must be in \[0, 4\) or -1 \(no expert\); got 0\.\.4294967297 \(1 out of range"),
    ("int64-negative", "ValueError", r"got -1099511627776\.\.3 \(1 out of range"),
    ("int32-too-large", "ValueError", r"got 4\.\.4 \(16 out of range"),
    ("float", "TypeError", r"topk_idx must hold integer expert ids, got torch\.float32"),
    ("float-again", "TypeError", r"topk_idx must hold integer expert ids, got torch\.float32"),
    ("bool", "TypeError", r"got torch\.bool"),
])
def test_moe_expert_ids_are_checked_before_any_cast(moe_job, case, kind, message):
    proc = moe_job
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = markers(proc.stdout, "IDS")
    for rank in (0, 1):
        assert found[case, rank].startswith(f"type={kind} "), found[case, rank]
        assert re.search(message, found[case, rank]), found[case, rank]
        assert f"IDS-OK rank={rank}" in proc.stdout  # int16 ids in range still route


def test_moe_zero_tokens_give_empty_results(moe_job):
    assert moe_job.returncode == 0, moe_job.stdout[-3000:] + moe_job.stderr[-3000:]
    for rank in (0, 1):
        assert f"EMPTY-OK rank={rank}" in moe_job.stdout


@pytest.mark.parametrize(("op", "mine", "theirs"), [
    # Signed with the receive buffers (ranks, max tokens, hidden) and dtype, not this rank's count.
    ("moe_dispatch", "moe_dispatch (2, 8, 32) float32", "moe_dispatch (2, 16, 32) float32"),
    ("moe_combine", "moe_combine (2, 2, 16, 32) float32", "moe_combine (2, 2, 16, 16) float32"),
    # A decode batch's dispatch (one kernel that routes) against a larger one's (after the routing kernels).
    ("moe_dispatch_across_decode", "moe_dispatch (2, 128, 32) float32", "moe_dispatch (2, 129, 32) float32"),
])
def test_moe_disagreement_raises_on_every_rank(moe_job, op, mine, theirs):
    assert moe_job.returncode == 0, moe_job.stdout[-3000:] + moe_job.stderr[-3000:]
    found = markers(moe_job.stdout, "MISMATCH")
    for rank in (0, 1):
        assert f"rank 0: {mine}" in found[op, rank] and f"rank 1: {theirs}" in found[op, rank], found[op, rank]


@pytest.mark.parametrize(("case", "outcome"), [
    ("valid", "ok"), ("valid_index", "ok"), ("expert_past_end", "raised raised"),
    ("expert_below_none", "raised raised"), ("tile_mixes_experts", "raised raised"),
    ("tile_starts_with_none", "raised raised"), ("index_past_end", "raised raised"), ("valid_after", "ok"),
    ("dispatch_layout_unchecked", "ok"), ("dispatch_layout_fewer_experts", "raised"), ("last_call_bad", "raised"),
    ("dispatch_layout_own_index", "raised"), ("in_place_index_short_rows", "raised"),
])
def test_grouped_gemm_refuses_broken_row_layouts(grouped_layout_job, case, outcome):
    """Before: an expert id past w's experts gave zero rows on GPUs (the weight tile's TMA load
    out of bounds), a tile mixing experts another expert's product, both without an error."""
    proc = grouped_layout_job
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    found = markers(proc.stdout, "LAYOUT")
    for rank in (0, 1):
        assert found[case, rank] == outcome, (case, rank, found.get((case, rank)))


@pytest.fixture(scope="module")
def grouped_layout_job():
    return run_cpu(str(RANKS / "grouped_layout_check.py"), 2)


def test_grouped_layout_record_stays_on_the_host_under_another_default_device():
    """The first GPU run of moe_check (torch.set_default_device(cuda)) made the pinned record a
    CUDA tensor, whose numpy view failed; a meta default device shows the same on the CPU."""
    import torch

    from tilescale.ops.grouped_layout import _Record

    with torch.device("meta"):
        record = _Record(torch.device("cpu"))
        record.raise_recorded()  # nothing recorded: returns
    assert record.host.device.type == "cpu" and record.host_view.shape == (3,)


@needs_nvcc
def test_grouped_layout_check_compiles_for_sm90a(tmp_path):
    """One block per tile: each fault's first row reduced over the block, then one atomic minimum."""
    from tilescale.ops.grouped_layout import check_layout_kernel

    src = lower_cuda(check_layout_kernel.__wrapped__(1024, 128, 8, 3000))
    assert src.count("tl::AllReduce<tl::MinOp, 128") == 3 and src.count("AtomicMin((&(record[") == 3
    assert "3000 <= index[" in src and "8 <= expert" in src
    result = nvcc(src, tmp_path / "grouped_layout.cubin")
    assert result.returncode == 0, result.stderr[-3000:]


def test_moe_combine_of_different_dispatches_raises_on_every_rank(moe_job):
    """Before: same shapes, so the ranks agreed, and rank 0 summed rows that rank 1 sent along
    another dispatch's routes; now the combine signs its dispatch's number."""
    assert moe_job.returncode == 0, moe_job.stdout[-3000:] + moe_job.stderr[-3000:]
    found = markers(moe_job.stdout, "MISMATCH")
    for rank in (0, 1):
        numbers = re.findall(r"rank [01]: moe_combine \(2, 2, 8, 32\) float32 topk=2 of dispatch #(\d+)",
                             found["moe_combine_other_dispatch", rank])
        assert sorted(map(int, numbers)) == [1, 2], found["moe_combine_other_dispatch", rank]


def test_constant_peer_out_of_range_is_a_short_error(tmp_path):
    """Before: ~165 lines of TileLang's generated builder source, then the IndexError."""
    program = textwrap.dedent("""
        import tilescale.language as T
        from tilescale.language import build_options

        def build():
            @T.prim_func
            def main(A: T.Tensor((128,), "float32"), B: T.Tensor((128,), "float32")):
                with T.Kernel(1, threads=128):
                    with T.Scale("device") as (rank, world):
                        T.copy(A, B, dst_pe=5)

        with build_options(world_size=2):
            try:
                build()
            except IndexError as err:
                print("INDEX-ERROR", err)
    """)
    script = tmp_path / "bad_peer.py"  # TileLang reads a kernel's source from its file
    script.write_text(program)
    proc = run_python(script, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "INDEX-ERROR T.copy destination 'B': peer 5 out of range for world size 2" in proc.stdout
    output = proc.stdout + proc.stderr  # TileLang logs to stdout
    assert "Failed to build prim_func" not in output and len(output.splitlines()) < 5, output


def _changed_kernels() -> dict:
    """The kernels this issue changed, at shapes of their own: integer reductions, the
    agreement (T.agree, T.announce, T.wait(agree=)) and the poisoned outputs."""
    from tilescale.ops import collectives, moe, tp_gemm
    from tilescale.ops._gemm import NARROW, WIDE

    return {
        "all_gather_bf16": lambda: collectives.all_gather_kernel.__wrapped__(2, "bfloat16", 8, 132),
        "all_reduce_int64_two_shot": lambda: collectives.reduce_kernel.__wrapped__(2, "int64", 2, 132, "push"),
        "all_reduce_int32_one_shot": lambda: collectives.reduce_kernel.__wrapped__(1, "int32", 4, 132, "local"),
        "reduce_scatter_fp16": lambda: collectives.reduce_kernel.__wrapped__(2, "float16", 8, 132, "scatter"),
        "ag_own_gemm": lambda: tp_gemm.ag_own_gemm_kernel.__wrapped__(2, "bfloat16", 256, 256, 512, 512, 16, WIDE),
        "ag_peer_gemm": lambda: tp_gemm.ag_peer_gemm_kernel.__wrapped__(2, "bfloat16", 256, 256, 512, 512, 1, WIDE,
                                                                        "state"),
        "ag_peer_gemm_epoch": lambda: tp_gemm.ag_peer_gemm_kernel.__wrapped__(2, "bfloat16", 256, 256, 512, 512, 2,
                                                                              WIDE, "epoch"),
        "ag_announce": lambda: tp_gemm.announce_kernel.__wrapped__(2),
        "gemm_reduce_scatter": lambda: tp_gemm.gemm_reduce_scatter_kernel.__wrapped__(2, "bfloat16", 512, 512, 512,
                                                                                      WIDE, 1),
        "gemm_push": lambda: tp_gemm.gemm_push_kernel.__wrapped__(2, "bfloat16", 512, 512, 512, 2, WIDE, 1),
        "sum_received": lambda: tp_gemm.sum_received_kernel.__wrapped__(2, 2, "bfloat16", 65536, 65536, 132),
        "all_reduce_gemm": lambda: tp_gemm.all_reduce_gemm_kernel.__wrapped__(2, "bfloat16", 128, 512, 1024, NARROW),
        "all_reduce_gemm_split": lambda: tp_gemm.all_reduce_gemm_kernel.__wrapped__(2, "bfloat16", 128, 512, 1024,
                                                                                    WIDE, 2),
        "moe_dispatch": lambda: moe.dispatch_kernel.__wrapped__(2, 64, 256, 4, 8, 1536, "bfloat16", 132, False),
        "moe_combine": lambda: moe.combine_kernel.__wrapped__(2, 64, 256, 4, 1024, "bfloat16", 132),
    }


def test_changed_kernels_lower_with_their_checks():
    from tilescale.language import build_options

    with build_options(world_size=2):
        sources = {name: lower_cuda(build()) for name, build in _changed_kernels().items()}
    for name in ("all_gather_bf16", "all_reduce_int64_two_shot", "all_reduce_int32_one_shot", "reduce_scatter_fp16",
                 "moe_combine"):
        assert re.search(r"agreed\[0\] = tilescale::grid_agree\(ts_sync_peers, ts_rank, 2, ts_status, "
                         r"ts_timeout_ns, sig\);", sources[name]), name
    for name in ("ag_own_gemm", "ag_announce", "gemm_reduce_scatter", "gemm_push", "all_reduce_gemm",
                 "all_reduce_gemm_split", "moe_dispatch"):
        assert "tilescale::announce(board__peers, ts_rank, 2, ident);" in sources[name], name
    for name in ("ag_peer_gemm", "ag_peer_gemm_epoch", "gemm_reduce_scatter", "sum_received", "all_reduce_gemm",
                 "all_reduce_gemm_split", "moe_dispatch"):
        assert re.search(r"tilescale::(block|warp)_wait\(.*\(&\(board\[0\]\)\), 2, ident\);", sources[name]), name
    # Integers add in their own type: no float accumulator in the integer reductions.
    for name, ctype in (("all_reduce_int64_two_shot", "int64_t"), ("all_reduce_int32_one_shot", "int")):
        assert re.search(rf"\b{ctype} acc\[", sources[name]) and "float acc[" not in sources[name], name
    assert "float acc[" in sources["reduce_scatter_fp16"]
    assert "quiet_NaN()" in sources["all_gather_bf16"]  # the poisoned output of a disagreeing call


@needs_nvcc
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_changed_kernels_compile_for_sm90a(tmp_path):
    from tilescale.language import build_options

    names = ["all_gather_bf16", "all_reduce_int64_two_shot", "all_reduce_int32_one_shot", "ag_own_gemm",
             "ag_peer_gemm_epoch", "ag_announce", "gemm_reduce_scatter", "all_reduce_gemm", "moe_combine"]
    with build_options(world_size=2):
        sources = {name: lower_cuda(_changed_kernels()[name]()) for name in names}
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda n: nvcc(sources[n], tmp_path / f"{n}.cubin"), names))
    for name, result in zip(names, results, strict=True):
        assert result.returncode == 0, f"{name}:\n{result.stderr[-3000:]}"
        assert (tmp_path / f"{name}.cubin").read_bytes()[:4] == b"\x7fELF"


@needs_nvcc
@pytest.mark.skipif(importlib.util.find_spec("nvidia.nvshmem") is None,
                    reason='needs pip "nvidia-nvshmem-cu13==3.4.5"')
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_agreement_through_nvshmem_calls_compiles_and_links(tmp_path):
    """T.agree (nvshmem_grid_agree: nvshmem_int_g of the peers' signatures) and T.announce
    (nvshmem_longlong_atomic_set) with T.wait(agree=), device-linked with libnvshmem_device."""
    import tilelang.env

    from tilescale.comm.nvshmem.lowering import build_cubin
    from tilescale.language import build_options

    names = ["all_gather_bf16", "moe_dispatch"]
    with build_options(world_size=2, remote="nvshmem"):
        sources = {name: lower_cuda(_changed_kernels()[name](), {"tl.disable_warp_specialized": True})
                   for name in names}
    assert "tilescale::nvshmem_grid_agree(" in sources["all_gather_bf16"]
    assert "tilescale::nvshmem_announce(" in sources["moe_dispatch"]
    includes = [tilelang.env.TILELANG_TEMPLATE_PATH, tilelang.env.CUTLASS_INCLUDE_DIR]
    with ThreadPoolExecutor(2) as pool:
        cubins = list(pool.map(lambda n: build_cubin(sources[n], "sm_90a", tmp_path / n, includes), names))
    for cubin in cubins:
        assert cubin.read_bytes()[:4] == b"\x7fELF"
