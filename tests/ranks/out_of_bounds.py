"""Rank program: out-of-bounds accesses on the CPU path raise IndexError with where and who."""

import torch

import tilescale as ts
import tilescale.language as T


@ts.jit
def push_past_the_end(M, N):
    @T.prim_func
    def main(A: T.Tensor((M, N), "float32"), B: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                T.copy(A[0, 0], B[M + 8, 0], dst_pe=(rank + 1) % world)  # a tile entirely outside B

    return main


@ts.jit
def scale_one_too_far(N):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32")):
        with T.Kernel(1, threads=128):
            for i in T.Parallel(N):
                A[i + 1] = A[i] * 2  # i + 1 reaches N

    return main


ts.init()
A = torch.ones(16, 8)
B = ts.zeros((16, 8), dtype=torch.float32)
for kernel, args in ((push_past_the_end(16, 8), (A, B)), (scale_one_too_far(16), (torch.ones(16),))):
    try:
        kernel(*args)
        print(f"rank {ts.rank()}: NO ERROR")
    except IndexError as err:
        print(f"rank {ts.rank()}: IndexError: {err}")
ts.finalize()
