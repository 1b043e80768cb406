"""Rank program (2 ranks): MoE expert-id checks, zero tokens, and dispatch/combine calls whose
ranks disagree after each shape has been seen.

Markers (one line each, checked by tests/test_reliability_data.py):

``IDS case=<name> rank=<r> type=<exception> msg=<message>``   every rejected id case
``IDS-OK rank=<r>``                                          a dispatch after them still routes right (its plan reused)
``EMPTY-OK rank=<r>``                                        zero tokens on every rank: empty results
``MISMATCH case=<op> rank=<r> msg=<message>``                every rank, every disagreeing call
(the last: ranks combining different dispatches of the same shapes)
"""

from __future__ import annotations

import torch
from expect import expect_mismatch

import tilescale as ts
from tilescale.ops.moe.routing import DECODE_TOKENS
from tilescale.testing import assert_close

HIDDEN, TOPK, EXPERTS = 32, 2, 4


def routing(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w, idx = torch.rand(tokens, EXPERTS, generator=g).topk(TOPK, dim=1)
    return x, idx, w


def expect(kind: type[Exception], marker: str, case: str, call) -> None:
    try:
        call()
    except kind as err:
        print(f"{marker} case={case} rank={ts.rank()} type={type(err).__name__} msg={err}", flush=True)
    else:
        raise AssertionError(f"rank {ts.rank()}: {case}: no {kind.__name__}")


def main() -> None:
    ts.init()
    rank = ts.rank()
    assert ts.world_size() == 2

    x, idx, w = routing(8, rank)
    wide = idx.clone()
    wide[0, 0] = 2**32 + 1  # int64: a cast to int32 would make it expert 1
    expect(ValueError, "IDS", "int64-wraps", lambda: ts.ops.moe_dispatch(x, wide, w, EXPERTS))
    negative = idx.clone()
    negative[3, 1] = -(2**40)
    expect(ValueError, "IDS", "int64-negative", lambda: ts.ops.moe_dispatch(x, negative, w, EXPERTS))
    expect(ValueError, "IDS", "int32-too-large",
           lambda: ts.ops.moe_dispatch(x, torch.full_like(idx, EXPERTS, dtype=torch.int32), w, EXPERTS))
    expect(TypeError, "IDS", "float", lambda: ts.ops.moe_dispatch(x, idx.float() + 0.7, w, EXPERTS))
    # Refused at a key's first call, nothing is kept for it: the next call is refused again.
    expect(TypeError, "IDS", "float-again", lambda: ts.ops.moe_dispatch(x, idx.float() + 0.7, w, EXPERTS))
    expect(TypeError, "IDS", "bool", lambda: ts.ops.moe_dispatch(x, idx > 0, w, EXPERTS))
    # In-range ids in any integer dtype still route: every token to expert 1 and 2 (rank 0, 1).
    ids = torch.tensor([[1, 2]] * 8, dtype=torch.int16)
    recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, ids, torch.ones(8, 2), EXPERTS)
    assert counts.tolist() == ([0, 16] if rank == 0 else [16, 0]), counts
    y = ts.ops.moe_combine(recv_x, recv_w, handle)
    assert_close(y, 2 * x)
    # A second call of the key reuses its plan; ids of another dtype make a new one (read as int32 alike).
    plans = len(handle.buffer._dispatches)
    again = ts.ops.moe_dispatch(x, ids, torch.ones(8, 2), EXPERTS)[2]
    assert len(handle.buffer._dispatches) == plans and torch.equal(again, counts), (plans, again)
    again = ts.ops.moe_dispatch(x, ids.to(torch.int8), torch.ones(8, 2), EXPERTS)[2]
    assert len(handle.buffer._dispatches) == plans + 1 and torch.equal(again, counts), (plans, again)
    print(f"IDS-OK rank={rank}", flush=True)

    # Zero tokens on every rank: empty results, and combine gives (0, hidden).
    recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(torch.empty(0, HIDDEN), torch.empty(0, TOPK,
                                                         dtype=torch.long), torch.empty(0, TOPK), EXPERTS)
    assert counts.tolist() == [0, 0] and bool((handle.row_expert == -1).all()), (counts, handle.row_expert)
    assert recv_x.shape[0] == recv_w.shape[0] == handle.row_expert.shape[0]
    assert tuple(ts.ops.moe_combine(recv_x, recv_w, handle).shape) == (0, HIDDEN)
    print(f"EMPTY-OK rank={rank}", flush=True)

    # Disagreeing calls, after every shape has been seen by every rank.
    handles = {}
    for tokens in (8, 16):
        x, idx, w = routing(tokens, rank)
        handles[tokens] = ts.ops.moe_dispatch(x, idx, w, EXPERTS)
        ts.ops.moe_combine(*handles[tokens][:2], handles[tokens][3])
        ts.ops.moe_combine(handles[tokens][0][:, :16].contiguous(), *handles[tokens][1:2], handles[tokens][3])
    tokens = 8 if rank == 0 else 16
    x, idx, w = routing(tokens, rank)
    expect_mismatch("moe_dispatch", lambda: ts.ops.moe_dispatch(x, idx, w, EXPERTS))
    recv_x, recv_w, _, handle = handles[16]
    out = recv_x if rank == 0 else recv_x[:, :16].contiguous()  # hidden 32 on rank 0, 16 on rank 1
    expect_mismatch("moe_combine", lambda: ts.ops.moe_combine(out, recv_w, handle))
    # Counts on either side of a decode batch: rank 0's dispatch kernel routes its own tokens, rank
    # 1's runs after the two routing kernels; different kernels, the same agreement check.
    for tokens in (DECODE_TOKENS, DECODE_TOKENS + 1):
        x, idx, w = routing(tokens, rank)
        ts.ops.moe_dispatch(x, idx, w, EXPERTS)
    x, idx, w = routing(DECODE_TOKENS + rank, rank)
    expect_mismatch("moe_dispatch_across_decode", lambda: ts.ops.moe_dispatch(x, idx, w, EXPERTS))

    # Two dispatches of the same shapes; rank 0 combines the first, rank 1 the second: the
    # routes differ, so the sums would be wrong; the combine signs which dispatch it brings back.
    # A buffer of its own: the calls above left their buffers' counts apart (see expect_mismatch).
    buf = ts.ops.moe.Buffer(None, max_tokens=8, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS, dtype=torch.float32)
    x, idx, w = routing(8, rank)
    first, second = buf.dispatch(x, idx, w), buf.dispatch(x, idx.flip(1), w)
    recv_x, recv_w, _, handle = first if rank == 0 else second
    expect_mismatch("moe_combine_other_dispatch", lambda: buf.combine(recv_x, recv_w, handle))
    ts.finalize()


if __name__ == "__main__":
    main()
