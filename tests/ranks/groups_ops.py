"""Rank program: several process groups at once (2 or 4 ranks), checked against torch.distributed.

With 4 ranks: TP groups {0,1} {2,3}, DP groups {0,2} {1,3} and an EP group of all four;
with 2 ranks: TP groups {0} {1}, DP = EP = a group of both. Symmetric tensors, peer views,
a ``ts.jit`` kernel, every collective, put/get, the fused TP GEMMs and MoE dispatch/combine
run on each group, calls of different groups interleaved (and, from two threads, in flight
at once), each result compared with gloo's on the same group; then finalize and init again
must start clean. Prints ``GROUPS-OK``.
"""

import threading

import torch
import torch.distributed as dist

import tilescale as ts
import tilescale.language as T
from tilescale.ops._gemm import TileConfig
from tilescale.testing import assert_close

SMALL = TileConfig(64, 64, 64, 2, 128, "FullRow")  # few tiles: the CPU path interprets every block


@ts.jit
def stamp_kernel(n: int):
    """Write (rank, world) into the next rank's slot ``rank`` of ``out``, then barrier."""

    @T.prim_func
    def main(out: T.Tensor((n, 2), "int32")):
        with T.Kernel(1, threads=32):
            with T.Scale("device") as (rank, world):
                mine = T.alloc_shared((1, 2), "int32")
                mine[0, 0] = rank
                mine[0, 1] = world
                T.copy(mine, out[rank:rank + 1, 0:2], dst_pe=(rank + 1) % world)
                T.barrier()

    return main


@ts.jit
def barrier_kernel():
    """Only a barrier: no symmetric argument, so the call names its group."""

    @T.prim_func
    def main(x: T.Tensor((1,), "int32")):
        with T.Kernel(1, threads=32):
            with T.Scale("device") as (rank, world):
                x[0] = rank * 100 + world
                T.barrier()

    return main


def make_groups(rank: int, world: int) -> dict[str, dist.ProcessGroup]:
    """Every rank creates every group, in the same order; each keeps the ones it belongs to."""
    if world == 4:
        tp_sets, dp_sets = [[0, 1], [2, 3]], [[0, 2], [1, 3]]
    else:
        tp_sets, dp_sets = [[0], [1]], [[0, 1]]
    tp = [ts.new_group(r) for r in tp_sets]
    dp = [ts.new_group(r) for r in dp_sets]
    ep = ts.new_group(list(range(world)))
    mine = lambda groups, sets: next(g for g, s in zip(groups, sets, strict=True) if rank in s)  # noqa: E731
    return {"tp": mine(tp, tp_sets), "dp": mine(dp, dp_sets), "ep": ep}


def check_state(groups: dict[str, dist.ProcessGroup], rank: int) -> None:
    for name, g in groups.items():
        state = ts.group_state(g)
        ranks = dist.get_process_group_ranks(g)
        assert state.ranks == ranks and state.size == len(ranks) and state.rank == ranks.index(rank), (name, state)
        assert ts.group_state(g) is state
    assert ts.group_state(None) is ts.group_state(dist.group.WORLD)
    assert ts.group_state(None).size == ts.world_size()


def check_symmetric(groups: dict[str, dist.ProcessGroup]) -> None:
    """Per group: tensors remember their group, peer views address the group's ranks."""
    xs = {name: ts.zeros((8,), dtype=torch.float32, group=g) for name, g in groups.items()}
    for name, g in groups.items():
        state = ts.group_state(g)
        x = xs[name]
        assert ts.is_symmetric(x) and ts.is_symmetric(x, group=g)
        assert ts.symmetric.group_of(x) is state
        assert ts.peer_ptrs(x).shape == (state.size,)
        ts.barrier(group=g)
        ts.peer_view(x, (state.rank + 1) % state.size).copy_(torch.full((8,), 1000.0 * len(name) + state.ranks[
            state.rank]))
    for name, g in groups.items():
        state = ts.group_state(g)
        ts.barrier(group=g)
        left = state.ranks[(state.rank - 1) % state.size]
        assert torch.equal(xs[name], torch.full((8,), 1000.0 * len(name) + left)), (name, xs[name])


