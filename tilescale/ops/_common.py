"""What the library kernels share: launch sizing, dtype names, symmetric workspaces.

Workspaces and shape checks belong to a process group: they live in its state
(``tilescale.groups.GroupState``), which every op resolves from its ``group=`` first.
"""

from __future__ import annotations

import functools

import torch

from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.symmetric import allocate, check_group, lookup

TORCH_TO_TL = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.uint8: "uint8",
}


def tl_dtype(t: torch.Tensor) -> str:
    """TileLang's name of ``t``'s dtype; TypeError for dtypes the kernels do not handle."""
    if t.dtype not in TORCH_TO_TL:
        raise TypeError(f"dtype {t.dtype} is not supported; use one of {sorted(map(str, TORCH_TO_TL))}")
    return TORCH_TO_TL[t.dtype]


def check_input(t: torch.Tensor, name: str) -> None:
    """Inputs must be contiguous tensors on this rank's device."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dev = runtime.device()
    if t.device.type != dev.type or (dev.index is not None and t.device.index != dev.index):
        raise ValueError(f"{name} is on {t.device}, but this rank computes on {dev}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def vector_width(numel: int, like: torch.Tensor) -> int:
    """Elements per 16-byte vector that evenly divide ``numel``: the kernels' sizes are
    ``vectors * width``, so TileLang can prove 16-byte accesses aligned and in bounds."""
    width = max(1, 16 // like.element_size())
    while numel % width:
        width //= 2
    return width


def sm_count() -> int:
    """Blocks a persistent kernel launches at most: one per SM, so every block is resident
    and device-scope barriers cannot deadlock."""
    return _sm_count(runtime.device())


@functools.cache
def _sm_count(dev: torch.device) -> int:
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4


def workspace(state: GroupState, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A symmetric scratch tensor of the group, reused across calls (allocating it is collective)."""
    k = (key, numel, dtype)
    found = state.workspaces.get(k)
    if found is None:
        found = state.workspaces[k] = allocate(state, (numel,), dtype)
    return found


def symmetric_in(t: torch.Tensor, state: GroupState, name: str) -> bool:
    """Whether ``t`` is symmetric over the group of ``state``; ValueError if it is symmetric over another."""
    found = lookup(t)
    if found is not None:
        check_group(found[0].group, state, name)
    return found is not None


def symmetric_or_staged(state: GroupState, t: torch.Tensor, key: str, name: str = "x") -> torch.Tensor:
    """``t`` itself when symmetric over the group, else a symmetric workspace holding a copy of it."""
    if symmetric_in(t, state, name):
        return t.reshape(-1)
    staged = workspace(state, key, t.numel(), t.dtype)
    staged.copy_(t.reshape(-1))
    return staged


def check_same_across_ranks(state: GroupState, what: str, value: list) -> None:
    """Ranks must agree on the shapes: checked at a shape's first call (a host round trip).

    A later call in which one rank alone switches to a new shape is still caught, by the
    bounded waits (TimeoutError naming the rank, or WaitTimeoutError), not by this check.
    """
    key = (what, *value)
    if key in state.verified:
        return
    values = state.comm.exchange(state.comm.next_tag(what), value)
    if any(v != value for v in values):
        detail = "; ".join(f"rank {r}: {v}" for r, v in zip(state.ranks, values, strict=True))
        where = "" if state.whole_job else f" of the {state.describe()}"
        raise ValueError(f"{what}: shapes differ across ranks{where} ({detail})")
    state.verified.add(key)
