"""Split-K GEMM for decode shapes, with the K-partials reduced in distributed shared memory.

With few rows (M = 64 or 128 tokens) a GEMM has too few output tiles to fill a GPU, so K is
cut into ``splits`` parts, one block per part. The partial sums must then be added up:

* ``reduce="dsmem"``: the blocks of one output tile form a thread-block cluster
  (``cluster_dims=(1, splits, 1)``). Each block puts slice ``r`` of its partial into block
  ``r``'s shared ``inbox`` with ``T.copy(..., dst_cta=r)`` (stores through ``mapa``
  addresses), a cluster barrier later every block adds up its slice from all partials and
  writes it to C. The partials never touch global memory.
* ``reduce="global"``: the same kernel without a cluster: every block atomically adds its
  partial into a float32 C in global memory (zeroed first, cast to bfloat16 after), the
  usual split-K.

The script checks both against torch and times them beside cuBLAS::

    python examples/cluster_splitk_gemm.py     # on an sm_90 GPU; without one, the CPU path at small shapes
"""

import torch

import tilescale as ts
import tilescale.language as T
from tilescale.testing import assert_close, do_bench


@ts.jit
def splitk_gemm(M, N, K, block_N, splits, reduce="dsmem", block_K=64, num_stages=3, dtype="bfloat16"):
    """C = A @ B with K split ``splits`` ways; ``reduce`` is "dsmem" (C in ``dtype``) or "global"
    (C float32, accumulated with atomics: zero it before the call)."""
    k_part = K // splits
    rows = M // splits  # rows of C each block of a cluster adds up and stores
    dsmem = reduce == "dsmem"

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype),
             C: T.Tensor((M, N), dtype if dsmem else "float32")):
        with T.Kernel(T.ceildiv(N, block_N), splits, threads=128,
                      cluster_dims=(1, splits, 1) if dsmem else None) as (bx, by):
            A_s = T.alloc_shared((M, block_K), dtype)
            B_s = T.alloc_shared((block_K, block_N), dtype)
            acc = T.alloc_fragment((M, block_N), "float32")
            T.clear(acc)
            for k in T.Pipelined(k_part // block_K, num_stages=num_stages):
                T.copy(A[0, by * k_part + k * block_K], A_s)
                T.copy(B[by * k_part + k * block_K, bx * block_N], B_s)
                T.gemm(A_s, B_s, acc)
            if dsmem:
                with T.Scale("cta_cluster") as (cta_rank, cluster_size):
                    partial = T.alloc_shared((M, block_N), "float32")
                    inbox = T.alloc_shared((splits, rows, block_N), "float32")
                    total = T.alloc_fragment((rows, block_N), "float32")
                    T.copy(acc, partial)
                    T.barrier()  # every block is done with its pipeline tiles, whose memory inbox may reuse
                    for r in T.unroll(cluster_size):
                        T.copy(partial[r * rows:(r + 1) * rows, :], inbox[cta_rank, :, :], dst_cta=r)
                    T.barrier()  # every block's slices have landed
                    T.clear(total)
                    for r in T.serial(cluster_size):
                        for i, j in T.Parallel(rows, block_N):
                            total[i, j] += inbox[r, i, j]
                    T.copy(total, C[cta_rank * rows, bx * block_N])
            else:
                T.atomic_add(C[0:M, bx * block_N:(bx + 1) * block_N], acc)

    return main


def global_splitk(kernel, A: torch.Tensor, B: torch.Tensor, workspace: torch.Tensor) -> torch.Tensor:
    """The split-K through global memory, end to end: zero, accumulate, cast."""
    workspace.zero_()
    kernel(A, B, workspace)
    return workspace.to(A.dtype)


def main() -> None:
    ts.init()
    gpu = ts.device().type == "cuda"
    shapes = [(128, 8192, 14336), (64, 7168, 16384)] if gpu else [(16, 256, 512)]
    block_N, splits = (128, 4) if gpu else (64, 4)
    for M, N, K in shapes:
        A = torch.randn(M, K, device=ts.device(), dtype=torch.bfloat16)
        B = torch.randn(K, N, device=ts.device(), dtype=torch.bfloat16) / K**0.5
        ref = A.float() @ B.float()
        C = torch.empty(M, N, device=ts.device(), dtype=torch.bfloat16)
        workspace = torch.empty(M, N, device=ts.device(), dtype=torch.float32)
        dsmem = splitk_gemm(M, N, K, block_N, splits, "dsmem")
        through_global = splitk_gemm(M, N, K, block_N, splits, "global")
        dsmem(A, B, C)
        assert_close(C.float(), ref, rtol=2e-2, atol=2e-2)
        assert_close(global_splitk(through_global, A, B, workspace).float(), ref, rtol=2e-2,
                     atol=2e-2)
        t_dsmem = do_bench(lambda: dsmem(A, B, C))  # noqa: B023 - timed before the loop moves on
        t_global = do_bench(lambda: global_splitk(through_global, A, B, workspace))  # noqa: B023
        t_torch = do_bench(lambda: A @ B)  # noqa: B023
        print(f"split-K GEMM M={M} N={N} K={K} ({splits} splits) correct; DSMEM reduction {t_dsmem:.3f} ms, "
              f"global-memory reduction {t_global:.3f} ms ({t_global / t_dsmem:.2f}x), torch.matmul "
              f"{t_torch:.3f} ms")
    ts.finalize()


if __name__ == "__main__":
    main()
