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
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tilescale import comm, native, plans, startup
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
    # The TP GEMMs' plan forced by TILESCALE_TP_PLAN when init ran (None: chosen per shape); read
    # once, as every eager TP GEMM call's plan key names it (an environment read per call cost
    # ~0.75 us of host time).
    tp_plan: str | None = None
    # (parameter name, address, bytes, element size) of each symmetric argument of the last
    # distributed kernel launched, to name a timed-out flag (no reference to its tensors is kept).
    last_kernel_spans: tuple[tuple[str, int, int, int], ...] = ()
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
        """The whole job's barrier workspace (each group has its own: ``group_state(g).sync_workspace``).

        Returns:
            The int32 tensor, or None before :func:`init` has set the job's group up.
        """
        state = self.groups.get(None)
        return state.sync_workspace if state is not None else None

    @property
    def wait_status(self) -> torch.Tensor:
        """The whole job's wait-status record (each group has its own: ``group_state(g).wait_status``)."""
        return self.groups[None].wait_status



_runtime: Runtime | None = None
# How long the process hosting the job's store (startup.hosts_store()) keeps it up at exit for
# peers to read that it exited.
HOST_LINGER_S = 1.0



def _publish_exit() -> None:
    # At interpreter exit without finalize(): tell ranks still waiting for this one (the
    # launcher adds the exit code later, or says it first if this process is killed).
    rt = _runtime
    if rt is None or rt.group.exits is None:
        return
    rendezvous.publish_exit(rt.group.exits, rt.env.rank, None)
    if startup.hosts_store():  # the store ends with this process: let waiting peers read the exit first
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

    Args:
        backend: the communication backend (``cuda_ipc``, ``host_shm``, ``nvshmem``); None: ``TILESCALE_BACKEND``,
            else the device's default.
        device: ``"cuda"`` or ``"cpu"``; None: ``TILESCALE_DEVICE``, else a GPU when torch sees one.
        timeout_s: the start-up deadline (rendezvous, process group); None: ``TILESCALE_INIT_TIMEOUT_S``, else 300.

    Returns:
        The process's :class:`Runtime` (also :func:`current`).
    """
    global _runtime
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
    dev = startup.choose_device(device)
    name = backend or comm.default_backend(dev.type)
    comm.check(name, dev.type)
    gpus_shared = dev.type == "cuda" and startup.shares_gpus(env)
    if dev.type == "cuda":
        dev = startup.bind_gpu(env)
    owns = not dist.is_initialized()
    startup.begin_session()
    plans.invalidate()  # plans name the groups and memory of the last session
    if owns:
        store = startup.init_process_group(env, dev, timeout_s, timeout_given, gpus_shared)
    else:  # the user's process group: its store, under the prefix torch gave it
        store = dist.distributed_c10d._get_default_store()
        if isinstance(store, dist.PrefixStore):
            store = store.underlying_store
    try:
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            env = LaunchEnv(env.launcher, dist.get_rank(), dist.get_world_size(), env.local_rank,
                            env.local_world_size, env.master_addr, env.master_port, env.launch_id)
        group_store = dist.PrefixStore(f"tilescale/{startup.session_key()}", store)
        group = comm.Group(env.rank, env.world_size, env.local_rank, env.local_world_size, group_store,
                           startup.job_id(group_store, env.rank, timeout_s), exits=store)
        _runtime = Runtime(env, dev, group, comm.create(name, group, dev.type), owns,
                           int(float(os.environ.get("TILESCALE_WAIT_TIMEOUT_S", "60")) * 1e9),
                           tp_plan=os.environ.get("TILESCALE_TP_PLAN") or None, gpus_shared=gpus_shared)
        _runtime.groups[None] = GroupState(None, group, _runtime.backend, dev.type == "cuda", forget_group)
        _groups_changed()
        _allocate_sync_workspace(_runtime.groups[None])
    except BaseException:
        _runtime = None
        _groups_changed()
        if owns and dist.is_initialized():
            dist.destroy_process_group()
        raise
    return _runtime


def is_initialized() -> bool:
    """Whether :func:`init` has run (and :func:`finalize` has not).

    Returns:
        True between :func:`init` and :func:`finalize`.
    """
    return _runtime is not None


def current() -> Runtime:
    """The runtime set up by :func:`init`; raises if there is none.

    Returns:
        The :class:`Runtime` of this process.
    """
    if _runtime is None:
        raise RuntimeError("tilescale is not initialised: call tilescale.init() first")
    return _runtime


def rank() -> int:
    """This process's global rank.

    Returns:
        The rank, 0 to ``world_size() - 1``.
    """
    return current().group.rank


def world_size() -> int:
    """Number of ranks in the job.

    Returns:
        The number of ranks.
    """
    return current().group.world_size


def local_rank() -> int:
    """This process's rank among the ranks of its node.

    Returns:
        The rank on this node, 0 to ``LOCAL_WORLD_SIZE - 1``.
    """
    return current().group.local_rank


def device() -> torch.device:
    """The device this rank computes on (``cuda:<local GPU>`` or ``cpu``).

    Returns:
        The rank's ``torch.device``.
    """
    return current().device


def backend_name() -> str:
    """Name of the communication backend in use.

    Returns:
        ``"cuda_ipc"``, ``"host_shm"`` or ``"nvshmem"``.
    """
    return current().backend.name


def check_device_waits(name_address: Callable[[int], str | None] | None = None) -> None:
    """Raise :class:`WaitTimeoutError` if a device-side wait of this rank has timed out, or
    :class:`ShapeMismatchError` if a ``T.agree`` found that ranks called with different shapes.

    Kernels launched through ``tilescale.jit`` call this before every launch (reading host
    memory only, never synchronising), passing ``name_address`` to name the flag.

    Args:
        name_address: maps the address of the flag that timed out to a name (``"flags[1]"``); None: look
            it up among the arguments of the last distributed kernel.
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

    Args:
        what: the op and what it would create, for the message.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"{what}: first call inside a CUDA graph capture; call it once before capturing (that "
                           "call allocates its buffers, on every rank together), then capture")


