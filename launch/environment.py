"""Who am I in this job? Read rank, world size and rendezvous from the launcher's environment.

Every launcher announces the process's place in the job through its own variables:

=============  ===========================  ===========================  ==============================
launcher       rank / size                  local rank / local size      rendezvous
=============  ===========================  ===========================  ==============================
torchrun       RANK / WORLD_SIZE            LOCAL_RANK / LOCAL_WORLD_SIZE MASTER_ADDR / MASTER_PORT
Open MPI       OMPI_COMM_WORLD_RANK / SIZE  OMPI_COMM_WORLD_LOCAL_RANK/SIZE  (none: MPI broadcast)
MPICH hydra    PMI_RANK / PMI_SIZE          MPI_LOCALRANKID / MPI_LOCALNRANKS (none: MPI broadcast)
Slurm srun     SLURM_PROCID / SLURM_NTASKS  SLURM_LOCALID / tasks on node  (none: first node of job)
=============  ===========================  ===========================  ==============================

``tilescale run`` sets the torchrun variables, so it is detected as torchrun. MASTER_ADDR and
MASTER_PORT, when exported, win over whatever a launcher implies.

The *launch id* tells one launch's ranks from another's (``tilescale.init`` checks it against
the one in the job's store, see ``tilescale.launch.rendezvous``): ``TILESCALE_LAUNCH_ID``,
which ``tilescale run`` gives its ranks whatever launcher it uses; else
``torchrun:<TORCHELASTIC_RUN_ID>:<TORCHELASTIC_RESTART_COUNT>`` under torchrun,
``slurm:<SLURM_JOB_ID>.<SLURM_STEP_ID>`` under srun, ``openmpi:<PMIX_NAMESPACE>`` (or Open MPI's
job id) under Open MPI; MPICH's hydra gives none (without MASTER_ADDR/MASTER_PORT, rank 0 draws
one and broadcasts it over MPI with the address). Empty when nothing names the launch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchEnv:
    """A process's place in a job, as its launcher described it.

    ``master_addr``/``master_port`` are None when the launcher gives no rendezvous
    address (MPI): the runtime then agrees on one through MPI itself.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None = None
    master_port: int | None = None
    launch_id: str = ""


def _int(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise ValueError(f"environment variable {name} is missing: the launcher set only part of its variables")
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int:
    # SLURM_TASKS_PER_NODE looks like "4(x2),3": the count for node i of the step.
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
    if not spec:
        return 1
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if node < len(counts) else 1


def _slurm_master_addr(env: Mapping[str, str]) -> str | None:
    # The first host of a nodelist such as "gpu[012-015,020],login1" is "gpu012".
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m:
        return None
    prefix, ranges = m.group(1), m.group(2)
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def _launch_id(launcher: str, env: Mapping[str, str]) -> str:
    if env.get("TILESCALE_LAUNCH_ID"):
        return env["TILESCALE_LAUNCH_ID"]
    if launcher == "torchrun" and "TORCHELASTIC_RUN_ID" in env:
        return f"torchrun:{env['TORCHELASTIC_RUN_ID']}:{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    if launcher == "slurm":
        return f"slurm:{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
    if launcher == "openmpi":
        job = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_ess_base_jobid")
        return f"openmpi:{job}" if job else ""
    return ""


def detect(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Detect the launcher from ``env`` (default ``os.environ``).

    Example::

        >>> detect({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...         "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}).rank
        1

    A process started by no launcher is rank 0 of a world of one.

    Args:
        env: the variables to read; None: ``os.environ``.

    Returns:
        The rank's place in the job and the launcher that started it.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        launched = LaunchEnv(
            "torchrun",
            _int(env, "RANK"),
            world,
            _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world,
        )
    elif "OMPI_COMM_WORLD_RANK" in env:
        launched = LaunchEnv(
            "openmpi",
            _int(env, "OMPI_COMM_WORLD_RANK"),
            _int(env, "OMPI_COMM_WORLD_SIZE"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
        )
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        world = _int(env, "PMI_SIZE")
        launched = LaunchEnv(
            "mpich",
            _int(env, "PMI_RANK"),
            world,
            _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else _int(env, "PMI_RANK"),
            _int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else world,
        )
    elif "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        # SLURM_STEP_ID marks a task started by srun; a batch script's shell also has
        # SLURM_PROCID=0 but is not a rank of a parallel step.
        launched = LaunchEnv(
            "slurm",
            _int(env, "SLURM_PROCID"),
            _int(env, "SLURM_STEP_NUM_TASKS") if "SLURM_STEP_NUM_TASKS" in env else _int(env, "SLURM_NTASKS"),
            _int(env, "SLURM_LOCALID"),
            _slurm_tasks_on_node(env),
            _slurm_master_addr(env),
            29500 + (_int(env, "SLURM_JOB_ID") if "SLURM_JOB_ID" in env else 0) % 20000,
        )
    else:
        launched = LaunchEnv("none", 0, 1, 0, 1)
    if not 0 <= launched.rank < launched.world_size:
        raise ValueError(f"{launched.launcher}: rank {launched.rank} outside world size {launched.world_size}")
    if not 0 <= launched.local_rank < launched.local_world_size:
        raise ValueError(
            f"{launched.launcher}: local rank {launched.local_rank} outside local world size "
            f"{launched.local_world_size}"
        )
    addr = env.get("MASTER_ADDR") or launched.master_addr
    port = _int(env, "MASTER_PORT") if "MASTER_PORT" in env else launched.master_port
    return LaunchEnv(
        launched.launcher,
        launched.rank,
        launched.world_size,
        launched.local_rank,
        launched.local_world_size,
        addr,
        port,
        _launch_id(launched.launcher, env),
    )
