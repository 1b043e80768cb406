"""Rank program (2 ranks): eager calls reuse their plans (tilescale.plans), and only those.

Each check counts the plans an op builds (its plan builder wrapped, still run) and checks the
results against torch. Prints ``PLANS-OK rank=<r> builds=<n>`` at the end.
"""

from __future__ import annotations

import gc
import sys

import torch

import tilescale as ts
from tilescale.ops import collectives, p2p
from tilescale.ops._common import op_plans, sm_count
from tilescale.ops.tp_gemm import all_gather, reduce
from tilescale.testing import assert_close

jit_module = sys.modules["tilescale.jit"]
grouped_module = sys.modules["tilescale.ops.grouped_gemm"]
builds = {"all_reduce": 0, "put": 0, "tp_gemm": 0, "grouped_gemm": 0}


def counted(fn, name):
    def build(*args, **kwargs):
        builds[name] += 1
        return fn(*args, **kwargs)

    return build


collectives._all_reduce_plan = counted(collectives._all_reduce_plan, "all_reduce")
p2p.transfer_kernel = counted(p2p.transfer_kernel, "put")  # p2p's plan builder looks its kernel up once
# The TP GEMM ops check their arguments once per plan, first thing when they build one.
all_gather._check_pair = counted(all_gather._check_pair, "tp_gemm")
reduce._check_pair = counted(reduce._check_pair, "tp_gemm")
grouped_module._plan = counted(grouped_module._plan, "grouped_gemm")


def all_reduce_checked(make, group=None) -> None:
    """All-reduce ``make(rank)`` (both ranks are members of ``group``) and check the sum."""
    want = make(0) + make(1)
    x = make(ts.rank())
    ts.ops.all_reduce(x, group=group)
    assert torch.equal(x, want), (x, want)


def expect(error: type, call, what: str) -> str:
    try:
        call()
    except error as err:
        return str(err)
    raise AssertionError(f"rank {ts.rank()}: {what}: no {error.__name__}")


def tp_gemms_reuse_their_plans(rank: int) -> None:
    g = torch.Generator().manual_seed(1)
    a_all = torch.randn(2, 16, 32, generator=g)  # each rank's rows
    weight = torch.randn(24, 32, generator=g)
    calls = {
        "all_gather_gemm fused": (lambda a: ts.ops.all_gather_gemm(a, weight, plan="fused"),
                                  lambda a_all: a_all.reshape(-1, 32) @ weight.T),
        "all_gather_gemm unfused": (lambda a: ts.ops.all_gather_gemm(a, weight, plan="unfused"),
                                    lambda a_all: a_all.reshape(-1, 32) @ weight.T),
        "gemm_all_reduce fused": (lambda a: ts.ops.gemm_all_reduce(a, weight, plan="fused"),
                                  lambda a_all: a_all.sum(0) @ weight.T),
        "gemm_reduce_scatter unfused": (lambda a: ts.ops.gemm_reduce_scatter(a, weight, plan="unfused"),
                                        lambda a_all: (a_all[0] @ weight.T + a_all[1] @ weight.T).chunk(2)[rank]),
    }
    for name, (call, reference) in calls.items():
        for rows, new_plan in ((16, True), (16, False), (8, True), (16, False)):
            before = builds["tp_gemm"]
            data = a_all[:, :rows] + len(op_plans)  # other values on every call
            y = call(data[rank])
            assert_close(y, reference(data), rtol=1e-4, atol=1e-4)
            assert builds["tp_gemm"] == before + new_plan, (name, rows, builds)
    # Layers (seed 0: every rank drew the same full weight and bias, see layer_params).
    weight, bias = layer_params(48, 32)
    column = ts.nn.ColumnParallelLinear(32, 48, bias=True, dtype=torch.float32)  # sequence parallel
    row = ts.nn.RowParallelLinear(32, 48, bias=True, dtype=torch.float32, sequence_parallel=False)
    for shape, new_plan in (((4, 32), True), ((4, 32), False), ((1, 6, 32), True), ((1, 6, 32), False)):
        x_all = torch.randn(2, *shape, generator=g)  # both ranks draw the same
        before = builds["tp_gemm"]
        with torch.no_grad():
            y = column(x_all[rank])  # this rank's rows in, every rank's rows of its output columns out
        want = (torch.cat(list(x_all)) @ weight.T + bias).chunk(2, -1)[rank]
        assert_close(y, want, rtol=1e-4, atol=1e-4)
        y = row(x_all[0].chunk(2, -1)[rank])  # the replicated input's columns of this rank (recording gradients)
        assert_close(y, x_all[0] @ weight.T + bias, rtol=1e-4, atol=1e-4)
        assert builds["tp_gemm"] == before + 2 * new_plan, (shape, builds)


