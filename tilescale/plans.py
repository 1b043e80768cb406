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


def capturing(t: torch.Tensor) -> bool:
    """Whether work on ``t``'s device is being captured into a CUDA graph (nothing runs now).

    Example::

        if capturing(x): ...          # a plan that a CUDA graph can replay
    """
    # torch.cuda.is_current_stream_capturing's own call, without its Python frame (every eager op asks).
    return t.is_cuda and torch._C._cuda_isCurrentStreamCapturing()
