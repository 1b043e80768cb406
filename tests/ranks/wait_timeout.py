"""Rank program: rank 1 skips the signal rank 0 waits for; both ranks must end with a clear error.

Rank 0's T.wait times out (its flag never changes); rank 0 then refuses to launch the next
kernel, so rank 1's T.barrier() in that kernel times out too. Each rank prints the
WaitTimeoutError it got and exits 0, so the launcher's exit code tells the test nothing
hung.
"""

import torch
from shared_kernels import handshake, meet

import tilescale as ts

ts.init()
flags = ts.zeros((4,), dtype=torch.int32)
ts.barrier()
try:
    ts.jit(handshake)(1)(flags)
    ts.synchronize()
    ts.jit(meet)()(flags)
    ts.synchronize()
    print(f"rank {ts.rank()}: NO ERROR")
except ts.WaitTimeoutError as err:
    print(f"rank {ts.rank()}: WaitTimeoutError: {err}")
ts.finalize()