def grouped_gemm_reuses_its_plans() -> None:
    """grouped_gemm: a second call of a layout reuses its plan, a new one builds one, and what
    the plan's key leaves out (the tensor's contiguity) is still checked on every call."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(2, 24, 32, generator=g)
    for rows, new_plan in ((128, True), (128, False), (256, True), (128, False)):
        x = torch.randn(rows, 32, generator=g)
        row_expert = (torch.arange(rows) >= 128).to(torch.int32)  # one 128-row tile per expert
        before = builds["grouped_gemm"]
        y = ts.ops.grouped_gemm(x, w, row_expert)
        assert_close(y, torch.einsum("rk,rnk->rn", x, w[row_expert.long()]), rtol=1e-4, atol=1e-4)
        assert builds["grouped_gemm"] == before + new_plan, (rows, builds)
    strided = torch.randn(128, 64, generator=g)[:, :32]
    msg = expect(ValueError, lambda: ts.ops.grouped_gemm(strided, w, torch.zeros(128, dtype=torch.int32)),
                 "non-contiguous x of a cached shape")
    assert "contiguous" in msg, msg


def layer_params(out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full weight and bias a layer built with ``seed=0`` draws (as ``nn.Linear`` does)."""
    g = torch.Generator().manual_seed(0)
    bound = 1 / in_features**0.5
    weight = (torch.rand(out_features, in_features, generator=g) * 2 - 1) * bound
    return weight, (torch.rand(out_features, generator=g) * 2 - 1) * bound


