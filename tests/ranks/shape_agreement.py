"""Rank program (2 ranks): collectives whose ranks pass different shapes, after each shape has
been seen, and exact integer reductions.

Markers (one line each, checked by tests/test_reliability_data.py):

``MISMATCH case=<name> rank=<r> poisoned=<0|1> msg=<message>``  every rank, every case
``INT-OK rank=<r> checks=<n>``                                   integer sums equal gloo's
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import tilescale as ts


def reset_status() -> None:
    """Clear the status record of a reported disagreement so that one job checks every case.

    Sound on the CPU path only: the kernel raised after it ran to its end on both ranks (the
    same barriers), so the ranks' synchronisation state still matches. A real program ends
    the job instead.
    """
    ts.current().wait_status.zero_()


def expect_mismatch(case: str, call, out: torch.Tensor | None = None) -> None:
    try:
        call()
    except ts.ShapeMismatchError as err:
        poisoned = int(out is not None and bool(torch.isnan(out).all()))
        print(f"MISMATCH case={case} rank={ts.rank()} poisoned={poisoned} msg={err}", flush=True)
    else:
        raise AssertionError(f"rank {ts.rank()}: {case}: no ShapeMismatchError")
    reset_status()
    ts.barrier()


def main() -> None:
    ts.init()
    rank = ts.rank()
    assert ts.world_size() == 2

    # Every shape is seen by every rank first: the first-call host check passes for both.
    for n in (8, 16):
        for algorithm in ("one_shot", "two_shot"):
            ts.ops.all_reduce(torch.ones(n), algorithm=algorithm)
        ts.ops.all_gather(torch.ones(n))
        ts.ops.reduce_scatter(torch.ones(n))

    n = 8 if rank == 0 else 16
    x = torch.full((n,), 100.0 + rank)
    expect_mismatch("all_reduce", lambda: ts.ops.all_reduce(x), out=x)
    y = torch.full((n,), 1.0)
    expect_mismatch("all_reduce_two_shot", lambda: ts.ops.all_reduce(y, algorithm="two_shot"), out=y)
    sym = ts.zeros((16,))
    sym.fill_(1.0)
    z = sym[:n] if rank == 0 else sym  # symmetric: reduced where it is, poisoned there
    expect_mismatch("all_reduce_symmetric", lambda: ts.ops.all_reduce(z), out=z)
    expect_mismatch("all_gather", lambda: ts.ops.all_gather(torch.ones(n)))
    expect_mismatch("reduce_scatter", lambda: ts.ops.reduce_scatter(torch.ones(n)))
    w = torch.ones(8)
    expect_mismatch("algorithm", lambda: ts.ops.all_reduce(w, algorithm="one_shot" if rank == 0 else "two_shot"))
    expect_mismatch("operation", lambda: ts.ops.all_reduce(torch.ones(8)) if rank == 0 else
                    ts.ops.all_gather(torch.ones(8)))

    # After the disagreements, agreeing calls give the right sums. A call whose plan both ranks
    # made before: the disagreeing calls left each rank plans the other lacks, and a plan's
    # first call waits on the host for the peers to build theirs (ops._common.launch_together).
    x = torch.full((16,), 1.0 + rank)
    ts.ops.all_reduce(x, algorithm="one_shot")
    assert torch.equal(x, torch.full((16,), 3.0)), x

    # Integers reduce in integer arithmetic: exact where fp32 would round.
    checks = 0
    cases = [(torch.int32, 16777217 + rank), (torch.int64, 2**40 + 1 + rank), (torch.int64, 2**53 + 1 + rank)]
    for dtype, value in cases:
        for algorithm in ("one_shot", "two_shot"):
            for numel in (1, 5, 4096):
                x = torch.full((numel,), value, dtype=dtype)
                expect = x.clone()
                dist.all_reduce(expect)
                ts.ops.all_reduce(x, algorithm=algorithm)
                assert torch.equal(x, expect), (dtype, algorithm, numel, x[:4], expect[:4])
                checks += 1
        rows = torch.arange(6, dtype=dtype) + value
        expect = torch.empty(3, dtype=dtype)
        dist.reduce_scatter_tensor(expect, rows)
        got = ts.ops.reduce_scatter(rows)
        assert torch.equal(got, expect), (dtype, got, expect)
        checks += 1
    print(f"INT-OK rank={rank} checks={checks}", flush=True)
    ts.finalize()


if __name__ == "__main__":
    main()
