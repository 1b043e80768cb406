"""Issue 19, launcher and teardown: isolated jobs, no leaks, no orphans, fast and short errors.

Every test runs real processes on the CPU path (``tilescale run -n 2 --cpu``, or ranks started
by hand as a bare launcher would) and sends real signals. Other jobs may run on this machine at
the same time, so /dev/shm is only ever checked for the names of the job under test, and only
names a test made itself are removed by it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cpu_jobs import RANKS, Started, bare_ranks, clean_env, gone, launch, run_python, tilescale_run

from tilescale.launch.cli import free_port, main, port_for_job

PROG = RANKS / "reliability.py"
SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs /dev/shm")


def names_of(job_id: str) -> list[str]:
    """What job ``job_id`` has in /dev/shm now."""
    return sorted(p.name for p in SHM.glob(f"tilescale-{job_id}*"))


# --- 3. job isolation ------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_a_second_job_or_stray_ranks_on_a_jobs_port_are_refused_and_the_job_keeps_its_data(tmp_path):
    # One job holds its port (its ranks check their peer's data until released) while, in turn,
    # a second launcher on the same port and ranks started by hand with its MASTER_PORT try to
    # join: a non-zero stray rank meets a foreign store (its launch id differs), a stray rank 0
    # cannot host the store on the taken port.
    port = free_port("127.0.0.1")
    release = tmp_path / "release"
    job = launch("-n", 2, "--cpu", "--master-port", port, PROG, "hold", env={"HOLD_UNTIL": str(release)})
    try:
        job.wait_for("HOLDING", count=2)
        start = time.monotonic()
        second = tilescale_run("-n", 2, "--cpu", "--master-port", port, PROG, "hold", env={"HOLD_UNTIL": release},
                               timeout=120)
        refused_in = time.monotonic() - start
        strays = bare_ranks(PROG, "hold", world=2, port=port,
                            env={"TILESCALE_LAUNCH_ID": "another-launch", "HOLD_UNTIL": release})
    finally:
        release.touch()
    assert second.returncode == 2, second.stderr
    assert f"port {port} is already in use" in second.stderr
    assert "[rank" not in second.stdout + second.stderr  # refused before any of its ranks started
    assert refused_in < 60, refused_in  # the launcher's own start-up, not a rendezvous deadline
    code, out, err = strays[1]
    assert code != 0 and "ForeignJobError" in err and f"port {port}" in err, err
    assert "another-launch" in err and "JOB " not in out
    code, out, err = strays[0]
    assert code != 0 and "PortInUseError" in err and f"port {port} is already in use" in err, err
    assert "JOB " not in out
    assert job.finish() == 0, job.explain()
    assert sorted(re.findall(r"DATA-OK rank=(\d)", job.out)) == ["0", "1"], job.explain()


@pytest.mark.timeout(60)
def test_several_nodes_without_a_port_need_a_shared_job_id(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    script = tmp_path / "rank.py"
    script.write_text("pass\n")
    assert main(["run", "--nnodes", "2", "--node-rank", "1", "-n", "1", "--cpu", str(script)]) == 2
    err = capsys.readouterr().err
    assert "--master-port" in err and "--job-id" in err


SHOW_PORT = """import os, sys
sys.stdout.write(f"PORT {os.environ['MASTER_PORT']} ID {os.environ['TILESCALE_LAUNCH_ID']}\\n")
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("args", "env", "job_id"), [
    (["--job-id", "train-42"], {}, "train-42"),
    ([], {"SLURM_JOB_ID": "777", "SLURM_STEP_ID": "3"}, "777.3"),
])  # fmt: skip
def test_several_nodes_derive_the_port_and_launch_id_from_the_job(tmp_path, args, env, job_id):
    script = tmp_path / "rank.py"
    script.write_text(SHOW_PORT)
    result = tilescale_run("--nnodes", 2, "--node-rank", 1, "-n", 2, "--cpu", *args, script, env=env, timeout=100)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "PORT" in line]
    assert len(lines) == 2 and all(line.endswith(f"PORT {port_for_job(job_id)} ID {job_id}") for line in lines)
    assert 29500 <= port_for_job(job_id) < 49500


