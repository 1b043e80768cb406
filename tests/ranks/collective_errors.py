"""Rank program (2 ranks): collective allocations that disagree, then a rank that never allocates.

Markers (one line each, checked by tests/test_symmetric.py):

``SHAPE-MISMATCH rank=<r> seconds=<t> msg=<message>``    every rank, on the ValueError
``DTYPE-MISMATCH rank=<r> seconds=<t> msg=<message>``    every rank, on the ValueError
``AFTER-MISMATCH-OK rank=<r>``                           an agreeing allocation still works
``TIMEOUT rank=0 seconds=<t> msg=<message>``             rank 0, on the TimeoutError
``SKIPPED rank=1``                                       rank 1, which never called ts.empty
``JOB <id>``                                             the job id in /dev/shm names
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch

import tilescale as ts


def expect_error(kind: type[Exception], marker: str, call) -> None:
    start = time.monotonic()
    try:
        call()
    except kind as err:
        msg = str(err).replace("\n", " ")
        print(f"{marker} rank={ts.rank()} seconds={time.monotonic() - start:.2f} msg={msg}", flush=True)
    else:
        raise AssertionError(f"rank {ts.rank()}: {marker}: no {kind.__name__}")


def main() -> None:
    rt = ts.init()
    print(f"JOB {rt.group.job_id}", flush=True)
    rank = ts.rank()
    assert ts.world_size() == 2

    shape = (3, 5) if rank == 1 else (4, 8)
    expect_error(ValueError, "SHAPE-MISMATCH", lambda: ts.empty(shape, dtype=torch.float32))
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    expect_error(ValueError, "DTYPE-MISMATCH", lambda: ts.zeros((16,), dtype=dtype))

    # The failed calls consumed the same number of tags on every rank: the next one agrees.
    x = ts.zeros((2, 2), dtype=torch.int32)
    ts.peer_view(x, 1 - rank).fill_(rank + 1)
    ts.barrier()
    assert torch.equal(x, torch.full((2, 2), 2 - rank, dtype=torch.int32)), x
    ts.barrier()
    print(f"AFTER-MISMATCH-OK rank={rank}", flush=True)

    # Rank 1 skips the next allocation; rank 0 must time out (after TILESCALE_COLLECTIVE_TIMEOUT_S,
    # which the test sets) naming it instead of hanging.
    store = ts.current().group.store
    if rank == 0:
        expect_error(TimeoutError, "TIMEOUT", lambda: ts.empty((8,), dtype=torch.float32))
        store.set("test/rank0-done", "1")
    else:
        store.wait(["test/rank0-done"], timedelta(seconds=60))
        print("SKIPPED rank=1", flush=True)
        time.sleep(0.5)  # let rank 0 read the store before the job ends


if __name__ == "__main__":
    main()
