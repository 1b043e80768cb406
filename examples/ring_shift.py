"""Ring shift: every rank pushes its tensor into its right neighbour's copy with remote T.copy.

The kernel loads a tile of ``A`` into shared memory and stores it straight into the peer's
``B`` (``dst_pe``): TileLang lowers that store like any other (a TMA bulk store for
contiguous tiles), through the peer-address table that tilescale passes as a hidden
argument. ``T.barrier()`` ends the kernel only when every rank's tiles have landed.

    tilescale run -n 2 examples/ring_shift.py
    tilescale run -n 4 --cpu examples/ring_shift.py        # the CPU path, with small shapes
"""

import torch
import torch.distributed as dist

import tilescale as ts
import tilescale.language as T
from tilescale.testing import assert_close, do_bench


@ts.jit
def ring_shift(M, N, block_M, dtype="bfloat16"):
    @T.prim_func
    def main(A: T.Tensor((M, N), dtype), B: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(M, block_M), threads=128) as bx:
            with T.Scale("device") as (rank, world):
                tile = T.alloc_shared((block_M, N), dtype)
                T.copy(A[bx * block_M, 0], tile)
                T.copy(tile, B[bx * block_M, 0], dst_pe=(rank + 1) % world)  # remote put
                T.barrier()  # every block of every rank

    return main


def main() -> None:
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    M, N, block_M = (4096, 1024, 32) if ts.device().type == "cuda" else (256, 64, 32)
    A = torch.randn(M, N, device=ts.device(), dtype=torch.bfloat16)
    B = ts.empty((M, N), dtype=torch.bfloat16)
    kernel = ring_shift(M, N, block_M)
    kernel(A, B)
    ts.synchronize()

    everyone = [torch.empty_like(A) for _ in range(world)]
    dist.all_gather(everyone, A)
    assert_close(B, everyone[(rank - 1) % world], rtol=0, atol=0)

    ms = do_bench(lambda: kernel(A, B))
    print(f"rank {rank}: ring shift correct; {A.nbytes / 2**20:.0f} MiB in {ms:.3f} ms "
          f"({A.nbytes / ms / 1e6:.0f} GB/s per rank, barrier included)")
    ts.finalize()


if __name__ == "__main__":
    main()
