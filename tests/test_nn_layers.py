"""ts.nn's layers against unsharded torch modules, and the Hugging Face examples, on the CPU path
with 2 and 4 ranks (real processes)."""

import importlib.util

import pytest
from cpu_jobs import run_cpu

needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers is not installed (pip install -e '.[models]')")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("n", [2, 4])
def test_layers_match_unsharded_modules(n):
    """Column, row and merged layers in both modes, 2-D and 3-D inputs, bias on and off; the
    from_weights MoE with three routings: outputs and every gradient (the fused plans forced)."""
    proc = run_cpu("tests/ranks/nn_layers_check.py", n, env={"TILESCALE_TP_PLAN": "fused"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("8 cases of column, row and merged layers: NN-TP-OK") == n
    assert proc.stdout.count("NN-MOE-OK") == n


@needs_transformers
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("example, what", [("hf_llama_tp", "tensor-parallel Llama"),
                                           ("hf_mixtral_ep", "expert-parallel Mixtral")])
def test_hf_example_matches_the_unsharded_model(example, what, n):
    proc = run_cpu(f"examples/{example}.py", n, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count(f"{what} over {n} ranks correct: logits and 4 greedy tokens match") == n


@needs_transformers
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_hf_llama_example_loads_a_checkpoint(tmp_path):
    """The example's checkpoint path: a Llama of another shape saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    proc = run_cpu("examples/hf_llama_tp.py", 2, timeout=400, args=(str(tmp_path),))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("tensor-parallel Llama over 2 ranks correct") == 2
    assert "(3072 MLP parameters per layer on this rank)" in proc.stdout  # 3 x 32 x 64 / 2: the saved shape