# --- 4 and 5. signals to the launcher, dying ranks: no leaks, no orphans ------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_the_launcher_while_ranks_allocate_stops_them_and_leaves_nothing(signum):
    job = launch("-n", 2, "--cpu", "--timeout-kill", 2, PROG, "allocate")
    job.wait_for("ALLOCATING", count=2)
    time.sleep(0.3)  # well inside the allocation loop
    job.proc.send_signal(signum)
    assert job.finish(60) == 128 + signum, job.explain()
    assert f"received {signal.Signals(signum).name}; stopping all ranks" in job.err
    pids, (job_id,) = job.pids(), job.job_ids()
    assert len(pids) == 2 and gone(pids), pids
    assert names_of(job_id) == []


@pytest.mark.timeout(180)
def test_sigkill_of_the_launcher_takes_its_ranks_and_the_next_start_removes_their_names(tmp_path):
    job = launch("-n", 2, "--cpu", PROG, "allocate")
    job.wait_for("ALLOCATING", count=2)
    time.sleep(0.3)
    job.proc.kill()
    job.finish(30)
    pids, (job_id,) = job.pids(), job.job_ids()
    assert len(pids) == 2 and gone(pids, timeout=10), pids
    # Nothing could remove what the ranks had in /dev/shm when they were killed; the next
    # launcher's start removes it (its owners are dead).
    script = tmp_path / "rank.py"
    script.write_text("pass\n")
    after = tilescale_run("-n", 1, "--cpu", script, timeout=120)
    assert after.returncode == 0, after.stderr
    assert names_of(job_id) == []


@pytest.mark.timeout(120)
def test_names_whose_creator_is_dead_are_removed_at_the_next_start(tmp_path):
    # Dead creators: one exited and reaped, one exited and left a zombie nobody reaps (as ranks
    # orphaned by a SIGKILLed launcher stay where a container's init does not reap them).
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    assert gone([zombie.pid], timeout=30) and Path(f"/proc/{zombie.pid}").exists()
    tag = f"{os.getpid():x}{time.monotonic_ns():x}"
    stale = [SHM / f"tilescale-{tag}-alloc-0-{i}-p{p.pid}" for i, p in enumerate((dead, zombie))]
    live = SHM / f"tilescale-{tag}-alloc-0-2-p{os.getpid()}"  # this test's own: alive
    script = tmp_path / "rank.py"
    script.write_text("pass\n")
    try:
        for path in (*stale, live):
            path.write_bytes(b"x")
        result = tilescale_run("-n", 1, "--cpu", script, timeout=100)
        assert result.returncode == 0, result.stderr
        assert not any(path.exists() for path in stale) and live.exists()
        assert "removed" in result.stderr and "dead jobs" in result.stderr
    finally:
        zombie.wait()
        for path in (*stale, live):
            path.unlink(missing_ok=True)


@pytest.mark.timeout(180)
def test_rank_killed_inside_an_allocation_leaves_no_segment():
    job = launch("-n", 2, "--cpu", PROG, "die-in-alloc")
    assert job.finish() == 128 + signal.SIGKILL, job.explain()
    assert "rank 1 (pid" in job.err and "killed by SIGKILL" in job.err
    assert "ALLOCATED" not in job.out
    (job_id,) = job.job_ids()
    assert gone(job.pids())
    assert names_of(job_id) == []


@pytest.mark.timeout(180)
def test_cpu_kernels_taking_the_job_lock_leave_no_lock_file_without_finalize():
    job = launch("-n", 2, "--cpu", PROG, "atomics")
    assert job.finish() == 0, job.explain()
    assert job.out.count("lock names: []") == 2, job.explain()  # none while the job ran
    (job_id,) = job.job_ids()
    assert names_of(job_id) == [] and not (SHM / f"tilescale-{job_id}.lock").exists()


