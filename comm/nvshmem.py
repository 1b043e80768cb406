"""Symmetric memory on the NVSHMEM heap, through nvshmem4py (``pip install "tilescale[nvshmem]"``).

NVSHMEM is initialised from the job tilescale already has: rank 0 creates a unique id,
the store carries it to every rank (``Group.exchange``, so a missing rank is named
instead of hanging), and each rank joins with ``initializer_method="uid"``. Ranks started
by Open MPI's ``mpirun`` can instead let NVSHMEM bootstrap over MPI
(``TILESCALE_NVSHMEM_BOOTSTRAP=mpi``; the pip package's MPI bootstrap is built for Open MPI,
so under MPICH use the default).

Every symmetric tensor is ``nvshmem.core.tensor`` memory: the same heap offset on every
rank. Peers that NVSHMEM maps into this process (same node, P2P or NVLink) get an address
from ``nvshmem_ptr``, so kernels lowered the default way (loads and stores through the
peer-address table) run unchanged. Peers on other nodes have no address (0 in the table);
kernels that touch them must be built with ``build_options(remote="nvshmem")``, which
lowers remote operations to NVSHMEM device calls (see ``tilescale.language.nvshmem``).
Launching an address-lowered kernel in such a job raises (``check_lowering``).

``tilescale.jit`` builds kernels with the peer-address lowering when every peer has an
address (the fast path) and with NVSHMEM calls otherwise; ``TILESCALE_NVSHMEM_CALLS=1``
forces the calls for every peer, so the path that crosses nodes runs on one node too.

Example::

    ts.init(backend="nvshmem")          # or TILESCALE_BACKEND=nvshmem
    x = ts.zeros((1024,), dtype=torch.float32)     # on the NVSHMEM symmetric heap
    ts.finalize()                                   # frees the heap, nvshmem finalize
"""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np
import torch

from tilescale.comm.base import CommBackend, SymmetricAllocation
from tilescale.comm.group import Group

INSTALL_HINT = 'pip install "tilescale[nvshmem]" (nvshmem4py-cu13 and nvidia-nvshmem-cu13)'
ADDRESS, NVSHMEM_CALLS = "address", "nvshmem"
# Set to 1: kernels use NVSHMEM device calls for every peer, also those reachable by address
# (the path that crosses nodes, exercised on one node).
FORCE_CALLS_ENV = "TILESCALE_NVSHMEM_CALLS"


def import_nvshmem() -> tuple[ModuleType, ModuleType]:
    """``nvshmem.core`` and ``nvshmem.bindings``; raises ``ImportError`` with the install command.

    Example::

        core, bindings = import_nvshmem()
    """
    try:
        import nvshmem.bindings as bindings
        import nvshmem.core as core
    except ImportError as err:
        raise ImportError(f"backend 'nvshmem' needs nvshmem4py ({err}); {INSTALL_HINT}") from err
    return core, bindings


def check_mpi_bootstrap(world_size: int) -> None:
    """Raise unless NVSHMEM's MPI bootstrap can run in this process of a ``world_size``-rank job.

    The pip package's ``nvshmem_bootstrap_mpi.so.3`` is built against Open MPI
    (``libmpi.so.40``): under MPICH it loads another MPI beside the one the job started,
    and the process crashes (seen on H200s: exit 11). And an mpi4py built for another MPI
    than the launcher's sees each process as a job of its own (seen on an H200: MPICH's
    mpiexec, an Open MPI mpi4py), so NVSHMEM would make every rank PE 0 of 1. The
    unique-id bootstrap, the default, works under any launcher.

    Example::

        check_mpi_bootstrap(2)   # RuntimeError under MPICH's mpiexec
    """
    unset = "leave TILESCALE_NVSHMEM_BOOTSTRAP unset (the unique-id bootstrap works under mpirun too)"
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise RuntimeError(f"TILESCALE_NVSHMEM_BOOTSTRAP=mpi needs mpi4py ({err}); or {unset}") from None
    library = MPI.Get_library_version().strip().splitlines()[0]
    if "Open MPI" not in library:
        raise RuntimeError(
            f"TILESCALE_NVSHMEM_BOOTSTRAP=mpi: NVSHMEM's MPI bootstrap in the pip package is built against Open MPI "
            f"(libmpi.so.40), but this process runs {library!r}; {unset}, or start the job with Open MPI"
        )
    processes = MPI.COMM_WORLD.Get_size()
    if processes != world_size:
        raise RuntimeError(
            f"TILESCALE_NVSHMEM_BOOTSTRAP=mpi: mpi4py's MPI ({library!r}) sees {processes} process(es), but the job "
            f"has {world_size} ranks: the job was not started by this MPI's mpirun; {unset}, or start it with "
            "Open MPI's mpirun"
        )


