"""Symmetric tensors: ordinary torch tensors of which every rank owns a copy at a known address.

Example::

    ts.init()
    x = ts.zeros((4, 1024), dtype=torch.bfloat16)      # collective: every rank calls it
    right = ts.peer_view(x, (ts.rank() + 1) % ts.world_size())
    right[0].fill_(ts.rank())                           # writes into the neighbour's copy
    ts.barrier()

Slices and views of a symmetric tensor stay symmetric: a view sits at the same byte offset
inside every rank's copy, so ``peer_view`` and ``peer_ptrs`` work on them too.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tilescale.comm import SymmetricAllocation
from tilescale.runtime import check_not_capturing, current


@dataclass
class _Entry:
    allocation: SymmetricAllocation
    device: torch.device
    ptr_tables: dict[int, torch.Tensor]


# Keyed by the data pointer of this rank's copy; an entry dies with the copy's storage.
_registry: dict[int, _Entry] = {}


def _normalize_shape(shape: Sequence[int] | int | torch.Size) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"shape must be non-negative integers, got {shape!r}")
    return dims


def empty(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32,
          device: torch.device | str | None = None) -> torch.Tensor:
    """Collectively allocate an uninitialised symmetric tensor (every rank calls it alike).

    Example::

        buf = ts.empty((1024, 1024), dtype=torch.float16)

    ``device`` defaults to this rank's device and must match it if given. Ranks that ask for
    different shapes or dtypes all get a ``ValueError`` naming the ranks and values; a rank
    that never calls makes the others raise ``TimeoutError`` naming it.
    """
    rt = current()
    dims = _normalize_shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if device is not None and torch.device(device).type != rt.device.type:
        raise ValueError(f"symmetric tensors of this job live on {rt.device}, not {device}")
    tag = rt.group.next_tag("alloc")
    request = [list(dims), str(dtype)]
    requests = rt.group.exchange(tag, request)
    if any(r != request for r in requests):
        groups: dict[str, list[int]] = {}
        for r, req in enumerate(requests):
            groups.setdefault(f"shape={tuple(req[0])} dtype={req[1]}", []).append(r)
        detail = "; ".join(f"ranks {ranks}: {what}" for what, ranks in groups.items())
        raise ValueError(f"symmetric allocation #{tag.split('/')[1]} differs across ranks: {detail}")
    nbytes = math.prod(dims) * dtype.itemsize
    local, allocation = rt.backend.allocate(nbytes, tag)
    storage = local.untyped_storage()
    key = storage.data_ptr()
    _registry[key] = _Entry(allocation, local.device, {})
    weakref.finalize(storage, _registry.pop, key, None)
    return local.view(dtype).view(dims)


def zeros(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32,
          device: torch.device | str | None = None) -> torch.Tensor:
    """Like :func:`empty`, zero-filled on every rank before any rank returns."""
    # Backends hand out zeroed memory and synchronise before returning.
    return empty(shape, dtype, device)


def _lookup(t: torch.Tensor) -> tuple[_Entry, int] | None:
    entry = _registry.get(t.untyped_storage().data_ptr())
    if entry is None:
        return None
    # Not t.data_ptr(): torch reports 0 for tensors without elements.
    return entry, t.storage_offset() * t.element_size()


def is_symmetric(t: torch.Tensor) -> bool:
    """Whether ``t`` is (a view of) a tensor allocated by :func:`empty` / :func:`zeros`."""
    return isinstance(t, torch.Tensor) and _lookup(t) is not None


def _require(t: torch.Tensor, what: str) -> tuple[_Entry, int]:
    found = _lookup(t) if isinstance(t, torch.Tensor) else None
    if found is None:
        raise TypeError(f"{what} is not a symmetric tensor: allocate it with tilescale.empty/zeros")
    return found


def peer_view(t: torch.Tensor, rank: int) -> torch.Tensor:
    """A torch view of rank ``rank``'s copy of the symmetric tensor (or view) ``t``.

    Example::

        ts.peer_view(x, 0)[:8].copy_(x[:8])     # write my first 8 rows into rank 0's copy
    """
    entry, offset = _require(t, "peer_view's tensor")
    world = current().group.world_size
    if not 0 <= rank < world:
        raise IndexError(f"peer rank {rank} out of range for world size {world}")
    if rank == current().group.rank:
        return t
    base = entry.allocation.peer(rank).view(t.dtype)
    return base.as_strided(t.shape, t.stride(), offset // t.element_size())


def peer_ptrs(t: torch.Tensor) -> torch.Tensor:
    """Address of ``t``'s first element on every rank, as an int64 tensor on ``t``'s device.

    This is the table a kernel indexes with a peer rank to build a view of that peer's copy;
    tables are cached per view offset.
    """
    entry, offset = _require(t, "peer_ptrs' tensor")
    table = entry.ptr_tables.get(offset)
    if table is None:
        check_not_capturing("a kernel's first use of this symmetric tensor (its peer table)")
        ptrs = [p + offset for p in entry.allocation.peer_ptrs]
        table = torch.tensor(ptrs, dtype=torch.int64, device=entry.device)
        entry.ptr_tables[offset] = table
    return table


def host_regions() -> list[tuple[int, int, torch.Tensor, int, int]]:
    """Peers' copies of every live symmetric allocation, as mapped into this process.

    One ``(address, nbytes, uint8 tensor, key of this rank's copy, peer rank)`` per peer
    copy; the CPU execution path resolves the addresses in peer tables with it.
    """
    me = current().group.rank
    regions = []
    for key, entry in list(_registry.items()):
        for peer, ptr in enumerate(entry.allocation.peer_ptrs):
            if peer != me:
                regions.append((ptr, entry.allocation.nbytes, entry.allocation.peer(peer), key, peer))
    return regions
