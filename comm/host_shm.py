"""Symmetric memory for the CPU path: one POSIX shared-memory segment per rank and allocation.

Each rank creates its own segment under ``/dev/shm``, every rank maps every peer's
segment, and once all ranks have mapped them the owner unlinks its name. From then on the
memory lives exactly as long as some process maps it, so a crashed job leaves nothing
behind in ``/dev/shm``. Peers' copies sit at different virtual addresses in each process;
like CUDA IPC mappings, the address table is therefore per process.
"""

from __future__ import annotations

import contextlib
import mmap
import os

import torch

from tilescale.comm.base import CommBackend, SymmetricAllocation

_SHM_DIR = "/dev/shm"


def _map(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class HostShmAllocation(SymmetricAllocation):
    def __init__(self, nbytes: int, peers: list[torch.Tensor | None], peer_ptrs: list[int]):
        super().__init__(nbytes, peer_ptrs)
        self._peers = peers

    def peer(self, rank: int) -> torch.Tensor:
        return self._peers[rank]


class HostShmBackend(CommBackend):
    """Symmetric memory in POSIX shared memory: the CPU path's backend (ranks on one host)."""

    name = "host_shm"
    device_type = "cpu"

    def allocate(self, nbytes: int, tag: str) -> tuple[torch.Tensor, SymmetricAllocation]:
        g = self.group
        if g.local_world_size != g.world_size:
            raise RuntimeError("the host_shm backend needs every rank on one host")
        size = max(nbytes, 1)
        names = [f"{_SHM_DIR}/tilescale-{g.job_id}-{tag.replace('/', '-')}-{r}" for r in range(g.world_size)]
        fd = os.open(names[g.rank], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)  # zero-filled by the kernel
        finally:
            os.close(fd)
        try:
            g.barrier(f"{tag}/created")
            maps = [_map(n, size) for n in names]
            g.barrier(f"{tag}/mapped")
        finally:
            os.unlink(names[g.rank])
        copies: list[torch.Tensor | None] = [torch.frombuffer(m, dtype=torch.uint8, count=size)[:nbytes] for m in maps]
        local = copies[g.rank]
        ptrs = [t.data_ptr() for t in copies]
        copies[g.rank] = None  # the user's tensor alone keeps this rank's copy alive
        return local, HostShmAllocation(nbytes, copies, ptrs)

    def finalize(self) -> None:
        # The CPU execution path's job-wide lock file (tilescale.interpreter), if it made one.
        if self.group.rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{_SHM_DIR}/tilescale-{self.group.job_id}.lock")
