"""The process's place in the job: launcher detection, device binding, process group, backend.

``tilescale.init()`` is the one collective call a program makes before anything else::

    import tilescale as ts
    ts.init()                       # torchrun, tilescale run, mpirun, srun or plain python
    print(ts.rank(), ts.world_size(), ts.device())
    ...
    ts.finalize()

On a machine with CUDA GPUs each rank binds GPU ``local_rank`` and the process group has
NCCL for CUDA tensors and gloo for CPU tensors; without GPUs (or with
``TILESCALE_DEVICE=cpu``, which ``tilescale run --cpu`` sets) the ranks run on the CPU
path with gloo and POSIX shared memory.

With ``TILESCALE_SHARE_GPUS=1`` (``tilescale run --share-gpus``) more ranks than GPUs may
run on a node: rank ``local_rank`` binds GPU ``local_rank % count``, and since NCCL refuses
two ranks on one GPU the process group moves CUDA tensors through gloo. The kernels of
ranks sharing a GPU run by turns (the GPU time-slices their contexts), so every wait
still completes: this checks multi-rank programs on one GPU for correctness; its timings
mean nothing.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tilescale import comm, plans
from tilescale.errors import (
    MISMATCH,
    WAIT_STATUS_FIELDS,
    ShapeMismatchError,
    WaitTimeoutError,
    describe_mismatch,
    describe_timeout,
)
from tilescale.groups import GroupState
from tilescale.launch import rendezvous
from tilescale.launch.environment import LaunchEnv, detect
from tilescale.protocol import sync_workspace_words


@dataclass
class Runtime:
    """Everything ``init`` set up; reach it through :func:`current`."""

    env: LaunchEnv
    device: torch.device
    group: comm.Group
    backend: comm.CommBackend
    owns_process_group: bool
    # Bound of every device-side wait, in ns (TILESCALE_WAIT_TIMEOUT_S when init ran, default 60 s).
    wait_timeout_ns: int = 60_000_000_000
    # (parameter names, arguments) of the last distributed kernel launched, to name a timed-out flag.
    last_kernel_args: tuple[list[str], tuple] = ([], ())
    # Whether ranks of this node share GPUs (TILESCALE_SHARE_GPUS): correct, but not timeable.
    gpus_shared: bool = False
    # Whether a failure the kernels recorded (wait timeout, ranks disagreeing) has been raised to
    # the program; finalize raises one that never was, so such a job cannot end with exit code 0.
    failure_reported: bool = False
    # The state of every process group in use (tilescale.groups), the whole job's under None.
    groups: dict[str | None, GroupState] = field(default_factory=dict)
    # Times a group of these global ranks has been created: each creation gets its own store prefix.
    group_creations: dict[tuple[int, ...], int] = field(default_factory=dict)

    @property
    def sync_workspace(self) -> torch.Tensor | None:
        """The whole job's barrier workspace (each group has its own: ``group_state(g).sync_workspace``)."""
        state = self.groups.get(None)
        return state.sync_workspace if state is not None else None

    @property
    def wait_status(self) -> torch.Tensor:
        """The whole job's wait-status record (each group has its own: ``group_state(g).wait_status``)."""
        return self.groups[None].wait_status



_runtime: Runtime | None = None
# Counts init() calls: each session's store keys get their own prefix, so a re-init that
# meets the previous session's store (tilescale run's lives as long as the job) never reads stale keys.
_session = 0
# Start-up deadline, and how often a wait is reported, when RANK/WORLD_SIZE/MASTER_* come with
# no launcher's marks (maybe stale).
UNMARKED_TIMEOUT_S, UNMARKED_PROGRESS_S = 30.0, 2.0
# Whether this process hosts the job's store (rank 0 under launchers other than tilescale run),
# and how long it keeps it up at exit for peers to read that it exited.
_hosts_store = False
HOST_LINGER_S = 1.0



