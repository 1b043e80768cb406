"""Thread-block-cluster GEMMs (distributed shared memory) vs their non-cluster forms and cuBLAS.

1. Split-K decode GEMMs (bf16): the K-partials reduced across the blocks of a cluster in
   DSMEM (``examples/cluster_splitk_gemm.py``) vs the same TileLang split-K reduced through
   global memory (atomics into a zeroed float32 workspace, then the cast: what producing the
   bf16 result costs) vs cuBLAS (``torch.matmul``), for 2 and 4 splits.
2. An 8192^3 GEMM whose clusters share A tiles through DSMEM
   (``examples/cluster_shared_operand_gemm.py``) vs TileLang's pipelined GEMM vs cuBLAS,
   with the operand bytes each tiling reads from L2/DRAM (computed, not measured).

Every result is checked against torch before it is timed. One process, one GPU::

    python benchmarks/cluster_gemm.py              # the issue's shapes (sm_90: H100/H200)
    python benchmarks/cluster_gemm.py --splits 4   # fewer kernels to compile
    python benchmarks/cluster_gemm.py --small      # tiny shapes, e.g. on the CPU path
"""

import argparse
import sys
from pathlib import Path

import torch
from harness import Report, check_close, progress, time_fn

import tilescale as ts

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from cluster_shared_operand_gemm import gemm, operand_bytes  # noqa: E402
from cluster_splitk_gemm import global_splitk, splitk_gemm  # noqa: E402

SPLITK_SHAPES = [(128, 8192, 14336), (64, 7168, 16384)]
SHARED_SHAPE = (8192, 8192, 8192)
SMALL = {"splitk": [(16, 256, 512)], "shared": (128, 128, 128)}


def bench_splitk(M: int, N: int, K: int, splits: int, block_N: int, iters: int) -> dict:
    A = torch.randn(M, K, device=ts.device(), dtype=torch.bfloat16)
    B = torch.randn(K, N, device=ts.device(), dtype=torch.bfloat16) / K**0.5
    ref = A.float() @ B.float()
    C = torch.empty(M, N, device=ts.device(), dtype=torch.bfloat16)
    workspace = torch.empty(M, N, device=ts.device(), dtype=torch.float32)
    dsmem = splitk_gemm(M, N, K, block_N, splits, "dsmem")
    through_global = splitk_gemm(M, N, K, block_N, splits, "global")
    dsmem(A, B, C)
    checks = [check_close(f"split-K DSMEM {M}x{N}x{K}", C.float(), ref, rtol=2e-2, atol=2e-2),
              check_close(f"split-K global {M}x{N}x{K}", global_splitk(through_global, A, B, workspace).float(),
                          ref, rtol=2e-2, atol=2e-2)]
    row = {"M": M, "N": N, "K": K, "splits": splits, "block_N": block_N, "checks": checks}
    for name, fn in (("dsmem", lambda: dsmem(A, B, C)),
                     ("global", lambda: global_splitk(through_global, A, B, workspace)),
                     ("cublas", lambda: A @ B)):
        row[f"{name}_ms"] = time_fn(fn, iters=iters).median_ms
    row["dsmem_speedup"] = row["global_ms"] / row["dsmem_ms"]
    return row


def bench_shared_operand(M: int, N: int, K: int, block: int, cluster: int, iters: int) -> list[dict]:
    A = torch.randn(M, K, device=ts.device(), dtype=torch.bfloat16)
    B = torch.randn(K, N, device=ts.device(), dtype=torch.bfloat16) / K**0.5
    ref = A.float() @ B.float()
    rows = []
    for c in (cluster, 1):
        kernel = gemm(M, N, K, block, block, cluster=c)
        C = torch.empty(M, N, device=ts.device(), dtype=torch.bfloat16)
        kernel(A, B, C)
        check = check_close(f"GEMM cluster={c}", C.float(), ref, rtol=2e-2, atol=2e-2)
        ms = time_fn(lambda: kernel(A, B, C), iters=iters).median_ms  # noqa: B023 - timed right here
        rows.append({"variant": f"tilescale cluster={c}" if c > 1 else "tilelang no cluster", "ms": ms,
                     "tflops": 2 * M * N * K / ms / 1e9, "operand_bytes": operand_bytes(M, N, K, block, block, c),
                     "check": check})
    ms = time_fn(lambda: A @ B, iters=iters).median_ms
    rows.append({"variant": "cublas", "ms": ms, "tflops": 2 * M * N * K / ms / 1e9, "operand_bytes": None})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke test, e.g. on the CPU path)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--splits", type=int, nargs="+", default=[2, 4], help="cluster sizes of the split-K GEMMs")
    args = parser.parse_args()
    ts.init()
    small = args.small or ts.device().type != "cuda"
    splitk_shapes = SMALL["splitk"] if small else SPLITK_SHAPES
    block_N = 64 if small else 128
    splitk = Report("cluster-splitk-gemm", columns=["M", "N", "K", "splits", "dsmem_ms", "global_ms",
                                                    "dsmem_speedup", "cublas_ms"])
    cases = [(shape, splits) for shape in splitk_shapes for splits in args.splits]
    for (M, N, K), splits in progress(cases, "split-K", fmt=str):
        splitk.add(bench_splitk(M, N, K, splits, block_N, args.iters))
    splitk.print_table()
    splitk.save()

    shared = Report("cluster-shared-operand-gemm", columns=["variant", "ms", "tflops", "operand_bytes"])
    M, N, K = SMALL["shared"] if small else SHARED_SHAPE
    for row in bench_shared_operand(M, N, K, 32 if small else 128, 2, args.iters):
        shared.add({"M": M, "N": N, "K": K, **row})
    shared.print_table()
    shared.save()
    ts.finalize()


if __name__ == "__main__":
    main()
