"""Symmetric memory for the CPU path: one POSIX shared-memory segment per rank and allocation.

Each rank creates its own segment under ``/dev/shm``, every rank maps every peer's
segment, and once all ranks have mapped them the owner unlinks its name. From then on the
memory lives exactly as long as some process maps it. The job-wide lock of the CPU
execution path is a file made the same way at init: every rank opens it, then it is
unlinked, and each rank keeps its descriptor.

A name is in ``/dev/shm`` only inside those windows. A rank killed inside one (SIGTERM from
a launcher, SIGKILL) cannot unlink it, so every name says whose it is,
``tilescale-<job>-<what>-p<pid of its creator>``: ``tilescale run`` removes its job's names
(``<job>`` starts with the launcher's ``TILESCALE_JOB_KEY``) once its ranks are gone, and
:func:`remove_stale` removes names whose creator is dead; the launcher and every CPU-path
``tilescale.init`` run it at start.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import socket
import threading
from collections.abc import Iterator

import torch

from tilescale.comm.base import CommBackend, SymmetricAllocation
from tilescale.comm.group import Group

SHM_DIR = "/dev/shm"
_OWNED = re.compile(r"tilescale-.+-p(\d+)")


def _map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _name(job_id: str, what: str, pid: int) -> str:
    return f"{SHM_DIR}/tilescale-{job_id}-{what.replace('/', '-')}-p{pid}"


def _alive(pid: int) -> bool:
    # A zombie counts as dead: it maps nothing and will never unlink its names, and where the
    # parent of killed ranks is a container's init that does not reap, it stays one for good.
    if os.path.isdir("/proc/self"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove tilescale's names in ``shm_dir`` whose creating process is gone; returns them.

    Example::

        remove_stale()   # e.g. ['/dev/shm/tilescale-9c1e...-alloc-0-1-p4242']

    Judged by process id: run it only where ``/dev/shm`` is shared by processes of one pid
    namespace (a container sharing the host's IPC namespace but not its pids would see the
    host's live jobs as dead).
    """
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(shm_dir):
            m = _OWNED.fullmatch(entry)
            if m and not _alive(int(m.group(1))):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{shm_dir}/{entry}")
                    removed.append(f"{shm_dir}/{entry}")
    return removed


def remove_job(job_key: str, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove every name of the jobs whose id starts with ``job_key``; returns them.

    Example::

        remove_job("5d0c2a9e71b4")   # what tilescale run does once its ranks are gone
    """
    if not re.fullmatch(r"[0-9a-f]{8,}", job_key):
        raise ValueError(f"job key must be at least 8 hex digits, got {job_key!r}")
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir(shm_dir):
            if entry.startswith(f"tilescale-{job_key}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(f"{shm_dir}/{entry}")
                    removed.append(f"{shm_dir}/{entry}")
    return removed


class HostShmAllocation(SymmetricAllocation):
    def __init__(self, nbytes: int, peers: list[torch.Tensor | None], peer_ptrs: list[int]):
        super().__init__(nbytes, peer_ptrs)
        self._peers = peers

    def peer(self, rank: int) -> torch.Tensor:
        return self._peers[rank]


class HostShmBackend(CommBackend):
    """Symmetric memory in POSIX shared memory: the CPU path's backend (ranks on one host).

    Every peer has an address here, but a job may declare several nodes on this host
    (``tilescale run --nnodes 2 --node-rank R`` twice): a group spanning the declared nodes
    then gets the device-call lowering a multi-node GPU job would (:attr:`call_lowering`,
    ``TILESCALE_CPU_CALL_LOWERING`` or the first registered one), and the interpreter runs
    its calls (``tilescale.interpreter``), so the cross-node path is exercised without a
    second node.
    """

    name = "host_shm"
    device_type = "cpu"

    def __init__(self, group: Group, parent: CommBackend | None = None):
        super().__init__(group, parent)
        from tilescale.comm import lowering_names  # the registry imports this module lazily

        self.lowerings = lowering_names()
        self.call_lowering = os.environ.get("TILESCALE_CPU_CALL_LOWERING") or self.lowerings[1]
        if self.call_lowering not in self.lowerings[1:]:
            raise ValueError(f"TILESCALE_CPU_CALL_LOWERING must be one of {list(self.lowerings[1:])}, "
                             f"got {self.call_lowering!r}")
        hosts = group.exchange(group.next_tag("host"), socket.gethostname())
        if len(set(hosts)) > 1:
            raise RuntimeError(f"the host_shm backend needs every rank on one host; they run on {sorted(set(hosts))}")
        if group.rank == 0:
            remove_stale()
        # The job-wide lock: rank 0 creates the file, every rank opens it, rank 0 unlinks it.
        # flock excludes other processes only (threads share the open file), so the blocks the
        # interpreter runs as threads take a thread lock first.
        self._thread_lock = threading.Lock()
        if group.rank == 0:
            path = _name(group.job_id, "lock", os.getpid())
            self._lock_fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            creator = group.exchange(group.next_tag("lock"), os.getpid())[0]
            if group.rank != 0:
                self._lock_fd = os.open(_name(group.job_id, "lock", creator), os.O_RDWR)
            group.barrier(group.next_tag("lock"))
        finally:
            if group.rank == 0:
                os.unlink(path)

    @contextlib.contextmanager
    def job_lock(self) -> Iterator[None]:
        """Exclusive across the job's ranks while held (read-modify-writes of shared memory).

        Example::

            with backend.job_lock():
                flag[0] += 1
        """
        with self._thread_lock:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def allocate(self, nbytes: int, tag: str) -> tuple[torch.Tensor, SymmetricAllocation]:
        g = self.group
        size = max(nbytes, 1)
        mine = _name(g.job_id, f"{tag}-{g.rank}", os.getpid())
        fd = os.open(mine, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            try:
                os.ftruncate(fd, size)  # zero-filled by the kernel
            finally:
                os.close(fd)
            pids = g.exchange(f"{tag}/created", os.getpid())
            maps = [_map(_name(g.job_id, f"{tag}-{r}", pid), size) for r, pid in enumerate(pids)]
            g.barrier(f"{tag}/mapped")
        finally:
            os.unlink(mine)
        copies: list[torch.Tensor | None] = [torch.frombuffer(m, dtype=torch.uint8, count=size)[:nbytes] for m in maps]
        local = copies[g.rank]
        ptrs = [t.data_ptr() for t in copies]
        copies[g.rank] = None  # the user's tensor alone keeps this rank's copy alive
        return local, HostShmAllocation(nbytes, copies, ptrs)

    def finalize(self) -> None:
        os.close(self._lock_fd)
