"""Rank program: the EP MoE layer's gradients against autograd through a single-process MoE,
with the same token count on every rank and with counts differing per rank (rank 0 none)."""

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.nn.moe import moe_weights
from tilescale.testing import assert_close, moe_dispatch_in_place, reference_moe

ts.init()
torch.set_default_device(ts.device())
rank, world = ts.rank(), ts.world_size()
hidden, ffn, num_experts, topk = 64, 96, 4 * world, 2
# fp32 on the CPU path (exact comparison); the GPUs' tensor-core kernels take bf16.
dtype = torch.bfloat16 if ts.device().type == "cuda" else torch.float32


def check(counts: list[int], max_tokens: int | None) -> None:
    tokens = counts[rank]
    moe = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=11, dtype=dtype, max_tokens=max_tokens)
    g = torch.Generator(device=ts.device()).manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
    grad_y = torch.randn(tokens, hidden, generator=g).to(dtype)
    y = moe(x)
    (y * grad_y).sum().backward()
    # Inference: no autograd nodes; the dispatch in place (the first GEMM gathering the received
    # rows) where experts get few rows, else grouped: both paths, forced, against autograd's.
    for in_place in (True, False):
        with moe_dispatch_in_place(in_place), torch.no_grad():
            assert_close(moe(x), y.detach(), rtol=1e-5, atol=1e-5)

    # Reference: every rank's tokens through the whole MoE (all experts) in one process.
    everyone = [None] * world
    dist.all_gather_object(everyone, (x.detach().cpu(), grad_y.cpu()))
    router, w1, w2 = (w.requires_grad_() for w in moe_weights(hidden, ffn, num_experts, 11))
    x_all = torch.cat([xs for xs, _ in everyone]).float().requires_grad_()
    y_all = reference_moe(x_all, router, w1, w2, topk)
    (y_all * torch.cat([gs for _, gs in everyone]).float()).sum().backward()

    per_rank = num_experts // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    router_grad = moe.router.grad.clone()
    dist.all_reduce(router_grad)  # the router is replicated: data-parallel gradients add up
    first = sum(counts[:rank])
    checks = {
        "x": (x.grad, x_all.grad[first:first + tokens]),
        "router": (router_grad, router.grad),
        "w1": (moe.w1.grad, w1.grad[mine]),
        "w2": (moe.w2.grad, w2.grad[mine]),
    }
    tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4  # relative L2 error
    for name, (got, want) in checks.items():
        error = float((got.float().cpu() - want).norm() / want.norm().clamp(min=1e-12)) if want.numel() else 0.0
        assert error < tolerance, f"{name}: relative error {error:.2e} >= {tolerance:g}"
    print(f"rank {rank}: MoE backward matches autograd (x, router, w1, w2), inference forward the same (in place "
          f"and grouped), "
          f"tokens {counts}: MOE-GRAD-OK", flush=True)


check([24] * world, None)
check([0, *[7 * r for r in range(1, world - 1)], 24][:world] if world > 1 else [24], 24)
ts.finalize()
