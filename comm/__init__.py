"""Communication backends: who provides symmetric memory and how peers reach it.

========  ==========  ===========================================================
name      device      symmetric memory
========  ==========  ===========================================================
cuda_ipc  cuda        torch symmetric memory (cuMem + IPC), peers on one node
host_shm  cpu         POSIX shared memory, ranks on one host (the CPU path)
========  ==========  ===========================================================
"""

from __future__ import annotations

import importlib

from tilescale.comm.base import CommBackend, SymmetricAllocation
from tilescale.comm.group import Group

_BACKENDS = {
    "cuda_ipc": ("tilescale.comm.cuda_ipc", "CudaIpcBackend", "cuda"),
    "host_shm": ("tilescale.comm.host_shm", "HostShmBackend", "cpu"),
}
_PLANNED = {"nvshmem": "the NVSHMEM backend (multi-node) is not implemented yet"}


def default_backend(device_type: str) -> str:
    """The backend used for ``device_type`` when ``tilescale.init`` is given none."""
    return "cuda_ipc" if device_type == "cuda" else "host_shm"


def check(name: str, device_type: str) -> None:
    """Raise unless backend ``name`` exists and runs on ``device_type`` ("cuda" or "cpu")."""
    if name in _PLANNED:
        raise NotImplementedError(f"backend '{name}': {_PLANNED[name]}")
    if name not in _BACKENDS:
        raise ValueError(f"unknown communication backend '{name}'; choose one of {sorted(_BACKENDS)}")
    needs = _BACKENDS[name][2]
    if needs != device_type:
        raise ValueError(f"backend '{name}' runs on {needs} devices, but this process uses {device_type}")


def create(name: str, group: Group, device_type: str) -> CommBackend:
    """Instantiate backend ``name`` for ``group`` on ``device_type`` ("cuda" or "cpu")."""
    check(name, device_type)
    module, cls, _ = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(group)


__all__ = ["CommBackend", "Group", "SymmetricAllocation", "check", "create", "default_backend"]
