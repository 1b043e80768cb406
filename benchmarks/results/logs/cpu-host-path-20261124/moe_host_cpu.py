"""Per-call host (Python) time of the MoE ops on the CPU path: the main thread's CPU time minus its time inside
the interpreted kernels (CPU time, not wall time: the machine is shared)."""
import time

import torch

import tilescale as ts
from tilescale.interpreter import CpuKernel

inside = [0]
_call = CpuKernel.__call__


def timed(self, *a):
    t = time.thread_time_ns()
    try:
        return _call(self, *a)
    finally:
        inside[0] += time.thread_time_ns() - t


CpuKernel.__call__ = timed
ts.init()
torch.manual_seed(0)
tokens, hidden, topk, experts = 128, 256, 8, 16
x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
w, idx = torch.rand(tokens, experts).topk(topk, dim=1)


def pair():
    rx, rw, _, h = ts.ops.moe_dispatch(x, idx, w, experts, low_latency=True)
    return ts.ops.moe_combine(rx, rw, h)


from torch.utils._python_dispatch import TorchDispatchMode


class Ops(TorchDispatchMode):
    """The aten ops the op runs itself (outside the interpreted kernels)."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not depth[0]:
            self.names.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


depth = [0]
mode = []
_inner = CpuKernel.__call__


def counted(self, *a):
    if not depth[0] and mode:
        mode[-1].names.append("kernel")
    depth[0] += 1
    try:
        return _inner(self, *a)
    finally:
        depth[0] -= 1


CpuKernel.__call__ = counted
for _ in range(3):
    pair()
for name, fn in (("dispatch", lambda: ts.ops.moe_dispatch(x, idx, w, experts, low_latency=True)),
                 ("dispatch+combine", pair)):
    best = []
    for _ in range(5):
        inside[0] = 0
        t = time.thread_time_ns()
        for _ in range(5):
            fn()
        best.append((time.thread_time_ns() - t - inside[0]) / 5 / 1e3)
    ops = Ops()
    mode[:] = [ops]
    with ops:
        fn()
    print(f"{name}: host {min(best):.1f} us/call (main thread CPU time, min of 5 x 5 calls: {[round(b, 1) for b in best]}); "
          f"kernels {sum(n == 'kernel' for n in ops.names)} + torch ops {len(ops.names) - sum(n == 'kernel' for n in ops.names)}: {ops.names}")
ts.finalize()