class NvshmemAllocation(SymmetricAllocation):
    """One ``nvshmem.core.tensor``; ``peer_ptrs[r]`` is 0 where rank r is not load/store reachable."""

    def __init__(self, local: torch.Tensor, peers: list[torch.Tensor | None], peer_ptrs: list[int], rank: int):
        super().__init__(local.numel(), peer_ptrs)
        self._peers = peers
        self._rank = rank

    def peer(self, rank: int) -> torch.Tensor:
        view = self._peers[rank]
        if view is None:
            raise RuntimeError(
                f"rank {rank}'s copy is not load/store reachable from rank {self._rank} (nvshmem_ptr gives no "
                "address: another node, or no P2P); reach it from kernels built with build_options(remote='nvshmem')"
            )
        return view


class NvshmemBackend(CommBackend):
    """Symmetric memory on the NVSHMEM heap; peers within one node are also reachable by address."""

    name = "nvshmem"
    device_type = "cuda"
    lowerings = (ADDRESS, NVSHMEM_CALLS)

    def __init__(self, group: Group):
        super().__init__(group)
        self._core, self._bindings = import_nvshmem()
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nvshmem' needs a CUDA GPU, and torch sees none")
        from cuda.core import Device

        device = Device(torch.cuda.current_device())
        device.set_current()
        method = os.environ.get("TILESCALE_NVSHMEM_BOOTSTRAP", "uid")
        if method == "mpi":
            check_mpi_bootstrap(group.world_size)
            self._core.init(device=device, initializer_method="mpi")
        elif method == "uid":
            self._core.init(device=device, uid=self._exchange_uid(), rank=group.rank, nranks=group.world_size,
                            initializer_method="uid")
        else:
            raise ValueError(f"TILESCALE_NVSHMEM_BOOTSTRAP must be 'uid' or 'mpi', got {method!r}")
        pe, npes = self._core.my_pe(), self._core.n_pes()
        if (pe, npes) != (group.rank, group.world_size):
            self._core.finalize()
            raise RuntimeError(f"NVSHMEM made this process PE {pe} of {npes}, but it is rank {group.rank} of "
                               f"{group.world_size}: start NVSHMEM and torch.distributed with the same ranks")
        self.unreachable: list[int] = []  # peers without an address, known after the first allocation
        self.force_calls = os.environ.get(FORCE_CALLS_ENV, "0") not in ("", "0")
        self._live: list[torch.Tensor] = []

    def _exchange_uid(self) -> object:
        """Rank 0's unique id, carried to every rank through the job's store."""
        uid = self._core.get_unique_id(empty=self.group.rank != 0)
        raw = uid._data.view(np.uint8).tobytes() if self.group.rank == 0 else None
        sent = self.group.exchange(self.group.next_tag("nvshmem-uid"), raw.hex() if raw is not None else None)[0]
        if self.group.rank != 0:
            np.copyto(uid._data.view(np.uint8), np.frombuffer(bytes.fromhex(sent), dtype=np.uint8))
        return uid

    def allocate(self, nbytes: int, tag: str) -> tuple[torch.Tensor, SymmetricAllocation]:
        local = self._core.tensor((max(nbytes, 1),), dtype=torch.uint8)
        local.zero_()
        me = self.group.rank
        peers: list[torch.Tensor | None] = []
        ptrs: list[int] = []
        for r in range(self.group.world_size):
            address = local.data_ptr() if r == me else self._bindings.ptr(local.data_ptr(), r)
            view = None if r == me or not address else self._core.get_peer_tensor(local, r)[:nbytes]
            peers.append(view)
            ptrs.append(address or 0)
        self.unreachable = [r for r, p in enumerate(ptrs) if p == 0]
        # A peer may write into our copy as soon as it returns: our zero_() must be done first.
        torch.cuda.synchronize()
        self.group.barrier(f"{tag}/zeroed")
        self._live.append(local)
        local = local[:nbytes]
        return local, NvshmemAllocation(local, peers, ptrs, me)

    def check_lowering(self, lowering: str) -> None:
        super().check_lowering(lowering)
        if lowering == ADDRESS and self.unreachable:
            raise RuntimeError(
                f"ranks {self.unreachable} are not load/store reachable from rank {self.group.rank} (another node, "
                "or no P2P), so this kernel's peer-address lowering cannot reach them: build it inside "
                "tilescale.language.build_options(remote='nvshmem') to lower remote operations to NVSHMEM calls"
            )

    def kernel_lowering(self) -> str:
        """Peer addresses when every peer has one (the fast path), NVSHMEM calls otherwise or when forced."""
        return NVSHMEM_CALLS if self.force_calls or self.unreachable else ADDRESS

    def finalize(self) -> None:
        torch.cuda.synchronize()
        for t in self._live:
            self._core.free_tensor(t)
        self._live.clear()
        self._core.finalize()
