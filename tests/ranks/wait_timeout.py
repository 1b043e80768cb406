"""Rank program: rank 1 skips the signal rank 0 waits for; both ranks must end with a clear error.

Rank 0's T.wait times out (its flag never changes); rank 0 then refuses to launch the next
kernel, so rank 1's T.barrier() in that kernel times out too. Each rank prints the
WaitTimeoutError it got and exits 0, so the launcher's exit code tells the test nothing
hung.
"""

import torch

import tilescale as ts
import tilescale.language as T


@ts.jit
def handshake(skip_rank: int):
    @T.prim_func
    def main(flags: T.Tensor((4,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device") as (rank, world):
                if rank != skip_rank:
                    T.signal(flags[1], 1, pe=(rank + 1) % world)
                T.wait(flags[1], "ge", 1)

    return main


@ts.jit
def meet():
    @T.prim_func
    def main(flags: T.Tensor((4,), "int32")):
        with T.Kernel(1, threads=128):
            with T.Scale("device"):
                T.barrier()

    return main


ts.init()
flags = ts.zeros((4,), dtype=torch.int32)
ts.barrier()
try:
    handshake(1)(flags)
    ts.synchronize()
    meet()(flags)
    ts.synchronize()
    print(f"rank {ts.rank()}: NO ERROR")
except ts.WaitTimeoutError as err:
    print(f"rank {ts.rank()}: WaitTimeoutError: {err}")
ts.finalize()
