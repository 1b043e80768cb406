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

This module is the one registry of backends and of device lowerings (how a kernel's remote
operations reach peers without an address: ``build_options(remote=name)``). The language
and the jit look lowerings up here by name and name no vendor: adding one is a package
under ``comm/`` and an entry in :data:`_LOWERINGS` (and :data:`_BACKENDS` for its host side).
"""

from __future__ import annotations

import importlib
import importlib.util

from tilescale.comm.base import ADDRESS, CommBackend, DeviceLowering, SymmetricAllocation
from tilescale.comm.group import Group

_BACKENDS = {
    "cuda_ipc": ("tilescale.comm.cuda_ipc", "CudaIpcBackend", "cuda"),
    "host_shm": ("tilescale.comm.host_shm", "HostShmBackend", "cpu"),
    "nvshmem": ("tilescale.comm.nvshmem", "NvshmemBackend", "cuda"),
}
# Device lowerings: name -> (module, attribute holding its DeviceLowering). Imported at first use.
_LOWERINGS = {"nvshmem": ("tilescale.comm.nvshmem.lowering", "NVSHMEM_LOWERING")}
# Python packages a backend needs beyond tilescale's own dependencies: (import name, install command).
_REQUIRES = {"nvshmem": ("nvshmem.core", 'pip install "tilescale[nvshmem]" (nvshmem4py-cu13, nvidia-nvshmem-cu13)')}


def lowering_names() -> tuple[str, ...]:
    """Every registered device lowering, the language's own ``"address"`` first.

    Example::

        lowering_names()     # ("address", "nvshmem")
    """
    return (ADDRESS, *_LOWERINGS)


def device_lowering(name: str) -> DeviceLowering | None:
    """The registered :class:`DeviceLowering` called ``name``; None for ``"address"``.

    Example::

        device_lowering("nvshmem").put      # "tilescale::nvshmem_put_block"
    """
    if name == ADDRESS:
        return None
    if name not in _LOWERINGS:
        raise ValueError(f"unknown device lowering {name!r}; registered: {list(lowering_names())}")
    module, attribute = _LOWERINGS[name]
    return getattr(importlib.import_module(module), attribute)


def backend_with_lowering(lowering: str) -> str:
    """The first registered GPU backend whose kernels may use ``lowering`` (for error messages).

    Example::

        backend_with_lowering("nvshmem")     # "nvshmem"
    """
    for name, (module, cls, device_type) in _BACKENDS.items():
        if device_type == "cuda" and lowering in getattr(importlib.import_module(module), cls).lowerings:
            return name
    return "?"


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


def create(name: str, group: Group, device_type: str, parent: CommBackend | None = None) -> CommBackend:
    """Instantiate backend ``name`` for ``group`` on ``device_type`` ("cuda" or "cpu"); ``parent``:
    the whole job's backend when ``group`` is a smaller process group.

    Example::

        backend = create("host_shm", group, "cpu")

    A backend whose Python package is missing raises ``ImportError`` naming the install command.
    """
    check(name, device_type)
    module, cls, _ = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(group, parent)


__all__ = ["ADDRESS", "CommBackend", "DeviceLowering", "Group", "SymmetricAllocation", "backend_with_lowering", "check",
           "create", "default_backend", "device_lowering", "lowering_names"]
