"""TileLang programs written for one GPU (a tiled GEMM with swizzle and pipelining, a softmax
with reductions, a scalar loop on a local buffer) run unchanged on the CPU path."""

import torch
from shared_kernels import gemm

import tilescale as ts
import tilescale.language as T


@ts.jit
def softmax(M, N, bM=8):
    @T.prim_func
    def main(X: T.Tensor((M, N), "float32"), Y: T.Tensor((M, N), "float32")):
        with T.Kernel(T.ceildiv(M, bM), threads=128) as bx:
            x = T.alloc_fragment((bM, N), "float32")
            mx = T.alloc_fragment((bM,), "float32")
            s = T.alloc_fragment((bM,), "float32")
            T.copy(X[bx * bM, 0], x)
            T.reduce_max(x, mx, dim=1)
            for i, j in T.Parallel(bM, N):
                x[i, j] = T.exp(x[i, j] - mx[i])
            T.reduce_sum(x, s, dim=1)
            for i, j in T.Parallel(bM, N):
                x[i, j] = x[i, j] / s[i]
            T.copy(x, Y[bx * bM, 0])
    return main

@ts.jit
def scalar_local(N):
    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), S: T.Tensor((1,), "float32")):
        with T.Kernel(1, threads=128):
            acc = T.alloc_local((1,), "float32")
            acc[0] = 0
            for i in T.serial(N):
                acc[0] = acc[0] + A[i]
            S[0] = acc[0]
    return main

ts.init(device="cpu")
A, B = torch.randn(70, 40).half(), torch.randn(40, 50).half()
C = torch.empty(70, 50).half()
# 32x32x16 tiles, 3 stages, swizzled, fp16 out: the CPU path runs what one GPU would
ts.jit(gemm)(T, 70, 50, 40, bM=32, bN=32, bK=16, out_dtype="float16", stages=3)(A, B, C)
torch.testing.assert_close(C.float(), A.float() @ B.float(), rtol=1e-2, atol=1e-2)
X = torch.randn(20, 33)
Y = torch.empty_like(X)
softmax(20, 33)(X, Y)
torch.testing.assert_close(Y, torch.softmax(X, 1))
a, s = torch.randn(100), torch.zeros(1)
scalar_local(100)(a, s)
torch.testing.assert_close(s[0], a.sum(), rtol=1e-5, atol=1e-4)
print("SINGLE-GPU-PROGRAMS-OK")
