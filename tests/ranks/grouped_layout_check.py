"""ts.ops.grouped_gemm on row layouts a caller built: a valid one matches torch; each way of
breaking the contract (expert id past w's experts, a tile mixing experts or starting with
none, an index past x's rows) raises GroupedLayoutError naming the fault and its first row,
on every call that makes it, and at ``ts.finalize()`` where nothing synchronised after it; a
dispatch's own layout is not checked again (an index of the caller's own with it is), one used
with weights of fewer experts than it was made for is refused at once, and an in-place
dispatch's index with fewer rows than its receive rows too.

Run: ``tilescale run -n 2 --cpu tests/ranks/grouped_layout_check.py`` (or on GPUs, where the
fault is found on the device and raised at the next synchronisation).
Prints ``LAYOUT case=<name> rank=<r> <outcome>`` per case.
"""

import torch

import tilescale as ts
from tilescale.ops import grouped_layout

ts.init()
rank, dev = ts.rank(), ts.device()
torch.set_default_device(dev)  # as programs do: the check's host record must not follow it
E, N, K, ROWS = 4, 64, 128, 256
g = torch.Generator(device="cpu").manual_seed(5 + rank)
x = torch.randn(ROWS, K, generator=g, device="cpu").to(torch.bfloat16).to(dev)
w = (torch.randn(E, N, K, generator=g, device="cpu") / K**0.5).to(torch.bfloat16).to(dev)


def layout(*runs: tuple[int, int]) -> torch.Tensor:
    """row_expert from (expert, rows) runs."""
    return torch.cat([torch.full((n,), e, dtype=torch.int32) for e, n in runs]).to(dev)


def report(case: str, outcome: str) -> None:
    print(f"LAYOUT case={case} rank={rank} {outcome}", flush=True)


# A valid layout of the caller's own: an expert's rows then padding (-1) in one tile, a whole tile of another.
good = layout((1, 100), (-1, 28), (3, 128))
out = ts.ops.grouped_gemm(x, w, good)
ts.synchronize()
want = torch.cat([x[:100].float() @ w[1].float().T, x[128:].float() @ w[3].float().T])
got = torch.cat([out[:100], out[128:]]).float()
report("valid", "ok" if torch.allclose(got, want, rtol=2e-2, atol=2e-2) else f"WRONG {(got - want).abs().max()}")

index = torch.arange(ROWS, dtype=torch.int32, device=dev).flip(0)
out = ts.ops.grouped_gemm(x, w, good, index=index)
ts.synchronize()
want = x.flip(0)[128:].float() @ w[3].float().T
report("valid_index", "ok" if torch.allclose(out[128:].float(), want, rtol=2e-2, atol=2e-2) else "WRONG")

past_end = index.clone()
past_end[5] = ROWS + 3
cases = {
    "expert_past_end": (layout((1, 128), (E, 128)), None, "expert id out of range (first at row 128)"),
    "expert_below_none": (layout((0, 64), (-2, 64), (3, 128)), None, "expert id out of range (first at row 64)"),
    "tile_mixes_experts": (layout((1, 100), (2, 28), (3, 128)), None,
                           "row of another expert than its tile's first row (first at row 100)"),
    "tile_starts_with_none": (layout((-1, 10), (2, 118), (3, 128)), None,
                              "row of another expert than its tile's first row (first at row 10)"),
    "index_past_end": (good, past_end, "index out of range (first at row 5)"),
}
for case, (row_expert, idx, fault) in cases.items():
    outcomes = []
    for _ in range(2):  # every call that makes the fault raises, not only the first
        try:
            ts.ops.grouped_gemm(x, w, row_expert, index=idx)
            ts.synchronize()
            outcomes.append("NOT RAISED")
        except ts.GroupedLayoutError as e:
            outcomes.append("raised" if fault in str(e) else f"WRONG MESSAGE {e}")
    report(case, " ".join(outcomes))

# After the faults: a valid layout runs clean again (the record was cleared when raised).
ts.ops.grouped_gemm(x, w, good)
ts.synchronize()
report("valid_after", "ok")

# A dispatch's own layout: no device check (its maker guarantees it), but its expert count still must fit w.
experts = 2 * ts.world_size()
tokens = torch.randn(16, K, generator=g, device="cpu").to(torch.bfloat16).to(dev)
topk_idx = torch.randint(0, experts, (16, 2), generator=g, device="cpu").to(dev)
recv, _, _, handle = ts.ops.moe_dispatch(tokens, topk_idx, torch.ones(16, 2, device=dev), experts)
record = grouped_layout._record(torch.device(dev) if isinstance(dev, str) else dev)
checks = record.calls
w2 = w[:2].contiguous()
ts.ops.grouped_gemm(recv, w2, handle.row_expert)
ts.synchronize()
report("dispatch_layout_unchecked", "ok" if record.calls == checks else f"CHECKED {record.calls - checks}")
try:
    ts.ops.grouped_gemm(recv, w2[:1].contiguous(), handle.row_expert)
    report("dispatch_layout_fewer_experts", "NOT RAISED")
except ValueError as e:
    report("dispatch_layout_fewer_experts", "raised" if "dispatch to 2 local experts, but w holds 1" in str(e) else
           f"WRONG MESSAGE {e}")

# A dispatch's layout with an index of the caller's own: the index is checked on the device.
bad_index = torch.full_like(handle.row_expert, recv.shape[0] + 5)
outcome = "NOT RAISED"
for _ in range(2):
    try:
        ts.ops.grouped_gemm(recv, w2, handle.row_expert, index=bad_index)
        ts.synchronize()
    except ts.GroupedLayoutError as e:
        outcome = "raised" if "index out of range (first at row 0)" in str(e) else f"WRONG MESSAGE {e}"
        break
report("dispatch_layout_own_index", outcome)

# An in-place dispatch's index used with fewer rows than its receive rows: refused at the call.
recv, _, _, handle = ts.ops.moe_dispatch(tokens, topk_idx, torch.ones(16, 2, device=dev), experts, in_place=True)
try:
    ts.ops.grouped_gemm(recv[:-8], w2, handle.row_expert, index=handle.source_row)
    report("in_place_index_short_rows", "NOT RAISED")
except ValueError as e:
    report("in_place_index_short_rows", "raised" if "pass that dispatch's recv_x" in str(e) else f"WRONG {e}")

# A bad layout as the last call, nothing synchronised after it: the job cannot end as if it were fine
# (on the CPU path the call itself raises; on GPUs ts.finalize() does, after its teardown).
try:
    ts.ops.grouped_gemm(x, w, layout((1, 128), (E + 3, 128)))
    ts.finalize()
    report("last_call_bad", "NOT RAISED")
except ts.GroupedLayoutError as e:
    report("last_call_bad", "raised" if "expert id out of range (first at row 128)" in str(e) else f"WRONG {e}")
ts.finalize()
