"""The job's ranks and the key-value store they share, as the backends see them.

Collective metadata (shapes, shared-memory names, error reports) travels through the
c10d store rather than through collectives, so every exchange has a deadline and can say
which ranks never arrived, instead of hanging in a collective that one rank skipped.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch.distributed as dist

from tilescale.launch.rendezvous import describe_exit, exit_key

# Polling of an exchange: the first pause, the longest, and how often to look for exited ranks.
# (A store wait that times out makes c10d log warnings, so waits poll with ``check`` instead.)
_FIRST_PAUSE_S, _MAX_PAUSE_S, _EXIT_CHECK_S = 0.0002, 0.02, 0.25


def default_timeout_s() -> float:
    """Deadline for one collective metadata exchange (``TILESCALE_COLLECTIVE_TIMEOUT_S``, default 120)."""
    return float(os.environ.get("TILESCALE_COLLECTIVE_TIMEOUT_S", "120"))


class PeerExitedError(RuntimeError):
    """A rank this one waits for has exited (its launcher, or its exit hook, said so)."""


class Group:
    """Rank, world size and a deadline-bounded exchange over a c10d store.

    For a process group smaller than the job, ``rank`` / ``world_size`` / ``local_*`` are
    this process's place within the group, ``ranks`` the group's global ranks (index = rank
    within the group), ``store`` a prefix of the job's store that only this group uses, and
    ``job_id`` unique to the group (it names the group's shared-memory segments).
    ``process_group_name`` is torch's name of the group (symmetric-memory rendezvous).
    ``exits`` is the store where a rank's exit is published (by ``tilescale run``, or by the
    rank's own exit hook; see ``tilescale.launch.rendezvous``), keyed by global rank: a wait
    for an exited rank raises :class:`PeerExitedError` at once rather than at its deadline.
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int,
                 store: dist.Store, job_id: str, exits: dist.Store | None = None, ranks: list[int] | None = None,
                 process_group_name: str | None = None):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.store = store
        self.job_id = job_id
        self.exits = exits
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)
        self.process_group_name = process_group_name
        self._counts: dict[str, int] = {}

    def next_tag(self, kind: str) -> str:
        """A tag unique to this call of kind ``kind``, identical on ranks that call in the same order."""
        n = self._counts.get(kind, 0)
        self._counts[kind] = n + 1
        return f"{kind}/{n}"

    def exchange(self, tag: str, value: Any, timeout_s: float | None = None) -> list[Any]:
        """Every rank contributes ``value`` (JSON-serialisable); all receive the list by rank.

        Example::

            shapes = group.exchange(group.next_tag("alloc"), [1024, "torch.float32"])

        Raises :class:`PeerExitedError` as soon as a rank it waits for has exited,
        ``TimeoutError`` naming the ranks that did not contribute within the deadline, and a
        one-line ``RuntimeError`` if the store itself is gone.
        """
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        keys = [f"tilescale/{tag}/{r}" for r in range(self.world_size)]
        try:
            self.store.set(keys[self.rank], json.dumps(value))
            self._wait(keys, tag, timeout_s)
            return [json.loads(self.store.get(k)) for k in keys]
        except dist.DistError:  # the store's host (rank 0, or the launcher) is gone
            raise RuntimeError(
                f"rank {self.ranks[self.rank]}: lost the job's store at '{tag}': the process hosting it (rank 0, "
                "or the launcher) has exited or crashed"
            ) from None

    def _wait(self, keys: list[str], tag: str, timeout_s: float) -> None:
        start = time.monotonic()
        pause, next_exit_check = _FIRST_PAUSE_S, start + _EXIT_CHECK_S
        while not self.store.check(keys):
            now = time.monotonic()
            if now >= next_exit_check or now - start >= timeout_s:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
                exited = self._exited(missing)
                if exited:
                    raise PeerExitedError(
                        f"rank {self.ranks[self.rank]}: waiting at '{tag}' for "
                        + ", ".join(f"rank {self.ranks[r]}, which {how}" for r, how in exited.items())
                        + (f"; also missing: ranks {[self.ranks[r] for r in sorted(set(missing) - set(exited))]}"
                           if len(exited) < len(missing) else "")
                    )
                if now - start >= timeout_s:
                    raise TimeoutError(
                        f"rank {self.ranks[self.rank]}: ranks {[self.ranks[r] for r in missing]} did not reach '{tag}' "
                        f"within {timeout_s:g} s (did they crash, or call collective operations in a different order?)"
                    )
                next_exit_check = now + _EXIT_CHECK_S
            time.sleep(pause)
            pause = min(2 * pause, _MAX_PAUSE_S)

    def _exited(self, ranks: list[int]) -> dict[int, str]:
        """Which of ``ranks`` (numbered within this group) have exited, and how (from the exit keys)."""
        if self.exits is None:
            return {}
        keys = {r: exit_key(self.ranks[r]) for r in ranks}
        return {r: describe_exit(self.exits.get(k).decode()) for r, k in keys.items() if self.exits.check([k])}

    def barrier(self, tag: str | None = None, timeout_s: float | None = None) -> None:
        """A deadline-bounded host barrier over the store."""
        self.exchange(tag or self.next_tag("barrier"), None, timeout_s)
