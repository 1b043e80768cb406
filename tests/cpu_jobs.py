"""The one way tests start processes: jobs under ``tilescale run``, bare rank programs, scripts.

Every process gets :func:`clean_env` (this environment without what a launcher, MPI, Slurm or an
earlier tilescale job may have exported) plus the test's own variables, and runs from the
repository root unless told otherwise. ``tests/conftest.py`` puts this folder on ``sys.path``::

    from cpu_jobs import run_cpu

    proc = run_cpu("tests/ranks/ops_check.py", 2)           # tilescale run -n 2 --cpu ...
    assert proc.returncode == 0, proc.stderr
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from tilescale.launch.cli import MULTICAST_OFF, TORCHRUN_VARS

ROOT = Path(__file__).resolve().parent.parent
RANKS = ROOT / "tests" / "ranks"
SHM = Path("/dev/shm")

_LAUNCHER_VARS = {*TORCHRUN_VARS, *MULTICAST_OFF, "MASTER_ADDR", "MASTER_PORT"}
_LAUNCHER_PREFIXES = ("PMI_", "MPI_LOCAL", "OMPI_", "SLURM_", "TILESCALE_", "TORCHELASTIC_")
# One intra-op thread per process unless the environment says otherwise, as torchrun sets for several
# ranks on a node: a job's ranks share CI's two cores, and torch's threads (which spin between
# parallel regions) would take them from each other (about a third of a MoE job's CPU time).
_ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def clean_env(**extra: object) -> dict[str, str]:
    """This environment without launcher, MPI, Slurm or tilescale variables, plus ``extra``.

    Args:
        **extra: variables to set (values are turned into strings); they may name dropped ones.

    Returns:
        The environment for a child process: a program started with it is a world of one, with
        one intra-op thread (OMP_NUM_THREADS=1) unless this environment sets OMP_NUM_THREADS.
    """
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith(_LAUNCHER_PREFIXES)}
    return {**_ONE_THREAD, **env, **{k: str(v) for k, v in extra.items()}}


def launcher_cmd(*args: object) -> list[str]:
    """The command line of ``tilescale run ARGS`` (through this interpreter: no PATH lookup).

    Args:
        *args: the launcher's arguments, turned into strings.

    Returns:
        The argv list.
    """
    return [sys.executable, "-m", "tilescale.launch", "run", *map(str, args)]


def run_python(*args: object, env: dict[str, str] | None = None, timeout: float = 280,
               cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` to its end, output captured.

    Args:
        *args: the interpreter's arguments (a script and its arguments, or ``-c CODE``).
        env: variables set on top of :func:`clean_env`.
        timeout: seconds before ``subprocess.TimeoutExpired``.
        cwd: the working directory.

    Returns:
        The finished process.
    """
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=clean_env(**(env or {})))  # fmt: skip


