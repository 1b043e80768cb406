"""Kernel factories shared by the rank programs here and the tests in tests/ (one copy of each).

The factories are undecorated: a rank program wraps one in ``ts.jit``, a lowering test calls it
under ``build_options(world_size=...)`` and reads the TIR or the CUDA. Rank programs import this
module from their own folder; tests/conftest.py puts the folder on ``sys.path`` for the tests::

    import tilescale as ts
    from shared_kernels import handshake

    ts.jit(handshake)(1)(flags)
"""

import tilescale.language as T


def handshake(skip_rank: int):
    """Signal the right neighbour's ``flags[1]``, then wait for one's own (``skip_rank`` never signals).

    Args:
        skip_rank: the rank that skips its signal, so that its right neighbour's wait times out.

    Returns:
        The prim_func ``main(flags: int32[4])``.
    """

    @T.prim_func
    def main(flags: T.Tensor((4,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                if rank != skip_rank:
                    T.signal(flags[1], 1, pe=(rank + 1) % world)
                T.wait(flags[1], "ge", 1)

    return main


def meet():
    """A device-wide barrier of all ranks, nothing else.

    Returns:
        The prim_func ``main(flags: int32[4])``.
    """

    @T.prim_func
    def main(flags: T.Tensor((4,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device"):
                T.barrier()

    return main


def push(N: int):
    """Copy ``A`` into the right neighbour's ``B``: ``B`` must be symmetric.

    Args:
        N: the length of both vectors.

    Returns:
        The prim_func ``main(A: float32[N], B: float32[N])``.
    """

    @T.prim_func
    def main(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                T.copy(A, B, dst_pe=(rank + 1) % world)

    return main


def gemm(lang=T, M: int = 256, N: int = 256, K: int = 128, bM: int = 128, bN: int = 128, bK: int = 32,
         dtype: str = "float16", out_dtype: str = "float32", stages: int = 2, swizzle: int = 10):
    """A single-GPU tiled GEMM ``C = A @ B`` as TileLang's examples write it.

    Args:
        lang: the language module, ``tilescale.language`` or ``tilelang.language`` (to compare lowerings).
        M, N, K: the problem; bM, bN, bK: the tile.
        dtype: the inputs' type; out_dtype: C's (the accumulator is float32).
        stages: the pipeline depth over K.
        swizzle: the panel size of ``use_swizzle`` (the order of the tiles over the grid).

    Returns:
        The prim_func ``main(A: dtype[M, K], B: dtype[K, N], C: out_dtype[M, N])``.
    """

    @lang.prim_func
    def main(A: lang.Tensor((M, K), dtype), B: lang.Tensor((K, N), dtype), C: lang.Tensor((M, N), out_dtype)):
        with lang.Kernel(lang.ceildiv(N, bN), lang.ceildiv(M, bM), threads=128) as (bx, by):
            As = lang.alloc_shared((bM, bK), dtype)
            Bs = lang.alloc_shared((bK, bN), dtype)
            acc = lang.alloc_fragment((bM, bN), "float32")
            lang.use_swizzle(panel_size=swizzle)
            lang.clear(acc)
            for k in lang.Pipelined(lang.ceildiv(K, bK), num_stages=stages):
                lang.copy(A[by * bM, k * bK], As)
                lang.copy(B[k * bK, bx * bN], Bs)
                lang.gemm(As, Bs, acc)
            lang.copy(acc, C[by * bM, bx * bN])

    return main