def _choose_device(device: str | None) -> torch.device:
    wanted = device or os.environ.get("TILESCALE_DEVICE")
    if wanted not in (None, "", "cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {wanted!r}")
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch sees no CUDA device")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda")


def _shares_gpus(env: LaunchEnv) -> bool:
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


def _bind_gpu(env: LaunchEnv) -> torch.device:
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


def _restart() -> str:
    # torchrun restarts the ranks of a failed attempt against the same store: keep attempts apart.
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


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
    keys = [f"tilescale/join/{_restart()}.{_session}/{r}" for r in range(env.world_size)]
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


def _init_process_group(env: LaunchEnv, device: torch.device, timeout_s: float, timeout_given: bool,
                        gpus_shared: bool) -> dist.Store:
    """Create the default process group; returns the job's store."""
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
    pg_store = dist.PrefixStore(f"tilescale/pg/{_restart()}.{_session}", store)
    dist.init_process_group(backend, store=pg_store, rank=env.rank, world_size=env.world_size, **kwargs)
    return store


def _job_id(group_store: dist.Store, rank: int, timeout_s: float) -> str:
    # Prefixed by the key of tilescale run's node launcher, which removes the job's /dev/shm names by it.
    if rank == 0:
        group_store.set("tilescale/job_id", os.environ.get(rendezvous.JOB_KEY_VAR, "") + uuid.uuid4().hex[:12])
    group_store.wait(["tilescale/job_id"], timedelta(seconds=timeout_s))
    return group_store.get("tilescale/job_id").decode()


def _publish_exit() -> None:
    # At interpreter exit without finalize(): tell ranks still waiting for this one (the
    # launcher adds the exit code later, or says it first if this process is killed).
    rt = _runtime
    if rt is None or rt.group.exits is None:
        return
    rendezvous.publish_exit(rt.group.exits, rt.env.rank, None)
    if _hosts_store:  # the store ends with this process: let waiting peers read the exit first
        others = [r for r in range(rt.env.world_size) if r != rt.env.rank]
        rendezvous.linger(rt.group.exits, others, HOST_LINGER_S)


def init(backend: str | None = None, *, device: str | None = None, timeout_s: float | None = None) -> Runtime:
    """Join the job: detect the launcher, bind the GPU, create the process group and backend.

    Example::

        ts.init()                      # GPU when present, CPU path otherwise
        ts.init(device="cpu")          # force the CPU path (gloo + shared memory)

    ``backend`` names the communication backend (``TILESCALE_BACKEND`` when None, else
    ``cuda_ipc`` on GPUs and ``host_shm`` on the CPU). Calling ``init`` again returns the
    existing runtime; asking it for a different backend or device then is an error.
    If torch.distributed is already initialised (by the user), its group is reused.
    """
    global _runtime, _session
    backend = backend or os.environ.get("TILESCALE_BACKEND") or None
    if _runtime is not None:
        if backend not in (None, _runtime.backend.name) or (device not in (None, _runtime.device.type)):
            raise RuntimeError(
                f"tilescale is already initialised with backend '{_runtime.backend.name}' on "
                f"{_runtime.device}; call finalize() before init() with other settings"
            )
        return _runtime
    timeout_given = timeout_s is not None or "TILESCALE_INIT_TIMEOUT_S" in os.environ
    timeout_s = float(os.environ.get("TILESCALE_INIT_TIMEOUT_S", "300")) if timeout_s is None else timeout_s
    env = detect()
    dev = _choose_device(device)
    name = backend or comm.default_backend(dev.type)
    comm.check(name, dev.type)
    gpus_shared = dev.type == "cuda" and _shares_gpus(env)
    if dev.type == "cuda":
        dev = _bind_gpu(env)
    owns = not dist.is_initialized()
    _session += 1
    plans.invalidate()  # plans name the groups and memory of the last session
    if owns:
        store = _init_process_group(env, dev, timeout_s, timeout_given, gpus_shared)
    else:  # the user's process group: its store, under the prefix torch gave it
        store = dist.distributed_c10d._get_default_store()
        if isinstance(store, dist.PrefixStore):
            store = store.underlying_store
    try:
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            env = LaunchEnv(env.launcher, dist.get_rank(), dist.get_world_size(), env.local_rank,
                            env.local_world_size, env.master_addr, env.master_port, env.launch_id)
        group_store = dist.PrefixStore(f"tilescale/{_restart()}.{_session}", store)
        group = comm.Group(env.rank, env.world_size, env.local_rank, env.local_world_size, group_store,
                           _job_id(group_store, env.rank, timeout_s), exits=store)
        _runtime = Runtime(env, dev, group, comm.create(name, group, dev.type), owns,
                           int(float(os.environ.get("TILESCALE_WAIT_TIMEOUT_S", "60")) * 1e9),
                           gpus_shared=gpus_shared)
        _runtime.groups[None] = GroupState(None, group, _runtime.backend, dev.type == "cuda")
        _allocate_sync_workspace(_runtime.groups[None])
    except BaseException:
        _runtime = None
        if owns and dist.is_initialized():
            dist.destroy_process_group()
        raise
    return _runtime


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`finalize` has not)."""
    return _runtime is not None


def current() -> Runtime:
    """The runtime set up by :func:`init`; raises if there is none."""
    if _runtime is None:
        raise RuntimeError("tilescale is not initialised: call tilescale.init() first")
    return _runtime


def rank() -> int:
    """This process's global rank."""
    return current().group.rank


