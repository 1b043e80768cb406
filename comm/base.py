"""What a communication backend provides to tilescale.

A backend owns symmetric memory: one allocation of the same size on every rank, each
rank able to address every peer's copy directly. The language lowers a remote access to a
load or store through the peer's address, so a backend that can hand out those addresses
(CUDA IPC on one node, POSIX shared memory on a CPU) needs no device library at all.
Backends whose peers are not load/store reachable (NVSHMEM across nodes) will add
device-side lowering hooks to this interface.
"""

from __future__ import annotations

import abc

import torch

from tilescale.comm.group import Group


class SymmetricAllocation(abc.ABC):
    """``nbytes`` bytes on every rank; ``peer_ptrs[r]`` is rank r's copy in this process.

    The allocation holds no reference to this rank's own copy: that copy is the tensor
    handed to the user, and the memory lives as long as its storage does.
    """

    def __init__(self, nbytes: int, peer_ptrs: list[int]):
        self.nbytes = nbytes
        self.peer_ptrs = peer_ptrs

    @abc.abstractmethod
    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s copy (``rank`` != own rank) as a uint8 tensor this process can read and write."""


class CommBackend(abc.ABC):
    """Symmetric allocation and reachability for one process group."""

    name: str
    device_type: str

    def __init__(self, group: Group):
        self.group = group

    @abc.abstractmethod
    def allocate(self, nbytes: int, tag: str) -> tuple[torch.Tensor, SymmetricAllocation]:
        """Collectively allocate ``nbytes`` zeroed bytes on every rank (``tag`` is unique per call).

        Returns this rank's copy as a uint8 tensor and the allocation describing all copies.
        """

    def finalize(self) -> None:
        """Release what the backend holds beyond its allocations."""
