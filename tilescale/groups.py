"""Process groups: what tilescale keeps for one ``torch.distributed`` process group.

Example::

    tp = ts.new_group([0, 1]) if ts.rank() < 2 else ts.new_group([2, 3])   # every rank calls both
    x = ts.zeros((1024,), group=tp)              # symmetric over the ranks of tp only
    ts.ops.all_reduce(x, group=tp)
    state = ts.group_state(tp)                   # rank/size within tp, its allocations, workspaces
    state.release()                              # or leave it to ts.finalize()

Like DeepEP's ``Buffer(group)`` and torch symmetric memory's per-group workspaces, one
:class:`GroupState` per process group owns everything that belongs to the group: its view
of the ranks (rank and size within it, its global ranks, a store prefix no other group
uses), its backend and symmetric allocations, the barrier workspace of ``T.barrier()``,
and the workspaces and exchanges of the ``ts.ops`` called on it. ``None`` names the whole
job. :func:`tilescale.group_state` looks the object up (creating it, collectively over the
group's ranks, at the group's first use).
"""

from __future__ import annotations

import ctypes
import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tilescale import plans
from tilescale.comm import CommBackend, Group, SymmetricAllocation
from tilescale.errors import WAIT_STATUS_FIELDS


@dataclass
class SymmetricEntry:
    """One symmetric allocation of a group: how to reach every member's copy."""

    allocation: SymmetricAllocation
    device: torch.device
    group: GroupState
    ptr_tables: dict[int, torch.Tensor] = field(default_factory=dict)  # peer tables by byte offset


