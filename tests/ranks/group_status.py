"""Rank program (4 ranks): a failure the kernels of one group record is that group's.

TP groups {0,1} and {2,3}; every shape is seen first, then ranks 2 and 3 call an all-reduce
on their group with different shapes while ranks 0 and 1 call theirs alike. Ranks 2 and 3
get a ``ShapeMismatchError`` naming their group, recorded in their group's wait-status
record only; ranks 0 and 1 get their result. After ``ts.finalize()`` and ``ts.init()`` every
group's record starts at zero. Prints ``GROUP-STATUS-OK``.
"""

import torch

import tilescale as ts


def tp_group(rank: int):
    return [ts.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]  # every rank creates both


def main() -> None:
    ts.init()
    rank = ts.rank()
    assert ts.world_size() == 4
    tp = tp_group(rank)
    for n in (8, 16):  # every shape seen on every rank: the first-call host check passes
        ts.ops.all_reduce(torch.ones(n), group=tp)
    n = 8 if rank == 2 else 16
    try:
        out = ts.ops.all_reduce(torch.full((n,), 1.0), group=tp)
        outcome = f"sum {out[0].item():g}"
    except ts.ShapeMismatchError as err:
        outcome = f"mismatch: {err}"
    print(f"STATUS rank={rank} {outcome}", flush=True)
    state, job = ts.group_state(tp), ts.group_state(None)
    assert job.wait_status is not state.wait_status and int(job.wait_status[0]) == 0, "the job's record is clean"
    if rank < 2:
        assert outcome == "sum 2" and int(state.wait_status[0]) == 0, outcome
    else:
        assert outcome.startswith("mismatch") and "group of ranks [2, 3]" in outcome, outcome
        assert int(state.wait_status[0]) == 1
    del tp, state, job
    ts.finalize()  # the failure was raised to the program: finalize does not raise it again

    ts.init()
    tp = tp_group(rank)
    state = ts.group_state(tp)
    assert int(state.wait_status[0]) == 0 and int(ts.group_state(None).wait_status[0]) == 0
    assert torch.equal(ts.ops.all_reduce(torch.ones(8), group=tp), torch.full((8,), 2.0))
    del tp, state
    ts.finalize()
    print(f"GROUP-STATUS-OK rank={rank}", flush=True)


if __name__ == "__main__":
    main()
