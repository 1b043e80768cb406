"""Call plans: what a call resolves once per (kernel or op, shapes, dtypes, group, addresses).

Example::

    _plans = PlanCache()

    def put(src, dst, peer, *, group=None):
        key = (src.shape, src.dtype, dst.shape, dst.dtype, peer, group)
        launch = _plans.get(key)
        if launch is None:                       # first call of this key: every check, then the plan
            launch = _plans.put(key, build(src, dst, peer, group))
        launch(src, dst)

An eager call that finds its plan does none of the work the first call of its key did
(argument checks one rank alone decides, kernel lookup, peer tables, group state): the
host cost of a tilescale call comes close to that of the kernel launch itself.

Plans refer to group state and to symmetric memory by address, so every plan cache is
emptied when any of that goes away: a symmetric allocation freed, a group released,
``tilescale.init()`` / ``finalize()`` (:func:`invalidate`). A symmetric free is one rank's
own event (its garbage collected at a moment of its own), so a plan built again must not meet
the peers: what an op's first call does with the group's ranks (the shape check, the build
barrier) is recorded in the group's state, once per key, and only releasing the group clears
it. Checks that ranks agree are not part of a plan: kernels compare the call on the device
every time (``T.agree``, ``T.announce``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch

# Incremented by invalidate(); a cache whose epoch differs drops its plans before its next lookup.
_epoch = 0


def invalidate() -> None:
    """Make every plan cache drop its plans (symmetric memory or group state went away).

    Example::

        invalidate()     # called by tilescale itself: at init, finalize, group release, symmetric free
    """
    global _epoch
    _epoch += 1


class PlanCache:
    """Plans by key, dropped at every :func:`invalidate`; at most ``limit`` kept (the oldest go first).

    Example::

        cache = PlanCache()
        plan = cache.get(key) or cache.put(key, make_plan())

    Args:
        limit: plans kept at most; a caller that makes a new key on every call (views at ever
            new offsets, say) keeps rebuilding plans, but its memory stays bounded.
    """

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._plans: dict[Any, Any] = {}
        self._epoch = _epoch

    def get(self, key: Any) -> Any:
        """The plan of ``key``, None if there is none (yet, or since the last invalidation).

        Returns:
            The plan stored by :meth:`put`, or None.
        """
        if self._epoch != _epoch:
            self._plans.clear()
            self._epoch = _epoch
        return self._plans.get(key)

    def put(self, key: Any, plan: Any) -> Any:
        """Keep ``plan`` for ``key``.

        Args:
            key: A hashable key naming everything the plan depends on.
            plan: The plan object (any value). The oldest plan is dropped when ``limit`` are kept.

        Returns:
            ``plan``.
        """
        if self._epoch != _epoch:
            self._plans.clear()
            self._epoch = _epoch
        if len(self._plans) >= self.limit:
            del self._plans[next(iter(self._plans))]
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        """Drop every plan."""
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans) if self._epoch == _epoch else 0


class ReusedOutputs:
    """A plan's small output tensors, made again only while something still holds the last ones.

    A call's outputs must be new while the caller may still use an earlier call's (a handle
    kept for a backward pass, say). Once nothing holds any of them, a later call gets the same
    tensors back, as the caching allocator would give it the same memory, but without
    allocating and viewing them again (a microsecond or more of host time per tensor). The
    last two sets made are kept, so that a loop holding the previous call's outputs while it
    makes the next (``out = op(x)``) gets them back too.

    Example::

        words = ReusedOutputs(lambda: torch.empty(2 * n, dtype=torch.int32, device=dev).split(n))
        counts, offsets = words.take()      # an earlier call's tensors where all were dropped

    Held means any of: a Python reference to one of the tensors besides this object's, a C++
    one (autograd, DLPack), or another tensor on their storage (a view, a slice); a weak
    reference does not hold (it finds the tensor alive, with a later call's values). Tensors go
    back only to a call on the stream they were made on (as the caching allocator hands memory
    back), and never into a CUDA graph capture: a capture's outputs belong to the graph's pool,
    are made afresh and are not kept. Sets over ``keep_bytes`` are not kept either: memory kept
    per shape would add up over a run's many shapes, where each shape has its own outputs.

    Args:
        make: Makes the outputs: tensors that are views of one allocation.
        keep_bytes: The largest set kept (``KEEP_BYTES``); None: any, for outputs whose memory
            their owner bounds (one set per buffer, say, not per shape).
    """

    KEPT = 2
    KEEP_BYTES = 1 << 20

    def __init__(self, make: Callable[[], Sequence[torch.Tensor]], keep_bytes: int | None = KEEP_BYTES):
        self._make = make
        self._keep_bytes = keep_bytes
        # Sets made outside a capture, newest last: (tensors, their storage, stream, holders as made).
        self._kept: list[tuple[tuple[torch.Tensor, ...], int, int, tuple[int, ...]]] = []

    def take(self) -> list[torch.Tensor]:
        """The outputs of this call: a kept set if nothing holds it any more, else a new one.

        Returns:
            A new list of the tensors ``make`` returns (the same objects as an earlier call's, or new ones).
        """
        current = _stream(self._kept[0][0][0]) if self._kept else None  # every set is on one device
        # The set returned last first: a caller that drops each call's outputs gets it back after
        # one check, whatever it keeps of older calls (a handle for the backward pass, say).
        for i in reversed(range(len(self._kept))):
            tensors, storage, stream, holders = self._kept[i]
            if stream == current and _unheld(tensors, storage, holders):
                if not capturing(tensors[0]):
                    self._kept.append(self._kept.pop(i))  # now the set returned last
                    return list(tensors)  # a new list: a caller keeping it holds the tensors
                break
        tensors = tuple(self._make())
        too_large = self._keep_bytes is not None and tensors[0].untyped_storage().nbytes() > self._keep_bytes
        if capturing(tensors[0]) or too_large:
            return list(tensors)
        storage = tensors[0].untyped_storage()._cdata  # the address only: a storage object would count as a holder
        self._kept = [*self._kept[1 - self.KEPT:], (tensors, storage, _stream(tensors[0]), _holders(tensors, storage))]
        return list(tensors)


def _holders(tensors: tuple[torch.Tensor, ...], storage: int) -> tuple[int, ...]:
    """References to each of ``tensors`` (Python and C++), then to their storage."""
    return (*[sys.getrefcount(t) + t._use_count() for t in tensors], torch._C._storage_Use_Count(storage))


def _unheld(tensors: tuple[torch.Tensor, ...], storage: int, holders: tuple[int, ...]) -> bool:
    """Whether ``tensors`` and their storage have only the references counted when they were
    made (``holders``): counted by the same function, so that its own references cancel out."""
    return _holders(tensors, storage) == holders


def _stream(t: torch.Tensor) -> int:
    """The current CUDA stream of ``t``'s device (0 for CPU tensors)."""
    return torch._C._cuda_getCurrentRawStream(t.get_device()) if t.is_cuda else 0


def capturing(t: torch.Tensor) -> bool:
    """Whether work on ``t``'s device is being captured into a CUDA graph (nothing runs now).

    Example::

        if capturing(x): ...          # a plan that a CUDA graph can replay
    """
    return t.is_cuda and torch.cuda.is_current_stream_capturing()
