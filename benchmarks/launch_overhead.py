"""Host cost of one call: a tilescale op, its kernel object, the raw TileLang kernel, and torch.

Each figure is the wall time per call of 2000 back-to-back calls of a 4 KiB put (short
kernels, so the host sets the pace), without and then with the final synchronisation.

    tilescale run -n 2 benchmarks/launch_overhead.py
"""

import time
from collections.abc import Callable

import torch

import tilescale as ts
from tilescale.ops import p2p
from tilescale.ops._common import sm_count


def per_call_us(fn: Callable[[], object], calls: int = 2000) -> tuple[float, float]:
    for _ in range(50):
        fn()
    ts.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host, (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    ts.init()
    x = torch.randn(2048, device=ts.device(), dtype=torch.bfloat16)
    y = ts.zeros((2048,), dtype=torch.bfloat16)
    right = (ts.rank() + 1) % ts.world_size()
    kernel = p2p.transfer_kernel("bfloat16", 8, p2p.DEFAULT_PLAN, sm_count(), False)
    table = ts.peer_ptrs(y)
    results = {
        "ts.ops.put": per_call_us(lambda: ts.ops.put(x, y, right)),
        "DistributedKernel": per_call_us(lambda: kernel(x, y, right)),
        "tilelang JITKernel": per_call_us(lambda: kernel.kernel(x, y, right, table)),
        "torch add_": per_call_us(lambda: x.add_(0)),
        "copy engine": per_call_us(lambda: ts.peer_view(y, right).copy_(x)),
    }
    if ts.rank() == 0:
        for name, (host, total) in results.items():
            print(f"{name:20s} host {host:7.2f} us/call   host+gpu {total:7.2f} us/call")
    ts.finalize()


if __name__ == "__main__":
    main()
