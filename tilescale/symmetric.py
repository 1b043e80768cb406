"""Symmetric tensors: ordinary torch tensors of which every rank owns a copy at a known address.

Example::

    ts.init()
    x = ts.zeros((4, 1024), dtype=torch.bfloat16)      # collective: every rank calls it
    right = ts.peer_view(x, (ts.rank() + 1) % ts.world_size())
    right[0].fill_(ts.rank())                           # writes into the neighbour's copy
    ts.barrier()

    y = ts.zeros((1024,), group=tp)                     # symmetric over the ranks of tp only
    ts.peer_view(y, 1 - ts.group_state(tp).rank)        # ranks are ranks within the group

Slices and views of a symmetric tensor stay symmetric: a view sits at the same byte offset
inside every rank's copy, so ``peer_view`` and ``peer_ptrs`` work on them too. A symmetric
tensor belongs to the group it was allocated over (its state, ``tilescale.groups``, holds
the allocation); peer ranks are ranks within that group.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tilescale.groups import GroupState, SymmetricEntry
from tilescale.runtime import check_not_capturing, current, group_state, live_groups


def _normalize_shape(shape: Sequence[int] | int | torch.Size) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if any(not isinstance(d, int) or d < 0 for d in dims):
        raise ValueError(f"shape must be non-negative integers, got {shape!r}")
    return dims


def empty(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32,
          device: torch.device | str | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Collectively allocate an uninitialised symmetric tensor (every rank of ``group`` calls it alike).

    Example::

        buf = ts.empty((1024, 1024), dtype=torch.float16)
        part = ts.empty((256,), group=tp)            # over the ranks of tp (None: the whole job)

    ``device`` defaults to this rank's device and must match it if given. Ranks that ask for
    different shapes or dtypes all get a ``ValueError`` naming the ranks and values; a rank
    that never calls makes the others raise ``TimeoutError`` naming it.

    Args:
        shape: the shape (an int for one dimension), the same on every rank.
        dtype: the element type, the same on every rank.
        device: None, or this rank's device (``ts.device()``).
        group: the process group whose ranks allocate it together; None: the whole job.

    Returns:
        This rank's copy, on this rank's device; peers reach theirs through :func:`peer_view` and kernels.
    """
    rt = current()
    dims = _normalize_shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {dtype!r}")
    if device is not None and torch.device(device).type != rt.device.type:
        raise ValueError(f"symmetric tensors of this job live on {rt.device}, not {device}")
    return group_state(group).allocate(dims, dtype)


