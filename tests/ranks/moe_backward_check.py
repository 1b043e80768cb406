"""Rank program: the EP MoE layer's gradients against autograd through a single-process MoE."""

import torch
import torch.distributed as dist

import tilescale as ts

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
gen = torch.Generator().manual_seed(11)
router = (torch.randn(num_experts, hidden, generator=gen) / hidden**0.5).requires_grad_()
w1 = (torch.randn(num_experts, ffn, hidden, generator=gen) / hidden**0.5).requires_grad_()
w2 = (torch.randn(num_experts, hidden, ffn, generator=gen) / ffn**0.5).requires_grad_()
x_all = torch.cat(xs).float().cpu().requires_grad_()
probs = torch.softmax(x_all @ router.T, dim=-1)
weights, experts = probs.topk(topk, dim=-1)
weights = weights / weights.sum(-1, keepdim=True)
y_all = torch.zeros_like(x_all)
for k in range(topk):
    h = torch.nn.functional.gelu(torch.einsum("th,tfh->tf", x_all, w1[experts[:, k]]))
    y_all = y_all + weights[:, k, None] * torch.einsum("tf,thf->th", h, w2[experts[:, k]])
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
