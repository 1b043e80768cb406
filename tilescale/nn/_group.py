"""The process group a layer runs over: its size and this rank's place in it."""

from __future__ import annotations

import torch.distributed as dist

from tilescale import runtime


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(size, this rank's rank) of ``group``; of the whole job when ``group`` is None.

    A rank that is not a member of ``group`` gets a ValueError here, when the layer is built
    (``dist.get_rank`` would give it -1, and a shard of nothing).
    """
    if group is None:
        return runtime.world_size(), runtime.rank()
    return runtime.group_size(group), dist.get_rank(group)
