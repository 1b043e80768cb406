"""Per-call Python (minus interpreter kernels and torch.distributed collectives) of the TP GEMM ops and ts.nn TP layers on the CPU path (1 rank): wall time of
N back-to-back calls minus the time inside the interpreter's kernel calls, per call."""
import sys
import time
import warnings

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale import interpreter

inside = [0]
_call = interpreter.CpuKernel.__call__


def timed(self, *args):
    profile = sys.getprofile()
    sys.setprofile(None)  # the interpreter's own calls are not counted
    t = time.perf_counter_ns()
    try:
        return _call(self, *args)
    finally:
        inside[0] += time.perf_counter_ns() - t
        sys.setprofile(profile)


interpreter.CpuKernel.__call__ = timed


def excluded(fn):
    def call(*args, **kwargs):
        profile = sys.getprofile()
        sys.setprofile(None)
        t = time.perf_counter_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter_ns() - t
            sys.setprofile(profile)

    return call


# The collectives of the unfused plans (gloo here, NCCL on GPUs) are not the Python around them either.
for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"):
    setattr(dist, name, excluded(getattr(dist, name)))
warnings.simplefilter("ignore")
ts.init()
torch.set_num_threads(1)  # no intra-op threads contending on a loaded 2-core host
F = torch.float32
g = torch.Generator().manual_seed(0)
rows = torch.randn(64, 128, generator=g)
w = torch.randn(128, 128, generator=g)
big = torch.randn(256, 128, generator=g)
cases = {
    "ops.all_gather_gemm fused (copy_engine) 64x128x128": lambda: ts.ops.all_gather_gemm(rows, w, plan="fused"),
    "ops.all_gather_gemm fused sm 64x128x128": lambda: ts.ops.all_gather_gemm(rows, w, plan="fused", producer="sm"),
    "ops.all_gather_gemm unfused 64x128x128": lambda: ts.ops.all_gather_gemm(rows, w),
    "ops.gemm_reduce_scatter fused 256x128x128": lambda: ts.ops.gemm_reduce_scatter(big, w, plan="fused"),
    "ops.gemm_reduce_scatter unfused 64x128x128": lambda: ts.ops.gemm_reduce_scatter(rows, w),
    "ops.gemm_all_reduce fused 64x128x128": lambda: ts.ops.gemm_all_reduce(rows, w, plan="fused"),
    "ops.gemm_all_reduce unfused 64x128x128": lambda: ts.ops.gemm_all_reduce(rows, w),
}
col = ts.nn.ColumnParallelLinear(128, 128, dtype=F)
merged = ts.nn.MergedColumnParallelLinear(128, [128, 128], dtype=F)
row = ts.nn.RowParallelLinear(128, 128, dtype=F, sequence_parallel=False)
rowb = ts.nn.RowParallelLinear(128, 128, dtype=F, bias=True)
mlp = ts.nn.TensorParallelMLP(128, 256, dtype=F)
x3 = torch.randn(4, 16, 128, generator=g)
cases.update({
    "nn.ColumnParallelLinear 64 rows": lambda: col(rows),
    "nn.MergedColumnParallelLinear 64 rows": lambda: merged(rows),
    "nn.RowParallelLinear all-reduce 64 rows": lambda: row(rows),
    "nn.RowParallelLinear bias seq-par (4,16,128)": lambda: rowb(x3),
    "nn.TensorParallelMLP 64 rows": lambda: mlp(rows),
})
N = 20
for grad in (False, True):
    with torch.set_grad_enabled(grad):
        for name, fn in cases.items():
            if grad and not name.startswith("nn."):
                continue
            for _ in range(3):
                fn()
            best = None
            for _ in range(5):
                inside[0] = 0
                t = time.perf_counter_ns()
                for _ in range(N):
                    fn()
                us = (time.perf_counter_ns() - t - inside[0]) / N / 1e3
                best = us if best is None else min(best, us)
            calls = [0]

            def count(frame, event, arg):
                if event == "call":
                    calls[0] += 1

            sys.setprofile(count)
            fn()
            sys.setprofile(None)
            print(f"{name}{' (grad)' if grad else ''}: {best:.1f} us, {calls[0]} Python calls", flush=True)
ts.finalize()
