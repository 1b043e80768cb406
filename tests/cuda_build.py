"""Lowering to CUDA and compiling with nvcc, for the tests that check generated code (no GPU needed)."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import tilelang
import tilelang.env
from tvm import tirx

TARGET = {"kind": "cuda", "arch": "sm_90a"}
# The scalar hidden parameters every distributed kernel with a wait or barrier gets, in binding order.
SCALARS = ("ts_rank", "ts_status", "ts_timeout_ns")
NVCC = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
needs_nvcc = pytest.mark.skipif(not os.access(NVCC, os.X_OK), reason="needs nvcc (CUDA toolkit)")


def lower_cuda(func: tirx.PrimFunc, pass_configs: dict | None = None) -> str:
    """The CUDA source TileLang generates for ``func`` (sm_90a), with ``pass_configs`` as
    ``tilelang.compile`` would apply them."""
    with tilelang.tvm.target.Target(TARGET), tilelang.tvm.transform.PassContext(opt_level=3,
                                                                               config=pass_configs or {}):
        return tilelang.lower(func, target=TARGET).kernel_source


def nvcc(src: str, out: Path, kind: str = "cubin") -> subprocess.CompletedProcess:
    """Compile ``src`` for sm_90a into ``out`` (``kind``: cubin or ptx) with TileLang's headers."""
    cu = out.with_suffix(".cu")
    cu.write_text(src)
    cmd = [NVCC, "-std=c++17", "-arch=sm_90a", f"-{kind}", "-o", str(out), f"-I{tilelang.env.TILELANG_TEMPLATE_PATH}",
           f"-I{tilelang.env.CUTLASS_INCLUDE_DIR}", "-DENABLE_BF16", "--expt-relaxed-constexpr", "-w", str(cu)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280)


def hidden_of(func: tirx.PrimFunc) -> dict[str, str]:
    """``tilescale.hidden`` as DistributedKernel reads it (its order is the binding order)."""
    return {str(k): str(v) for k, v in dict(func.attrs["tilescale.hidden"]).items()}
