"""ts.ops.silu_and_mul: the CPU path against torch's composition, bad inputs; CUDA lowering and nvcc."""

import textwrap

import pytest
from cpu_jobs import run_python
from cuda_build import lower_cuda, needs_nvcc, nvcc


@pytest.mark.timeout(200)
def test_silu_and_mul_matches_torch(tmp_path):
    script = tmp_path / "act.py"
    script.write_text(textwrap.dedent("""
        import torch
        import tilescale as ts

        ts.init(device="cpu")
        g = torch.Generator().manual_seed(0)
        # rows and columns past the block's (8 x 256), columns not a multiple of a vector (300, 5)
        for rows, ffn, dtype in [(37, 300, torch.bfloat16), (16, 512, torch.float16), (9, 5, torch.float32),
                                 (1, 1408, torch.bfloat16)]:
            h = (torch.randn(rows, 2 * ffn, generator=g) * 4).to(dtype)
            gate, up = h.chunk(2, -1)
            want = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
            got = ts.ops.silu_and_mul(h)
            assert got.shape == (rows, ffn) and got.dtype == dtype, (got.shape, got.dtype)
            # one rounding of the same float32 value (sigmoid's form may move the last float32 bit)
            torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
            if dtype != torch.float32:  # rounded to 16 bits: equal but for rare ties
                assert (got != want).float().mean() < 0.01, (rows, ffn, dtype)
        assert ts.ops.silu_and_mul(torch.empty(0, 8, dtype=torch.bfloat16)).shape == (0, 4)
        for bad, what in [(torch.zeros(4, 7), ValueError), (torch.zeros(8), ValueError),
                          (torch.zeros(4, 8, dtype=torch.int32), ValueError),
                          (torch.zeros(8, 4).T, ValueError)]:
            try:
                ts.ops.silu_and_mul(bad)
            except what as e:
                print("refused:", e)
            else:
                raise AssertionError(f"accepted {tuple(bad.shape)} {bad.dtype}")
        print("ACT-OK")
    """))
    proc = run_python(script, timeout=180, cwd=tmp_path)
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
