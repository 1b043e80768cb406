"""MoE dispatch/combine: CPU path with 2 and 4 ranks against a reference; CUDA lowering and nvcc."""

import pytest
from cpu_jobs import run_cpu
from cuda_build import lower_cuda, needs_nvcc, nvcc

from tilescale.language import build_options
from tilescale.ops import moe


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_dispatch_combine_match_reference(n):
    proc = run_cpu("tests/ranks/moe_check.py", n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("MOE-OK") == 7 * n  # topk 1/2/8, skewed routing, low-latency mode; every rank
    assert proc.stdout.count("received 0 rows: MOE-OK") == n - 1  # skewed: only rank 0 receives
    # an out-of-range expert id is a ValueError naming the rank and the ids
    for r in range(n):
        assert f"rank {r}: ValueError: moe_dispatch: rank {r}: expert ids must be in [0, {4 * n}); got" in proc.stdout


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_moe_layer_gradients_match_autograd(n):
    proc = run_cpu("tests/ranks/moe_backward_check.py", n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("MOE-GRAD-OK") == n  # input, router, both expert weights, every rank


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize("low_latency", [False, True])
@pytest.mark.parametrize("name", ["dispatch", "combine"])
def test_kernels_lower_and_compile(name, low_latency, tmp_path):
    with build_options(world_size=4):
        func = (moe.dispatch_kernel.__wrapped__(4, 128, 7168, 8, "bfloat16", 132, low_latency) if name == "dispatch"
                else moe.combine_kernel.__wrapped__(4, 128, 7168, 8, 4096, "bfloat16", 132, low_latency))
    src = lower_cuda(func)
    if low_latency:  # no device-wide barrier: per-source arrival counts instead
        assert "tilescale::grid_barrier(" not in src
        assert "tilescale::block_signal(" in src and "tilescale::block_wait(" in src
    else:
        assert src.count("tilescale::grid_barrier(") == 2  # the barriers around the exchange
    assert "uint4" in src  # rows move as 16-byte vectors
    proc = nvcc(src, tmp_path / f"{name}_{low_latency}.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


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
def test_grouping_kernel_lowers_to_vector_copies_and_compiles(tmp_path):
    src = lower_cuda(moe.group_rows_kernel.__wrapped__(2, 4096, 7168, 8, 81920, "bfloat16", 132))
    assert "uint4" in src and "position[" in src
    proc = nvcc(src, tmp_path / "group_rows.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize("name", ["route", "count", "place"])
def test_scan_kernels_lower_and_compile(name, tmp_path):
    kernels = {"route": lambda: moe.route_kernel.__wrapped__(2, 4096, 8, 128),
               "count": lambda: moe.count_hits_kernel.__wrapped__(2, 4096, 8, 128),
               "place": lambda: moe.place_hits_kernel.__wrapped__(2, 4096, 8, 128, 81920)}
    with build_options(world_size=2):
        func = kernels[name]()
    src = lower_cuda(func)
    assert "cumsum" in src.lower() or "scan" in src.lower()  # the block-wide scan of hit flags
    proc = nvcc(src, tmp_path / f"{name}.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