def world_size() -> int:
    """Number of ranks in the job."""
    return current().group.world_size


def local_rank() -> int:
    """This process's rank among the ranks of its node."""
    return current().group.local_rank


def device() -> torch.device:
    """The device this rank computes on (``cuda:<local GPU>`` or ``cpu``)."""
    return current().device


def backend_name() -> str:
    """Name of the communication backend in use."""
    return current().backend.name


def check_device_waits(name_address: Callable[[int], str | None] | None = None) -> None:
    """Raise :class:`WaitTimeoutError` if a device-side wait of this rank has timed out, or
    :class:`ShapeMismatchError` if a ``T.agree`` found that ranks called with different shapes.

    Kernels launched through ``tilescale.jit`` call this before every launch (reading host
    memory only, never synchronising), passing ``name_address`` to name the flag.
    """
    rt = current()
    for state in rt.groups.values():
        if state.wait_status_view[0] != 1:  # a plain host-memory read: this runs before every launch
            continue
        record = dict(zip(WAIT_STATUS_FIELDS, state.wait_status.tolist(), strict=True))
        rt.failure_reported = True
        where = "" if state.whole_job else f" (in the {state.describe()}: ranks within it)"
        if record["kind"] == MISMATCH:
            raise ShapeMismatchError(describe_mismatch(record) + where)
        name = (name_address or _name_in_last_kernel)(record["address"])
        raise WaitTimeoutError(describe_timeout(record, name, rt.wait_timeout_ns / 1e9) + where)


def check_not_capturing(what: str) -> None:
    """Refuse to create state that an op makes at its first call (symmetric buffers, which
    every rank allocates together; peer tables) while a CUDA graph is being captured.

    Example::

        check_not_capturing("moe_dispatch at tokens=128")  # RuntimeError inside a capture
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: first call inside a CUDA graph capture; call it once before capturing (that "
                           "call allocates its buffers, on every rank together), then capture")


def _name_in_last_kernel(address: int) -> str | None:
    names, args = current().last_kernel_args
    for name, t in zip(names, args, strict=True):
        if not isinstance(t, torch.Tensor):
            continue
        start = t.data_ptr()
        if start <= address < start + t.numel() * t.element_size():
            return f"{name}[{(address - start) // t.element_size()}]"
    return None


def synchronize() -> None:
    """Wait for this rank's queued GPU work, then raise if a device-side wait timed out."""
    if current().device.type == "cuda":
        torch.cuda.synchronize()
    check_device_waits()


