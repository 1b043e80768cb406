"""Unit tests of ``tilescale.launch.environment.detect``: the launcher's variables -> the rank's place."""

from __future__ import annotations

import pytest

from tilescale.launch.environment import LaunchEnv, detect


def test_no_launcher_is_rank_0_of_1():
    assert detect({}) == LaunchEnv("none", 0, 1, 0, 1, None, None)


def test_no_launcher_ignores_unrelated_variables():
    env = detect({"HOME": "/root", "PATH": "/usr/bin", "LOCAL_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size) == ("none", 0, 1, 0, 1)


def test_default_reads_os_environ(monkeypatch):
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "1234")
    env = detect()
    assert (env.launcher, env.rank, env.world_size, env.master_addr, env.master_port) == (
        "torchrun", 2, 3, "10.1.2.3", 1234,
    )  # fmt: skip


# --- torchrun (and tilescale run, which sets the same variables) -------------------------


def test_torchrun():
    env = detect({
        "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "node0", "MASTER_PORT": "29400",
    })  # fmt: skip
    assert env == LaunchEnv("torchrun", 5, 8, 1, 4, "node0", 29400)


def test_torchrun_without_local_variables_is_one_node():
    env = detect({"RANK": "2", "WORLD_SIZE": "3"})
    assert env == LaunchEnv("torchrun", 2, 3, 0, 3, None, None)


def test_torchrun_needs_both_rank_and_world_size():
    assert detect({"RANK": "1"}).launcher == "none"
    assert detect({"WORLD_SIZE": "4"}).launcher == "none"


def test_torchrun_wins_over_mpi_variables():
    # tilescale run under an outer mpirun/srun: the torchrun variables describe this process.
    env = detect(
        {
            "RANK": "1",
            "WORLD_SIZE": "2",
            "PMI_RANK": "0",
            "PMI_SIZE": "1",
            "SLURM_PROCID": "0",
            "SLURM_STEP_ID": "0",
            "SLURM_STEP_NUM_TASKS": "1",
            "SLURM_LOCALID": "0",
        }
    )
    assert (env.launcher, env.rank, env.world_size) == ("torchrun", 1, 2)


# --- Open MPI --------------------------------------------------------------------------


def test_open_mpi():
    env = detect({
        "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    })  # fmt: skip
    assert env == LaunchEnv("openmpi", 6, 8, 2, 4, None, None)


def test_open_mpi_takes_master_from_the_environment():
    env = detect({
        "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "40000",
    })  # fmt: skip
    assert (env.master_addr, env.master_port) == ("127.0.0.1", 40000)


# --- MPICH (hydra) ---------------------------------------------------------------------


def test_mpich():
    env = detect({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert env == LaunchEnv("mpich", 3, 4, 1, 2, None, None)


def test_mpich_without_local_variables_is_one_node():
    env = detect({"PMI_RANK": "1", "PMI_SIZE": "2"})
    assert env == LaunchEnv("mpich", 1, 2, 1, 2, None, None)


def test_mpich_needs_both_rank_and_size():
    assert detect({"PMI_RANK": "0"}).launcher == "none"


# --- Slurm srun ------------------------------------------------------------------------

SRUN = {
    "SLURM_JOB_ID": "123456",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "9",
    "SLURM_NTASKS": "99",  # the job's; the step's own count wins
    "SLURM_STEP_NUM_TASKS": "11",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2),3",
    "SLURM_TASKS_PER_NODE": "1(x3)",
    "SLURM_STEP_NODELIST": "gpu[012-015],login1",
    "SLURM_JOB_NODELIST": "other[1-9]",
}


def test_slurm_step():
    env = detect(SRUN)
    assert env == LaunchEnv("slurm", 9, 11, 1, 3, "gpu012", 29500 + 123456 % 20000, "slurm:123456.0")


@pytest.mark.parametrize(("node", "tasks"), [("0", 4), ("1", 4), ("2", 3)])
def test_slurm_tasks_per_node_repeat_syntax(node, tasks):
    env = detect({**SRUN, "SLURM_NODEID": node, "SLURM_PROCID": "0", "SLURM_LOCALID": "0"})
    assert env.local_world_size == tasks


def test_slurm_port_follows_the_job_id():
    ports = {detect({**SRUN, "SLURM_JOB_ID": job}).master_port for job in ("1", "2", "20001")}
    assert ports == {29501, 29502}
    assert all(29500 <= detect({**SRUN, "SLURM_JOB_ID": str(j)}).master_port < 49500 for j in (0, 19999, 10**9))


def test_slurm_falls_back_to_job_variables():
    env = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP_") or k == "SLURM_STEP_ID"}
    env.update(SLURM_NTASKS="3", SLURM_PROCID="2", SLURM_NODEID="1", SLURM_TASKS_PER_NODE="2,1", SLURM_LOCALID="0")
    launched = detect(env)
    assert (launched.world_size, launched.local_world_size, launched.master_addr) == (3, 1, "other1")


@pytest.mark.parametrize(
    ("nodelist", "master"),
    [
        ("gpu[012-015],login1", "gpu012"),
        ("gpu[012-015,020],login1", "gpu012"),
        ("gpu[7,3-4]", "gpu7"),
        ("login1,gpu[1-2]", "login1"),
        ("node-a17", "node-a17"),
        ("n1,n2", "n1"),
    ],
)
def test_slurm_master_is_the_first_node(nodelist, master):
    assert detect({**SRUN, "SLURM_STEP_NODELIST": nodelist}).master_addr == master


def test_slurm_without_step_id_is_a_batch_shell_not_a_rank():
    # The batch script's shell has SLURM_PROCID=0 and the job's sizes, but no step.
    env = {k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}
    env.update(SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0", SLURM_NTASKS="8")
    assert detect(env) == LaunchEnv("none", 0, 1, 0, 1, None, None)


def test_slurm_master_variables_win():
    env = detect({**SRUN, "MASTER_ADDR": "10.9.8.7", "MASTER_PORT": "31337"})
    assert (env.launcher, env.rank, env.master_addr, env.master_port) == ("slurm", 9, "10.9.8.7", 31337)


# --- MASTER_ADDR / MASTER_PORT ----------------------------------------------------------


@pytest.mark.parametrize(
    "launcher_env",
    [
        {"RANK": "0", "WORLD_SIZE": "2"},
        {"PMI_RANK": "0", "PMI_SIZE": "2"},
        {
            "OMPI_COMM_WORLD_RANK": "0",
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        },
        {},
    ],
)
def test_master_override_applies_to_every_launcher(launcher_env):
    env = detect({**launcher_env, "MASTER_ADDR": "host-x", "MASTER_PORT": "12345"})
    assert (env.master_addr, env.master_port) == ("host-x", 12345)


def test_master_addr_alone_keeps_the_launchers_port():
    env = detect({**SRUN, "MASTER_ADDR": "host-y"})
    assert (env.master_addr, env.master_port) == ("host-y", 29500 + 123456 % 20000)


def test_master_port_alone_keeps_the_launchers_address():
    env = detect({**SRUN, "MASTER_PORT": "2000"})
    assert (env.master_addr, env.master_port) == ("gpu012", 2000)


# --- bad values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2.0"}, "WORLD_SIZE"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": ""}, "LOCAL_RANK"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE"),
        ({"PMI_RANK": "0", "PMI_SIZE": "two"}, "PMI_SIZE"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "?"}, "MPI_LOCALRANKID"),
        (
            {
                "OMPI_COMM_WORLD_RANK": "r",
                "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            },
            "OMPI_COMM_WORLD_RANK",
        ),
        ({**SRUN, "SLURM_PROCID": "nine"}, "SLURM_PROCID"),
        ({**SRUN, "SLURM_STEP_NUM_TASKS": "many"}, "SLURM_STEP_NUM_TASKS"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "http"}, "MASTER_PORT"),
    ],
)
def test_non_integer_values_are_named(env, name):
    with pytest.raises(ValueError, match=name):
        detect(env)


@pytest.mark.parametrize(
    "env",
    [
        {"RANK": "2", "WORLD_SIZE": "2"},
        {"RANK": "-1", "WORLD_SIZE": "2"},
        {"RANK": "0", "WORLD_SIZE": "0"},
        {"PMI_RANK": "4", "PMI_SIZE": "4"},
        {
            "OMPI_COMM_WORLD_RANK": "8",
            "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "0",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
        },
        {**SRUN, "SLURM_PROCID": "11"},
    ],
)
def test_rank_outside_world_is_rejected(env):
    with pytest.raises(ValueError, match="outside world size"):
        detect(env)


def test_more_ranks_than_gpus_need_share_gpus(monkeypatch):
    import torch

    from tilescale.startup import shares_gpus

    many = LaunchEnv("torchrun", 0, torch.cuda.device_count() + 1, 0, torch.cuda.device_count() + 1, None, None)
    monkeypatch.delenv("TILESCALE_SHARE_GPUS", raising=False)
    with pytest.raises(RuntimeError, match=r"visible GPUs; start one rank per GPU, use --cpu, or --share-gpus"):
        shares_gpus(many)
    monkeypatch.setenv("TILESCALE_SHARE_GPUS", "1")
    assert shares_gpus(many)


# --- the launch id (checked by the ranks at rendezvous, see tilescale.launch.rendezvous) ----


@pytest.mark.parametrize(
    ("env", "launch_id"),
    [
        ({"RANK": "0", "WORLD_SIZE": "2", "TILESCALE_LAUNCH_ID": "5d0c2a9e71b4", "TORCHELASTIC_RUN_ID": "x"},
         "5d0c2a9e71b4"),
        ({"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_RESTART_COUNT": "2"},
         "torchrun:none:2"),
        (SRUN, "slurm:123456.0"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
          "OMPI_COMM_WORLD_LOCAL_SIZE": "1", "PMIX_NAMESPACE": "prterun-host-1234@1"}, "openmpi:prterun-host-1234@1"),
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, ""),  # MPICH's hydra names no job
        ({"RANK": "0", "WORLD_SIZE": "2"}, ""),  # no launcher's marks: maybe stale variables
    ],
)  # fmt: skip
def test_launch_id_comes_from_what_the_launcher_gives(env, launch_id):
    assert detect(env).launch_id == launch_id
