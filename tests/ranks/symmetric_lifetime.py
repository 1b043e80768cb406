"""Rank program: many symmetric tensors alive at once, and their memory coming back (any backend, >= 2 ranks).

For the whole job and for a process group of its own (on NVSHMEM the group's tensors are
ranges of one heap arena, the job's are separate NVSHMEM allocations):

- four tensors alive at once each get their own peer addresses, and writes through peer
  views and through a kernel (``ts.ops.put``) land in the tensor they were meant for;
- a tensor every rank dropped leaves the registry, and its memory comes back: allocating
  and dropping several times what the group's heap holds (NVSHMEM's arena) must not run out.

Prints ``LIFETIME-OK rank=<r> world=<n>``.
"""

from __future__ import annotations

import gc

import torch

import tilescale as ts

N = 64


def check_live_tensors(group, device: torch.device) -> None:
    state = ts.group_state(group)
    right, left = (state.rank + 1) % state.size, (state.rank - 1) % state.size
    xs = [ts.zeros((N,), dtype=torch.float32, group=group) for _ in range(4)]
    targets = {int(ts.peer_ptrs(x)[right]) for x in xs}
    assert len(targets) == len(xs), f"rank {state.rank}: {len(xs)} live tensors share peer addresses {targets}"
    ts.barrier(group=group)
    for i, x in enumerate(xs[:2]):
        ts.peer_view(x, right).copy_(torch.full((N,), 100.0 * i + state.rank, device=device))
    for i, x in enumerate(xs[2:], start=2):
        ts.ops.put(torch.full((N,), 100.0 * i + state.rank, device=device), x, right, group=group)
    ts.barrier(group=group)
    for i, x in enumerate(xs):
        want = torch.full((N,), 100.0 * i + left, device=device)
        assert torch.equal(x, want), f"rank {state.rank}: tensor {i} holds {x[:4].tolist()}..., want {want[0].item()}"


def check_memory_comes_back(group) -> None:
    state = ts.group_state(group)
    arena = getattr(state.backend, "arena", None)
    # On NVSHMEM, a third of the arena groups allocate from: the eighth allocation fails unless
    # dropped ones come back. Elsewhere 1 MiB (the registry is checked all the same).
    nbytes = arena.nbytes // 3 if arena is not None and group is not None else 1 << 20
    live = len(state.allocations)
    for step in range(8):
        y = ts.zeros((nbytes,), dtype=torch.uint8, group=group)
        y.fill_(step + 1)
        del y
        gc.collect()
    assert len(state.allocations) == live, f"rank {state.rank}: {len(state.allocations) - live} dropped tensors kept"


def main() -> None:
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    assert world >= 2, world
    group = ts.new_group(list(range(world)))  # every rank, but a group of its own
    for g in (None, group):
        check_live_tensors(g, ts.device())
        check_memory_comes_back(g)
        check_live_tensors(g, ts.device())  # ranges given back are handed out again, correctly
    ts.finalize()
    print(f"LIFETIME-OK rank={rank} world={world}", flush=True)


if __name__ == "__main__":
    main()
