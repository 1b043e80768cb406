"""The process group a layer runs over: its size, this rank's place in it, and how ops get it."""

from __future__ import annotations

import torch.distributed as dist

from tilescale import runtime


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, this rank's rank) of ``group``; of the whole job when ``group`` is None."""
    if group is None:
        return runtime.world_size(), runtime.rank()
    return dist.get_world_size(group), dist.get_rank(group)


def group_kwargs(group: dist.ProcessGroup | None) -> dict:
    """``group=`` for a ``ts.ops`` call, given only when a group is: the ops of this branch do not
    take the keyword yet (the process-group work adds it), and the whole job is their default."""
    return {} if group is None else {"group": group}
