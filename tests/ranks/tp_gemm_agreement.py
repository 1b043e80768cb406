"""Rank program (2 ranks): the fused TP GEMMs when ranks pass different row counts after each
count has been seen, and with zero rows.

``TILESCALE_TEST_CASE`` picks what runs:

* ``mismatch``: one disagreeing call of each op; markers
  ``MISMATCH case=<op> rank=<r> msg=<message>``, then ``EMPTY-OK rank=<r>`` after zero rows
  on every rank gave empty results;
* ``zero-on-one-rank``: rank 0 passes zero rows, rank 1 64 (both counts seen before); every
  rank must raise (within the test's short timeouts), marker ``ZERO-ROWS-ERROR rank=<r>
  type=<exception> msg=<message>``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch

import tilescale as ts


def expect_mismatch(case: str, call) -> None:
    try:
        call()
    except ts.ShapeMismatchError as err:
        print(f"MISMATCH case={case} rank={ts.rank()} msg={err}", flush=True)
    else:
        raise AssertionError(f"rank {ts.rank()}: {case}: no ShapeMismatchError")
    # One job checks every op: sound here because every op's kernels ran to their end on both
    # ranks (CPU path) and the next op uses other buffers. A real program ends the job.
    ts.current().wait_status.zero_()
    ts.barrier()


def main() -> None:
    ts.init()
    rank = ts.rank()
    assert ts.world_size() == 2
    k, n = 64, 32
    w = torch.ones(n, k)
    ops = {
        "all_gather_gemm": lambda m: ts.ops.all_gather_gemm(torch.ones(m, k), w, plan="fused"),
        "gemm_reduce_scatter": lambda m: ts.ops.gemm_reduce_scatter(torch.ones(2 * m, k), w, plan="fused"),
        "gemm_all_reduce": lambda m: ts.ops.gemm_all_reduce(torch.ones(m, k), w, plan="fused"),
    }
    for op in ops.values():  # every row count is seen by every rank first
        for m in (0, 64, 72):
            op(m)
    if os.environ["TILESCALE_TEST_CASE"] == "mismatch":
        for name, op in ops.items():
            expect_mismatch(name, lambda op=op: op(64 if rank == 0 else 72))
        results = [op(0) for op in ops.values()]
        assert [tuple(r.shape) for r in results] == [(0, n), (0, n), (0, n)], [r.shape for r in results]
        print(f"EMPTY-OK rank={rank}", flush=True)
    else:
        try:
            ops["all_gather_gemm"](0 if rank == 0 else 64)
            ts.synchronize()
        except (TimeoutError, ts.WaitTimeoutError, ts.ShapeMismatchError) as err:
            msg = str(err).replace("\n", " ")
            print(f"ZERO-ROWS-ERROR rank={rank} type={type(err).__name__} msg={msg}", flush=True)
            # Rank 0 serves the job's store, which rank 1's wait uses until it times out.
            store = ts.current().group.store
            store.set(f"test/error-{rank}", "1")
            store.wait([f"test/error-{1 - rank}"], timedelta(seconds=60))
            os._exit(0)  # the job's state is undefined after the error: end without finalize
        raise AssertionError(f"rank {rank}: zero rows on rank 0 only returned without an error")
    ts.finalize()


if __name__ == "__main__":
    main()
