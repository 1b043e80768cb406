"""Rank program: ts.nn's tensor-parallel layers (both modes) and ExpertParallelMoE.from_weights
against unsharded torch modules, forward and backward, inputs 2-D and 3-D, bias on and off.

Every rank builds the same full modules and data (shared seeds), runs its shard, and compares
its part of the output and of every gradient with autograd through the unsharded module.
"""

import itertools

import torch
import torch.distributed as dist
from torch import nn

import tilescale as ts

ts.init()
rank, world, dev = ts.rank(), ts.world_size(), ts.device()
# fp32 on the CPU path (near-exact comparison); the GPUs' tensor-core kernels take bf16.
dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
TOL = 3e-2 if dtype == torch.bfloat16 else 1e-5  # relative L2 error


def shared(*shape: int, seed: int) -> torch.Tensor:
    """The same tensor on every rank (host RNG), rounded to the layers' dtype."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).float()


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"rank {rank}: {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    error = float((got.detach().float().cpu() - want).norm() / want.norm())
    assert error < TOL, f"rank {rank}: {name}: relative error {error:.2e} >= {TOL:g}"


def rows(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of the first dimension (sequence-parallel activations)."""
    return t.chunk(world, 0)[rank]


def cols(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """This rank's slice of ``dim`` (sharded features)."""
    return t.chunk(world, dim)[rank]


def linear(in_features: int, out_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)  # nn.Linear's own initialisation, the same on every rank
    return nn.Linear(in_features, out_features, bias=bias).to(dtype)


def reference(lin: nn.Linear, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(y, dx, dW, db) of the unsharded layer in fp32 for output gradient ``dy``."""
    ref = nn.Linear(lin.in_features, lin.out_features, bias=lin.bias is not None)
    ref.load_state_dict({k: v.float() for k, v in lin.state_dict().items()})
    x = x.detach().clone().requires_grad_()
    y = ref(x)
    (y * dy).sum().backward()
    return y.detach(), x.grad, ref.weight.grad, None if ref.bias is None else ref.bias.grad


def run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    x = x.to(dev, dtype, copy=True).requires_grad_()  # a leaf of its own, not the shared tensor
    y = layer(x)
    (y.float() * dy.to(dev)).sum().backward()
    return y, x.grad


IN, OUT = 24, 16  # both divisible by 2 and 4 ranks
cases = 0
for sp, bias, lead in itertools.product((True, False), (False, True), ((world * 3,), (world * 2, 3))):
    where = f"sequence_parallel={sp} bias={bias} lead={lead}"
    x_full, seed = shared(*lead, IN, seed=1), 10 * cases

    # Column parallel: this rank's output columns, of every row.
    lin = linear(IN, OUT, bias, seed)
    dy = shared(*lead, OUT, seed=seed + 1)
    y_ref, dx_ref, dw_ref, db_ref = reference(lin, x_full, dy)
    layer = ts.nn.ColumnParallelLinear.from_linear(lin, sequence_parallel=sp)
    y, dx = run(layer, rows(x_full) if sp else x_full, cols(dy))
    check(f"column y {where}", y, cols(y_ref))
    check(f"column dx {where}", dx, rows(dx_ref) if sp else dx_ref)  # plain TP: all-reduced, whole
    check(f"column dW {where}", layer.weight.grad, cols(dw_ref, 0))
    if bias:
        check(f"column db {where}", layer.bias.grad, cols(db_ref, 0))

    # Row parallel: this rank's input columns; output rows (sequence parallel) or whole.
    lin = linear(OUT, IN, bias, seed + 2)
    h_full, dy = shared(*lead, OUT, seed=seed + 3), shared(*lead, IN, seed=seed + 4)
    y_ref, dh_ref, dw_ref, db_ref = reference(lin, h_full, dy)
    layer = ts.nn.RowParallelLinear.from_linear(lin, sequence_parallel=sp)
    y, dh = run(layer, cols(h_full), rows(dy) if sp else dy)
    check(f"row y {where}", y, rows(y_ref) if sp else y_ref)
    check(f"row dx {where}", dh, cols(dh_ref))
    check(f"row dW {where}", layer.weight.grad, cols(dw_ref))
    if bias:  # the replicated bias gets every row's gradient on every rank
        check(f"row db {where}", layer.bias.grad, db_ref)

    # Merged gate and up projections: [gate shard, up shard] on every rank.
    gate, up = linear(IN, OUT, bias, seed + 5), linear(IN, OUT, bias, seed + 6)
    dg, du = shared(*lead, OUT, seed=seed + 7), shared(*lead, OUT, seed=seed + 8)
    g_ref, dxg, dwg, dbg = reference(gate, x_full, dg)
    u_ref, dxu, dwu, dbu = reference(up, x_full, du)
    layer = ts.nn.MergedColumnParallelLinear.from_linears([gate, up], sequence_parallel=sp)
    y, dx = run(layer, rows(x_full) if sp else x_full, torch.cat([cols(dg), cols(du)], -1))
    g, u = y.chunk(2, -1)
    check(f"merged gate {where}", g, cols(g_ref))
    check(f"merged up {where}", u, cols(u_ref))
    check(f"merged dx {where}", dx, rows(dxg + dxu) if sp else dxg + dxu)
    check(f"merged dW {where}", layer.weight.grad, torch.cat([cols(dwg, 0), cols(dwu, 0)]))
    if bias:
        check(f"merged db {where}", layer.bias.grad, torch.cat([cols(dbg, 0), cols(dbu, 0)]))
    cases += 1
print(f"rank {rank}: {cases} cases of column, row and merged layers: NN-TP-OK", flush=True)


# ExpertParallelMoE.from_weights: Hugging Face Mixtral's layout and routing.
H, F, E, TOPK = 32, 16, 2 * world, 2


def reference_moe(x: torch.Tensor, route, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """Every token through its top-k SwiGLU experts in one process (as Mixtral's block)."""
    experts, weights = route(x)
    out = torch.zeros_like(x)
    for k in range(experts.shape[1]):
        for e in range(gate_up.shape[0]):
            sel = (experts[:, k] == e).nonzero(as_tuple=True)[0]
            g, u = (x[sel] @ gate_up[e].T).chunk(2, -1)
            out = out.index_add(0, sel, weights[sel, k, None] * ((nn.functional.silu(g) * u) @ down[e].T))
    return out


def softmax_route(router: torch.Tensor, normalize: bool):  # noqa: ANN201
    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = torch.softmax(x @ router.T, -1).topk(TOPK, -1)
        return experts, weights / weights.sum(-1, keepdim=True) if normalize else weights
    return route


class SigmoidRouter(nn.Module):
    """A user's routing scheme: sigmoid scores, top-k, unnormalised (a trainable module)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, experts = torch.sigmoid(x.float() @ self.weight.float().T).topk(TOPK, -1)
        return experts, weights


per_rank = E // world
mine = slice(rank * per_rank, (rank + 1) * per_rank)
for case, (scheme, lead) in enumerate([("normalized", (2, 3)), ("unnormalized", (5,)), ("callable", (2, 3))]):
    router = shared(E, H, seed=100 + case) / H**0.5
    gate_up, down = shared(E, 2 * F, H, seed=200 + case) / H**0.5, shared(E, H, F, seed=300 + case) / F**0.5
    if scheme == "callable":
        route = SigmoidRouter(router.to(dev, dtype))
        moe = ts.nn.ExpertParallelMoE.from_weights(route, gate_up.to(dtype), down.to(dtype), TOPK)
    else:
        moe = ts.nn.ExpertParallelMoE.from_weights(router.to(dtype), gate_up.to(dtype), down.to(dtype), TOPK,
                                                   normalize_topk=scheme == "normalized")
    x = torch.randn(*lead, H, generator=torch.Generator().manual_seed(rank)).to(dev, dtype).requires_grad_()
    dy = torch.randn(*lead, H, generator=torch.Generator().manual_seed(world + rank)).to(dev, dtype)
    y = moe(x)
    (y.float() * dy.float()).sum().backward()

    # Reference: every rank's tokens through the whole MoE in one process.
    xs, dys = [torch.empty_like(x) for _ in range(world)], [torch.empty_like(dy) for _ in range(world)]
    dist.all_gather(xs, x.detach())
    dist.all_gather(dys, dy)
    x_all = torch.cat([t.reshape(-1, H) for t in xs]).float().cpu().requires_grad_()
    ref_router, ref_gate_up, ref_down = (t.clone().requires_grad_() for t in (router, gate_up, down))
    ref_route = SigmoidRouter(ref_router) if scheme == "callable" else softmax_route(ref_router,
                                                                                   scheme == "normalized")
    y_all = reference_moe(x_all, ref_route, ref_gate_up, ref_down)
    (y_all * torch.cat([t.reshape(-1, H) for t in dys]).float().cpu()).sum().backward()

    tokens = x.numel() // H
    ours = slice(rank * tokens, (rank + 1) * tokens)
    check(f"moe {scheme} y", y, y_all.detach()[ours].reshape(*lead, H))
    with torch.no_grad():  # inference: no autograd nodes, the fused activation kernel
        check(f"moe {scheme} y, inference", moe(x), y_all.detach()[ours].reshape(*lead, H))
    check(f"moe {scheme} dx", x.grad, x_all.grad[ours].reshape(*lead, H))
    router_grad = (route.weight if scheme == "callable" else moe.router).grad.float().clone()
    dist.all_reduce(router_grad)  # the router is replicated: each rank's tokens add their part
    check(f"moe {scheme} d router", router_grad, (ref_route.weight if scheme == "callable" else ref_router).grad)
    check(f"moe {scheme} d gate_up", moe.w1.grad, ref_gate_up.grad[mine])
    check(f"moe {scheme} d down", moe.w2.grad, ref_down.grad[mine])
print(f"rank {rank}: from_weights MoE (softmax top-k with and without renormalisation, a router module): "
      "outputs and gradients, inference outputs: NN-MOE-OK", flush=True)
ts.finalize()
