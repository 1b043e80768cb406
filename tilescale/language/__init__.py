"""The tilescale language: all of ``tilelang.language`` plus distributed tile operations.

Example::

    import tilescale.language as T

    @T.prim_func
    def ring_shift(A: T.Tensor((M, N), "bfloat16"), B: T.Tensor((M, N), "bfloat16")):
        with T.Kernel(T.ceildiv(M, 64), threads=128) as bx:
            with T.Scale("device") as (rank, world):
                tile = T.alloc_shared((64, N), "bfloat16")
                T.copy(A[bx * 64, 0], tile)
                T.copy(tile, B[bx * 64, 0], dst_pe=(rank + 1) % world)
                T.barrier()

Every single-GPU TileLang program is a tilescale program: the names below replace
TileLang's only to add keywords (``T.copy``'s ``dst_pe``/``src_pe``) or hidden
arguments (``T.prim_func`` appends the peer-address tables a kernel needs).
"""

from tilelang.language import *  # noqa: F403
from tilelang.language import __all__ as _tilelang_all

from tilescale.language.kernel import Kernel, prim_func  # noqa: F401 - replace TileLang's, in __all__
from tilescale.language.remote import copy  # noqa: F401 - replaces TileLang's, in __all__
from tilescale.language.scale import Scale, build_options
from tilescale.language.sync import agree, announce, barrier, count_call, fence, signal, wait

__all__ = [*_tilelang_all, "Scale", "agree", "announce", "barrier", "build_options", "count_call", "fence", "signal",
           "wait"]
