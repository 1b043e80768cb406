"""Symmetric memory on the NVSHMEM heap, through nvshmem4py (``pip install "tilescale[nvshmem]"``).

NVSHMEM is initialised from the job tilescale already has: rank 0 creates a unique id,
the store carries it to every rank (``Group.exchange``, so a missing rank is named
instead of hanging), and each rank joins with ``initializer_method="uid"``. Ranks started
by Open MPI's ``mpirun`` can instead let NVSHMEM bootstrap over MPI
(``TILESCALE_NVSHMEM_BOOTSTRAP=mpi``; the pip package's MPI bootstrap is built for Open MPI,
so under MPICH use the default).

Every symmetric tensor is ``nvshmem.core.tensor`` memory: the same heap offset on every
rank. The tensor tilescale hands out has a storage of its own over that memory
(:func:`heap_tensor`), so its death is seen and the memory comes back (see
:meth:`NvshmemBackend.allocate`). Peers that NVSHMEM maps into this process (same node,
P2P or NVLink) get an address from ``nvshmem_ptr``, so kernels lowered the default way
(loads and stores through the peer-address table) run unchanged. Peers on other nodes have no address (0 in the table);
kernels that touch them must be built with ``build_options(remote="nvshmem")``, which
lowers remote operations to NVSHMEM device calls (see ``tilescale.comm.nvshmem.lowering``).
Launching an address-lowered kernel in such a job raises (``check_lowering``).

The lowering is chosen per process group (one backend per group): ``tilescale.jit`` builds
a group's kernels with the peer-address lowering when its ranks share a node and every
peer has an address (the fast path), and with NVSHMEM calls otherwise (a group spanning
nodes); ``TILESCALE_NVSHMEM_CALLS=1`` forces the calls for every group, so the path that
crosses nodes runs on one node too.

Process groups smaller than the job: NVSHMEM is initialised once per process, over the
whole job (the job's backend), and a group's backend shares it (``parent``). But
``nvshmem_malloc`` is collective over every PE of the job, and a group allocates with its
own ranks only. So the job's backend reserves, at init, an arena on the heap
(``TILESCALE_NVSHMEM_GROUP_HEAP``, default 256M; ``0``: no groups), every rank keeps its
own list of the arena's free ranges, and a group allocation takes the first range free on
*all* of the group's ranks (they exchange their lists): the same heap offset on each
member, which is what NVSHMEM's one-sided calls need (they address the peer's copy at the
caller's offset), and disjoint from the rank's allocations of its other groups.

Example::

    ts.init(backend="nvshmem")          # or TILESCALE_BACKEND=nvshmem
    x = ts.zeros((1024,), dtype=torch.float32)     # on the NVSHMEM symmetric heap
    ts.finalize()                                   # frees the heap, nvshmem finalize
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from tilescale.comm.base import ADDRESS, CommBackend, SymmetricAllocation
from tilescale.comm.group import Group

INSTALL_HINT = 'pip install "tilescale[nvshmem]" (nvshmem4py-cu13 and nvidia-nvshmem-cu13)'
NVSHMEM_CALLS = "nvshmem"
# Set to 1: kernels use NVSHMEM device calls for every peer, also those reachable by address
# (the path that crosses nodes, exercised on one node).
FORCE_CALLS_ENV = "TILESCALE_NVSHMEM_CALLS"
# Bytes of the heap reserved at init for the allocations of process groups smaller than the job.
GROUP_HEAP_ENV, GROUP_HEAP_DEFAULT = "TILESCALE_NVSHMEM_GROUP_HEAP", "256M"
# Group allocations start at multiples of this (TMA and vector accesses need 128-byte alignment at most).
GROUP_ALIGN = 512


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
    """One range of the NVSHMEM heap; ``peer_ptrs[r]`` is 0 where rank r is not load/store reachable."""

    def __init__(self, nbytes: int, peers: list[torch.Tensor | None], peer_ptrs: list[int], rank: int,
                 on_drop: Callable[[], None]):
        super().__init__(nbytes, peer_ptrs)
        self._peers = peers
        self._rank = rank
        self._on_drop = on_drop

    def peer(self, rank: int) -> torch.Tensor:
        view = self._peers[rank]
        if view is None:
            raise RuntimeError(
                f"rank {rank}'s copy is not load/store reachable from rank {self._rank} (nvshmem_ptr gives no "
                "address: another node, or no P2P); reach it from kernels built with build_options(remote='nvshmem')"
            )
        return view

    def dropped(self) -> None:
        self._on_drop()


class _HeapRange:
    """``nbytes`` of the heap at ``address``, in the form ``torch.as_tensor`` wraps (CUDA array interface)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3}


