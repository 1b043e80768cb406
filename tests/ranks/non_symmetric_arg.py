"""Rank program: a kernel that puts into B must refuse a B that is not symmetric."""

import torch
from shared_kernels import push

import tilescale as ts

ts.init()
A = torch.ones(256, device=ts.device())
try:
    ts.jit(push)(256)(A, torch.zeros(256, device=ts.device()))
    print(f"rank {ts.rank()}: NO ERROR")
except TypeError as err:
    print(f"rank {ts.rank()}: TypeError: {err}")
ts.finalize()
