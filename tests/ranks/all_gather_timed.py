"""Rank program: examples/all_gather.py run in this process after its imports, its wall time
printed (``WORK-S``), so the CPU path's speed test times the example's work (init, the
exchange, its checks and benchmark loop, finalize) without two process start-ups' noise."""

import runpy
import time
from pathlib import Path

import tilescale.language  # noqa: F401  (the DSL, as the example imports it)
import tilescale.ops  # noqa: F401  (ts.ops loads on first use: the example uses it)

start = time.monotonic()
runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "all_gather.py"), run_name="__main__")
print(f"WORK-S {time.monotonic() - start:.2f}", flush=True)
