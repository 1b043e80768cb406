"""The TP GEMMs and the MoE exchange at shapes drawn at random (``tests/ranks/random_shapes.py``), CPU path."""

import pytest
from cpu_jobs import RANKS, run_cpu


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("n", "seed"), [(3, 1), (4, 2)])
def test_ops_at_random_shapes_match_torch(n, seed):
    proc = run_cpu(RANKS / "random_shapes.py", n, args=("--cases", "4", "--small", "--seed", str(seed)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("CASE-OK") == 3 * 4 * n  # a TP, a MoE and a layer case per draw, every rank
    if seed == 1:  # its first MoE case has one expert per rank (Mixtral's 8 experts on 8 ranks, say)
        assert proc.stdout.count("top-2 of 3 bf16") == n
