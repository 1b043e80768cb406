"""Train an expert-parallel MoE layer for a few steps and match a single-process reference.

``ts.nn.ExpertParallelMoE`` keeps ``num_experts / world`` experts on each rank; tokens
travel to their experts with ``ts.ops.moe_dispatch`` and back with ``ts.ops.moe_combine``,
and in the backward the other way round (combine's gradient is a re-dispatch along the same
routes, dispatch's a combine). Every rank trains on its own tokens; the router is
replicated, so its gradient is all-reduced as in data parallelism, while each expert's
gradient already holds every rank's tokens. Every rank also trains the whole MoE in one
process on all ranks' tokens, and the losses and weights must agree.

    tilescale run -n 2 examples/moe_training.py
    tilescale run -n 4 --cpu examples/moe_training.py
"""

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.nn.moe import moe_weights
from tilescale.testing import do_bench, reference_moe


def main(steps: int = 4, lr: float = 0.5) -> None:
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    gpu = ts.device().type == "cuda"
    tokens, hidden, ffn, num_experts, topk = (512, 256, 512, 8 * world, 2) if gpu else (24, 32, 48, 4 * world, 2)
    dtype = torch.bfloat16 if gpu else torch.float32
    moe = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=5, dtype=dtype)
    opt = torch.optim.SGD(moe.parameters(), lr=lr)

    g = torch.Generator().manual_seed(1)  # every rank draws all ranks' data and keeps its rows
    x_all = torch.randn(world * tokens, hidden, generator=g)
    target_all = torch.randn(world * tokens, hidden, generator=g)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x, target = x_all[mine].to(ts.device(), dtype), target_all[mine].to(ts.device(), dtype)

    ref = [w.requires_grad_() for w in moe_weights(hidden, ffn, num_experts, 5)]  # all experts, one process
    ref_opt = torch.optim.SGD(ref, lr=lr)
    tol = 3e-2 if gpu else 1e-4

    for step in range(steps):
        opt.zero_grad()
        loss = ((moe(x).float() - target.float()) ** 2).sum() / target_all.numel()
        loss.backward()
        dist.all_reduce(moe.router.grad)  # replicated router: data-parallel gradients add up
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)

        ref_opt.zero_grad()
        ref_loss = ((reference_moe(x_all, *ref, topk) - target_all) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        assert abs(total.item() - ref_loss.item()) <= tol * ref_loss.item(), (step, total.item(), ref_loss.item())
        if rank == 0:
            print(f"step {step}: loss {total.item():.5f} (reference {ref_loss.item():.5f})")

    per_rank = num_experts // world
    experts = slice(rank * per_rank, (rank + 1) * per_rank)
    for name, got, want in (("router", moe.router, ref[0]), ("w1", moe.w1, ref[1][experts]),
                            ("w2", moe.w2, ref[2][experts])):
        error = float((got.detach().float().cpu() - want.detach()).norm() / want.detach().norm())
        assert error < tol, f"{name}: relative error {error:.2e}"
    ms = do_bench(lambda: moe(x).sum().backward(), iters=5)
    print(f"rank {rank}: MoE training correct: matches the single-process reference after {steps} steps; "
          f"forward + backward {ms:.3f} ms")
    ts.finalize()


if __name__ == "__main__":
    main()
