"""Tensor-parallel Hugging Face Llama: its MLPs split over the job by ``ts.nn`` layers.

Every current LLM's MLP is SwiGLU: ``down(act(gate(x)) * up(x))``. Megatron-style tensor
parallelism splits ``gate`` and ``up`` by output features (column parallel: each rank computes
its slice of the hidden activations, with no communication) and ``down`` by input features
(row parallel: each rank's partial product is summed over ranks). Here the two column-parallel
projections run as one GEMM (``MergedColumnParallelLinear``, each projection split on its own,
so ``chunk(2, -1)`` gives every rank its gate and up slices) and the row-parallel sum is
tilescale's fused ``gemm_all_reduce``::

    gate_up = ts.nn.MergedColumnParallelLinear.from_linears([mlp.gate_proj, mlp.up_proj], sequence_parallel=False)
    down = ts.nn.RowParallelLinear.from_linear(mlp.down_proj, sequence_parallel=False)

Each rank keeps 1/world of every MLP weight; attention and embeddings stay replicated. Every
rank loads the same model (a random tiny Llama, or a local checkpoint given as the argument),
computes the unsharded model's logits and greedy tokens, swaps the MLPs, and checks that the
tensor-parallel model gives the same logits and tokens.

    tilescale run -n 2 --cpu examples/hf_llama_tp.py
    tilescale run -n 2 examples/hf_llama_tp.py [path/to/llama-checkpoint]

Needs ``transformers`` (``pip install -e ".[models]"``); written against transformers 5
(``LlamaMLP`` with ``gate_proj``, ``up_proj``, ``down_proj`` and ``act_fn``: the same names in
transformers 4, and in Mistral's and Qwen2's MLPs). fp32 on the CPU path, bf16 on GPUs.
"""

import sys

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import tilescale as ts
from tilescale.testing import compare_sharded_model


class TensorParallelMLP(nn.Module):
    """A Llama MLP with this rank's shards of its three projections; input and output replicated."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.gate_up = ts.nn.MergedColumnParallelLinear.from_linears([mlp.gate_proj, mlp.up_proj],
                                                                     sequence_parallel=False)
        self.down = ts.nn.RowParallelLinear.from_linear(mlp.down_proj, sequence_parallel=False)
        self.act_fn = mlp.act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, -1)  # this rank's slices of the gate and up activations
        return self.down(self.act_fn(gate) * up)  # summed over ranks by the fused GEMM + all-reduce


def load(path: str | None, dtype: torch.dtype) -> nn.Module:
    """The checkpoint at ``path``, or a random tiny Llama (the same on every rank: seeded)."""
    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(config).to(dtype)


def main(path: str | None = None, new_tokens: int = 4) -> None:
    ts.init()
    rank, world, dev = ts.rank(), ts.world_size(), ts.device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = load(path, dtype).to(dev).eval()
    prompt = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).to(dev)

    def shard(model: nn.Module) -> None:  # every MLP, in place
        for layer in model.model.layers:
            layer.mlp = TensorParallelMLP(layer.mlp)

    result = compare_sharded_model(model, prompt, shard, new_tokens)
    local = sum(p.numel() for p in model.model.layers[0].mlp.parameters())
    if rank == 0:
        print(result.describe_tokens())
    print(f"rank {rank}: tensor-parallel Llama over {world} ranks correct: logits and {new_tokens} greedy tokens "
          f"match the unsharded model ({local} MLP parameters per layer on this rank); prefill of "
          f"{tuple(prompt.shape)} tokens {result.ms:.2f} ms (unsharded {result.ref_ms:.2f} ms)")
    ts.finalize()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
