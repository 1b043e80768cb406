"""ts.ops.silu_and_mul: the CPU path against torch's composition, bad inputs; CUDA lowering and nvcc."""

import pytest
from cpu_jobs import run_cpu
from cuda_build import lower_cuda, needs_nvcc, nvcc


@pytest.mark.timeout(300)
def test_silu_and_mul_matches_torch():
    proc = run_cpu("tests/ranks/activation_check.py", 1)
    assert "ACT-OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("refused:") == 4
    assert "must be contiguous" in proc.stdout


@needs_nvcc
@pytest.mark.timeout(200)
def test_silu_and_mul_lowers_to_vector_loads_and_compiles(tmp_path):
    from tilescale.ops.activation import silu_and_mul_kernel

    # An MoE layer's first-GEMM output (ffn 1408 = 5.5 blocks of columns): 16-byte loads of
    # the gate and the up halves, one guard per vector.
    src = lower_cuda(silu_and_mul_kernel.__wrapped__(1408, "bfloat16"))
    assert src.count("*(uint4*)(h + ") == 2, src[-3000:]
    assert "int rows" in src  # a run-time argument: no kernel built per row count
    proc = nvcc(src, tmp_path / "act.cubin")
    assert proc.returncode == 0, proc.stderr[-3000:]