# --- 7. fast, short errors ----------------------------------------------------------------


@pytest.mark.timeout(180)
@pytest.mark.parametrize("leaver", [1, 0])
def test_peer_that_exited_zero_is_named_at_once(leaver):
    job = launch("-n", 2, "--cpu", PROG, "exit-early", leaver)
    assert job.finish() == 1, job.explain()
    raised = re.search(r"RAISED after ([\d.]+) s: (.*)", job.out)
    assert raised, job.explain()
    assert float(raised.group(1)) < 10, raised.group(0)  # not the 120 s collective deadline
    assert f"for rank {leaver}, which exited" in raised.group(2)  # "with code 0" once the launcher has said so
    assert "frame #" not in job.err and "Broken pipe" not in job.err


@pytest.mark.timeout(180)
def test_rank_0_exiting_under_a_bare_launcher_gives_a_short_error():
    # Started by hand, as mpirun or srun would: rank 0 hosts the store and takes it along.
    port = free_port("127.0.0.1")
    (code0, _, err0), (code1, out1, err1) = bare_ranks(PROG, "exit-early", 0, world=2, port=port,
                                                       env={"TILESCALE_LAUNCH_ID": "bare"})
    assert code0 == 0, err0
    assert code1 == 1, err1
    (raised,) = [line for line in out1.splitlines() if line.startswith("RAISED")]
    assert "rank 0" in raised and ("exited" in raised or "lost the job's store" in raised), raised
    assert float(re.search(r"RAISED after ([\d.]+) s", raised).group(1)) < 10
    assert "frame #" not in err1 and "Broken pipe" not in err1, err1


@pytest.mark.timeout(60)
def test_missing_tilescale_mpiexec_is_a_clear_error(tmp_path, capsys, monkeypatch):
    script = tmp_path / "rank.py"
    script.write_text("pass\n")
    monkeypatch.setenv("TILESCALE_MPIEXEC", str(tmp_path / "no-such-mpiexec"))
    assert main(["run", "--launcher", "mpirun", "-n", "2", str(script)]) == 2
    err = capsys.readouterr().err
    assert "TILESCALE_MPIEXEC" in err and "no-such-mpiexec" in err and "no such executable" in err


@pytest.mark.timeout(120)
def test_stale_rank_variables_without_a_rendezvous_fail_at_once():
    result = run_python(PROG, "hold", env={"RANK": "1", "WORLD_SIZE": "2", "TILESCALE_DEVICE": "cpu"}, timeout=100)
    assert result.returncode != 0
    assert "RANK=1 and WORLD_SIZE=2 are set but MASTER_ADDR/MASTER_PORT are not" in result.stderr, result.stderr


@pytest.mark.timeout(180)
def test_stale_rendezvous_variables_say_within_seconds_who_is_awaited():
    port = free_port("127.0.0.1")  # nobody listens there
    stale = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "TILESCALE_DEVICE": "cpu"}  # fmt: skip
    waiting = Started([sys.executable, str(PROG), "hold"], clean_env(**stale))
    try:
        (line,) = waiting.wait_for(r"has waited", stream="err", timeout=120)
    finally:
        waiting.proc.kill()
        waiting.finish()
    seconds = float(re.search(r"has waited (\d+) s", line).group(1))
    assert seconds <= 5 and f"the job's store at 127.0.0.1:{port}" in line and "left over from another job" in line
    # With a deadline of its own it gives up with a clear error, naming what it waited for.
    result = run_python(PROG, "hold", env={**stale, "TILESCALE_INIT_TIMEOUT_S": "3"}, timeout=150)
    assert result.returncode != 0
    assert f"no store answered at 127.0.0.1:{port} within 3 s" in result.stderr, result.stderr
