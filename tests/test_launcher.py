"""Tests for ``tilescale run`` (launch/cli.py): every test starts the launcher and its ranks as real processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from cpu_jobs import clean_env, gone, launch, tilescale_run

from tilescale.launch.cli import MULTICAST_OFF, extra_env, find_mpiexec, free_port, main

# Ranks print the variables they were given as one JSON object per line. Each line is one
# write: print() writes the text and the newline separately, and MPICH hydra's -prepend-rank
# output is not line-atomic, so two ranks' print() lines can interleave under mpirun.
SHOW_ENV = r"""
    import json, os, sys
    names = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
             "MASTER_PORT", "TILESCALE_DEVICE", "PYTHONUNBUFFERED", "PMI_RANK", "PMI_SIZE",
             "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
             "TILESCALE_SHARE_GPUS"]
    sys.stdout.write(json.dumps({n: os.environ.get(n) for n in names}) + "\n")
    sys.stderr.write("hello on stderr\n")
"""

needs_mpiexec = pytest.mark.skipif(find_mpiexec() is None, reason='needs MPICH: pip install "tilescale[mpi]"')


def write_script(tmp_path: Path, body: str, name: str = "rank.py") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def rank_envs(stdout: str, prefix: str = "[rank {}] ") -> dict[int, dict[str, str | None]]:
    """Parse the SHOW_ENV lines of every rank, keyed by the rank in the output prefix."""
    envs = {}
    for line in stdout.splitlines():
        for rank in range(16):
            tag = prefix.format(rank)
            if line.startswith(tag):
                envs[rank] = json.loads(line[len(tag) :])
    return envs


def test_ranks_sharing_a_node_get_one_intra_op_thread_unless_the_user_set_it():
    # As torchrun: several ranks' torch thread pools would each take every core of the node.
    assert extra_env({}, cpu=True, nproc=2)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in extra_env({"OMP_NUM_THREADS": "8"}, cpu=False, nproc=4)  # the user's, inherited
    assert "OMP_NUM_THREADS" not in extra_env({}, cpu=False, nproc=1)


# --- the auto launcher -----------------------------------------------------------------


@pytest.mark.timeout(60)
def test_four_cpu_ranks_get_torchrun_env_and_prefixed_output(tmp_path):
    result = tilescale_run("-n", 4, "--cpu", write_script(tmp_path, SHOW_ENV))
    assert result.returncode == 0, result.stderr
    envs = rank_envs(result.stdout)
    assert sorted(envs) == [0, 1, 2, 3]
    port = envs[0]["MASTER_PORT"]
    assert port is not None and 0 < int(port) < 65536
    for rank, env in envs.items():
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
        assert env["GROUP_RANK"] == "0"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] == port
        assert env["TILESCALE_DEVICE"] == "cpu"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert {name: env[name] for name in MULTICAST_OFF} == MULTICAST_OFF
        assert f"[rank {rank}] hello on stderr" in result.stderr.splitlines()
        assert env["TILESCALE_SHARE_GPUS"] is None
    assert "warning" not in result.stderr


@pytest.mark.timeout(60)
def test_share_gpus_is_passed_to_every_rank(tmp_path):
    result = tilescale_run("-n", 2, "--cpu", "--share-gpus", write_script(tmp_path, SHOW_ENV))
    assert result.returncode == 0, result.stderr
    envs = rank_envs(result.stdout)
    assert [envs[r]["TILESCALE_SHARE_GPUS"] for r in (0, 1)] == ["1", "1"]


@pytest.mark.timeout(60)
def test_node_rank_offsets_global_ranks(tmp_path):
    script = write_script(tmp_path, SHOW_ENV)
    result = tilescale_run(
        "--nnodes", 2, "--node-rank", 1, "-n", 2, "--master-addr", "10.1.2.3", "--master-port", 29555, "--cpu", script
    )
    assert result.returncode == 0, result.stderr
    envs = rank_envs(result.stdout)
    assert sorted(envs) == [2, 3]
    for rank, env in envs.items():
        assert env["RANK"] == str(rank)
        assert env["LOCAL_RANK"] == str(rank - 2)
        assert env["WORLD_SIZE"] == "4"
        assert env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "1"
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.1.2.3", "29555")


@pytest.mark.timeout(120)
def test_two_nodes_on_localhost_rendezvous_into_one_job(tmp_path):
    # Two launchers, as on two nodes, each starting 2 ranks; the 4 ranks form one gloo group.
    script = write_script(
        tmp_path,
        """
        import json, os, sys
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")  # env://: the launcher's RANK, WORLD_SIZE, MASTER_ADDR/PORT
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total)
        names = ["RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"]
        sys.stdout.write(json.dumps({**{n: os.environ[n] for n in names}, "sum": int(total)}) + "\\n")
        dist.destroy_process_group()
        """,
    )
    port = free_port("127.0.0.1")
    nodes = [
        launch("--nnodes", 2, "--node-rank", node, "-n", 2, "--master-addr", "127.0.0.1", "--master-port", port,
               "--cpu", script)
        for node in (1, 0)  # the node of rank 0 may start last: the others wait for its store
    ]
    for node in nodes:
        assert node.finish(100) == 0, node.explain()
        assert "other nodes cannot reach it" in node.err  # 127.0.0.1 is only right for this test
    envs = {**rank_envs(nodes[0].out), **rank_envs(nodes[1].out)}
    assert sorted(envs) == [0, 1, 2, 3]
    for rank, env in envs.items():
        assert env["sum"] == 0 + 1 + 2 + 3
        assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank), str(rank % 2), str(rank // 2))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")


@pytest.mark.timeout(60)
def test_exported_multicast_switch_is_forced_off_with_a_warning(tmp_path):
    env = {"NCCL_NVLS_ENABLE": "1", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    result = tilescale_run("-n", 1, "--cpu", write_script(tmp_path, SHOW_ENV), env=env)
    assert result.returncode == 0, result.stderr
    assert rank_envs(result.stdout)[0]["NCCL_NVLS_ENABLE"] == "0"
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, result.stderr  # the variable already off is left alone
    assert "NCCL_NVLS_ENABLE=1" in warnings[0]


@pytest.mark.timeout(60)
def test_failed_rank_stops_the_others_and_sets_the_exit_code(tmp_path):
    # Rank 0 starts a child of its own and sleeps; rank 1 fails once both are running.
    pids = tmp_path / "pids"
    script = write_script(
        tmp_path,
        f"""
        import os, subprocess, sys, time
        from pathlib import Path
        pids = Path({str(pids)!r})
        if os.environ["RANK"] == "0":
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            (pids.parent / "tmp").write_text(f"{{os.getpid()}} {{child.pid}}")
            (pids.parent / "tmp").rename(pids)
            time.sleep(60)
        while not pids.exists():
            time.sleep(0.02)
        print("rank 1 gives up", file=sys.stderr)
        sys.exit(3)
        """,
    )
    start = time.monotonic()
    result = tilescale_run("-n", 2, "--cpu", script)
    assert time.monotonic() - start < 10
    assert result.returncode == 3
    assert "[rank 1] rank 1 gives up" in result.stderr
    summary = [line for line in result.stderr.splitlines() if line.startswith("tilescale run: rank 1 (pid ")]
    assert len(summary) == 1 and "exited with code 3" in summary[0], result.stderr
    # The whole process group of rank 0 went, its child included.
    assert gone([int(pid) for pid in pids.read_text().split()], timeout=5)


@pytest.mark.timeout(60)
def test_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path):
    ready = tmp_path / "ready"
    script = write_script(
        tmp_path,
        f"""
        import os, signal, sys, time
        from pathlib import Path
        ready = Path({str(ready)!r})
        if os.environ["RANK"] == "0":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            ready.write_text(str(os.getpid()))
            time.sleep(60)
        while not ready.exists() or not ready.read_text():
            time.sleep(0.02)
        sys.exit(4)
        """,
    )
    start = time.monotonic()
    result = tilescale_run("-n", 2, "--cpu", "--timeout-kill", 1, script)
    assert time.monotonic() - start < 15
    assert result.returncode == 4, result.stderr
    assert gone([int(ready.read_text())], timeout=5)


@pytest.mark.timeout(60)
def test_rank_killed_by_a_signal_is_reported(tmp_path):
    script = write_script(
        tmp_path,
        """
        import os, signal, time
        if os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
        """,
    )
    result = tilescale_run("-n", 2, "--cpu", script)
    assert result.returncode == 128 + signal.SIGKILL
    assert "rank 1 (pid " in result.stderr and "killed by SIGKILL (9)" in result.stderr, result.stderr


@pytest.mark.timeout(60)
def test_sigint_to_the_launcher_stops_every_rank(tmp_path):
    script = write_script(
        tmp_path,
        """
        import os, time
        print("ready", os.getpid())
        time.sleep(60)
        """,
    )
    job = launch("-n", 2, "--cpu", script)
    try:
        pids = [int(line.split()[-1]) for line in job.wait_for("ready", count=2, timeout=40)]
    finally:
        job.proc.send_signal(signal.SIGINT)  # also when the wait failed: the launcher stops its ranks
    assert job.finish(20) == 128 + signal.SIGINT, job.explain()
    assert gone(pids, timeout=5)


# --- refusals (in-process: nothing gets started) ----------------------------------------


@pytest.mark.timeout(30)
def test_missing_script_exits_2_with_a_message(tmp_path, capsys):
    assert main(["run", "-n", "2", "--cpu", str(tmp_path / "nowhere.py")]) == 2
    err = capsys.readouterr().err
    assert "script not found" in err and "nowhere.py" in err


@pytest.mark.timeout(30)
def test_mpirun_launcher_refuses_several_nodes(tmp_path, capsys):
    script = write_script(tmp_path, "pass\n")
    assert main(["run", "--launcher", "mpirun", "--nnodes", "2", "-n", "2", str(script)]) == 2
    assert "hostfile" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args",
    [
        ["--nnodes", "2", "--node-rank", "2"],
        ["-n", "0"],
        ["--launcher", "srun"],
        ["--master-port", "70000"],
        ["-n", "two"],
    ],
)
def test_bad_arguments_exit_2(tmp_path, capsys, args):
    script = write_script(tmp_path, "pass\n")
    with pytest.raises(SystemExit) as exc:
        main(["run", *args, str(script)])
    assert exc.value.code == 2
    assert "tilescale run: error:" in capsys.readouterr().err


# --- torchrun and mpirun ---------------------------------------------------------------


@pytest.mark.timeout(120)
def test_torchrun_launcher_on_cpu(tmp_path):
    result = tilescale_run("--launcher", "torchrun", "-n", 2, "--cpu", write_script(tmp_path, SHOW_ENV))
    assert result.returncode == 0, result.stderr
    envs = [json.loads(line.split(":", 1)[1]) for line in result.stdout.splitlines() if line.startswith("[default")]
    assert sorted(env["RANK"] for env in envs) == ["0", "1"]
    for env in envs:
        assert env["WORLD_SIZE"] == "2"
        assert env["TILESCALE_DEVICE"] == "cpu"
        assert {name: env[name] for name in MULTICAST_OFF} == MULTICAST_OFF


@needs_mpiexec
@pytest.mark.timeout(60)
def test_mpirun_launcher_runs_ranks_with_pmi_env(tmp_path):
    env = {"RANK": "5", "WORLD_SIZE": "9"}  # stale torchrun variables must not reach the ranks
    result = tilescale_run("--launcher", "mpirun", "-n", 2, write_script(tmp_path, SHOW_ENV), env=env)
    assert result.returncode == 0, result.stderr
    envs = rank_envs(result.stdout, prefix="[{}] ")
    assert sorted(envs) == [0, 1]
    for rank, rank_env in envs.items():
        assert (rank_env["PMI_RANK"], rank_env["PMI_SIZE"]) == (str(rank), "2")
        assert rank_env["RANK"] is None and rank_env["WORLD_SIZE"] is None
        assert rank_env["MASTER_ADDR"] == "127.0.0.1"
        assert rank_env["MASTER_PORT"] == envs[0]["MASTER_PORT"]
        assert {name: rank_env[name] for name in MULTICAST_OFF} == MULTICAST_OFF


@needs_mpiexec
@pytest.mark.timeout(60)
def test_mpirun_launcher_reports_a_failed_rank(tmp_path):
    # Hydra does not stop the other ranks when one exits non-zero (only on a crash or
    # MPI_Abort), so rank 0 here finishes on its own.
    script = write_script(tmp_path, 'import os, sys\nsys.exit(3 if os.environ["PMI_RANK"] == "1" else 0)\n')
    result = tilescale_run("--launcher", "mpirun", "-n", 2, script)
    assert result.returncode == 3
    assert "tilescale run: mpirun exited with code 3" in result.stderr


# --- multi-node scripts (launch/nvshmem_env.sh, launch/mpirun_multinode.sh) --------------

LAUNCH = Path(__file__).resolve().parents[1] / "launch"


def sourced_env(**env: str) -> dict[str, str]:
    """The environment after `source launch/nvshmem_env.sh` in a bash given only ``env``."""
    script = f'source {LAUNCH / "nvshmem_env.sh"} && env -0'
    out = subprocess.run(["bash", "-c", script], env={"PATH": os.environ["PATH"], **env}, capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    return dict(item.split("=", 1) for item in out.split("\0") if item)


def test_nvshmem_env_picks_the_rank_nic_keeps_user_values_and_forces_multicast_off():
    nics = "mlx5_0 mlx5_1 mlx5_2 mlx5_3"
    env = sourced_env(LOCAL_RANK="6", TILESCALE_NICS=nics, TILESCALE_SOCKET_IFNAME="bond0",
                      NVSHMEM_SYMMETRIC_SIZE="16G", NVSHMEM_DISABLE_NVLS="0")  # fmt: skip
    assert env["NVSHMEM_HCA_LIST"] == "mlx5_2:1"  # local rank 6 of 4 NICs
    assert env["NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "bond0"
    assert (env["NVSHMEM_REMOTE_TRANSPORT"], env["NVSHMEM_IB_ENABLE_IBGDA"]) == ("ibrc", "1")  # ibgda by default
    assert env["NVSHMEM_SYMMETRIC_SIZE"] == "16G"
    assert {name: env[name] for name in MULTICAST_OFF} == MULTICAST_OFF
    assert sourced_env(SLURM_LOCALID="1", TILESCALE_NICS=nics)["NVSHMEM_HCA_LIST"] == "mlx5_1:1"
    ucx = sourced_env(TILESCALE_NVSHMEM_TRANSPORT="ucx")
    assert (ucx["NVSHMEM_REMOTE_TRANSPORT"], ucx["NVSHMEM_IB_ENABLE_IBGDA"]) == ("ucx", "0")
    assert "NVSHMEM_HCA_LIST" not in ucx and "NCCL_SOCKET_IFNAME" not in ucx
    bad = subprocess.run(["bash", "-c", f"source {LAUNCH / 'nvshmem_env.sh'}"], capture_output=True, text=True,
                         env={"PATH": os.environ["PATH"], "TILESCALE_NVSHMEM_TRANSPORT": "tcp"})  # fmt: skip
    assert bad.returncode == 2 and "must be ibgda, ibrc or ucx" in bad.stderr


@needs_mpiexec
@pytest.mark.timeout(60)
def test_mpirun_multinode_script_runs_a_job_from_a_hostfile(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# MPICH hostfile\nlocalhost:2\n")
    script = write_script(
        tmp_path,
        r"""
        import json, os, sys
        import torch, torch.distributed as dist
        from tilescale.launch.environment import detect
        env = detect()
        dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                                rank=env.rank, world_size=env.world_size)
        total = torch.tensor([env.rank])
        dist.all_reduce(total)
        sys.stdout.write(json.dumps({"launcher": env.launcher, "rank": env.rank, "local": env.local_rank,
                                     "sum": int(total), "args": sys.argv[1:], "addr": env.master_addr,
                                     "nic": os.environ.get("NVSHMEM_HCA_LIST"),
                                     "nvls": os.environ.get("NVSHMEM_DISABLE_NVLS")}) + "\n")
        sys.stdout.flush()
        # Leaving gloo's threads to interpreter exit once ended a rank in std::terminate (CI, exit 15).
        dist.destroy_process_group()
        """,
    )
    env = clean_env(MPIRUN=find_mpiexec(), PYTHON=sys.executable, MASTER_PORT=str(free_port("127.0.0.1")),
                    TILESCALE_NICS="mlx5_0 mlx5_1")  # fmt: skip
    proc = subprocess.run([str(LAUNCH / "mpirun_multinode.sh"), str(hosts), "2", str(script), "a b", "c"],
                          env=env, capture_output=True, text=True, timeout=50)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ranks = sorted((json.loads(line) for line in proc.stdout.splitlines()), key=lambda r: r["rank"])
    assert [(r["launcher"], r["rank"], r["local"], r["nic"]) for r in ranks] == [
        ("mpich", 0, 0, "mlx5_0:1"), ("mpich", 1, 1, "mlx5_1:1"),
    ]  # fmt: skip
    assert all(r["sum"] == 1 and r["args"] == ["a b", "c"] and r["addr"] == "localhost" for r in ranks)
    assert all(r["nvls"] == "1" for r in ranks)


def test_multinode_scripts_parse():
    for name in ("mpirun_multinode.sh", "nvshmem_env.sh", "slurm.sbatch"):
        assert subprocess.run(["bash", "-n", str(LAUNCH / name)]).returncode == 0, name
    usage = subprocess.run([str(LAUNCH / "mpirun_multinode.sh")], capture_output=True, text=True)
    assert usage.returncode == 2 and "HOSTFILE GPUS_PER_NODE SCRIPT" in usage.stderr
