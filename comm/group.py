"""The job's ranks and the key-value store they share, as the backends see them.

Collective metadata (shapes, shared-memory names, error reports) travels through the
c10d store rather than through collectives, so every exchange has a deadline and can say
which ranks never arrived, instead of hanging in a collective that one rank skipped.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from typing import Any

import torch.distributed as dist


def default_timeout_s() -> float:
    """Deadline for one collective metadata exchange (``TILESCALE_COLLECTIVE_TIMEOUT_S``, default 120)."""
    return float(os.environ.get("TILESCALE_COLLECTIVE_TIMEOUT_S", "120"))


class Group:
    """Rank, world size and a deadline-bounded exchange over a c10d store.

    For a process group smaller than the job, ``rank`` / ``world_size`` / ``local_*`` are
    this process's place within the group, ``ranks`` the group's global ranks (index = rank
    within the group), ``store`` a prefix of the job's store that only this group uses, and
    ``job_id`` unique to the group (it names the group's shared-memory segments).
    ``process_group_name`` is torch's name of the group (symmetric-memory rendezvous).
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int,
                 store: dist.Store, job_id: str, ranks: list[int] | None = None,
                 process_group_name: str | None = None):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.store = store
        self.job_id = job_id
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

        Raises ``TimeoutError`` naming the ranks that did not contribute within the deadline.
        """
        timeout_s = default_timeout_s() if timeout_s is None else timeout_s
        keys = [f"tilescale/{tag}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], json.dumps(value))
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except Exception as err:  # c10d raises its own error types, by version
            try:
                missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            except Exception:  # the store's host (rank 0) is gone
                raise RuntimeError(
                    f"rank {self.ranks[self.rank]}: lost the job's store while waiting at '{tag}': rank 0 has exited "
                    "or crashed"
                ) from err
            raise TimeoutError(
                f"rank {self.ranks[self.rank]}: ranks {[self.ranks[r] for r in missing]} did not reach '{tag}' "
                f"within {timeout_s:g} s (did they crash, or call collective operations in a different order?)"
            ) from err
        return [json.loads(self.store.get(k)) for k in keys]

    def barrier(self, tag: str | None = None, timeout_s: float | None = None) -> None:
        """A deadline-bounded host barrier over the store."""
        self.exchange(tag or self.next_tag("barrier"), None, timeout_s)
