"""A GEMM whose thread-block clusters share an operand tile through distributed shared memory.

In a plain tiled GEMM every block loads the A tile of its row from L2/DRAM, so each A tile
is read once per block column. Here the ``cluster`` blocks of adjacent columns of a row
form a cluster: at each K step block ``r`` loads only slice ``r`` of the shared A tile (its
own B tile as usual), and after a cluster barrier every block gathers the whole A tile
from the slices of all blocks with ``T.copy(..., src_cta=p)``. A is read ``cluster`` times
less, for the same result.

The slices are double-buffered, so one cluster barrier per K step both publishes the new
slices and tells every block that the slices of two steps ago are free. The kernel is not
software-pipelined (the barrier orders each step), so it shows the traffic saving rather
than a speed-up over TileLang's pipelined GEMM, which the script times beside it and
cuBLAS, with the bytes each reads::

    python examples/cluster_shared_operand_gemm.py   # on an sm_90 GPU; without one, the CPU path at small shapes
"""

import torch

import tilescale as ts
import tilescale.language as T
from tilescale.testing import assert_close, do_bench


@ts.jit
def gemm(M, N, K, block_M=128, block_N=128, block_K=64, cluster=1, dtype="bfloat16"):
    """C = A @ B. ``cluster`` > 1: blocks of ``cluster`` adjacent columns share their A tiles
    through DSMEM; ``cluster`` == 1: TileLang's pipelined GEMM."""

    @T.prim_func
    def main(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=128,
                      cluster_dims=(cluster, 1, 1) if cluster > 1 else None) as (bx, by):
            A_s = T.alloc_shared((block_M, block_K), dtype)
            B_s = T.alloc_shared((block_K, block_N), dtype)
            acc = T.alloc_fragment((block_M, block_N), "float32")
            T.clear(acc)
            if cluster > 1:
                rows = block_M // cluster
                with T.Scale("cta_cluster") as (cta_rank, cluster_size):
                    slices = T.alloc_shared((2, rows, block_K), dtype)
                    for k in T.serial(T.ceildiv(K, block_K)):
                        row = by * block_M + cta_rank * rows
                        T.copy(A[row:row + rows, k * block_K:(k + 1) * block_K], slices[k % 2, :, :])
                        T.copy(B[k * block_K, bx * block_N], B_s)
                        T.barrier()  # this step's slices are written; last step's gathers are done
                        for p in T.unroll(cluster_size):
                            T.copy(slices[k % 2, :, :], A_s[p * rows:(p + 1) * rows, :], src_cta=p)
                        T.gemm(A_s, B_s, acc)
                    T.barrier()  # no block finishes while another may still read its slices
            else:
                for k in T.Pipelined(T.ceildiv(K, block_K), num_stages=3):
                    T.copy(A[by * block_M, k * block_K], A_s)
                    T.copy(B[k * block_K, bx * block_N], B_s)
                    T.gemm(A_s, B_s, acc)
            T.copy(acc, C[by * block_M, bx * block_N])

    return main


def operand_bytes(M: int, N: int, K: int, block_M: int, block_N: int, cluster: int, itemsize: int = 2) -> int:
    """Bytes the blocks read from L2/DRAM (A once per cluster of block columns, B once per block
    row) plus C written: the traffic a GEMM's tiling asks of the memory system.

    >>> operand_bytes(256, 256, 64, 128, 128, 1) == (256 * 64 * 2 + 64 * 256 * 2 + 256 * 256) * 2
    True
    """
    a = M * K * (N // block_N) // cluster
    b = K * N * (M // block_M)
    return (a + b + M * N) * itemsize


def main() -> None:
    ts.init()
    gpu = ts.device().type == "cuda"
    M = N = K = 8192 if gpu else 128
    block = 128 if gpu else 32
    cluster = 2
    A = torch.randn(M, K, device=ts.device(), dtype=torch.bfloat16)
    B = torch.randn(K, N, device=ts.device(), dtype=torch.bfloat16) / K**0.5
    ref = A.float() @ B.float()
    results = []
    for c in (cluster, 1):
        kernel = gemm(M, N, K, block, block, cluster=c)
        C = torch.empty(M, N, device=ts.device(), dtype=torch.bfloat16)
        kernel(A, B, C)
        assert_close(C.float(), ref, rtol=2e-2, atol=2e-2)
        results.append((c, do_bench(lambda: kernel(A, B, C)), operand_bytes(M, N, K, block, block, c)))  # noqa: B023
    t_torch = do_bench(lambda: A @ B)
    for c, ms, nbytes in results:
        name = f"cluster of {c}, A shared through DSMEM" if c > 1 else "no cluster (TileLang pipelined)"
        print(f"GEMM {M}x{N}x{K} {name} correct: {ms:.3f} ms, {2 * M * N * K / ms / 1e9:.0f} TFLOP/s, "
              f"{nbytes / 2**30:.2f} GiB operand traffic")
    print(f"torch.matmul: {t_torch:.3f} ms, {2 * M * N * K / t_torch / 1e9:.0f} TFLOP/s")
    ts.finalize()


if __name__ == "__main__":
    main()