def heap_tensor(address: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of the heap at ``address``, with a storage of its own.

    Its own storage, not a view of the allocation NVSHMEM handed out: so the tensor's death is
    seen (the memory goes back to the heap), and its storage offsets start at the range.

    Example::

        local = heap_tensor(arena.data_ptr() + start, 4096, torch.device("cuda", 0))

    Args:
        address: the range's first byte (this process's address of some rank's copy).
        nbytes: its length (at least 1).
        device: the GPU the address belongs to.

    Returns:
        The tensor; it does not own the memory (the backend does).
    """
    return torch.as_tensor(_HeapRange(address, nbytes), device=device)


def parse_size(text: str) -> int:
    """Bytes in a size such as ``"256M"``, ``"4G"`` or ``"1048576"`` (NVSHMEM's own notation).

    Example::

        parse_size("256M")    # 268435456
    """
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    text = text.strip().upper().removesuffix("B")
    if text[-1:] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


class Arena:
    """Free ranges of one rank's share of the group heap; a group allocation takes a range free on all of its ranks.

    Example::

        arena = Arena(1 << 20)
        start = arena.first_fit([arena.free, peer_free_list], 4096)
        arena.take(start, 4096)
    """

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.free: list[list[int]] = [[0, nbytes]] if nbytes else []
        self._dropped: list[tuple[int, int]] = []

    @staticmethod
    def first_fit(free_lists: list[list[list[int]]], nbytes: int) -> int | None:
        """The lowest offset where ``nbytes`` are free in every list (aligned), or None."""
        size = -(-nbytes // GROUP_ALIGN) * GROUP_ALIGN
        candidates = sorted({start for free in free_lists for start, _ in free})
        for start in candidates:
            if all(any(s <= start and start + size <= e for s, e in free) for free in free_lists):
                return start
        return None

    def take(self, start: int, nbytes: int) -> None:
        end = start + -(-nbytes // GROUP_ALIGN) * GROUP_ALIGN
        for i, (s, e) in enumerate(self.free):
            if s <= start and end <= e:
                self.free[i:i + 1] = [r for r in ([s, start], [end, e]) if r[1] > r[0]]
                return
        raise AssertionError(f"heap range {start}..{end} is not free")

    def drop(self, start: int, nbytes: int) -> None:
        """Queue a range for :meth:`free_ranges` to give back (safe from a tensor's finalizer, at any moment)."""
        self._dropped.append((start, nbytes))

    def free_ranges(self) -> list[list[int]]:
        """The free ranges, after giving back every dropped one."""
        while self._dropped:
            self.give_back(*self._dropped.pop())
        return self.free

    def give_back(self, start: int, nbytes: int) -> None:
        end = start + -(-nbytes // GROUP_ALIGN) * GROUP_ALIGN
        if any(s <= start and end <= e for s, e in self.free):
            return  # already free: a range given back twice must not overlap the free list
        merged = sorted([*self.free, [start, end]])
        self.free = []
        for s, e in merged:
            if self.free and self.free[-1][1] == s:
                self.free[-1][1] = e
            else:
                self.free.append([s, e])


class NvshmemBackend(CommBackend):
    """Symmetric memory on the NVSHMEM heap; peers within one node are also reachable by address."""

    name = "nvshmem"
    device_type = "cuda"
    lowerings = (ADDRESS, NVSHMEM_CALLS)
    call_lowering = NVSHMEM_CALLS

    def __init__(self, group: Group, parent: CommBackend | None = None):
        super().__init__(group, parent)
        self.unreachable: list[int] = []  # peers without an address, known after the first allocation
        self.force_calls = os.environ.get(FORCE_CALLS_ENV, "0") not in ("", "0")
        self.finalized = False
        self._owners: dict[str, torch.Tensor] = {}  # the job's allocations by tag, until freed
        # Tags of the job's allocations whose tensor this rank dropped (appended by the tensors'
        # finalizers, so at any moment: only the allocation path reads and trims it).
        self._dropped: list[str] = []
        self._ranges: dict[int, int] = {}  # a group's live ranges of the job's arena: start -> bytes
        if parent is not None:  # a process group: NVSHMEM and the arena are the job's
            if not isinstance(parent, NvshmemBackend) or parent.arena is None:
                raise RuntimeError("a process group on the nvshmem backend needs the job's nvshmem backend")
            self._core, self._bindings = parent._core, parent._bindings
            self.arena, self.arena_tensor = parent.arena, parent.arena_tensor
            return
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
        self.arena = Arena(parse_size(os.environ.get(GROUP_HEAP_ENV, GROUP_HEAP_DEFAULT)))
        # Collective over every PE, so here, while the whole job is: the groups' allocations come from it.
        self.arena_tensor = self._core.tensor((self.arena.nbytes,), dtype=torch.uint8) if self.arena.nbytes else None

    def _exchange_uid(self) -> object:
        """Rank 0's unique id, carried to every rank through the job's store."""
        uid = self._core.get_unique_id(empty=self.group.rank != 0)
        raw = uid._data.view(np.uint8).tobytes() if self.group.rank == 0 else None
        sent = self.group.exchange(self.group.next_tag("nvshmem-uid"), raw.hex() if raw is not None else None)[0]
        if self.group.rank != 0:
            np.copyto(uid._data.view(np.uint8), np.frombuffer(bytes.fromhex(sent), dtype=np.uint8))
        return uid

    def _group_range(self, nbytes: int, tag: str) -> int:
        """The offset of a range of the job's arena free on every rank of this group (collective over it)."""
        lists = self.group.exchange(f"{tag}/free", self.arena.free_ranges())
        start = Arena.first_fit(lists, nbytes)
        if start is None:
            raise RuntimeError(f"{nbytes} bytes do not fit in the NVSHMEM heap reserved for process groups on all of "
                               f"ranks {self.group.ranks} ({self.arena.nbytes} bytes): raise {GROUP_HEAP_ENV} (and "
                               "NVSHMEM_SYMMETRIC_SIZE with it)")
        self.arena.take(start, nbytes)
        self._ranges[start] = nbytes
        return start

    def allocate(self, nbytes: int, tag: str) -> tuple[torch.Tensor, SymmetricAllocation]:
        """The job's allocations are NVSHMEM allocations of their own; a group's, ranges of the arena.

        The memory comes back when the tensor dies (:meth:`SymmetricAllocation.dropped`): a
        group's range at its rank's next arena allocation; the job's allocations at the job's
        next allocation, once every rank has dropped them.
        """
        size = max(nbytes, 1)
        if self.parent is None:
            self._free_dropped(tag)
            owner = self._core.tensor((size,), dtype=torch.uint8)
            self._owners[tag] = owner
            address, on_drop = owner.data_ptr(), functools.partial(self._dropped.append, tag)
        else:
            start = self._group_range(size, tag)
            address, on_drop = self.arena_tensor.data_ptr() + start, functools.partial(self._drop_range, start, size)
        me, device = self.group.rank, torch.device("cuda", torch.cuda.current_device())
        # NVSHMEM numbers PEs by global rank; 0 where nvshmem_ptr gives no address.
        ptrs = [address if r == me else self._bindings.ptr(address, pe) or 0 for r, pe in enumerate(self.group.ranks)]
        local = heap_tensor(address, size, device)
        local.zero_()
        peers = [None if r == me or not p else heap_tensor(p, size, device)[:nbytes] for r, p in enumerate(ptrs)]
        self.unreachable = [r for r, p in enumerate(ptrs) if p == 0]
        # A peer may write into our copy as soon as it returns: our zero_() must be done first.
        torch.cuda.synchronize()
        self.group.barrier(f"{tag}/zeroed")
        return local[:nbytes], NvshmemAllocation(nbytes, peers, ptrs, me, on_drop)

    def _free_dropped(self, tag: str) -> None:
        """Free the job's allocations whose tensors every rank has dropped (collective over the job).

        ``nvshmem_free`` is collective, so a tensor's death on one rank cannot free it: each
        rank lists what it dropped, and what all dropped is freed, in the same order everywhere.
        """
        lists = self.group.exchange(f"{tag}/dropped", sorted(self._dropped))
        for gone in sorted(set.intersection(*map(set, lists))):
            self._core.free_tensor(self._owners.pop(gone))
            self._dropped.remove(gone)

    def _drop_range(self, start: int, nbytes: int) -> None:
        if not self.finalized:
            self._ranges.pop(start, None)
            self.arena.drop(start, nbytes)

    def check_lowering(self, lowering: str) -> None:
        super().check_lowering(lowering)
        if lowering == ADDRESS and self.unreachable:
            raise RuntimeError(
                f"ranks {self.unreachable} are not load/store reachable from rank {self.group.rank} (another node, "
                "or no P2P), so this kernel's peer-address lowering cannot reach them: build it inside "
                "tilescale.language.build_options(remote='nvshmem') to lower remote operations to NVSHMEM calls"
            )

    def kernel_lowering(self) -> str:
        """Peer addresses when the group's ranks share a node and every peer has one (the fast path),
        NVSHMEM calls otherwise or when forced."""
        return NVSHMEM_CALLS if self.force_calls or self.unreachable or self.spans_nodes else ADDRESS

    def finalize(self) -> None:
        torch.cuda.synchronize()
        self.finalized = True
        for start, nbytes in list(self._ranges.items()):  # the group's ranks met before this (GroupState.release)
            self.arena.drop(start, nbytes)
        self._ranges.clear()
        if self.parent is not None:
            return
        for owner in self._owners.values():  # the same tags, in the same order, on every rank
            self._core.free_tensor(owner)
        self._owners.clear()
        if self.arena_tensor is not None:
            self._core.free_tensor(self.arena_tensor)
        self._core.finalize()