class GroupState:
    """Everything tilescale holds for one process group; released by :meth:`release`.

    Example::

        state = ts.group_state(tp)
        state.rank, state.size, state.ranks      # 1, 2, [2, 3] on global rank 3

    ``tilescale.runtime`` constructs it (users get it from ``ts.group_state``).

    Args:
        process_group: The torch process group; None for the whole job.
        comm: The host channel of the group's ranks (exchanges, barriers, tags).
        backend: The group's communication backend (allocation, lowering).
        pinned: Put the wait-status words in pinned host memory that the GPU writes (CUDA).
        on_release: Called with the state once :meth:`release` has freed it (the runtime drops
            it from its groups).
    """

    def __init__(self, process_group: dist.ProcessGroup | None, comm: Group, backend: CommBackend,
                 pinned: bool = False, on_release: Callable[[GroupState], None] | None = None):
        self.process_group = process_group
        self.on_release = on_release
        self.whole_job = process_group is None
        self.comm = comm
        self.backend = backend
        # This rank's copies of the group's symmetric allocations, by storage data pointer
        # (an entry dies with its copy's storage, or when the group is released).
        self.allocations: dict[int, SymmetricEntry] = {}
        # Counters of T.barrier() (see tilescale.language.sync), allocated when the group is created.
        self.sync_workspace: torch.Tensor | None = None
        # Where the group's kernels report a failed wait or a disagreement (tilescale.errors.WAIT_STATUS_FIELDS):
        # host memory the GPU writes directly (``pinned``: mapped through UVA), read without
        # synchronising. One per group, so a failure is reported against its group, and ends
        # the waits of that group's kernels only.
        self.wait_status = torch.zeros(len(WAIT_STATUS_FIELDS), dtype=torch.int64, pin_memory=pinned)
        self.wait_status_view = self.wait_status.numpy()  # read before every launch: no torch dispatch
        # The group's global ranks by rank within it, on the device: kernels lowered to a
        # library's device calls translate their peers through it (tilescale.comm.base.DeviceLowering).
        self.pes: torch.Tensor | None = None
        # The ops' symmetric scratch buffers, shape checks done, and exchanges (receive buffers,
        # flags, device-side counters), keyed by what the op needs them for.
        self.workspaces: dict[tuple, torch.Tensor] = {}
        self.verified: set[tuple] = set()
        # Plan keys whose first call met the group's ranks (tilescale.ops._common.launch_together):
        # kept when a rank alone drops its plans (a symmetric free), so it rebuilds them alone.
        self.launched: set[tuple] = set()
        self.exchanges: dict[tuple, Any] = {}
        # Calls announced on the group's call board (tilescale.ops._common.call_identity),
        # numbered alike on every rank of the group that makes the same calls; a ctypes integer,
        # so that the ops' calls made from C++ (tilescale.op_launch.Direct) number theirs in it too.
        self.call_counter = ctypes.c_int64(0)
        self.released = False

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return self.comm.rank

    @property
    def size(self) -> int:
        """Number of ranks in the group."""
        return self.comm.world_size

    @property
    def ranks(self) -> list[int]:
        """The group's global ranks, by rank within the group."""
        return self.comm.ranks

    @property
    def lowering(self) -> str:
        """How kernels built for this group lower remote operations: ``"address"`` when its ranks
        share a node, the backend's device calls (e.g. ``"nvshmem"``) when they span nodes.

        Example::

            ts.group_state(tp).lowering      # "address": TP inside a node
            ts.group_state(ep).lowering      # "nvshmem": EP across two nodes
        """
        return self.backend.kernel_lowering()

    def describe(self) -> str:
        """How errors name the group, after "the": ``"whole job"`` or ``"group of ranks [0, 2]"``.

        Returns:
            The name.
        """
        return "whole job" if self.whole_job else f"group of ranks {self.ranks}"

    def exchange(self, key: tuple, create: Callable[[], Any]) -> Any:
        """The op state stored under ``key``, made by ``create()`` at its first use.

        Example::

            ex = state.exchange(("tp_gemm", "ag", rows, k), lambda: make_buffers())

        Args:
            key: what the state is for (the op, its role and its shapes).
            create: makes the state; called once per key (collective calls inside are made by every rank alike).

        Returns:
            The state.
        """
        self.check_live()
        found = self.exchanges.get(key)
        if found is None:
            found = self.exchanges[key] = create()
        return found

    def allocate(self, dims: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A symmetric tensor over the group's ranks (``ts.empty(..., group=)``; tilescale's own
        buffers): every rank of the group calls it with the same shape and dtype, which are
        compared across them first.

        Example::

            flags = ts.group_state(tp).allocate((8,), torch.int32)

        Args:
            dims: the shape.
            dtype: the element type.

        Returns:
            This rank's copy (uninitialised).

        Raises:
            ValueError: ranks of the group asked for different shapes or dtypes.
        """
        self.check_live()
        tag = self.comm.next_tag("alloc")
        request = [list(dims), str(dtype)]
        requests = self.comm.exchange(tag, request)
        if any(r != request for r in requests):
            groups: dict[str, list[int]] = {}
            for r, req in zip(self.ranks, requests, strict=True):
                groups.setdefault(f"shape={tuple(req[0])} dtype={req[1]}", []).append(r)
            detail = "; ".join(f"ranks {ranks}: {what}" for what, ranks in groups.items())
            where = "" if self.whole_job else f" of the {self.describe()}"
            raise ValueError(f"symmetric allocation #{tag.split('/')[1]}{where} differs across ranks: {detail}")
        nbytes = math.prod(dims) * dtype.itemsize
        local, allocation = self.backend.allocate(nbytes, tag)
        storage = local.untyped_storage()
        key = storage.data_ptr()
        self.allocations[key] = SymmetricEntry(allocation, local.device, self)
        weakref.finalize(storage, _forget, self, key)
        return local.view(dtype).view(dims)

    def check_live(self) -> None:
        """Raise if the group has been released."""
        if self.released:
            raise RuntimeError(f"the tilescale state of the {self.describe()} has been released")

    def release(self, barrier: bool = True, *, finalizing: bool = False) -> None:
        """Free the group's allocations, workspaces and exchanges and its backend's state.

        Example::

            ts.group_state(tp).release()    # every rank of tp calls it; the next use starts afresh

        With ``barrier`` (the default) the group's ranks first meet (after this rank's queued
        GPU work), so no rank frees memory a peer may still write into. Symmetric tensors of
        the group that the caller still holds stay valid local tensors but are no longer
        symmetric (peer views and kernels refuse them); on the ``nvshmem`` backend their memory
        goes back to the heap at once: drop them first.

        Args:
            barrier: meet the group's ranks first (pass False only where they cannot be reached any more).
            finalizing: ``tilescale.finalize()``'s call, the only one that releases the whole job's state.
        """
        if self.released:
            return
        if self.whole_job and not finalizing:
            raise RuntimeError("the whole job's tilescale state is released by tilescale.finalize(), not by itself")
        if barrier:
            if self.backend.device_type == "cuda":
                torch.cuda.synchronize()
            self.comm.barrier()
        self.released = True
        plans.invalidate()  # plans hold this state and addresses of its allocations
        self.allocations.clear()
        self.workspaces.clear()
        self.verified.clear()
        self.launched.clear()
        self.exchanges.clear()
        self.sync_workspace = None
        self.pes = None
        self.backend.finalize()
        # Nor may a state the caller keeps hold the job's store (and so its server) or torch's group.
        self.comm.store = None
        self.process_group = None
        if self.on_release is not None:
            self.on_release(self)


def _forget(state: GroupState, key: int) -> None:
    # The memory of this copy may now be handed out again: plans that know it by address go.
    entry = state.allocations.pop(key, None)
    if entry is not None:
        entry.allocation.dropped()
    plans.invalidate()
