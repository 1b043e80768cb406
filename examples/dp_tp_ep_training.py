"""Train a small DP x TP x EP model for a few steps and match a single-process reference.

Three kinds of process groups at once, as in a Megatron-style job (4 ranks shown):

* tensor parallel (TP) groups of 2 ranks, {0, 1} and {2, 3}: each runs a residual MLP,
  ``h = x + mlp(x)``, as ``ts.nn.TensorParallelMLP(group=tp)`` (fused all-gather-GEMM and
  GEMM-reduce-scatter on the TP group; activations sharded by rows);
* data parallel (DP) groups, {0, 2} and {1, 3}: the ranks holding the same MLP shards, whose
  gradients are summed with ``ts.ops.all_reduce(grad, group=dp)``;
* one expert-parallel (EP) group of every rank: ``ts.nn.ExpertParallelMoE(group=ep)`` keeps
  ``experts / ranks`` experts per rank and sends each token to its experts; its replicated
  router's gradient is summed over the EP group.

Every rank also trains the whole model in one process on the whole batch, and the losses
and weights must agree.

    tilescale run -n 4 --cpu examples/dp_tp_ep_training.py
    tilescale run -n 4 --share-gpus examples/dp_tp_ep_training.py
"""

import os

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.nn.moe import moe_weights
from tilescale.testing import reference_moe

TP = 2


def make_groups(rank: int, world: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup, dist.ProcessGroup]:
    """(tp, dp, ep) of this rank; every rank creates every group, in the same order."""
    tp_groups = [ts.new_group(list(range(start, start + TP))) for start in range(0, world, TP)]
    dp_groups = [ts.new_group(list(range(offset, world, TP))) for offset in range(TP)]
    ep = ts.new_group(list(range(world)))
    return tp_groups[rank // TP], dp_groups[rank % TP], ep


def main(steps: int = 3, lr: float = 0.1) -> None:
    # The fused TP GEMMs even at this size, where the plan rule would pick torch's collectives.
    os.environ.setdefault("TILESCALE_TP_PLAN", "fused")
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    if world % TP:
        raise SystemExit(f"run with a multiple of {TP} ranks")
    tp, dp, ep = make_groups(rank, world)
    gpu = ts.device().type == "cuda"
    rows, hidden, ffn, experts, topk = (256, 256, 512, 2 * world, 2) if gpu else (16, 32, 64, 2 * world, 2)
    dtype = torch.bfloat16 if gpu else torch.float32
    tol = 3e-2 if gpu else 1e-4

    g = torch.Generator().manual_seed(0)  # the same data and initial weights on every rank
    up = (torch.rand(ffn, hidden, generator=g) * 2 - 1) / hidden**0.5
    down = (torch.rand(hidden, ffn, generator=g) * 2 - 1) / ffn**0.5
    x_all = torch.randn(world * rows, hidden, generator=g)
    target_all = torch.randn(world * rows, hidden, generator=g)
    # TP group t holds batch rows [t * TP * rows, (t + 1) * TP * rows), sharded by rows among its
    # ranks in TP-rank order: global rank r holds rows [r * rows, (r + 1) * rows).
    mine = slice(rank * rows, (rank + 1) * rows)
    x, target = x_all[mine].to(ts.device(), dtype), target_all[mine].to(ts.device(), dtype)

    mlp = ts.nn.TensorParallelMLP(hidden, ffn, up=up, down=down, dtype=dtype, group=tp)
    moe = ts.nn.ExpertParallelMoE(hidden, ffn, experts, topk, seed=3, dtype=dtype, group=ep)
    opt = torch.optim.SGD([*mlp.parameters(), *moe.parameters()], lr=lr)

    ref_up, ref_down = up.clone().requires_grad_(), down.clone().requires_grad_()
    ref_moe = [w.requires_grad_() for w in moe_weights(hidden, ffn, experts, 3)]
    ref_opt = torch.optim.SGD([ref_up, ref_down, *ref_moe], lr=lr)

    for step in range(steps):
        opt.zero_grad()
        h = x + mlp(x)
        loss = ((moe(h).float() - target.float()) ** 2).sum() / target_all.numel()
        loss.backward()
        for p in mlp.parameters():  # the MLP shards are replicated across the DP group
            ts.ops.all_reduce(p.grad, group=dp)
        ts.ops.all_reduce(moe.router.grad, group=ep)  # the router is replicated on every rank
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)

        ref_opt.zero_grad()
        ref_h = x_all + torch.nn.functional.gelu(x_all @ ref_up.T) @ ref_down.T
        ref_loss = ((reference_moe(ref_h, *ref_moe, topk) - target_all) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        assert abs(total.item() - ref_loss.item()) <= tol * ref_loss.item(), (step, total.item(), ref_loss.item())
        if rank == 0:
            print(f"step {step}: loss {total.item():.6f} (reference {ref_loss.item():.6f})", flush=True)

    tp_rank = ts.group_state(tp).rank
    per_rank = experts // world
    local = slice(rank * per_rank, (rank + 1) * per_rank)
    for name, got, want in (("mlp.up", mlp.up.weight, ref_up.chunk(TP, 0)[tp_rank]),
                            ("mlp.down", mlp.down.weight, ref_down.chunk(TP, 1)[tp_rank]),
                            ("moe.router", moe.router, ref_moe[0]), ("moe.w1", moe.w1, ref_moe[1][local]),
                            ("moe.w2", moe.w2, ref_moe[2][local])):
        want = want.detach()
        error = float((got.detach().float().cpu() - want).norm() / want.norm())
        assert error < tol, f"{name}: relative error {error:.2e} after {steps} steps"
    print(f"rank {rank}: DP x TP x EP training MATCHES-REFERENCE after {steps} steps "
          f"(tp ranks {ts.group_state(tp).ranks}, dp ranks {ts.group_state(dp).ranks}, ep size "
          f"{ts.group_state(ep).size})", flush=True)
    ts.finalize()


if __name__ == "__main__":
    main()
