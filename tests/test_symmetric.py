"""Symmetric tensors on the CPU path, exercised by real multi-process jobs.

Each job runs one of the rank programs in tests/ranks/ (several checks per program: starting a
process and importing torch costs seconds) through ``tilescale run --cpu`` or MPICH's
``mpiexec``; the programs assert and print markers, the tests check the markers, exit codes,
timings and that no ``/dev/shm/tilescale-*`` segment of the job is left behind.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from cpu_jobs import RANKS, SHM, clean_env, launcher_cmd

import tilescale as ts
from tilescale import runtime

MPIEXEC = Path(sys.executable).parent / "mpiexec"
JOB_TIMEOUT_S = 90

needs_mpiexec = pytest.mark.skipif(
    not (MPIEXEC.is_file() and os.access(MPIEXEC, os.X_OK)), reason='needs MPICH: pip install "tilescale[mpi]"'
)
needs_shm = pytest.mark.skipif(not SHM.is_dir(), reason="needs POSIX shared memory in /dev/shm")


def shm_names() -> set[str]:
    return {p.name for p in SHM.glob("tilescale-*")} if SHM.is_dir() else set()


class Job:
    """One finished job: its command's result, wall time and the /dev/shm names it left behind."""

    def __init__(self, cmd: list[str], env: dict[str, str], timeout: float = JOB_TIMEOUT_S):
        before = shm_names()
        start = time.monotonic()
        self.result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        self.finished_at = time.time()
        self.seconds = time.monotonic() - start
        self.new_shm = shm_names() - before

    @property
    def out(self) -> str:
        return self.result.stdout

    @property
    def err(self) -> str:
        return self.result.stderr

    def explain(self) -> str:
        return (
            f"exit {self.result.returncode} after {self.seconds:.1f} s\n--- stdout\n{self.out}\n--- stderr\n{self.err}"
        )

    def job_ids(self) -> set[str]:
        return set(re.findall(r"JOB ([0-9a-f]{12})", self.out))

    def assert_no_shm_left(self) -> None:
        """No segment of this job is left in /dev/shm (other concurrent jobs' segments are ignored)."""
        ids = self.job_ids()
        assert ids, self.explain()
        left = sorted(name for name in self.new_shm if any(job in name for job in ids))
        assert not left, f"shared-memory segments left behind: {left}"


def cpu_job(n: int, script: Path, **env: str) -> Job:
    """``tilescale run -n n --cpu script`` to its end."""
    return Job(launcher_cmd("-n", n, "--cpu", script), clean_env(**env))


# --- the full symmetric-tensor program, 4 ranks through tilescale run, 2 through mpiexec --------


@pytest.fixture(scope="module")
def four_ranks() -> Job:
    return cpu_job(4, RANKS / "symmetric_ops.py")


@pytest.mark.timeout(120)
def test_four_ranks_exchange_through_symmetric_tensors_and_views(four_ranks):
    job = four_ranks
    assert job.result.returncode == 0, job.explain()
    for rank in range(4):
        # Every assert in the program ran: allocation in float32, bfloat16 and int32, writes into
        # the right neighbour, views (row and strided column slices), error types, init/finalize.
        assert f"[rank {rank}] SYMMETRIC-OK rank={rank} world=4" in job.out, job.explain()
    assert len(job.job_ids()) >= 1


@needs_shm
@pytest.mark.timeout(120)
def test_four_rank_job_leaves_no_shared_memory(four_ranks):
    four_ranks.assert_no_shm_left()


@pytest.mark.timeout(180)
def test_many_live_tensors_keep_their_own_peers_and_dropped_ones_come_back():
    """Of the whole job and of a process group: four tensors alive at once, written through peer
    views and a kernel, each receives its own data; dropped tensors leave the registry (on
    NVSHMEM their heap ranges come back: the GPU run of the same program, test_gpu.py)."""
    job = cpu_job(3, RANKS / "symmetric_lifetime.py")
    assert job.result.returncode == 0, job.explain()
    for rank in range(3):
        assert f"LIFETIME-OK rank={rank} world=3" in job.out, job.explain()


@pytest.mark.timeout(120)
def test_init_after_finalize_works_in_a_launched_job(four_ranks):
    job = four_ranks
    for rank in range(4):
        assert f"REINIT-OK rank={rank}" in job.out, job.explain()


@needs_mpiexec
@pytest.mark.timeout(120)
def test_two_ranks_under_mpiexec_agree_on_a_rendezvous_through_mpi():
    # mpiexec gives PMI_RANK/PMI_SIZE and no MASTER_ADDR: init picks the address over mpi4py.
    pytest.importorskip("mpi4py")
    job = Job(
        [str(MPIEXEC), "-n", "2", sys.executable, str(RANKS / "symmetric_ops.py")], clean_env(TILESCALE_DEVICE="cpu")
    )
    assert job.result.returncode == 0, job.explain()
    for rank in range(2):
        assert f"SYMMETRIC-OK rank={rank} world=2" in job.out, job.explain()
        # A fresh rendezvous port per init: init after finalize works here.
        assert f"REINIT-OK rank={rank}" in job.out, job.explain()
    if SHM.is_dir():
        job.assert_no_shm_left()


# --- collective errors: mismatching allocations, a rank that never allocates ------------------