def zeros(shape: Sequence[int] | int, dtype: torch.dtype = torch.float32,
          device: torch.device | str | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Like :func:`empty`, zero-filled on every rank before any rank returns.

    Example::

        flags = ts.zeros((8,), dtype=torch.int32)    # every rank's copy is 0 when any rank returns

    Args and returns: those of :func:`empty`.

    Args:
        shape: The shape (an int for one dimension), the same on every rank.
        dtype: The element type, the same on every rank (default float32).
        device: None, or this rank's device (``ts.device()``).
        group: The process group whose ranks allocate it together; None: the whole job.

    Returns:
        This rank's zero-filled copy, on this rank's device.

    Raises:
        ValueError: ranks ask for different shapes or dtypes, or ``device`` is not this rank's.
        TypeError: ``dtype`` is not a ``torch.dtype``.
    """
    # Backends hand out zeroed memory and synchronise before returning.
    return empty(shape, dtype, device, group=group)


def _lookup(t: torch.Tensor) -> tuple[SymmetricEntry, int] | None:
    key = t.untyped_storage().data_ptr()
    for state in live_groups():
        entry = state.allocations.get(key)
        if entry is not None:
            # Not t.data_ptr(): torch reports 0 for tensors without elements.
            return entry, t.storage_offset() * t.element_size()
    return None


def is_symmetric(t: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``t`` is (a view of) a tensor allocated by :func:`empty` / :func:`zeros`, over
    ``group`` if one is given.

    Example::

        ts.is_symmetric(x)                 # symmetric over any group
        ts.is_symmetric(x, group=tp)       # over tp

    Args:
        t: any object (False for anything but a tensor).
        group: None: any group; else the tensor must be symmetric over this one.

    Returns:
        Whether ``t`` is symmetric (over ``group``).
    """
    found = _lookup(t) if isinstance(t, torch.Tensor) else None
    if found is None:
        return False
    return group is None or found[0].group is group_state(group)


def group_of(t: torch.Tensor) -> GroupState:
    """The state of the group the symmetric tensor ``t`` was allocated over.

    Example::

        ts.symmetric.group_of(x).ranks     # [0, 1]

    Args:
        t: a symmetric tensor or a view of one (TypeError otherwise).

    Returns:
        The group's :class:`GroupState`.
    """
    return _require(t, "the tensor")[0].group


def _require(t: torch.Tensor, what: str, group: dist.ProcessGroup | None = None) -> tuple[SymmetricEntry, int]:
    found = _lookup(t) if isinstance(t, torch.Tensor) else None
    if found is None:
        raise TypeError(f"{what} is not a symmetric tensor: allocate it with tilescale.empty/zeros")
    if group is not None:
        check_group(found[0].group, group_state(group), what)
    return found


def check_group(owner: GroupState, wanted: GroupState, what: str) -> None:
    """Raise ValueError unless a symmetric tensor of ``owner``'s group is used on ``wanted``'s.

    Example::

        check_group(group_of(x), ts.group_state(dp), "x")   # ValueError: x is symmetric over ...

    Args:
        owner: the group the tensor was allocated over (:func:`group_of`).
        wanted: the group of the operation.
        what: the tensor's name, for the message.
    """
    if owner is not wanted:
        raise ValueError(f"{what} is a symmetric tensor of the {owner.describe()}, but it is used on the "
                         f"{wanted.describe()}; allocate it with group= of the operation")


def peer_view(t: torch.Tensor, rank: int, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """A torch view of rank ``rank``'s copy of the symmetric tensor (or view) ``t``.

    Example::

        ts.peer_view(x, 0)[:8].copy_(x[:8])     # write my first 8 rows into rank 0's copy

    ``rank`` is a rank within ``t``'s group; ``group``, if given, must be that group.

    Args:
        t: a symmetric tensor or a view of one.
        rank: the peer's rank within ``t``'s group.
        group: None, or ``t``'s group (ValueError for another).

    Returns:
        The view (``t`` itself for this rank), of ``t``'s shape, strides and dtype.
    """
    entry, offset = _require(t, "peer_view's tensor", group)
    state = entry.group
    if not 0 <= rank < state.size:
        raise IndexError(f"peer rank {rank} out of range for the {state.describe()} of size {state.size}")
    if rank == state.rank:
        return t
    base = entry.allocation.peer(rank).view(t.dtype)
    return base.as_strided(t.shape, t.stride(), offset // t.element_size())


def peer_ptrs(t: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Address of ``t``'s first element on every rank of its group (by rank within it), as an
    int64 tensor on ``t``'s device.

    Example::

        table = ts.peer_ptrs(x)                  # table[p]: x on rank p

    This is the table a kernel indexes with a peer rank to build a view of that peer's copy;
    tables are cached per view offset. ``group``, if given, must be ``t``'s group.

    Args:
        t: a symmetric tensor or a view of one.
        group: None, or ``t``'s group (ValueError for another).

    Returns:
        An int64 tensor of the group's size; do not modify it (it is shared by the cache).
    """
    return peer_table(*_require(t, "peer_ptrs' tensor", group))


def peer_table(entry: SymmetricEntry, offset: int) -> torch.Tensor:
    """The peer table of the view at byte ``offset`` of ``entry``'s allocation (cached).

    Args:
        entry: the allocation (:func:`lookup`).
        offset: the view's byte offset within it.

    Returns:
        The int64 tensor of peer addresses, on the allocation's device.
    """
    table = entry.ptr_tables.get(offset)
    if table is None:
        check_not_capturing("a kernel's first use of this symmetric tensor (its peer table)")
        ptrs = [p + offset for p in entry.allocation.peer_ptrs]
        table = torch.tensor(ptrs, dtype=torch.int64, device=entry.device)
        entry.ptr_tables[offset] = table
    return table


def lookup(t: object) -> tuple[SymmetricEntry, int] | None:
    """``(entry, byte offset)`` of the symmetric tensor ``t``, None for anything else (for ``tilescale.jit``).

    Args:
        t: any object.

    Returns:
        ``(entry, byte offset)``, or None.
    """
    return _lookup(t) if isinstance(t, torch.Tensor) else None


def host_regions() -> list[tuple[int, int, torch.Tensor, int, int]]:
    """Peers' copies of every live symmetric allocation of every group, as mapped into this process.

    One ``(address, nbytes, uint8 tensor, key of this rank's copy, peer's global rank)`` per
    peer copy; the CPU execution path resolves the addresses in peer tables with it.

    Returns:
        The regions, in no particular order.
    """
    regions = []
    for state in live_groups():
        for key, entry in list(state.allocations.items()):
            for peer, ptr in enumerate(entry.allocation.peer_ptrs):
                if peer != state.rank:
                    regions.append((ptr, entry.allocation.nbytes, entry.allocation.peer(peer), key, state.ranks[peer]))
    return regions
