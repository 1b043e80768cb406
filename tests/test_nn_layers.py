"""ts.nn's layers against unsharded torch modules, and the Hugging Face examples, on the CPU path
with 2 and 4 ranks (real processes)."""

import importlib.util
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from cpu_jobs import example_output, run_cpu, run_examples

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


@pytest.fixture(scope="module")
def hf_examples(tmp_path_factory) -> Callable[[int], tuple[subprocess.CompletedProcess, Path | None]]:
    """One job per rank count runs both Hugging Face examples (transformers, torch and TileLang
    are imported once per rank); the 2-rank job also runs the Llama example on a checkpoint.

    Returns ``job(n)``: the job's process and the checkpoint's folder (None for 4 ranks).
    """
    jobs = {}

    def job(n: int) -> tuple[subprocess.CompletedProcess, Path | None]:
        if n not in jobs:
            checkpoint = save_llama_checkpoint(tmp_path_factory.mktemp("llama")) if n == 2 else None
            specs = ["hf_llama_tp", "hf_mixtral_ep"] + ([f"hf_llama_tp={checkpoint}"] if checkpoint else [])
            jobs[n] = run_examples(n, specs), checkpoint
        return jobs[n]

    return job


def save_llama_checkpoint(folder: Path) -> Path:
    """A Llama of another shape than the example's own, saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@needs_transformers
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("example, what", [("hf_llama_tp", "tensor-parallel Llama"),
                                           ("hf_mixtral_ep", "expert-parallel Mixtral")])
def test_hf_example_matches_the_unsharded_model(hf_examples, example, what, n):
    proc, _ = hf_examples(n)
    outputs = [example_output(proc.stdout, rank, example) for rank in range(n)]
    assert None not in outputs, proc.stdout[-2000:] + proc.stderr[-3000:]
    for out in outputs:
        assert f"{what} over {n} ranks correct: logits and 4 greedy tokens match" in out, out


@needs_transformers
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [2, 4])
def test_hf_examples_job_exits_cleanly(hf_examples, n):
    proc, _ = hf_examples(n)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@needs_transformers
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hf_llama_example_loads_a_checkpoint(hf_examples):
    """The example's checkpoint path: a Llama of another shape saved with save_pretrained."""
    proc, checkpoint = hf_examples(2)
    outputs = [example_output(proc.stdout, rank, f"hf_llama_tp={checkpoint}") for rank in range(2)]
    assert None not in outputs, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert all("tensor-parallel Llama over 2 ranks correct" in out for out in outputs), outputs
    assert "(3072 MLP parameters per layer on this rank)" in outputs[0]  # 3 x 32 x 64 / 2: the saved shape