def check_kernels(groups: dict[str, dist.ProcessGroup]) -> None:
    """T.Scale("device") gives rank and size within the group of the call's tensors."""
    for name, g in groups.items():
        state = ts.group_state(g)
        out = ts.zeros((state.size, 2), dtype=torch.int32, group=g)
        ts.barrier(group=g)
        stamp_kernel(state.size, group=g)(out)
        left = (state.rank - 1) % state.size
        assert out[left].tolist() == [left, state.size], (name, out)
        flag = torch.zeros(1, dtype=torch.int32)
        barrier_kernel(group=g)(flag, group=g)
        assert flag.item() == state.rank * 100 + state.size, (name, flag)
    flag = torch.zeros(1, dtype=torch.int32)
    barrier_kernel()(flag)  # no group: the whole job
    assert flag.item() == ts.rank() * 100 + ts.world_size()


def reference_all_gather(x: torch.Tensor, g: dist.ProcessGroup) -> torch.Tensor:
    out = torch.empty(dist.get_world_size(g) * x.shape[0], *x.shape[1:], dtype=x.dtype)
    dist.all_gather_into_tensor(out, x, group=g)
    return out


def check_collectives(groups: dict[str, dist.ProcessGroup], rank: int, gen: torch.Generator) -> None:
    """Calls of different groups interleaved, each result equal to gloo's on the same group."""
    for step in range(2):
        for name, g in groups.items():
            size = dist.get_world_size(g)
            x = torch.randint(-50, 50, (size * 12, 5), generator=gen).float()
            ref = x.clone()
            dist.all_reduce(ref, group=g)
            assert torch.equal(ts.ops.all_reduce(x.clone(), group=g), ref), (name, step)
            assert torch.equal(ts.ops.all_reduce(x.clone(), algorithm="two_shot", group=g), ref), (name, step)
            rs = torch.empty(12, 5)
            dist.reduce_scatter_tensor(rs, x, group=g)
            assert torch.equal(ts.ops.reduce_scatter(x, group=g), rs), (name, step)
            assert torch.equal(ts.ops.all_gather(x, group=g), reference_all_gather(x, g)), (name, step)
    # put / get with ranks within the group
    for name, g in groups.items():
        state = ts.group_state(g)
        buf = ts.zeros((16,), group=g)
        src = torch.full((16,), float(rank))
        ts.barrier(group=g)
        ts.ops.put(src, buf, (state.rank + 1) % state.size, group=g)
        ts.barrier(group=g)
        assert torch.equal(buf, torch.full((16,), float(state.ranks[(state.rank - 1) % state.size]))), name
        got = torch.empty(16)
        ts.ops.get(buf, got, (state.rank + 1) % state.size, group=g)
        assert torch.equal(got, torch.full((16,), float(rank))), name
        ts.barrier(group=g)