@pytest.fixture(scope="module")
def collective_errors() -> Job:
    return cpu_job(2, RANKS / "collective_errors.py", TILESCALE_COLLECTIVE_TIMEOUT_S="3")


def markers(job: Job, name: str) -> dict[int, tuple[float, str]]:
    """``{rank: (seconds, message)}`` of the ``NAME rank=R seconds=S msg=M`` lines."""
    found = {}
    for rank, seconds, msg in re.findall(rf"{name} rank=(\d+) seconds=([\d.]+) msg=(.*)", job.out):
        found[int(rank)] = (float(seconds), msg)
    return found


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("marker", "mine", "theirs"),
    [
        (
            "SHAPE-MISMATCH",
            "ranks [0]: shape=(4, 8) dtype=torch.float32",
            "ranks [1]: shape=(3, 5) dtype=torch.float32",
        ),
        ("DTYPE-MISMATCH", "ranks [0]: shape=(16,) dtype=torch.float32", "ranks [1]: shape=(16,) dtype=torch.bfloat16"),
    ],
)
def test_mismatched_allocation_raises_value_error_on_every_rank(collective_errors, marker, mine, theirs):
    job = collective_errors
    assert job.result.returncode == 0, job.explain()
    found = markers(job, marker)
    assert set(found) == {0, 1}, job.explain()
    for seconds, msg in found.values():
        assert mine in msg and theirs in msg, msg
        assert seconds < 5, f"detecting the mismatch took {seconds} s"
    # The failed calls kept the ranks in step: the next agreeing allocation works.
    assert "AFTER-MISMATCH-OK rank=0" in job.out and "AFTER-MISMATCH-OK rank=1" in job.out, job.explain()


@pytest.mark.timeout(120)
def test_rank_that_never_allocates_makes_the_others_time_out_naming_it(collective_errors):
    job = collective_errors
    assert job.result.returncode == 0, job.explain()
    found = markers(job, "TIMEOUT")
    assert set(found) == {0}, job.explain()
    seconds, msg = found[0]
    assert "ranks [1]" in msg and "3 s" in msg, msg
    assert 2.5 <= seconds < 15, f"TILESCALE_COLLECTIVE_TIMEOUT_S=3 but the wait took {seconds} s"
    assert "[rank 1] SKIPPED rank=1" in job.out, job.explain()


@needs_shm
@pytest.mark.timeout(120)
def test_failed_allocations_leave_no_shared_memory(collective_errors):
    collective_errors.assert_no_shm_left()


# --- a rank that dies while the other waits ---------------------------------------------------


@pytest.mark.timeout(120)
def test_rank_exiting_during_a_barrier_fails_the_job_fast(tmp_path):
    job = cpu_job(2, RANKS / "dead_peer.py")
    assert job.result.returncode == 3, job.explain()
    assert re.search(r"rank 1 \(pid \d+\) exited with code 3", job.err), job.explain()
    assert "[rank 0] RANK0-IN-BARRIER" in job.out and "RANK0-PASSED-BARRIER" not in job.out, job.explain()
    exited = re.search(r"RANK1-EXITING at=([\d.]+)", job.out)
    assert exited, job.explain()
    assert job.finished_at - float(exited.group(1)) < 15, "the launcher took too long to stop rank 0"


# --- one process, no launcher -----------------------------------------------------------------


@pytest.fixture(scope="module")
def single_process() -> Job:
    # Without a launcher a program is rank 0 of a world of one.
    return Job([sys.executable, str(RANKS / "init_checks.py")], clean_env())


@pytest.mark.timeout(120)
def test_init_checks_and_idempotence_in_a_world_of_one(single_process):
    job = single_process
    assert job.result.returncode == 0, job.explain()
    assert "INIT-CHECKS-OK" in job.out, job.explain()


@pytest.mark.timeout(120)
def test_zero_size_allocation(single_process):
    assert "ZERO-SIZE-OK" in single_process.out, single_process.explain()


@pytest.mark.timeout(120)
def test_failed_init_leaves_no_process_group(single_process):
    assert "PROCESS-GROUP-LEFT=False" in single_process.out, single_process.explain()


def test_allocating_before_init_raises(monkeypatch):
    monkeypatch.setattr(runtime, "_runtime", None)
    assert not ts.is_initialized()
    for call in (lambda: ts.zeros((2, 3)), lambda: ts.empty(4, dtype=torch.bfloat16), ts.rank, ts.barrier):
        with pytest.raises(RuntimeError, match="init"):
            call()
    plain = torch.zeros(3)
    assert not ts.is_symmetric(plain)
    with pytest.raises(TypeError, match="symmetric"):
        ts.peer_view(plain, 0)
    with pytest.raises(TypeError, match="symmetric"):
        ts.peer_ptrs(plain)
    ts.finalize()  # nothing to finalize: no error


def test_first_use_inside_a_cuda_graph_capture_is_refused_clearly(monkeypatch):
    """Ops allocate symmetric buffers (every rank together) and peer tables at their first
    call at a shape: inside a capture that cannot work, so they say what to do instead."""
    runtime.check_not_capturing("moe_dispatch")  # no capture: nothing to refuse
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"moe_dispatch: first call inside a CUDA graph capture; call it once "
                                           r"before capturing"):
        runtime.check_not_capturing("moe_dispatch")
