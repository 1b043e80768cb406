"""Rank program: ``ts.ops.silu_and_mul`` on this rank's device against torch's composition, at
row counts one kernel serves (the row count is a run-time argument), repeated calls of a row count
(its first call the kernel's own, then an OpLaunch that learns, then on a GPU straight from C++) among
other counts and in a CUDA graph, and its refusals of bad input, also of a layout learned before.

    tilescale run -n 1 tests/ranks/activation_check.py          # a GPU (tests/test_gpu.py)
    tilescale run -n 1 --cpu tests/ranks/activation_check.py    # the CPU path (tests/test_activation.py)
"""

import torch

import tilescale as ts
from tilescale.op_launch import OpLaunch
from tilescale.ops import activation
from tilescale.ops._common import layout_key

ts.init()
g = torch.Generator(device=ts.device()).manual_seed(0)
# Rows and columns past the block's (8 x 256), columns not a multiple of a vector (300, 5), an MoE
# layer's grouped rows and one more: each (ffn, dtype) one kernel for every row count.
for rows, ffn, dtype in [(37, 300, torch.bfloat16), (16, 512, torch.float16), (9, 5, torch.float32),
                         (1, 1408, torch.bfloat16), (24576, 1408, torch.bfloat16), (24577, 1408, torch.bfloat16),
                         (64, 768, torch.float32)]:
    h = (torch.randn(rows, 2 * ffn, generator=g, device=ts.device()) * 4).to(dtype)
    gate, up = h.chunk(2, -1)
    want = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
    got = ts.ops.silu_and_mul(h)
    assert got.shape == (rows, ffn) and got.dtype == dtype, (got.shape, got.dtype)
    # one rounding of the same float32 value (sigmoid's form may move the last float32 bit)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    if dtype != torch.float32:  # rounded to 16 bits: equal but for rare ties
        assert (got != want).float().mean() < 0.01, (rows, ffn, dtype)

# Repeated calls, two row counts interleaved, new values each time: every path gives torch's result.
for _ in range(6):
    for rows in (128, 33):
        h = (torch.randn(rows, 2 * 512, generator=g, device=ts.device()) * 4).to(torch.bfloat16)
        want = (torch.nn.functional.silu(h[:, :512].float()) * h[:, 512:].float()).to(torch.bfloat16)
        torch.testing.assert_close(ts.ops.silu_and_mul(h), want, rtol=1e-2, atol=1e-2)
# The plans: a row count called once keeps no launch (prefill's ever new batch sizes learn
# nothing); one called again runs through an OpLaunch, one per layout.
once = torch.zeros(77, 2 * 512, dtype=torch.bfloat16, device=ts.device())
ts.ops.silu_and_mul(once)
assert activation._launches.get(layout_key(once)) is False
launches = [activation._launches.get(layout_key(torch.empty(rows, 2 * 512, dtype=torch.bfloat16, device=ts.device())))
            for rows in (128, 33)]
assert all(isinstance(launch, OpLaunch) for launch in launches) and launches[0] is not launches[1], launches
if ts.device().type == "cuda" and activation._direct.find(activation._SITE) is not None:
    print("direct calls: yes", flush=True)
    graph = torch.cuda.CUDAGraph()  # a capture takes the op's path; the replay reads h as it is then
    with torch.cuda.graph(graph):
        captured = ts.ops.silu_and_mul(h)
    h.copy_((torch.randn(h.shape, generator=g, device=ts.device()) * 4).to(torch.bfloat16))
    graph.replay()
    want = (torch.nn.functional.silu(h[:, :512].float()) * h[:, 512:].float()).to(torch.bfloat16)
    torch.testing.assert_close(captured, want, rtol=1e-2, atol=1e-2)
elif ts.device().type == "cuda":
    raise AssertionError("silu_and_mul: repeated calls of a row count did not go straight to C++")
# A layout learned (contiguous float32 (4, 8)) and the same shape not contiguous: still refused.
for _ in range(3):
    ts.ops.silu_and_mul(torch.zeros(4, 8, device=ts.device()))
assert ts.ops.silu_and_mul(torch.empty(0, 8, dtype=torch.bfloat16, device=ts.device())).shape == (0, 4)
for bad, what in [(torch.zeros(4, 7), ValueError), (torch.zeros(8), ValueError),
                  (torch.zeros(4, 8, dtype=torch.int32), ValueError), (torch.zeros(8, 4).T, ValueError)]:
    try:
        ts.ops.silu_and_mul(bad.to(ts.device()))
    except what as e:
        print("refused:", e)
    else:
        raise AssertionError(f"accepted {tuple(bad.shape)} {bad.dtype}")
print(f"rank {ts.rank()}: silu_and_mul matches torch ACT-OK", flush=True)
ts.finalize()