def barrier(timeout_s: float | None = None, *, group: dist.ProcessGroup | None = None) -> None:
    """Host barrier of the ranks of ``group`` (None: all ranks) after this rank's queued GPU work has finished.

    Example::

        ts.barrier()                 # every rank of the job
        ts.barrier(group=tp)         # the ranks of tp only

    Raises ``TimeoutError`` naming the missing ranks instead of hanging.
    """
    state = group_state(group)
    synchronize()
    state.comm.barrier(timeout_s=timeout_s)


def _allocate_sync_workspace(state: GroupState) -> None:
    # Allocated when the group is set up, while its ranks are known to be here, rather than
    # collectively inside the first barrier kernel's launch, where a rank that failed earlier
    # would stall it.
    from tilescale.symmetric import allocate  # symmetric imports this module

    # After the barrier counters, T.agree's call signatures: two slots per rank of the group.
    state.sync_workspace = allocate(state, (sync_workspace_words(state.size),), torch.int32)
    state.pes = torch.tensor(state.ranks, dtype=torch.int32, device=current().device)


def _group_ranks(group: dist.ProcessGroup) -> list[int]:
    """The global ranks of ``group`` by rank within it; ValueError where this rank is not one."""
    me = current().group.rank
    if not isinstance(group, dist.ProcessGroup):
        if isinstance(group, int) and group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(f"rank {me} called a tilescale operation on a process group it is not a member of "
                             "(torch.distributed gave this rank GroupMember.NON_GROUP_MEMBER for it)")
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    ranks = dist.get_process_group_ranks(group)
    if me not in ranks:
        raise ValueError(f"rank {me} called a tilescale operation on the process group of ranks {ranks}, "
                         "of which it is not a member")
    return ranks


def _is_job(group: dist.ProcessGroup | None) -> bool:
    return group is None or group is dist.group.WORLD


def group_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (None: the job), without setting up its state.

    Example::

        group_size(tp)     # 2
    """
    return current().group.world_size if _is_job(group) else len(_group_ranks(group))


def group_state(group: dist.ProcessGroup | None = None) -> GroupState:
    """The state tilescale keeps for ``group`` (None or ``dist.group.WORLD``: the whole job).

    Example::

        state = ts.group_state(tp)       # state.rank, state.size, state.ranks, state.release()

    The first call for a group sets it up, collectively over the group's ranks: they check
    that they agree on which torch group this is (ranks that created their groups in
    different orders get a ValueError here), then allocate its barrier workspace. A rank
    that is not a member of ``group`` gets a ValueError at once.
    """
    rt = current()
    if _is_job(group):
        return rt.groups[None]
    state = rt.groups.get(group.group_name) if isinstance(group, dist.ProcessGroup) else None
    if state is not None and state.process_group is group:
        return state
    return _create_group_state(rt, group)


def _create_group_state(rt: Runtime, group: dist.ProcessGroup) -> GroupState:
    ranks = _group_ranks(group)
    if group.group_name in rt.groups:
        raise ValueError(f"two process groups named '{group.group_name}' (ranks {rt.groups[group.group_name].ranks} "
                         f"and {ranks}): create groups with dist.new_group, in the same order on every rank")
    check_not_capturing(f"the first use of the process group of ranks {ranks}")
    me = rt.group.rank
    creation = rt.group_creations.get(tuple(ranks), 0)
    rt.group_creations[tuple(ranks)] = creation + 1
    # The group's keys live under a prefix of its ranks and creation count, so exchanges of two
    # groups, or of a group released and set up again, never read each other's keys.
    prefix = f"group/{'-'.join(map(str, ranks))}/{creation}"
    job_id = f"{rt.group.job_id}-{hashlib.sha1(prefix.encode()).hexdigest()[:10]}"
    comm_group = comm.Group(ranks.index(me), len(ranks), 0, 1, dist.PrefixStore(prefix, rt.group.store), job_id,
                            exits=rt.group.exits, ranks=ranks, process_group_name=group.group_name)
    # Identity check: members that agree on the ranks must agree on torch's group name too;
    # groups created in different orders pair names with other rank sets.
    node = rt.env.rank - rt.env.local_rank  # the node's first global rank names the node
    seen = comm_group.exchange("identity", [group.group_name, node])
    if any(name != group.group_name for name, _ in seen):
        detail = "; ".join(f"rank {r}: '{name}'" for r, (name, _) in zip(ranks, seen, strict=True))
        raise ValueError(f"the process group of ranks {ranks} has different torch names on its ranks ({detail}): "
                         "process groups were created in different orders on different ranks, or ranks passed "
                         "different groups of the same ranks")
    local = [r for r, (_, n) in enumerate(seen) if n == node]
    comm_group.local_rank, comm_group.local_world_size = local.index(comm_group.rank), len(local)
    state = GroupState(group, comm_group, comm.create(rt.backend.name, comm_group, rt.device.type, rt.backend),
                       rt.device.type == "cuda")
    rt.groups[group.group_name] = state
    try:
        _allocate_sync_workspace(state)
    except BaseException:
        state.release(barrier=False)
        raise
    return state


def forget_group(state: GroupState) -> None:
    """Drop a released group's state from the runtime (``GroupState.release`` calls this)."""
    if _runtime is None:
        return
    for key, found in list(_runtime.groups.items()):
        if found is state:
            del _runtime.groups[key]


