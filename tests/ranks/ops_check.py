"""Rank program: every ts.ops operation against torch.distributed, at awkward sizes and dtypes."""

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.testing import assert_close

ts.init()
torch.set_default_device(ts.device())  # the same program checks the GPU path
rank, world = ts.rank(), ts.world_size()
gen = torch.Generator(device=ts.device()).manual_seed(rank)
checked = 0
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    tol = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for numel in (1, 7, 4096, 40001):  # odd sizes take the narrow-vector kernels and tails
        x = torch.randn(numel, generator=gen).to(dtype)
        ref = torch.empty(world * numel, dtype=dtype)
        dist.all_gather_into_tensor(ref, x)
        assert_close(ts.ops.all_gather(x), ref, rtol=0, atol=0)

        for algorithm in ("one_shot", "two_shot"):
            for symmetric in (False, True):
                y = ts.empty((numel,), dtype=dtype) if symmetric else torch.empty(numel, dtype=dtype)
                y.copy_(x)
                expect = x.float()
                dist.all_reduce(expect)
                ts.ops.all_reduce(y, algorithm=algorithm)
                assert_close(y.float(), expect, **({"rtol": 1e-6, "atol": 1e-5} if dtype ==
                                                                 torch.float32 else tol))
                checked += 1

        rows = torch.randn(world * numel, generator=gen).to(dtype)
        expect = torch.empty(numel, dtype=torch.float32)
        dist.reduce_scatter_tensor(expect, rows.float())
        assert_close(ts.ops.reduce_scatter(rows).float(), expect,
                     **({"rtol": 1e-6, "atol": 1e-5} if dtype == torch.float32 else tol))

        dst = ts.zeros((numel,), dtype=dtype)
        ts.barrier()
        ts.ops.put(x, dst, (rank + 1) % world)
        ts.barrier()
        everyone = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(everyone, x)
        assert_close(dst, everyone[(rank - 1) % world], rtol=0, atol=0)
        got = torch.empty_like(x)
        ts.ops.get(dst, got, (rank + 1) % world)  # the right neighbour holds my x
        assert_close(got, x, rtol=0, atol=0)
        ts.barrier()
        checked += 4
for bad, err in ((lambda: ts.ops.put(torch.ones(4), ts.zeros((4,)), world), IndexError),
                 (lambda: ts.ops.reduce_scatter(torch.ones(world * 2 + 1)), ValueError),
                 (lambda: ts.ops.all_reduce(torch.ones(4), algorithm="three_shot"), ValueError),
                 (lambda: ts.ops.all_gather(torch.ones(4), out=torch.empty(world * 4)), ValueError),
                 (lambda: ts.ops.all_reduce(torch.ones(8)[::2]), ValueError)):
    try:
        bad()
        raise AssertionError(f"expected {err.__name__}")
    except err:
        checked += 1
print(f"rank {rank}: OPS-OK {checked} checks")
ts.finalize()
