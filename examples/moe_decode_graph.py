"""A decode step of an expert-parallel MoE layer, captured once in a CUDA graph and replayed.

At decode sizes (here 128 tokens per rank) the kernels of an MoE layer are short, and an
eager step spends most of its time launching them from Python. Nothing in
``ts.nn.ExpertParallelMoE``'s forward waits for the host: the dispatch and combine keep
their per-call state (which receive buffers, which flag values to wait for) on the device.
So the step can be captured with ``torch.cuda.graph`` and replayed, each replay on the
tokens then in ``x``. ``low_latency=True`` groups the received rows in one kernel.

Checked against a single-process MoE with the same weights, then every replay against the
eager layer on new tokens; prints the eager and replayed step times.

    tilescale run -n 2 examples/moe_decode_graph.py
    tilescale run -n 2 --cpu examples/moe_decode_graph.py     # no graphs on the CPU path: eager only
"""

import torch

import tilescale as ts
from tilescale.nn.moe import moe_weights
from tilescale.testing import assert_close, do_bench, reference_moe


def main() -> None:
    ts.init()
    rank = ts.rank()
    gpu = ts.device().type == "cuda"
    tokens, hidden, ffn, num_experts, topk = (128, 2048, 1024, 64, 6) if gpu else (16, 64, 96, 8, 2)
    moe = ts.nn.ExpertParallelMoE(hidden, ffn, num_experts, topk, seed=5, low_latency=True)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=g).to(ts.device(), torch.bfloat16)
    with torch.no_grad():  # inference: no autograd state, as in a serving decode step
        y = moe(x)
        expected = reference_moe(x.float().cpu(), *moe_weights(hidden, ffn, num_experts, 5), topk)
        assert_close(y.float().cpu(), expected, rtol=5e-2, atol=5e-2)
        if not gpu:
            print(f"rank {rank}: low-latency MoE layer correct ({tokens} tokens); CUDA graphs need a GPU")
            ts.finalize()
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the kernels; nothing runs yet
            y_graph = moe(x)
        for _ in range(3):  # new tokens each step, read from x by the replay
            x.copy_(torch.randn(tokens, hidden, generator=g))
            graph.replay()
            assert_close(y_graph, moe(x), rtol=1e-2, atol=1e-2)
        eager_ms = do_bench(lambda: moe(x))
        graph_ms = do_bench(graph.replay)
    print(f"rank {rank}: MoE decode step correct ({tokens} tokens/rank, {num_experts} experts, top-{topk}): "
          f"eager {eager_ms * 1e3:.0f} us, CUDA graph replay {graph_ms * 1e3:.0f} us")
    ts.finalize()


if __name__ == "__main__":
    main()
