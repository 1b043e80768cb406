"""Symmetric memory on the GPUs of one node through torch symmetric memory (cuMem + IPC).

Every rank's copy is mapped into every process, so a kernel reaches a peer's copy with
ordinary loads and stores (and TMA) through ``peer_ptrs``. ``buffer_ptrs`` of a torch
handle are allocation bases; a tensor inside the allocation sits at the same offset on
every peer (DESIGN.md, pointer rule).

Torch symmetric memory refuses ranks that share a GPU (``tilescale run --share-gpus``),
so there each copy is an ordinary caching-allocator tensor whose legacy CUDA IPC handle
(the one ``torch.multiprocessing`` sends) the peers open. Torch counts the peers' references
to such memory and may warn at exit ("Producer process has been terminated before all
shared CUDA tensors released") about copies still alive then: harmless, as every rank has
passed ``finalize``'s barrier.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

from tilescale.comm.base import CommBackend, SymmetricAllocation
from tilescale.comm.group import Group


class CudaIpcAllocation(SymmetricAllocation):
    def __init__(self, local: torch.Tensor, handle, rank: int):
        self._handle = handle
        self._offset = local.data_ptr() - handle.buffer_ptrs[rank]
        super().__init__(local.numel(), [p + self._offset for p in handle.buffer_ptrs])

    def peer(self, rank: int) -> torch.Tensor:
        return self._handle.get_buffer(rank, (self.nbytes,), torch.uint8, self._offset)


class SharedGpuAllocation(SymmetricAllocation):
    def __init__(self, local: torch.Tensor, peers: list[torch.Tensor | None]):
        self._peers = peers  # keeps the peers' opened copies mapped; None for our own
        super().__init__(local.numel(), [local.data_ptr() if p is None else p.data_ptr() for p in peers])

    def peer(self, rank: int) -> torch.Tensor:
        return self._peers[rank]


def _ipc_handle(local: torch.Tensor) -> list:
    fields = local.untyped_storage()._share_cuda_()
    return [f.hex() if isinstance(f, bytes) else f for f in fields]


def _open_ipc_handle(fields: list) -> torch.Tensor:
    """A peer's copy, opened in this process's current GPU's context.

    Torch would open it in the context of the GPU the memory is on (its ``device`` field),
    which maps it for kernels on that GPU only: with ranks sharing several GPUs (two ranks on
    each of two GPUs, say) a kernel here storing to a peer on the other GPU faulted. Opened
    here, CUDA enables peer access to the owner's GPU as it maps the copy
    (``cudaIpcMemLazyEnablePeerAccess``, as torch passes), and the tensor names this GPU,
    whose kernels are the ones that reach it.
    """
    _, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = fields
    me = torch.cuda.current_device()
    storage = torch.UntypedStorage._new_shared_cuda(
        me, bytes.fromhex(handle), size, offset, bytes.fromhex(ref_handle), ref_offset,
        bytes.fromhex(event_handle) if event_handle else event_handle, event_sync,
    )  # fmt: skip
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", me)).set_(storage)


class CudaIpcBackend(CommBackend):
    """Peer-address symmetric memory for ranks that share a node (NVLink or PCIe peers)."""

    name = "cuda_ipc"
    device_type = "cuda"

    def __init__(self, group: Group, parent: CommBackend | None = None):
        super().__init__(group, parent)
        if group.local_world_size != group.world_size:
            raise RuntimeError(
                f"the cuda_ipc backend reaches GPUs of one node only, but the job spans "
                f"{group.world_size // max(group.local_world_size, 1)} nodes; use backend='nvshmem'"
            )
        me = torch.cuda.current_device()
        others = [d for d in range(torch.cuda.device_count()) if d != me]
        blocked = [d for d in others if not torch.cuda.can_device_access_peer(me, d)]
        if blocked:
            raise RuntimeError(f"GPU {me} cannot reach GPUs {blocked} directly (no P2P); cuda_ipc needs peer access")
        # torch's name of the group whose ranks meet in each allocation's rendezvous.
        self._group_name = group.process_group_name or dist.group.WORLD.group_name
        gpus = group.exchange(group.next_tag("gpu-uuid"), str(torch.cuda.get_device_properties(me).uuid))
        self.gpus_shared = len(set(gpus)) < len(gpus)

    def allocate(self, nbytes: int, tag: str) -> tuple[torch.Tensor, SymmetricAllocation]:
        gpu = torch.device("cuda", torch.cuda.current_device())
        if self.gpus_shared:
            return self._allocate_shared(nbytes, tag, gpu)
        local = symm_mem.empty(max(nbytes, 1), dtype=torch.uint8, device=gpu)
        local.zero_()
        handle = symm_mem.rendezvous(local, self._group_name)
        # A peer may write into our copy as soon as it returns: it must see zeros, not our zero_() racing it.
        torch.cuda.synchronize()
        handle.barrier()
        local = local[:nbytes]
        return local, CudaIpcAllocation(local, handle, self.group.rank)

    def _allocate_shared(self, nbytes: int, tag: str, gpu: torch.device) -> tuple[torch.Tensor, SymmetricAllocation]:
        whole = torch.zeros(max(nbytes, 1), dtype=torch.uint8, device=gpu)
        # Zeroed before any peer can open it: each rank synchronises before it contributes its handle.
        torch.cuda.synchronize()
        handles = self.group.exchange(f"{tag}/ipc", _ipc_handle(whole))
        peers = [None if r == self.group.rank else _open_ipc_handle(h)[:nbytes] for r, h in enumerate(handles)]
        local = whole[:nbytes]
        return local, SharedGpuAllocation(local, peers)
