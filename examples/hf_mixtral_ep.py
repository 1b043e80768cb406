"""Expert-parallel Hugging Face Mixtral: its sparse MoE blocks on ``ts.nn.ExpertParallelMoE``.

A Mixtral MoE block routes each token to its top-k experts (softmax over the router's logits,
top-k, renormalised) and sums their SwiGLU outputs with the routing weights. Expert
parallelism puts ``num_experts / world`` experts on each rank: tokens travel to their experts'
ranks (``moe_dispatch``), the experts run as one grouped GEMM, and the results travel back
(``moe_combine``). ``ExpertParallelMoE.from_weights`` builds the layer from the block's own
weights, every rank keeping its experts' slices::

    moe = ts.nn.ExpertParallelMoE.from_weights(block.gate.weight, block.experts.gate_up_proj,
                                               block.experts.down_proj, topk=block.top_k,
                                               max_tokens=most_tokens_per_rank)

``max_tokens`` sizes the layer's buffers once: the prompt and every decode step, each with
its own token count, go through the same buffers and kernels.

Attention stays replicated, so every rank holds the whole batch: each rank routes its own
share of the tokens (the experts see every token once) and the outputs are gathered back.

Every rank loads the same model (a random tiny Mixtral, or a local checkpoint given as the
argument), computes the original model's logits and greedy tokens, swaps the MoE blocks, and
checks that the expert-parallel model gives the same logits and tokens.

    tilescale run -n 2 --cpu examples/hf_mixtral_ep.py
    tilescale run -n 2 examples/hf_mixtral_ep.py [path/to/mixtral-checkpoint]

Needs ``transformers`` (``pip install -e ".[models]"``). Written against transformers 5's
layout: ``MixtralSparseMoeBlock`` at ``layer.mlp``, with ``gate`` (a router holding ``weight``,
(experts, hidden)) and ``experts`` holding ``gate_up_proj`` (experts, 2 x ffn, hidden) and
``down_proj`` (experts, hidden, ffn). transformers 4 kept the block at
``layer.block_sparse_moe`` with one ``nn.Linear`` per expert projection (``w1`` gate, ``w3``
up, ``w2`` down): stack those to use this example there. fp32 on the CPU path, bf16 on GPUs.
"""

import sys

import torch
from torch import nn
from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

import tilescale as ts
from tilescale.testing import compare_sharded_model


class ExpertParallelBlock(nn.Module):
    """A Mixtral sparse MoE block with this rank's experts; input and output replicated."""

    def __init__(self, block: nn.Module, max_tokens: int):
        super().__init__()
        # max_tokens: the most tokens a rank passes (its share of the prompt); the decode steps'
        # fewer tokens go through the same buffers and kernels (no build per token count).
        self.moe = ts.nn.ExpertParallelMoE.from_weights(block.gate.weight, block.experts.gate_up_proj,
                                                        block.experts.down_proj, topk=block.top_k,
                                                        max_tokens=max_tokens)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        rank, world = ts.rank(), ts.world_size()
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        tokens = x.shape[0]
        share = -(-tokens // world)  # equal shares for the all-gather after the layer: pad the last one
        x = nn.functional.pad(x, (0, 0, 0, share * world - tokens))
        y = ts.ops.all_gather(self.moe(x[rank * share:(rank + 1) * share]))
        return y[:tokens].reshape(hidden_states.shape)


def load(path: str | None, dtype: torch.dtype) -> nn.Module:
    """The checkpoint at ``path``, or a random tiny Mixtral (the same on every rank: seeded)."""
    if path:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=128)
    return MixtralForCausalLM(config).to(dtype)


def main(path: str | None = None, new_tokens: int = 4) -> None:
    ts.init()
    rank, world, dev = ts.rank(), ts.world_size(), ts.device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = load(path, dtype).to(dev).eval()
    if model.config.hidden_act not in ("silu", "swish"):
        raise ValueError(f"the experts' activation is {model.config.hidden_act!r}, not SiLU (SwiGLU)")
    prompt = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1)).to(dev)

    def shard(model: nn.Module) -> None:  # every MLP, in place
        for layer in model.model.layers:
            layer.mlp = ExpertParallelBlock(layer.mlp, max_tokens=-(-prompt.numel() // world))

    result = compare_sharded_model(model, prompt, shard, new_tokens)
    experts = model.model.layers[0].mlp.moe.w1.shape[0]
    if rank == 0:
        print(result.describe_tokens())
    print(f"rank {rank}: expert-parallel Mixtral over {world} ranks correct: logits and {new_tokens} greedy tokens "
          f"match the original model ({experts} of {model.config.num_local_experts} experts per layer on this "
          f"rank); prefill of {tuple(prompt.shape)} tokens {result.ms:.2f} ms (original {result.ref_ms:.2f} ms)")
    ts.finalize()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
