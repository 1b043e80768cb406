"""Rank program (4 ranks): misuse of process groups is a clear error on the ranks concerned, fast.

Each case prints ``CASE <name> <ExceptionType> <seconds> <message>`` on every rank that
raised (the test checks which ranks, the type, the time and the message); the job then goes
on to the next case, so every case also checks that a failed call leaves the job usable.
Ends with ``ERRORS-DONE``.
"""

import time

import torch

import tilescale as ts
import tilescale.language as T


@ts.jit
def copy_kernel(n: int):
    """Both arguments are accessed on other ranks, so both must be symmetric over one group."""

    @T.prim_func
    def main(a: T.Tensor((n,), "float32"), b: T.Tensor((n,), "float32")):
        with T.Kernel(1, threads=32):
            with T.Scale("device") as (rank, world):
                tile = T.alloc_shared((n,), "float32")
                T.copy(a[0:n], tile, src_pe=(rank + 1) % world)
                T.copy(tile, b[0:n], dst_pe=(rank + 1) % world)

    return main


def case(name: str, call) -> None:
    start = time.monotonic()
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the test checks the type printed
        message = str(err).replace("\n", " ")
        print(f"CASE {name} {type(err).__name__} {time.monotonic() - start:.2f} {message}", flush=True)
    else:
        print(f"CASE {name} none {time.monotonic() - start:.2f}", flush=True)


def run_cases(rank: int) -> None:
    """Every case, then an op on each group (the job still works); its groups die on return."""
    tp_groups = [ts.new_group(r) for r in ([0, 1], [2, 3])]
    dp_groups = [ts.new_group(r) for r in ([0, 2], [1, 3])]
    tp, other_tp = tp_groups[rank // 2], tp_groups[1 - rank // 2]
    dp = dp_groups[rank % 2]
    x = torch.ones(8)

    # A rank calling an op of a group it is not in (torch hands it NON_GROUP_MEMBER).
    case("not-a-member", lambda: ts.ops.all_reduce(x.clone(), group=other_tp))
    case("not-a-member-alloc", lambda: ts.zeros((4,), group=other_tp))

    # Groups created in different orders: rank 3 creates {2, 3} before {0, 1}.
    order = ([2, 3], [0, 1]) if rank == 3 else ([0, 1], [2, 3])
    case("creation-order", lambda: [ts.new_group(r) for r in order])

    # Ranks of one rank set using different torch groups for it (both groups created by all).
    twins = [ts.new_group([0, 1, 2, 3]) for _ in range(2)]
    case("group-identity", lambda: ts.group_state(twins[rank % 2]))

    # A symmetric tensor of group A passed to an op on group B (every rank does it).
    on_tp = ts.zeros((8,), group=tp)
    on_dp = ts.zeros((8,), group=dp)
    case("tensor-of-another-group", lambda: ts.ops.all_reduce(on_tp, group=dp))
    case("put-into-another-group", lambda: ts.ops.put(x, on_tp, 0, group=dp))
    case("peer-view-of-another-group", lambda: ts.peer_view(on_tp, 0, group=dp))
    case("kernel-mixing-groups", lambda: copy_kernel(8, group=tp)(on_tp, on_dp))
    # A kernel built for the whole job (4 ranks) called with tensors of a group of 2.
    case("kernel-built-for-another-size", lambda: copy_kernel(8)(on_tp, on_tp))

    # Ranks of one group allocating different shapes: rank 1 and rank 3 ask for one more element.
    case("shapes-differ", lambda: ts.zeros((4 + rank % 2,), group=tp))

    # The job still works: an op on each group.
    assert torch.equal(ts.ops.all_reduce(torch.ones(4), group=tp), torch.full((4,), 2.0))
    assert torch.equal(ts.ops.all_reduce(torch.ones(4), group=dp), torch.full((4,), 2.0))


def main() -> None:
    rt = ts.init()
    print(f"JOB {rt.group.job_id}", flush=True)
    run_cases(ts.rank())
    ts.finalize()
    print("ERRORS-DONE", flush=True)


if __name__ == "__main__":
    main()