def _name_in_last_kernel(address: int) -> str | None:
    for name, start, nbytes, element in current().last_kernel_spans:
        if start <= address < start + nbytes:
            return f"{name}[{(address - start) // element}]"
    return None


# Checks of what ops' kernels found on the device outside a wait (ops register them, the
# runtime knows no op): each raises what its kernels recorded.
_device_checks: list[Callable[[], None]] = []


def add_device_check(check: Callable[[], None]) -> None:
    """Have :func:`synchronize` call ``check``, which raises what an op's kernels recorded
    on the device (e.g. ``ts.ops.grouped_gemm``'s layout check).

    Args:
        check: Raises if a recorded fault is pending, else returns.
    """
    _device_checks.append(check)


def _check_op_faults() -> None:
    """Raise the first fault an op's kernels recorded (:func:`add_device_check`)."""
    for check in _device_checks:
        check()


def synchronize() -> None:
    """Wait for this rank's queued GPU work, then raise if a device-side wait timed out or an
    op's kernel recorded a fault (:func:`add_device_check`)."""
    if current().device.type == "cuda":
        torch.cuda.synchronize()
    check_device_waits()
    _check_op_faults()


def barrier(timeout_s: float | None = None, *, group: dist.ProcessGroup | None = None) -> None:
    """Host barrier of the ranks of ``group`` (None: all ranks) after this rank's queued GPU work has finished.

    Example::

        ts.barrier()                 # every rank of the job
        ts.barrier(group=tp)         # the ranks of tp only

    Raises ``TimeoutError`` naming the missing ranks instead of hanging.

    Args:
        timeout_s: seconds to wait for the other ranks; None: TILESCALE_COLLECTIVE_TIMEOUT_S, else 120.
        group: the process group; None: the whole job.
    """
    state = group_state(group)
    synchronize()
    state.comm.barrier(timeout_s=timeout_s)


def _allocate_sync_workspace(state: GroupState) -> None:
    # Allocated when the group is set up, while its ranks are known to be here, rather than
    # collectively inside the first barrier kernel's launch, where a rank that failed earlier
    # would stall it.
    # After the barrier counters, T.agree's call signatures: two slots per rank of the group.
    state.sync_workspace = state.allocate((sync_workspace_words(state.size),), torch.int32)
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

    Args:
        group: a process group this rank belongs to; None: the whole job.

    Returns:
        Its number of ranks.
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

    Args:
        group: a process group this rank belongs to; None: the whole job.

    Returns:
        The group's :class:`GroupState` (created, collectively, at its first use).
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
                       rt.device.type == "cuda", forget_group)
    rt.groups[group.group_name] = state
    _groups_changed()
    try:
        _allocate_sync_workspace(state)
    except BaseException:
        state.release(barrier=False)
        raise
    return state


def forget_group(state: GroupState) -> None:
    """Drop a released group's state from the runtime (``GroupState.release`` calls this: its ``on_release``).

    Args:
        state: the state :func:`group_state` returned.
    """
    if _runtime is None:
        return
    for key, found in list(_runtime.groups.items()):
        if found is state:
            del _runtime.groups[key]
    _groups_changed()


def _groups_changed() -> None:
    """Hand the native launcher every live group's wait-status record (``native.watch_waits``)."""
    native.watch_waits([state.wait_status for state in live_groups()])


def live_groups() -> Collection[GroupState]:
    """Every group's state in this job (none before ``init``): a live view, read on every
    symmetric-tensor lookup (copy it to keep a snapshot).

    Returns:
        The states of the groups in use (none before :func:`init`).
    """
    return _runtime.groups.values() if _runtime is not None else ()


def new_group(ranks: list[int], **kwargs) -> dist.ProcessGroup:
    """``dist.new_group(ranks, **kwargs)``, after checking that every rank creates the same group now.

    Example::

        tp = [ts.new_group(r) for r in ([0, 1], [2, 3])][ts.rank() // 2]   # every rank creates both

    torch requires every rank to create every group, in the same order; when they do not,
    ``dist.new_group`` itself hangs (torch 2.13, gloo). This checks first, through the job's
    store: ranks whose n-th group differs all get a ValueError naming each rank's ranks.

    Args:
        ranks: the global ranks of the group (every rank of the job calls this with the same list).
        **kwargs: passed to ``torch.distributed.new_group``.

    Returns:
        The process group (``GroupMember.NON_GROUP_MEMBER`` on ranks not in ``ranks``).
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
    ranks disagreed, or a wait timed out, or an op's kernel found bad input, and nothing checked
    since) is raised after the teardown, so the job cannot end with exit code 0; one already
    raised is not raised again.
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
        try:
            _check_op_faults()  # e.g. a bad grouped-GEMM layout in the last calls
        except Exception as err:  # noqa: BLE001 - raised after the teardown, like the waits' failures
            unreported = unreported or err
        rt.group.barrier()
    finally:
        _runtime = None
        _groups_changed()
        plans.invalidate()
        for state in reversed(list(rt.groups.values())):  # the whole job's last: it was first
            state.release(barrier=False, finalizing=True)
        rt.group.store = None  # a runtime object kept by the caller must not keep the store alive
        if rt.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
    if unreported is not None:
        raise unreported


atexit.register(_publish_exit)
