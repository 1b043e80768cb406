"""Fused TP GEMMs and TP layers: CPU-path correctness with 2 and 4 ranks, CUDA lowering and nvcc."""

from pathlib import Path

import pytest
from cpu_jobs import run_cpu
from cuda_build import lower_cuda, needs_nvcc, nvcc

from tilescale.language import build_options
from tilescale.ops import tp_gemm

RANKS = Path(__file__).resolve().parent / "ranks"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_fused_tp_gemms_match_torch(n):
    proc = run_cpu(str(RANKS / "tp_gemm_check.py"), n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("(130, 64, 200) ok") == 2 * n  # fp16 and bf16, every rank
    assert proc.stdout.count("ERRORS ['TypeError', 'ValueError', 'ValueError', 'ValueError', 'ValueError']") == n
    assert proc.stdout.count("shapes differ across ranks (rank 0: [73, 32, 48") == n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_tp_mlp_training_on_fused_ops_matches_reference(n):
    proc = run_cpu("examples/tp_mlp_training.py", n, env={"TILESCALE_TP_PLAN": "fused"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("TP MLP training correct: matches the single-process reference") == n


KERNELS = {
    "all_gather_gemm": lambda: tp_gemm.ag_gemm_kernel.__wrapped__(2, "bfloat16", 4000, 4096, 1024, 2048, 3, 16),
    "gemm_reduce_scatter": lambda: tp_gemm.gemm_push_kernel.__wrapped__(2, "bfloat16", 4096, 1024, 2048, 2, 3),
    "gemm_all_reduce": lambda: tp_gemm.gemm_push_kernel.__wrapped__(2, "float16", 128, 1024, 2048, 1, 3),
    "sum_received": lambda: tp_gemm.sum_received_kernel.__wrapped__(2, "bfloat16", 4096 * 2048, 4000 * 2048, 132),
}


def lower(name: str) -> str:
    # As the ops compile them: the reduce-scatter/all-reduce GEMMs without warp specialisation.
    configs = {"tl.disable_warp_specialized": True} if name.startswith("gemm_") else None
    with build_options(world_size=2):
        return lower_cuda(KERNELS[name](), configs)


@pytest.mark.timeout(120)
def test_gemm_kernels_lower_to_wgmma_with_signals():
    ag = lower("all_gather_gemm")
    assert "wgmma" in ag and "tilescale::block_wait(" in ag  # waits for its segment, then tensor cores
    assert "gathered__peers[" in ag and "tilescale::block_signal(" in ag  # the pushers
    assert "tilescale::grid_barrier(" not in ag  # double-buffered: no barrier between calls
    rs = lower("gemm_reduce_scatter")
    assert "wgmma" in rs and "tilescale::block_signal(" in rs and "recv__peers[" in rs
    assert "tilescale::grid_barrier(" not in rs
    # The signalling thread (thread 0) runs the epilogue: no producer/consumer split.
    assert "warpgroup_reg_dealloc" not in rs
    # Each tile waits for its own segment's flag; TVM's simplifier once folded the segment
    # arithmetic into a closed form that was wrong for even ranks.
    assert "block_wait((&(flags[(((by >> " in ag


@pytest.mark.slow
@pytest.mark.timeout(300)
@needs_nvcc
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_gemm_kernels_compile_for_sm90a(name, tmp_path):
    proc = nvcc(lower(name), tmp_path / f"{name}.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # A device-side call inside a GEMM kernel would serialise its wgmma pipeline.
    assert "wgmma.mma_async instructions are serialized" not in proc.stderr
