"""Expert-parallel MoE dispatch and combine: tokens cross to their experts' ranks and back.

Experts are split evenly over ranks (expert ``e`` lives on rank ``e // experts_per_rank``).
A token routed to several experts of one rank crosses the link once (DeepEP's
deduplication): every (token, destination rank) pair is one row.

Dispatch:
1. Layout, on the device with torch (no host synchronisation): each pair's destination
   and its slot in the destination's receive buffer (one slot range per source rank, so
   senders never need the receivers' offsets).
2. ``dispatch_kernel`` (tilescale): every pair's row, expert ids and weights are put into
   the destination's receive buffers with remote copies, the per-destination counts after
   them, and a device-scope barrier publishes everything.
3. The receiver groups its received rows by local expert (torch, on the device), into a
   fixed-capacity ``(local_experts, capacity, hidden)`` tensor plus per-expert counts, so
   the output size needs no host round trip.

Combine reverses it: each received row's expert outputs are summed with their routing
weights on the expert side, ``combine_kernel`` puts the row back into the source rank's
slot, and the source sums each token's rows from its destination ranks.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

from dataclasses import dataclass

import torch

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit
from tilescale.language.scale import current_context
from tilescale.ops._common import check_input, sm_count, tl_dtype
from tilescale.symmetric import zeros

# The grouped rows of each expert are padded to a whole number of GEMM row tiles.
CAPACITY_ALIGN = 128


def capacity(tokens: int) -> int:
    """Rows per local expert in ``moe_dispatch``'s output: every token of every rank, rounded up."""
    return -(-runtime.world_size() * tokens // CAPACITY_ALIGN) * CAPACITY_ALIGN


@T.macro
def _open(low_latency):
    if not low_latency:
        T.barrier()  # every rank is done with its receive buffers from the last call


@T.macro
def _close(low_latency, arrivals, arrived):
    # The rank comes from the build context, not as an argument: a macro would bind it anew.
    if low_latency:
        # Each block tells every rank it is done; a rank waits only for what it receives.
        for d in T.serial(current_context().world):
            T.signal(arrivals[current_context().rank], 1, pe=d, op="add")
        for src in T.serial(current_context().world):
            T.wait(arrivals[src], "ge", arrived)
    else:
        T.barrier()  # everything sent has landed everywhere


@jit
def dispatch_kernel(world: int, tokens: int, hidden: int, topk: int, dtype: str, sms: int, low_latency: bool):
    """Put pair p's row of ``x`` (token ``token[p]``) into slot ``slot[p]`` of rank ``dest[p]``.

    ``low_latency``: no barriers; the receive buffers alternate between two sets from call to
    call (so the opening barrier is not needed) and per-source arrival counts end the kernel.
    """
    pairs = tokens * world

    @T.prim_func
    def main(x: T.Tensor((tokens, hidden), dtype), topk_idx: T.Tensor((tokens, topk), "int32"),
             topk_w: T.Tensor((tokens, topk), "float32"), token: T.Tensor((pairs,), "int32"),
             dest: T.Tensor((pairs,), "int32"), slot: T.Tensor((pairs,), "int32"),
             send_counts: T.Tensor((world,), "int32"),
             recv_x: T.Tensor((world, tokens, hidden), dtype), recv_idx: T.Tensor((world, tokens, topk), "int32"),
             recv_w: T.Tensor((world, tokens, topk), "float32"), recv_counts: T.Tensor((world,), "int32"),
             arrivals: T.Tensor((world,), "int32"), arrived: T.int32):
        with T.Kernel(T.min(pairs, sms), threads=128) as bx:
            with T.Scale("device") as (rank, ranks):
                _open(low_latency)
                for q in T.serial(T.ceildiv(pairs - bx, T.min(pairs, sms))):
                    p = bx + q * T.min(pairs, sms)
                    if dest[p] >= 0:
                        T.copy(x[token[p], 0:hidden], recv_x[rank, slot[p], 0:hidden], dst_pe=dest[p])
                        T.copy(topk_idx[token[p], 0:topk], recv_idx[rank, slot[p], 0:topk], dst_pe=dest[p])
                        T.copy(topk_w[token[p], 0:topk], recv_w[rank, slot[p], 0:topk], dst_pe=dest[p])
                if bx < ranks:
                    T.copy(send_counts[bx:bx + 1], recv_counts[rank:rank + 1], dst_pe=bx)
                _close(low_latency, arrivals, arrived)

    return main


@jit
def combine_kernel(world: int, tokens: int, hidden: int, dtype: str, sms: int, low_latency: bool):
    """Put row ``j`` of ``partial[s]`` into slot ``j`` of rank ``s``'s ``back[rank]``, for j < counts[s]."""
    rows = world * tokens

    @T.prim_func
    def main(partial: T.Tensor((world, tokens, hidden), dtype), counts: T.Tensor((world,), "int32"),
             back: T.Tensor((world, tokens, hidden), dtype), arrivals: T.Tensor((world,), "int32"),
             arrived: T.int32):
        with T.Kernel(T.min(rows, sms), threads=128) as bx:
            with T.Scale("device") as (rank, ranks):
                _open(low_latency)
                for q in T.serial(T.ceildiv(rows - bx, T.min(rows, sms))):
                    r = bx + q * T.min(rows, sms)
                    src = r // tokens
                    j = r % tokens
                    if j < counts[src]:
                        T.copy(partial[src, j, 0:hidden], back[rank, j, 0:hidden], dst_pe=src)
                _close(low_latency, arrivals, arrived)

    return main


@dataclass
class DispatchHandle:
    """What combine needs to send rows back and sum them: returned by :func:`moe_dispatch`."""

    tokens: int
    dest: torch.Tensor  # (tokens * world,) destination of each pair, -1 if unused
    slot: torch.Tensor  # (tokens * world,) slot at the destination
    token: torch.Tensor  # (tokens * world,) token of each pair
    recv_counts: torch.Tensor  # (world,) rows received from each rank
    recv_idx: torch.Tensor  # (world, tokens, topk) expert ids of the received rows
    recv_w: torch.Tensor  # (world, tokens, topk) routing weights of the received rows
    expert_rows: torch.Tensor  # (local_experts, capacity): flat received row of each grouped row, -1 if none
    experts_per_rank: int
    buffers: "_Buffers"  # the receive buffers this dispatch used (combine answers through the same set)
    low_latency: bool


@dataclass
class _Buffers:
    x: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    counts: torch.Tensor
    back: torch.Tensor


@dataclass
class _Exchange:
    """Receive buffers of one shape (two sets, alternated in low-latency mode) and arrival counts."""

    sets: list[_Buffers]
    dispatch_arrivals: torch.Tensor
    combine_arrivals: torch.Tensor
    low_latency_calls: int = 0
    low_latency_combines: int = 0


_exchanges: dict[tuple, _Exchange] = {}


def _exchange(tokens: int, hidden: int, topk: int, dtype: torch.dtype) -> _Exchange:
    key = (tokens, hidden, topk, dtype)
    if key not in _exchanges:
        world = runtime.world_size()
        sets = [_Buffers(
            zeros((world, tokens, hidden), dtype=dtype), zeros((world, tokens, topk), dtype=torch.int32),
            zeros((world, tokens, topk), dtype=torch.float32), zeros((world,), dtype=torch.int32),
            zeros((world, tokens, hidden), dtype=dtype),
        ) for _ in range(2)]
        _exchanges[key] = _Exchange(sets, zeros((world,), dtype=torch.int32), zeros((world,), dtype=torch.int32))
    return _exchanges[key]


def _check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    """Local checks, then one exchange so that a problem on any rank is a ValueError on every rank."""
    check_input(x, "x")
    world = runtime.world_size()
    problem = ""
    if x.dim() != 2:
        problem = f"x must be (tokens, hidden), got {tuple(x.shape)}"
    elif topk_idx.shape != topk_weights.shape or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        problem = (f"topk_idx {tuple(topk_idx.shape)} and topk_weights {tuple(topk_weights.shape)} must both be "
                   f"(tokens={x.shape[0]}, topk)")
    elif num_experts % world:
        problem = f"num_experts ({num_experts}) must be divisible by the world size {world}"
    elif topk_idx.numel() and (int(topk_idx.min()) < 0 or int(topk_idx.max()) >= num_experts):
        problem = f"expert ids must be in [0, {num_experts}); got {int(topk_idx.min())}..{int(topk_idx.max())}"
    rt = runtime.current()
    mine = [list(x.shape), list(topk_idx.shape), str(x.dtype), num_experts, problem]
    everyone = rt.group.exchange(rt.group.next_tag("moe_dispatch"), mine)
    problems = [f"rank {r}: {v[4]}" for r, v in enumerate(everyone) if v[4]]
    if problems:
        raise ValueError("moe_dispatch: " + "; ".join(problems))
    if any(v[:4] != mine[:4] for v in everyone):
        detail = "; ".join(f"rank {r}: x {v[0]} topk_idx {v[1]} {v[2]} experts={v[3]}" for r, v in enumerate(everyone))
        raise ValueError(f"moe_dispatch: ranks disagree ({detail}); pad every rank to the same token count")


def moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                 low_latency: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token to the ranks of its experts; return the tokens grouped by local expert.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_weights, num_experts=64)
        # recv_x[l, :counts[l]] are the tokens of local expert l; recv_w their routing weights

    Shapes: ``recv_x`` (local_experts, capacity, hidden), ``recv_w`` (local_experts,
    capacity), ``counts`` (local_experts,), with ``capacity(tokens)`` rows per expert (every
    token of every rank could pick it, so nothing overflows). Every rank passes the same number of
    tokens (pad with tokens weighted 0).

    ``low_latency=True`` (decode batches) drops the kernel's two device-wide barriers: the
    receive buffers alternate between two sets, and each rank waits only until every other
    rank's blocks have reported their rows sent. Every rank must pick the same mode, and a
    low-latency handle must be combined before two more low-latency dispatches reuse its set.

    Two host round trips remain per call: the expert ids are range-checked on the host (a
    bad id would make a remote copy land outside its buffer), and the ranks agree on shapes
    and on any input error through the job's store, so bad input on one rank is a
    ValueError on every rank rather than a hang.
    """
    _check_routing(x, topk_idx, topk_weights, num_experts)
    world, rank = runtime.world_size(), runtime.rank()
    tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    per_rank = num_experts // world
    ex = _exchange(tokens, hidden, topk, x.dtype)
    if low_latency:
        ex.low_latency_calls += 1
    buf = ex.sets[ex.low_latency_calls % 2]
    dev = x.device

    # Layout: pair (t, r) exists when token t has an expert on rank r; its slot at r is its
    # order among this rank's tokens going to r.
    goes = torch.zeros(tokens, world, dtype=torch.bool, device=dev)
    goes.scatter_(1, (topk_idx // per_rank).long(), True)
    slots = torch.cumsum(goes.to(torch.int32), dim=0) - 1
    send_counts = goes.sum(0).to(torch.int32)
    pairs = goes.T.reshape(-1)  # pair index = r * tokens + t
    dest = torch.where(pairs, torch.arange(world, device=dev).repeat_interleave(tokens), -1).to(torch.int32)
    slot = slots.T.reshape(-1).to(torch.int32)
    token = torch.arange(tokens, device=dev, dtype=torch.int32).repeat(world)

    sms = sm_count()
    kernel = dispatch_kernel(world, tokens, hidden, topk, tl_dtype(x), sms, low_latency)
    arrived = ex.low_latency_calls * min(world * tokens, sms)  # every block of every rank, every call
    kernel(x, topk_idx.to(torch.int32).contiguous(), topk_weights.to(torch.float32).contiguous(), token, dest, slot,
           send_counts, buf.x, buf.idx, buf.w, buf.counts, ex.dispatch_arrivals, arrived)

    # Group received rows by local expert, in (source rank, slot) order.
    received = torch.arange(tokens, device=dev)[None, :] < buf.counts[:, None].long()  # (world, tokens)
    local = buf.idx.long() - rank * per_rank  # (world, tokens, topk)
    hits = (local >= 0) & (local < per_rank) & received[:, :, None]
    onehot = torch.zeros(world * tokens, per_rank, dtype=torch.int32, device=dev)
    weight = torch.zeros(world * tokens, per_rank, dtype=torch.float32, device=dev)
    rows = torch.arange(world * tokens, device=dev)[:, None].expand(-1, topk)[hits.view(-1, topk)]
    experts = local.view(-1, topk)[hits.view(-1, topk)]
    onehot.index_put_((rows, experts), torch.ones_like(rows, dtype=torch.int32), accumulate=True)
    weight.index_put_((rows, experts), buf.w.view(-1, topk)[hits.view(-1, topk)], accumulate=True)
    position = torch.cumsum(onehot, dim=0) - 1  # (world * tokens, local experts)
    counts = onehot.sum(0)
    rows_per_expert = capacity(tokens)
    expert_rows = torch.full((per_rank, rows_per_expert), -1, dtype=torch.long, device=dev)
    taken = onehot > 0
    flat_rows = torch.arange(world * tokens, device=dev)[:, None].expand(-1, per_rank)[taken]
    flat_experts = torch.arange(per_rank, device=dev)[None, :].expand(world * tokens, -1)[taken]
    expert_rows[flat_experts, position[taken]] = flat_rows
    recv_x = torch.zeros(per_rank, rows_per_expert, hidden, dtype=x.dtype, device=dev)
    recv_w = torch.zeros(per_rank, rows_per_expert, dtype=torch.float32, device=dev)
    valid = expert_rows >= 0
    recv_x[valid] = buf.x.view(-1, hidden)[expert_rows[valid]]
    recv_w[valid] = weight[expert_rows[valid], torch.nonzero(valid)[:, 0]]
    handle = DispatchHandle(tokens, dest, slot, token, buf.counts.clone(), buf.idx, buf.w, expert_rows, per_rank,
                            buf, low_latency)
    return recv_x, recv_w, counts, handle


def moe_combine(expert_out: torch.Tensor, recv_weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, back on its source rank in the original order.

    Example::

        y = ts.ops.moe_combine(expert_out, recv_w, handle)     # (tokens, hidden)

    ``expert_out`` is (local_experts, capacity, hidden) as ``moe_dispatch`` laid it out;
    ``recv_weights`` the routing weights it returned (pass ones to sum unweighted).
    """
    check_input(expert_out, "expert_out")
    world = runtime.world_size()
    tokens = handle.tokens
    per_rank, rows_per_expert, hidden = expert_out.shape
    if per_rank != handle.experts_per_rank or rows_per_expert != capacity(tokens):
        raise ValueError(f"expert_out must be ({handle.experts_per_rank}, {capacity(tokens)}, hidden), "
                         f"got {tuple(expert_out.shape)}")
    buf = handle.buffers
    ex = _exchange(tokens, hidden, handle.recv_idx.shape[2], expert_out.dtype)
    valid = handle.expert_rows >= 0
    weighted = (expert_out.float() * recv_weights[:, :, None])[valid]
    partial = torch.zeros(world * tokens, hidden, dtype=torch.float32, device=expert_out.device)
    partial.index_add_(0, handle.expert_rows[valid], weighted)
    partial = partial.to(expert_out.dtype).view(world, tokens, hidden)
    sms = sm_count()
    if handle.low_latency:
        ex.low_latency_combines += 1
    kernel = combine_kernel(world, tokens, hidden, tl_dtype(expert_out), sms, handle.low_latency)
    arrived = ex.low_latency_combines * min(world * tokens, sms)
    kernel(partial, handle.recv_counts, buf.back, ex.combine_arrivals, arrived)
    # Token t's rows come back from each destination rank r at slot[r * tokens + t].
    out = torch.zeros(tokens, hidden, dtype=torch.float32, device=expert_out.device)
    pairs = handle.dest >= 0
    out.index_add_(0, handle.token[pairs].long(),
                   buf.back[handle.dest[pairs].long(), handle.slot[pairs].long()].float())
    return out.to(expert_out.dtype)
