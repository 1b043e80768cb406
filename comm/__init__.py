"""Communication backends: who provides symmetric memory and how peers reach it.

========  ==========  ===========================================================
name      device      symmetric memory
========  ==========  ===========================================================
cuda_ipc  cuda        torch symmetric memory (cuMem + IPC), peers on one node
host_shm  cpu         POSIX shared memory, ranks on one host (the CPU path)
nvshmem   cuda        the NVSHMEM heap through nvshmem4py (``tilescale[nvshmem]``):
                      same-node peers by address, others through NVSHMEM calls
========  ==========  ===========================================================

What a backend must provide is documented in :mod:`tilescale.comm.base` and comm/README.md.
"""

from __future__ import annotations

import importlib
import importlib.util

from tilescale.comm.base import CommBackend, DeviceLowering, SymmetricAllocation
from tilescale.comm.group import Group

_BACKENDS = {
    "cuda_ipc": ("tilescale.comm.cuda_ipc", "CudaIpcBackend", "cuda"),
    "host_shm": ("tilescale.comm.host_shm", "HostShmBackend", "cpu"),
    "nvshmem": ("tilescale.comm.nvshmem", "NvshmemBackend", "cuda"),
}
# Python packages a backend needs beyond tilescale's own dependencies: (import name, install command).
_REQUIRES = {"nvshmem": ("nvshmem.core", 'pip install "tilescale[nvshmem]" (nvshmem4py-cu13, nvidia-nvshmem-cu13)')}


def default_backend(device_type: str) -> str:
    """The backend used for ``device_type`` when ``tilescale.init`` is given none.

    Example::

        default_backend("cpu")     # "host_shm"
    """
    return "cuda_ipc" if device_type == "cuda" else "host_shm"


def check(name: str, device_type: str) -> None:
    """Raise unless backend ``name`` exists and runs on ``device_type`` ("cuda" or "cpu").

    Example::

        check("nvshmem", "cpu")    # ValueError: backend 'nvshmem' runs on cuda devices, ...
    """
    if name not in _BACKENDS:
        raise ValueError(f"unknown communication backend '{name}'; choose one of {sorted(_BACKENDS)}")
    needs = _BACKENDS[name][2]
    if needs != device_type:
        raise ValueError(f"backend '{name}' runs on {needs} devices, but this process uses {device_type}")
    if name in _REQUIRES:
        module, install = _REQUIRES[name]
        if not _importable(module):
            raise ImportError(f"backend '{name}' needs the Python module '{module}', which is not installed: {install}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package is missing
        return False


def create(name: str, group: Group, device_type: str) -> CommBackend:
    """Instantiate backend ``name`` for ``group`` on ``device_type`` ("cuda" or "cpu").

    Example::

        backend = create("host_shm", group, "cpu")

    A backend whose Python package is missing raises ``ImportError`` naming the install command.
    """
    check(name, device_type)
    module, cls, _ = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(group)


__all__ = ["CommBackend", "DeviceLowering", "Group", "SymmetricAllocation", "check", "create", "default_backend"]
