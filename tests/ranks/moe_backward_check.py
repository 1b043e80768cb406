"""Rank program: the EP MoE layer's gradients against autograd through a single-process MoE."""

import torch
import torch.distributed as dist

import tilescale as ts
from tilescale.nn.moe import moe_weights
from tilescale.testing import reference_moe

ts.init()
torch.set_default_device(ts.device())
rank, world = ts.rank(), ts.world_size()
tokens, hidden, ffn, num_experts, topk = 24, 64, 96, 4 * world, 2
# fp32 on the CPU path (exact comparison); the GPUs' tensor-core kernels take bf16.
dtype = torch.bfloat16 if ts.device().type == "cuda" else torch.float32
moe = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=11, dtype=dtype)
g = torch.Generator(device=ts.device()).manual_seed(rank)
x = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
grad_y = torch.randn(tokens, hidden, generator=g).to(dtype)
(moe(x) * grad_y).sum().backward()

# Reference: every rank's tokens through the whole MoE (all experts) in one process.
xs = [torch.empty_like(x) for _ in range(world)]
gs = [torch.empty_like(grad_y) for _ in range(world)]
dist.all_gather(xs, x.detach())
dist.all_gather(gs, grad_y)
router, w1, w2 = (w.requires_grad_() for w in moe_weights(hidden, ffn, num_experts, 11))
x_all = torch.cat(xs).float().cpu().requires_grad_()
y_all = reference_moe(x_all, router, w1, w2, topk)
(y_all * torch.cat(gs).float().cpu()).sum().backward()

per_rank = num_experts // world
mine = slice(rank * per_rank, (rank + 1) * per_rank)
router_grad = moe.router.grad.clone()
dist.all_reduce(router_grad)  # the router is replicated: data-parallel gradients add up
checks = {
    "x": (x.grad, x_all.grad[rank * tokens:(rank + 1) * tokens]),
    "router": (router_grad, router.grad),
    "w1": (moe.w1.grad, w1.grad[mine]),
    "w2": (moe.w2.grad, w2.grad[mine]),
}
tolerance = 3e-2 if dtype == torch.bfloat16 else 1e-4  # relative L2 error
for name, (got, want) in checks.items():
    error = float((got.float().cpu() - want).norm() / want.norm())
    assert error < tolerance, f"{name}: relative error {error:.2e} >= {tolerance:g}"
print(f"rank {rank}: MoE backward matches autograd (x, router, w1, w2): MOE-GRAD-OK", flush=True)
ts.finalize()
