"""Rank program: a kernel that puts into B must refuse a B that is not symmetric."""

import torch

import tilescale as ts
import tilescale.language as T


@ts.jit
def push(N):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                T.copy(A, B, dst_pe=(rank + 1) % world)

    return main


ts.init()
A = torch.ones(256, device=ts.device())
try:
    push(256)(A, torch.zeros(256, device=ts.device()))
    print(f"rank {ts.rank()}: NO ERROR")
except TypeError as err:
    print(f"rank {ts.rank()}: TypeError: {err}")
ts.finalize()
