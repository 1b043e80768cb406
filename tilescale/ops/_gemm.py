"""The tile GEMM the library's GEMM kernels share: tile shape and one output tile's K loop."""

import tilescale.language as T

# Output tile, K step, pipeline depth of the K loop, and threads per block.
BLOCK_M, BLOCK_N, BLOCK_K, STAGES, THREADS = 128, 128, 64, 3, 256


@T.macro
def gemm_tile(A, a_row, W, w_row, C, c_row, c_col, K, dtype, stages):
    """C[c_row:+BM, c_col:+BN] = A[a_row:+BM, :] @ W[w_row:+BN, :].T, accumulated in fp32."""
    a = T.alloc_shared((BLOCK_M, BLOCK_K), dtype)
    w = T.alloc_shared((BLOCK_N, BLOCK_K), dtype)
    acc = T.alloc_fragment((BLOCK_M, BLOCK_N), "float32")
    T.clear(acc)
    for k in T.Pipelined(T.ceildiv(K, BLOCK_K), num_stages=stages):
        T.copy(A[a_row, k * BLOCK_K], a)
        T.copy(W[w_row, k * BLOCK_K], w)
        T.gemm(a, w, acc, transpose_B=True)
    T.copy(acc, C[c_row, c_col])
