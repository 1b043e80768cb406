"""Run a program as a job of CPU-path ranks under ``tilescale run``, for the tests that do."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_cpu(script: str, n: int, env: dict | None = None, timeout: float = 280,
            args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``tilescale run -n n --cpu script *args`` from the repository root; output captured."""
    return subprocess.run(
        [sys.executable, "-m", "tilescale.launch", "run", "-n", str(n), "--cpu", script, *args],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})},
    )
