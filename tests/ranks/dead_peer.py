"""Rank program (2 ranks): rank 1 exits with code 3 right after init while rank 0 waits in a barrier."""

from __future__ import annotations

import sys
import time

import tilescale as ts

ts.init()
if ts.rank() == 1:
    print(f"RANK1-EXITING at={time.time():.3f}", flush=True)
    sys.exit(3)
print("RANK0-IN-BARRIER", flush=True)
ts.barrier()
print("RANK0-PASSED-BARRIER", flush=True)  # must never happen
