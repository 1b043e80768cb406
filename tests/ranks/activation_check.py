"""Rank program: ``ts.ops.silu_and_mul`` on this rank's device at row counts one kernel serves
(the row count is a run-time argument), against torch's composition.

    tilescale run -n 1 tests/ranks/activation_check.py
"""

import torch

import tilescale as ts

ts.init()
g = torch.Generator(device=ts.device()).manual_seed(0)
# Rows not a multiple of the block's 8, an MoE layer's grouped rows, columns not a multiple of a vector.
for rows, ffn, dtype in [(1, 1408, torch.bfloat16), (37, 1408, torch.bfloat16), (24577, 1408, torch.bfloat16),
                         (24576, 1408, torch.bfloat16), (300, 5, torch.float16), (64, 768, torch.float32)]:
    h = (torch.randn(rows, 2 * ffn, generator=g, device=ts.device()) * 4).to(dtype)
    gate, up = h.chunk(2, -1)
    want = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
    got = ts.ops.silu_and_mul(h)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    if dtype != torch.float32:  # one rounding of the same float32 value: equal but for rare ties
        assert (got != want).float().mean() < 0.01, (rows, ffn, dtype)
print(f"rank {ts.rank()}: silu_and_mul matches torch at 6 shapes ACT-OK", flush=True)
ts.finalize()