def check_concurrent(groups: dict[str, dist.ProcessGroup], rank: int) -> None:
    """Ops of the TP and the DP group in flight at once, from two threads of each rank."""
    errors = []

    def run(name: str, base: float) -> None:
        g = groups[name]
        members = dist.get_process_group_ranks(g)
        try:
            for i in range(4):
                x = torch.full((40,), base + rank + i)
                want = sum(base + r + i for r in members)
                assert torch.equal(ts.ops.all_reduce(x, group=g), torch.full((40,), want)), (name, i, x)
                y = torch.full((3, 2), base + rank * 10 + i)
                assert torch.equal(ts.ops.all_gather(y, group=g), reference_all_gather(y, g)), (name, i)
        except Exception as err:  # noqa: BLE001 - reported by the main thread
            errors.append(f"{name}: {err!r}")

    threads = [threading.Thread(target=run, args=(name, base)) for name, base in (("tp", 0.0), ("dp", 100.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def check_tp_gemms(g: dist.ProcessGroup, gen: torch.Generator) -> None:
    size = dist.get_world_size(g)
    m, k, n = 32, 64, 48
    a = torch.randn(m, k, generator=gen).bfloat16()
    w = torch.randn(n, k, generator=gen).bfloat16()
    ref = reference_all_gather(a, g).float() @ w.float().T
    assert_close(ts.ops.all_gather_gemm(a, w, plan="fused", tile=SMALL, group=g).float(), ref,
                 rtol=2e-2, atol=2e-1)
    a2 = torch.randn(size * m, k, generator=gen).bfloat16()
    part = a2.float() @ w.float().T
    rs = torch.empty(m, n)
    dist.reduce_scatter_tensor(rs, part, group=g)
    assert_close(ts.ops.gemm_reduce_scatter(a2, w, plan="fused", tile=SMALL, group=g).float(), rs,
                 rtol=2e-2, atol=3e-1)
    dist.all_reduce(part, group=g)
    assert_close(ts.ops.gemm_all_reduce(a2, w, plan="fused", tile=SMALL, group=g).float(), part,
                 rtol=2e-2, atol=3e-1)


def check_moe(g: dist.ProcessGroup, gen: torch.Generator) -> None:
    """Dispatch + combine with unit expert outputs: every token comes back as its weight sum times x."""
    size = dist.get_world_size(g)
    tokens, hidden, topk, experts = 6, 16, 2, 2 * size
    x = torch.randn(tokens, hidden, generator=gen)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]).int()
    w = torch.rand(tokens, topk, generator=gen)
    recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, idx, w, experts, group=g)
    assert handle.group is g
    # What this rank's experts receive, by torch: every rank's tokens, gathered.
    all_idx = reference_all_gather(idx, g)
    state = ts.group_state(g)
    mine = range(state.rank * 2, state.rank * 2 + 2)
    assert counts.tolist() == [int((all_idx == e).sum()) for e in mine], (counts, all_idx)
    y = ts.ops.moe_combine(recv_x, recv_w, handle)
    assert_close(y, x * w.sum(1, keepdim=True), rtol=1e-5, atol=1e-5)


def main() -> None:
    rt = ts.init()
    rank, world = ts.rank(), ts.world_size()
    print(f"JOB {rt.group.job_id}", flush=True)
    gen = torch.Generator().manual_seed(rank)
    groups = make_groups(rank, world)
    check_state(groups, rank)
    check_symmetric(groups)
    check_kernels(groups)
    check_collectives(groups, rank, gen)
    check_concurrent(groups, rank)
    check_tp_gemms(groups["tp"], gen)
    check_tp_gemms(groups["ep"], gen)
    check_moe(groups["ep"], gen)
    check_moe(groups["dp"], gen)
    print(rank, "groups checked", flush=True)

    # A released group starts afresh at its next use; its tensors are no longer symmetric.
    tp = groups["tp"]
    old = ts.group_state(tp)
    x = ts.zeros((4,), group=tp)
    old.release()
    assert old.released and not ts.is_symmetric(x)
    assert ts.group_state(tp) is not old
    assert torch.equal(ts.ops.all_reduce(torch.ones(3), group=tp), torch.full((3,), float(old.size)))
    try:
        ts.group_state(None).release()
        raise AssertionError("the whole job's state must only be released by finalize")
    except RuntimeError as err:
        assert "finalize" in str(err), err

    # finalize releases every group; init after it starts clean: no buffer of the first job reused.
    states = list(ts.runtime.live_groups())
    kept = [t for s in states for t in (s.sync_workspace, *s.workspaces.values())]  # mapped: addresses stay taken
    first_ptrs = {t.data_ptr() for t in kept}
    del groups, tp  # torch's groups hold the job's store: a new job cannot start while they live
    ts.finalize()
    assert all(s.released and not s.allocations and not s.workspaces and not s.exchanges for s in states)
    assert not any(ts.is_symmetric(t) for t in kept)
    rt = ts.init()
    print(f"JOB {rt.group.job_id}", flush=True)
    ep = ts.new_group(list(range(world)))
    assert torch.equal(ts.ops.all_reduce(torch.ones(5), group=ep), torch.full((5,), float(world)))
    assert torch.equal(ts.ops.all_reduce(torch.ones(5)), torch.full((5,), float(world)))
    fresh = list(ts.runtime.live_groups())
    assert not set(map(id, fresh)) & set(map(id, states))
    second = {t.data_ptr() for s in fresh for t in (s.sync_workspace, *s.workspaces.values())}
    assert second and not second & first_ptrs, "a buffer of the first job was reused"
    ts.finalize()
    print(f"GROUPS-OK rank={rank} world={world}", flush=True)


if __name__ == "__main__":
    main()
