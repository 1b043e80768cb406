"""An expert-parallel MoE layer checked against a single-process MoE with the same weights.

``ts.nn.ExpertParallelMoE`` routes each token to its top-k experts, sends it once to each
rank holding one of them (``ts.ops.moe_dispatch``), runs the local experts as grouped GEMMs
written in TileLang, and brings the weighted results back (``ts.ops.moe_combine``).

    tilescale run -n 2 examples/moe_layer.py
    tilescale run -n 4 --cpu examples/moe_layer.py
"""

import torch

import tilescale as ts
from tilescale.nn.moe import moe_weights
from tilescale.testing import assert_close, do_bench, reference_moe


def main() -> None:
    ts.init()
    rank = ts.rank()
    gpu = ts.device().type == "cuda"
    tokens, hidden, ffn, num_experts, topk = (4096, 1024, 2048, 16, 2) if gpu else (24, 64, 96, 8, 2)
    moe = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=7)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank)).to(ts.device(), torch.bfloat16)
    with torch.no_grad():  # inference here; tests/ranks/moe_backward_check.py checks the gradients
        y = moe(x)
    expected = reference_moe(x.float().cpu(), *moe_weights(hidden, ffn, num_experts, 7), topk)
    assert_close(y.float().cpu(), expected, rtol=5e-2, atol=5e-2)
    with torch.no_grad():
        ms = do_bench(lambda: moe(x), iters=5)
    print(f"rank {rank}: MoE layer correct ({tokens} tokens, {num_experts} experts, top-{topk}); {ms:.3f} ms")
    ts.finalize()


if __name__ == "__main__":
    main()
