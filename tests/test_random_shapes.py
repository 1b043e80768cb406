"""The TP GEMMs, the MoE exchange and the TP / EP layers at shapes drawn at random
(``tests/ranks/random_shapes.py``), CPU path."""

import pytest
from cpu_jobs import RANKS, run_cpu


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("n", "seed", "plan"), [(3, 1, None), (4, 2, None), (2, 3, "fused")])
def test_ops_and_layers_at_random_shapes_match_torch(n, seed, plan):
    env = {"TILESCALE_TP_PLAN": plan} if plan else None  # the TP layers on their fused plans too
    proc = run_cpu(RANKS / "random_shapes.py", n, env=env, args=("--cases", "4", "--small", "--seed", str(seed)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("CASE-OK") == 4 * 4 * n  # a TP, a MoE, an EP layer and a TP layer case per draw
    if seed == 1:  # its first MoE case has one expert per rank (Mixtral's 8 experts on 8 ranks, say)
        assert proc.stdout.count("top-2 of 3 bf16") == n
