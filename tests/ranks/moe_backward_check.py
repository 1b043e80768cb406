"""Rank program: the EP MoE layer's gradients against autograd through a single-process MoE."""

import torch
import torch.distributed as dist

import tilescale as ts

ts.init()
torch.set_default_device(ts.device())
rank, world = ts.rank(), ts.world_size()
tokens, hidden, ffn, num_experts, topk = 24, 64, 96, 4 * world, 2
moe = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=11, dtype=torch.float32)
g = torch.Generator(device=ts.device()).manual_seed(rank)
x = torch.randn(tokens, hidden, generator=g).requires_grad_()
grad_y = torch.randn(tokens, hidden, generator=g)
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
x_all = torch.cat(xs).cpu().requires_grad_()
probs = torch.softmax(x_all @ router.T, dim=-1)
weights, experts = probs.topk(topk, dim=-1)
weights = weights / weights.sum(-1, keepdim=True)
y_all = torch.zeros_like(x_all)
for k in range(topk):
    h = torch.nn.functional.gelu(torch.einsum("th,tfh->tf", x_all, w1[experts[:, k]]))
    y_all = y_all + weights[:, k, None] * torch.einsum("tf,thf->th", h, w2[experts[:, k]])
(y_all * torch.cat(gs).cpu()).sum().backward()

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
for name, (got, want) in checks.items():
    torch.testing.assert_close(got.float().cpu(), want.float(), rtol=1e-3, atol=1e-3, msg=name)
print(f"rank {rank}: MoE backward matches autograd (x, router, w1, w2): MOE-GRAD-OK", flush=True)
ts.finalize()