def live_groups() -> Collection[GroupState]:
    """Every group's state in this job (none before ``init``): a live view, read on every
    symmetric-tensor lookup (copy it to keep a snapshot)."""
    return _runtime.groups.values() if _runtime is not None else ()


def new_group(ranks: list[int], **kwargs) -> dist.ProcessGroup:
    """``dist.new_group(ranks, **kwargs)``, after checking that every rank creates the same group now.

    Example::

        tp = [ts.new_group(r) for r in ([0, 1], [2, 3])][ts.rank() // 2]   # every rank creates both

    torch requires every rank to create every group, in the same order; when they do not,
    ``dist.new_group`` itself hangs (torch 2.13, gloo). This checks first, through the job's
    store: ranks whose n-th group differs all get a ValueError naming each rank's ranks.
    Returns what ``dist.new_group`` returns (``GroupMember.NON_GROUP_MEMBER`` on ranks not in it).
    """
    rt = current()
    wanted = sorted(int(r) for r in ranks)
    tag = rt.group.next_tag("new_group")
    seen = rt.group.exchange(tag, wanted)
    if any(s != wanted for s in seen):
        detail = "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
        raise ValueError(f"process group #{tag.split('/')[1]} is created with different ranks on different ranks "
                         f"({detail}): create groups in the same order on every rank")
    return dist.new_group(wanted, **kwargs)


def finalize() -> None:
    """Leave the job: wait for every rank, release every group's state and the process group.

    A failure the kernels recorded that the program has not been told of yet (the last call's
    ranks disagreed, or a wait timed out, and nothing checked since) is raised after the
    teardown, so the job cannot end with exit code 0; one already raised is not raised again.
    """
    global _runtime
    if _runtime is None:
        return
    rt = _runtime
    unreported: Exception | None = None
    try:
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        if not rt.failure_reported:
            try:
                check_device_waits()
            except (WaitTimeoutError, ShapeMismatchError) as err:
                unreported = err
        rt.group.barrier()
    finally:
        _runtime = None
        plans.invalidate()
        for state in reversed(list(rt.groups.values())):  # the whole job's last: it was first
            state.release(barrier=False)
        rt.group.store = None  # a runtime object kept by the caller must not keep the store alive
        if rt.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
    if unreported is not None:
        raise unreported


atexit.register(_publish_exit)
