"""Rank program: a job that declares two nodes of two ranks on one machine (CPU path).

Started by two launchers on this machine, ``tilescale run --nnodes 2 --node-rank 0|1 -n 2
--cpu``: ranks 0, 1 are node 0, ranks 2, 3 node 1. The TP groups {0,1} {2,3} sit inside a
node and must get the peer-address lowering; the DP groups {0,2} {1,3} and the whole job
(EP) span the nodes and must get the device-call lowering a multi-node GPU job uses
(NVSHMEM calls). Checks: each group's lowering; the CUDA TileLang generates for a kernel
built for each group (peer stores through peer tables inside a node, NVSHMEM calls with
the peers translated to global ranks across nodes); then every op of groups_ops.py on
every group, each result against gloo on the same group, the cross-node ones run by the
interpreter through the device-call protocol. Prints ``TWO-NODES-OK``.
"""

import re

import groups_ops
import tilelang
import torch
import torch.distributed as dist

import tilescale as ts

CUDA = {"kind": "cuda", "arch": "sm_90a"}


def cuda_source(kernel) -> str:
    """The CUDA source a GPU job would compile for this kernel (the CPU path interprets the same TIR)."""
    with tilelang.tvm.target.Target(CUDA), tilelang.tvm.transform.PassContext(opt_level=3):
        return tilelang.lower(kernel.kernel.func, target=CUDA).kernel_source


def check_lowerings(groups: dict[str, dist.ProcessGroup]) -> None:
    want = {"tp": "address", "dp": "nvshmem", "ep": "nvshmem"}
    for name, g in groups.items():
        assert ts.group_state(g).lowering == want[name], (name, ts.group_state(g).lowering)
    assert ts.group_state(None).lowering == "nvshmem"
    if ts.rank() != 0:
        return
    for name in ("tp", "dp"):
        state = ts.group_state(groups[name])
        kernel = groups_ops.stamp_kernel(state.size, group=groups[name])
        assert kernel.remote == want[name], (name, kernel.remote)
        src = cuda_source(kernel)
        body = src[src.index('extern "C" __global__'):]
        if name == "tp":  # a peer store through the peer table; no NVSHMEM anywhere
            assert "out__peers" in body and "nvshmem" not in src, body[:2000]
        else:  # NVSHMEM calls on this rank's address, the peer translated to its global rank
            assert "#include <nvshmem.h>" in src and "__peers" not in body.replace("ts_sync_peers", "")
            assert re.search(r"tilescale::nvshmem_put_block\(.*ts_pes\[", body), body[:3000]
            assert re.search(r"tilescale::nvshmem_grid_barrier\(ts_sync_peers, ts_rank, 2, .*ts_pes\)", body)
    print("rank 0: CUDA of the TP kernel has peer stores, of the DP kernel NVSHMEM calls", flush=True)


def main() -> None:
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    assert world == 4 and ts.runtime.current().env.local_world_size == 2, "two declared nodes of two ranks"
    gen = torch.Generator().manual_seed(rank)
    groups = groups_ops.make_groups(rank, world)
    check_lowerings(groups)
    groups_ops.check_state(groups, rank)
    groups_ops.check_symmetric(groups)
    groups_ops.check_kernels(groups)
    groups_ops.check_collectives(groups, rank, gen)
    groups_ops.check_tp_gemms(groups["dp"], gen)
    groups_ops.check_moe(groups["ep"], gen)
    del groups
    ts.finalize()
    print(f"TWO-NODES-OK rank={rank}", flush=True)


if __name__ == "__main__":
    main()
