"""Train a tensor-parallel MLP for a few steps and match a single-process reference.

The MLP's up projection is column parallel and its down projection row parallel
(``ts.nn.TensorParallelMLP``); activations between layers are sharded by rows. Forward and
backward run on tilescale's fused TP GEMMs (all-gather-GEMM and GEMM-reduce-scatter, each
the other's backward). Every rank also trains the same, unsharded MLP with plain torch on
the whole batch, and the losses and weights must agree.

    tilescale run -n 2 examples/tp_mlp_training.py
    tilescale run -n 4 --cpu examples/tp_mlp_training.py
"""

import torch

import tilescale as ts
from tilescale.testing import assert_close, do_bench


def main(steps: int = 5, lr: float = 0.05) -> None:
    ts.init()
    rank, world = ts.rank(), ts.world_size()
    gpu = ts.device().type == "cuda"
    rows, hidden, ffn = (2048, 1024, 4096) if gpu else (32, 64, 128)
    dtype = torch.bfloat16 if gpu else torch.float32
    g = torch.Generator().manual_seed(0)  # the same data and weights on every rank
    up = (torch.rand(ffn, hidden, generator=g) * 2 - 1) / hidden**0.5
    down = (torch.rand(hidden, ffn, generator=g) * 2 - 1) / ffn**0.5
    x = torch.randn(world * rows, hidden, generator=g)
    target = torch.randn(world * rows, hidden, generator=g)

    mlp = ts.nn.TensorParallelMLP(hidden, ffn, up=up, down=down, dtype=dtype)
    opt = torch.optim.SGD(mlp.parameters(), lr=lr)
    mine = slice(rank * rows, (rank + 1) * rows)
    x_rows, t_rows = x[mine].to(ts.device(), dtype), target[mine].to(ts.device(), dtype)

    ref_up = up.clone().requires_grad_()
    ref_down = down.clone().requires_grad_()
    ref_opt = torch.optim.SGD([ref_up, ref_down], lr=lr)

    for step in range(steps):
        opt.zero_grad()
        # Each rank holds its rows; the global loss is the mean over all ranks' rows.
        loss = ((mlp(x_rows).float() - t_rows.float()) ** 2).sum() / target.numel()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)

        ref_opt.zero_grad()
        ref_loss = ((torch.nn.functional.gelu(x @ ref_up.T) @ ref_down.T - target) ** 2).mean()
        ref_loss.backward()
        ref_opt.step()
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        assert abs(total.item() - ref_loss.item()) <= tol * ref_loss.item(), (step, total.item(), ref_loss.item())
        if rank == 0:
            print(f"step {step}: loss {total.item():.5f} (reference {ref_loss.item():.5f})")

    up_shard = ref_up.detach().chunk(world, 0)[rank]
    assert_close(mlp.up.weight.float().cpu(), up_shard, rtol=tol, atol=tol)
    ms = do_bench(lambda: mlp(x_rows), iters=10)
    print(f"rank {rank}: TP MLP training correct: matches the single-process reference; forward {ms:.3f} ms")
    ts.finalize()


if __name__ == "__main__":
    main()
