"""Rank programs of tests/test_reliability_launch.py (2 ranks, CPU path): ``reliability.py MODE``.

Every mode prints ``JOB <job id>`` and ``PID <pid>`` right after init, so that the test can
find the job's names in /dev/shm and its processes.

hold
    Every rank fills a symmetric tensor with its launch id's hash and rank, then checks its
    peer's copy until the file named by ``HOLD_UNTIL`` exists (at most 60 s): meanwhile the
    test tries to start a second job, or a stray rank, on the same port.
allocate
    Allocate symmetric tensors in a loop until killed (``ALLOCATING`` once started).
die-in-alloc
    Rank 0 allocates 64 MiB; rank 1 takes the allocation's first step and SIGKILLs itself once
    rank 0's segment exists, so that rank 0 is inside the allocation when its peer dies.
exit-early R
    Rank R exits 0 right after init, without finalize; the other allocates, and must learn at once.
atomics
    An all-reduce on the CPU path (its kernels take the job-wide lock), then exit 0 without finalize.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import zlib
from pathlib import Path

import torch

import tilescale as ts

mode = sys.argv[1]
ts.init()
group = ts.current().group
rank, other = ts.rank(), 1 - ts.rank()
print(f"JOB {group.job_id}", flush=True)
print(f"PID {os.getpid()}", flush=True)

if mode == "hold":
    mark = zlib.crc32(os.environ["TILESCALE_LAUNCH_ID"].encode())
    x = ts.zeros((1024,), dtype=torch.int64)
    x.fill_(mark * 10 + rank)
    ts.barrier()
    peer = ts.peer_view(x, other)
    print("HOLDING", flush=True)
    deadline = time.monotonic() + 60
    while not Path(os.environ["HOLD_UNTIL"]).exists() and time.monotonic() < deadline:
        assert bool((peer == mark * 10 + other).all()), f"peer holds {peer[:4].tolist()}, not this launch's data"
        time.sleep(0.1)
    ts.barrier()
    assert bool((peer == mark * 10 + other).all()), f"peer holds {peer[:4].tolist()}, not this launch's data"
    print(f"DATA-OK rank={rank}", flush=True)
    ts.finalize()
elif mode == "allocate":
    print("ALLOCATING", flush=True)
    while True:
        ts.empty((1 << 18,), dtype=torch.float32)
elif mode == "die-in-alloc":
    request = ((1 << 24,), torch.float32)
    if rank == 0:
        ts.empty(*request)
        print("ALLOCATED rank=0", flush=True)  # must not happen: rank 1 died inside the allocation
    else:
        # The first step of ts.empty (the ranks agree on the request), then death: rank 0 is
        # then surely inside the allocation, its segment made, waiting for rank 1's.
        group.exchange(group.next_tag("alloc"), [list(request[0]), str(request[1])])
        segment = f"tilescale-{group.job_id}-alloc-1-0-p"
        while not any(name.startswith(segment) for name in os.listdir("/dev/shm")):
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGKILL)
elif mode == "exit-early":
    if rank == int(sys.argv[2]):
        sys.exit(0)
    start = time.monotonic()
    try:
        ts.empty((1024,), dtype=torch.float32)
    except RuntimeError as err:
        print(f"RAISED after {time.monotonic() - start:.1f} s: {err}", flush=True)
        sys.exit(1)
elif mode == "atomics":
    out = ts.ops.all_reduce(torch.full((256,), float(rank + 1)))
    assert out.tolist() == [3.0] * 256, out[:4]
    print(f"ATOMICS-OK rank={rank} lock names: {sorted(Path('/dev/shm').glob(f'tilescale-{group.job_id}*'))}",
          flush=True)
    sys.exit(0)
else:
    raise SystemExit(f"unknown mode {mode}")