def tilescale_run(*args: object, env: dict[str, str] | None = None, timeout: float = 280,
                  cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``tilescale run ARGS`` to its end, output captured (as :func:`run_python` runs a script).

    Example::

        result = tilescale_run("-n", 2, "--cpu", "--timeout-kill", 1, script)
    """
    return run_python(*launcher_cmd(*args)[1:], env=env, timeout=timeout, cwd=cwd)


def run_cpu(script: str | Path, n: int, env: dict[str, str] | None = None, timeout: float = 280,
            args: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """``tilescale run -n n --cpu script *args`` from the repository root, output captured.

    Args:
        script: the rank program (relative to the repository root, or absolute).
        n: the number of ranks.
        env: variables set on top of :func:`clean_env`.
        timeout: seconds before ``subprocess.TimeoutExpired``.
        args: the program's own arguments.

    Returns:
        The finished launcher process.
    """
    return tilescale_run("-n", n, "--cpu", script, *args, env=env, timeout=timeout)


class Started:
    """A process started now whose output is collected line by line while it runs.

    Example::

        job = Started(launcher_cmd("-n", 2, "--cpu", prog, "hold"), clean_env())
        job.wait_for("HOLDING", count=2)
        job.proc.send_signal(signal.SIGTERM)
        assert job.finish(60) == 128 + signal.SIGTERM, job.explain()
    """

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: Path = ROOT):
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)  # fmt: skip
        self.lines: dict[str, list[str]] = {"out": [], "err": []}
        self._readers = [threading.Thread(target=self._read, args=(pipe, self.lines[name]), daemon=True)
                         for name, pipe in (("out", self.proc.stdout), ("err", self.proc.stderr))]  # fmt: skip
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(pipe, into: list[str]) -> None:
        for line in pipe:
            into.append(line.rstrip("\n"))

    @property
    def out(self) -> str:
        return "\n".join(self.lines["out"])

    @property
    def err(self) -> str:
        return "\n".join(self.lines["err"])

    def wait_for(self, pattern: str, count: int = 1, stream: str = "out", timeout: float = 120) -> list[str]:
        """The first ``count`` lines of ``stream`` ("out" or "err") matching ``pattern``, once there are that many.

        Args:
            pattern: a regular expression searched in every line.
            count: how many matching lines to wait for.
            stream: ``"out"`` or ``"err"``.
            timeout: seconds before the wait fails its assertion.

        Returns:
            The matching lines.
        """
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in list(self.lines[stream]) if re.search(pattern, line)]
            if len(found) >= count:
                return found[:count]
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {pattern!r}:\n{self.explain()}"
            assert time.monotonic() < deadline, f"no {pattern!r} within {timeout} s:\n{self.explain()}"
            time.sleep(0.02)

    def finish(self, timeout: float = 120) -> int:
        """Wait for the end (killing the process if it outlives ``timeout``) and for its last output.

        Args:
            timeout: seconds to wait before ``subprocess.TimeoutExpired``.

        Returns:
            The exit code.
        """
        try:
            code = self.proc.wait(timeout)
        finally:
            self.proc.kill()
            for reader in self._readers:
                reader.join(5)
        return code

    def explain(self) -> str:
        return f"--- stdout\n{self.out}\n--- stderr\n{self.err}"

    def job_ids(self) -> set[str]:
        """The job ids the ranks printed as ``JOB <id>``."""
        return set(re.findall(r"JOB ([0-9a-f]+)", self.out))

    def pids(self) -> list[int]:
        """The process ids the ranks printed as ``PID <pid>``."""
        return [int(p) for p in re.findall(r"PID (\d+)", self.out)]


def launch(*args: object, env: dict[str, str] | None = None) -> Started:
    """Start ``tilescale run ARGS`` without waiting (see :class:`Started`).

    Args:
        *args: the launcher's arguments.
        env: variables set on top of :func:`clean_env`.

    Returns:
        The running launcher.
    """
    return Started(launcher_cmd(*args), clean_env(**(env or {})))


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie nobody reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Wait until none of ``pids`` runs.

    Args:
        pids: process ids.
        timeout: seconds to wait.

    Returns:
        True if all were gone within ``timeout``.
    """
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def bare_ranks(script: str | Path, *args: object, world: int, port: int,
               env: dict[str, str] | None = None) -> list[tuple[int, str, str]]:
    """Run ``world`` ranks of ``script`` started by hand, as mpirun or srun would, to their end.

    Every rank gets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR=127.0.0.1, MASTER_PORT=port and
    TILESCALE_DEVICE=cpu; no launcher hosts a store.

    Args:
        script: the rank program.
        *args: its arguments.
        world: the number of ranks.
        port: MASTER_PORT.
        env: further variables for every rank.

    Returns:
        ``(exit code, stdout, stderr)`` of every rank, in rank order.
    """
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *map(str, args)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=clean_env(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=port, TILESCALE_DEVICE="cpu", **(env or {})),
        )
        for rank in range(world)
    ]  # fmt: skip
    return [(p.wait(timeout=150), *p.communicate()) for p in procs]


def run_examples(n: int, specs: list[str], timeout: float = 840) -> subprocess.CompletedProcess[str]:
    """One job of ``n`` CPU-path ranks that runs several examples (tests/ranks/run_examples.py).

    Example::

        proc = run_examples(2, ["all_gather", "hf_llama_tp=/tmp/ckpt"])
        assert "correct" in example_output(proc.stdout, 0, "all_gather")

    Args:
        n: the number of ranks.
        specs: ``NAME`` or ``NAME=ARG`` per example, run in this order.
        timeout: seconds for the whole job.

    Returns:
        The finished launcher process.
    """
    return run_cpu(RANKS / "run_examples.py", n, timeout=timeout, args=tuple(specs))


def example_output(stdout: str, rank: int | None, spec: str) -> str | None:
    """What ``rank`` printed while it ran the example ``spec`` in a :func:`run_examples` job.

    Args:
        stdout: the job's output.
        rank: the rank; None for tests/ranks/run_examples.py run by plain python (one process).
        spec: the example as given to :func:`run_examples`.

    Returns:
        Its lines (without the rank prefix), or None if the rank did not finish that example.
    """
    prefix = "" if rank is None else f"[rank {rank}] "
    lines = [line[len(prefix):] for line in stdout.splitlines() if line.startswith(prefix)]
    begin, end = f"EXAMPLE-BEGIN {spec}", f"EXAMPLE-END {spec}"
    if begin not in lines or end not in lines:
        return None
    return "\n".join(lines[lines.index(begin) + 1:lines.index(end)])
