"""How a process joins the job (the steps of :func:`tilescale.init`): the device it runs on and
the GPU it binds, the rendezvous at the job's store, the default process group, the job id.

Nothing here is called by programs; ``tilescale.runtime`` keeps the process's state.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from tilescale.launch import rendezvous
from tilescale.launch.environment import LaunchEnv

# Counts init() calls: each session's store keys get their own prefix (session_key()).
_session = 0
# Start-up deadline, and how often a wait is reported, when RANK/WORLD_SIZE/MASTER_* come with
# no launcher's marks (maybe stale).
UNMARKED_TIMEOUT_S, UNMARKED_PROGRESS_S = 30.0, 2.0
# Whether this process hosts the job's store (hosts_store()).
_hosts_store = False


def choose_device(device: str | None) -> torch.device:
    wanted = device or os.environ.get("TILESCALE_DEVICE")
    if wanted not in (None, "", "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {wanted!r}")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def shares_gpus(env: LaunchEnv) -> bool:
    """Whether this node runs more ranks than it has GPUs, which only TILESCALE_SHARE_GPUS allows."""
    count = torch.cuda.device_count()
    if env.local_world_size <= count:
        return False
    if os.environ.get("TILESCALE_SHARE_GPUS", "0") in ("", "0"):
        raise RuntimeError(
            f"{env.local_world_size} ranks on this node but only {count} visible GPUs; start one "
            "rank per GPU, use --cpu, or --share-gpus (TILESCALE_SHARE_GPUS=1) to check a "
            "program's correctness with ranks sharing GPUs"
        )
    return True


def bind_gpu(env: LaunchEnv) -> torch.device:
    count = torch.cuda.device_count()
    index = env.local_rank % count
    major, minor = torch.cuda.get_device_capability(index)
    if major < 7:
        raise RuntimeError(
            f"GPU {index} ({torch.cuda.get_device_name(index)}) has compute capability {major}.{minor}; "
            "tilescale needs 7.0 or newer (9.0 for TMA and clusters)"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _mpi_rendezvous(env: LaunchEnv) -> tuple[str, int, str]:
    # mpirun gives no rendezvous address: rank 0 picks one, and a launch id, and broadcasts them over MPI.
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            f"started by {env.launcher} without MASTER_ADDR/MASTER_PORT: export them, or "
            'install mpi4py (pip install "tilescale[mpi]") so ranks can agree on one'
        ) from None
    chosen = None
    if env.rank == 0:
        addr = socket.gethostbyname(socket.gethostname()) if env.local_world_size < env.world_size else "127.0.0.1"
        with socket.socket() as s:
            s.bind(("", 0))
            chosen = (addr, s.getsockname()[1], env.launch_id or f"mpi:{uuid.uuid4().hex[:12]}")
    return MPI.COMM_WORLD.bcast(chosen, root=0)


def begin_session() -> None:
    """Give the next :func:`tilescale.init` store keys of its own (see :func:`session_key`)."""
    global _session
    _session += 1


def session_key() -> str:
    """``<restart>.<session>``: the part of the store keys that keeps attempts and sessions apart.

    torchrun restarts the ranks of a failed attempt against the same store, and a re-init meets
    the store the previous session wrote into (tilescale run's lives as long as the job).
    """
    return f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}.{_session}"


def hosts_store() -> bool:
    """Whether this process hosts the job's store (rank 0 under launchers other than tilescale run)."""
    return _hosts_store


def _rendezvous(env: LaunchEnv, timeout_s: float, timeout_given: bool) -> dist.Store:
    """Join the job's store (rank 0 hosts it when no launcher does), after checking it is this
    launch's, and wait until every rank has joined; returns the store."""
    global _hosts_store
    launch_id = env.launch_id
    addr, port = env.master_addr, env.master_port
    if addr is None or port is None:
        if env.launcher == "torchrun":
            raise RuntimeError(
                f"RANK={env.rank} and WORLD_SIZE={env.world_size} are set but MASTER_ADDR/MASTER_PORT are not: "
                "stale variables of another job? Unset RANK and WORLD_SIZE to run as one process, or start the "
                "program with tilescale run / torchrun"
            )
        addr, port, launch_id = _mpi_rendezvous(env)
    where = f"{addr}:{port}"
    # RANK/WORLD_SIZE and MASTER_* with no launcher's marks may be left over from another job:
    # say so early, and give up long before the usual start-up deadline.
    unmarked = env.launcher == "torchrun" and not launch_id
    hint = ""
    if unmarked:
        hint = (f" (RANK={env.rank}, WORLD_SIZE={env.world_size}, MASTER_ADDR and MASTER_PORT come from the "
                "environment with no launcher's marks: if they are left over from another job, unset them)")
        if not timeout_given:
            timeout_s = min(timeout_s, UNMARKED_TIMEOUT_S)
    every = UNMARKED_PROGRESS_S if unmarked else rendezvous.PROGRESS_S

    def waiting_for(what: str) -> Callable[[float], None]:
        return lambda s: rendezvous.say(f"rank {env.rank} has waited {s:.0f} s for {what}{hint}")

    hosted = os.environ.get(rendezvous.HOSTED_VAR) == "1"  # by tilescale run
    agent = not hosted and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's
    if env.rank == 0 and not hosted and not agent:
        try:
            store = rendezvous.host_store(port, launch_id, timeout_s)
        except rendezvous.PortInUseError as err:
            raise rendezvous.PortInUseError(f"rank 0 cannot host the job's store: {err}") from None
        _hosts_store = True
    else:
        store = rendezvous.connect(addr, port, timeout_s, waiting_for(f"the job's store at {where}"), every)
        if not agent:  # torchrun's agent holds the port itself, and writes no launch id
            rendezvous.verify_launch(store, launch_id, where, timeout_s, waiting_for(f"the store at {where}"), every)
    _join(store, env, where, timeout_s, waiting_for, every)
    return store


def _join(store: dist.Store, env: LaunchEnv, where: str, timeout_s: float,
          waiting_for: Callable[[str], Callable[[float], None]], every: float) -> None:
    # Each rank claims its number: a second process given the same RANK (stale variables, or
    # another job's rank on this port) is refused instead of standing in for it.
    keys = [f"tilescale/join/{session_key()}/{r}" for r in range(env.world_size)]
    me = f"{socket.gethostname()} pid {os.getpid()}"
    claimed = store.compare_set(keys[env.rank], "", me).decode()
    if claimed != me:
        raise RuntimeError(
            f"rank {env.rank}: another process ({claimed}) already joined the store at {where} as rank {env.rank}: "
            "two processes were given the same RANK (stale variables, or two jobs on one MASTER_PORT?)"
        )
    progress = rendezvous.Progress(every)
    while not store.check(keys):
        if progress.elapsed() >= timeout_s:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            raise TimeoutError(f"rank {env.rank}: ranks {missing} did not join the job at {where} within "
                               f"{timeout_s:g} s (did they start, with the same MASTER_ADDR/MASTER_PORT?)")
        progress.tick(lambda s: waiting_for(
            f"ranks {[r for r, k in enumerate(keys) if not store.check([k])]} to join at {where}")(s))
        time.sleep(0.01)


def init_process_group(env: LaunchEnv, device: torch.device, timeout_s: float, timeout_given: bool,
                        gpus_shared: bool) -> dist.Store:
    """Create the default process group; returns the job's store.

    Args:
        env: The launch environment (rank, world size, store address, launcher).
        device: This rank's device: gloo on the CPU or where ranks share GPUs, else gloo for CPU
            tensors and NCCL (bound to ``device``) for CUDA tensors.
        timeout_s: Seconds to wait for the other ranks to join, and the process group's timeout.
        timeout_given: Whether the user set the timeout; if not, a rendezvous on leftover
            environment variables with no launcher's marks gives up after ``UNMARKED_TIMEOUT_S``.
        gpus_shared: Whether several ranks share one GPU (NCCL refuses that: gloo is used).

    Returns:
        dist.Store: The job's store (a ``HashStore`` for one process started without a launcher).

    Raises:
        TimeoutError: ranks did not join within ``timeout_s``.
        RuntimeError: the environment is inconsistent (e.g. two processes with one RANK, or RANK
            without MASTER_ADDR/MASTER_PORT under torchrun).
    """
    # NCCL refuses two ranks on one GPU ("Duplicate GPU detected"); gloo stages CUDA tensors on the host.
    backend = "gloo" if device.type == "cpu" or gpus_shared else "cpu:gloo,cuda:nccl"
    kwargs = {"timeout": timedelta(seconds=timeout_s)}
    if device.type == "cuda" and not gpus_shared:
        kwargs["device_id"] = device
    if env.world_size == 1 and env.master_addr is None:
        store = dist.HashStore()
    else:
        store = _rendezvous(env, timeout_s, timeout_given)
    # Its own prefix per session: a re-init meets the store the previous session wrote into.
    pg_store = dist.PrefixStore(f"tilescale/pg/{session_key()}", store)
    dist.init_process_group(backend, store=pg_store, rank=env.rank, world_size=env.world_size, **kwargs)
    return store


def job_id(group_store: dist.Store, rank: int, timeout_s: float) -> str:
    """The job's identifier, the same on every rank: rank 0 draws it and publishes it in the store.

    Example::

        jid = job_id(store, env.rank, timeout_s)      # e.g. names the job's shared-memory segments

    Args:
        group_store: The job's store (:func:`init_process_group`).
        rank: This process's rank; rank 0 writes the identifier.
        timeout_s: Seconds to wait for rank 0's identifier.

    Returns:
        str: The launcher's job key (``tilescale run``'s, empty otherwise) followed by 12 random hex digits.
    """
    # Prefixed by the key of tilescale run's node launcher, which removes the job's /dev/shm names by it.
    if rank == 0:
        group_store.set("tilescale/job_id", os.environ.get(rendezvous.JOB_KEY_VAR, "") + uuid.uuid4().hex[:12])
    group_store.wait(["tilescale/job_id"], timedelta(seconds=timeout_s))
    return group_store.get("tilescale/job_id").decode()