def main() -> None:
    ts.init()
    rank = ts.rank()
    assert ts.world_size() == 2

    # A second call of a shape reuses the first one's plan; a new shape or dtype builds one.
    all_reduce_checked(lambda r: torch.full((64,), 1.0 + r))
    assert builds["all_reduce"] == 1 and len(op_plans) == 1
    all_reduce_checked(lambda r: torch.full((64,), 2.0 + r))
    assert builds["all_reduce"] == 1 and len(op_plans) == 1, builds
    all_reduce_checked(lambda r: torch.full((32,), 1.0))
    assert builds["all_reduce"] == 2, builds
    all_reduce_checked(lambda r: torch.full((64,), 3 + r, dtype=torch.int32))
    assert builds["all_reduce"] == 3, builds
    all_reduce_checked(lambda r: torch.full((64,), 3 + r, dtype=torch.int32))
    assert builds["all_reduce"] == 3, builds

    # What one rank decides alone is part of the key: a non-contiguous tensor of a cached shape
    # still meets the contiguity check, a symmetric one takes its own (in-place) plan.
    msg = expect(ValueError, lambda: ts.ops.all_reduce(torch.ones(64, 2)[:, 0]), "non-contiguous x")
    assert "contiguous" in msg, msg
    assert builds["all_reduce"] == 4, builds  # its checks ran (and failed): no plan kept
    sym = ts.zeros((64,))

    def symmetric(r: int) -> torch.Tensor:
        return sym.fill_(1.0 + r) if r == rank else torch.full((64,), 1.0 + r)

    all_reduce_checked(symmetric)
    assert builds["all_reduce"] == 5, builds

    # Another group (the same ranks, another torch group) builds its own plan.
    pair = ts.new_group([0, 1])
    all_reduce_checked(lambda r: torch.full((64,), 1.0), group=pair)
    assert builds["all_reduce"] == 6, builds
    all_reduce_checked(lambda r: torch.full((64,), 1.0), group=pair)
    assert builds["all_reduce"] == 6, builds

    # A kernel's hidden arguments are kept by the addresses of its symmetric arguments.
    kernel = p2p.transfer_kernel("float32", 4, p2p.DEFAULT_PLAN, sm_count(), False)
    dst = ts.zeros((256,))
    src = torch.full((256,), 10.0 + rank)
    for _ in range(2):
        kernel(src, dst, 1 - rank)
    assert len(kernel._plans) == 1
    ts.barrier()
    assert torch.equal(dst, torch.full((256,), 11.0 - rank)), dst
    kernel(src[:128], dst[128:], 1 - rank)  # a view at another offset: another peer table
    assert len(kernel._plans) == 2
    msg = expect(TypeError, lambda: kernel(src, torch.zeros(256), 1 - rank), "non-symmetric dst")
    assert "symmetric" in msg, msg
    # ts.ops.put: one plan per (shapes, peer, group); a peer out of range is still refused.
    y = ts.zeros((256,))
    ts.ops.put(src, y, 1 - rank)
    ts.ops.put(src, y, 1 - rank)
    assert builds["put"] == 2, builds  # kernel() above, then the op's first call
    msg = expect(IndexError, lambda: ts.ops.put(src, y, 2), "peer out of range")
    assert "out of range" in msg, msg
    ts.barrier()
    assert torch.equal(y, torch.full((256,), 11.0 - rank)), y

    # TP GEMM ops and the ts.nn layers on them: a second call of a shape reuses its plan (fused and
    # not), a new shape builds one; results stay right on every call.
    tp_gemms_reuse_their_plans(rank)
    grouped_gemm_reuses_its_plans()

    # Freeing symmetric memory drops every plan that may know its address.
    ts.barrier()
    del dst
    gc.collect()
    assert len(kernel._plans) == 0 and len(op_plans) == 0

    # Symmetric memory freed on one rank only (its garbage collected at another moment than its
    # peer's): that rank builds its plans again, alone, with none of a first call's collectives
    # (the peer, launching from its cached plans, would wait on the device for it in vain).
    for _ in range(2):  # cached on both ranks
        all_reduce_checked(lambda r: torch.full((64,), 5.0 + r))
        ts.ops.gemm_all_reduce(torch.ones(16, 32), torch.ones(24, 32), plan="fused")
    local = ts.zeros((8,))
    ts.barrier()
    before = dict(builds)
    if rank == 0:
        del local
        gc.collect()
        assert len(op_plans) == 0
    all_reduce_checked(lambda r: torch.full((64,), 6.0 + r))
    y = ts.ops.gemm_all_reduce(torch.full((16, 32), 1.0 + rank), torch.ones(24, 32), plan="fused")
    assert_close(y, torch.full((16, 24), 96.0))
    rebuilt = [builds[op] - before[op] for op in ("all_reduce", "tp_gemm")]
    assert rebuilt == ([1, 1] if rank == 0 else [0, 0]), rebuilt
    if rank == 1:
        del local
        gc.collect()

    # Ranks disagreeing on shapes both cached still get ShapeMismatchError, on every call.
    for n in (8, 16):
        all_reduce_checked(lambda r, n=n: torch.ones(n))
    cached = builds["all_reduce"]
    for _ in range(2):
        x = torch.ones(8 if rank == 0 else 16)
        msg = expect(ts.ShapeMismatchError, lambda x=x: ts.ops.all_reduce(x), "ranks disagreeing")
        assert "different arguments" in msg, msg
        assert builds["all_reduce"] == cached, builds  # the calls ran on their cached plans
        ts.current().wait_status.zero_()  # sound here: both ranks ran the kernel to its end
        ts.barrier()

    # ts.jit's factory object: compile() is the call's kernel; cache_clear() forgets it.
    factory = collectives.reduce_kernel
    first = factory(1, "float32", 4, sm_count(), "local")
    assert factory.compile(1, "float32", 4, sm_count(), "local") is first
    assert "main" in factory.get_tir(1, "float32", 4, sm_count(), "local").script()
    assert isinstance(factory.get_kernel_source(1, "float32", 4, sm_count(), "local"), str)
    factory.cache_clear()
    assert factory(1, "float32", 4, sm_count(), "local") is not first

    # After finalize() and init() every plan is built again, and results are right.
    ts.finalize()
    ts.init()
    before = builds["all_reduce"]
    all_reduce_checked(lambda r: torch.full((64,), 2.0 + r))
    assert builds["all_reduce"] == before + 1, builds
    all_reduce_checked(lambda r: torch.full((64,), 2.0 + r))
    assert builds["all_reduce"] == before + 1, builds

    print(f"PLANS-OK rank={ts.rank()} builds={builds['all_reduce']}", flush=True)
    ts.finalize()


if __name__ == "__main__":
    main()
