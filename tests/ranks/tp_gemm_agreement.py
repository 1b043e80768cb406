"""Rank program (2 ranks): the fused TP GEMMs when ranks pass different row counts after each
count has been seen, or the same rows with another tile or producer, and with zero rows.

``TILESCALE_TEST_CASE`` picks what runs:

* ``mismatch``: one disagreeing call of each op and plan (both all-gather producers, the
  one- and two-kernel reduce-scatter and all-reduce), each after agreeing calls and counted
  on the device, like them, as one call by its own kernels, then calls that differ only in the
  all-gather's tile or producer; markers ``MISMATCH case=<case> rank=<r> msg=<message>``,
  then ``EMPTY-OK rank=<r>`` after zero rows on every rank gave empty results;
* ``zero-on-one-rank``: rank 0 passes zero rows, rank 1 64 (both counts seen before); every
  rank must raise (within the test's short timeouts), marker ``ZERO-ROWS-ERROR rank=<r>
  type=<exception> msg=<message>``.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
from expect import counted_calls, exchange_states, expect_mismatch

import tilescale as ts
from tilescale.ops._gemm import WIDE, TileConfig

# 64 x 64 tiles: 5 column tiles of N = 320 are more blocks than the CPU path's 4 "SMs", so
# gemm_all_reduce takes its two-kernel plan.
SHORT = TileConfig(64, 64, 64, 2, 128, "FullRow")


def main() -> None:
    ts.init()
    rank = ts.rank()
    assert ts.world_size() == 2
    k, n = 64, 32
    w, w_long, w_wide = torch.ones(n, k), torch.ones(n, 2 * k), torch.ones(320, k)
    # K = 128 on the CPU path's 4 "SMs": the reduce-scatter splits K (its GEMM kernel, then the
    # reduction kernel), the all-reduce too, in its one kernel.
    ops = {
        "all_gather_gemm": lambda m: ts.ops.all_gather_gemm(torch.ones(m, k), w, plan="fused",
                                                            producer="copy_engine"),
        "all_gather_gemm_sm": lambda m: ts.ops.all_gather_gemm(torch.ones(m, k), w, plan="fused", producer="sm"),
        "gemm_reduce_scatter": lambda m: ts.ops.gemm_reduce_scatter(torch.ones(2 * m, k), w, plan="fused"),
        "gemm_reduce_scatter_split_k": lambda m: ts.ops.gemm_reduce_scatter(torch.ones(2 * m, 2 * k), w_long,
                                                                            plan="fused"),
        "gemm_all_reduce": lambda m: ts.ops.gemm_all_reduce(torch.ones(m, k), w, plan="fused"),
        "gemm_all_reduce_split_k": lambda m: ts.ops.gemm_all_reduce(torch.ones(m, 2 * k), w_long, plan="fused"),
        "gemm_all_reduce_two_kernels": lambda m: ts.ops.gemm_all_reduce(torch.ones(m, k), w_wide, plan="fused",
                                                                        tile=SHORT),
    }
    # The same rows, another plan: (rank 0's call, rank 1's call).
    plans = {
        "all_gather_gemm_tile": (ops["all_gather_gemm"],
                                 lambda m: ts.ops.all_gather_gemm(torch.ones(m, k), w, plan="fused", tile=WIDE)),
        "all_gather_gemm_producer": (ops["all_gather_gemm"], ops["all_gather_gemm_sm"]),
    }
    for op in ops.values():  # every row count is seen by every rank first
        for m in (0, 64, 72, 80):
            op(m)
    for pair in plans.values():
        for op in pair:
            op(64)
    if os.environ["TILESCALE_TEST_CASE"] == "mismatch":
        for name, op in ops.items():
            # The call that raises still counts as one call on the device, as every call does: a
            # later call's buffer set and flag targets stay those of the ranks' other calls.
            counted = name != "all_gather_gemm"  # the copy engines' calls are counted on the host
            # 72 and 80 rows pad to the same tile (one of 128 rows): the same buffers and flags.
            step = counted_calls(lambda op=op: op(72), 3)[0] if counted else 0
            before = exchange_states()
            expect_mismatch(name, lambda op=op: op(72 if rank == 0 else 80))
            after = exchange_states()
            if counted:
                changed = [[a - b for a, b in zip(after[key], before[key], strict=True)] for key in after
                           if after[key] != before[key]]
                assert changed == [[1, step, 0]], (name, changed, step)
        # Last: after the producers differed, each rank's count of all-gather calls differs per producer.
        for name, pair in plans.items():
            expect_mismatch(name, lambda pair=pair: pair[rank](64))
        # 64 rows take the 64-row tile, 72 a 128-row one: other kernels and exchanges per rank.
        expect_mismatch("gemm_all_reduce_tiles", lambda: ops["gemm_all_reduce"](64 if rank == 0 else 72))
        results = [op(0) for op in ops.values()]
        assert [tuple(r.shape) for r in results] == [(0, n)] * 6 + [(0, 320)], [r.shape for r in results]
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
