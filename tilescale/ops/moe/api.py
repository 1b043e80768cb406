"""The functional MoE ops: ``moe_dispatch``, ``moe_combine``, ``moe_redispatch``, over a per-group cached Buffer."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tilescale import runtime
from tilescale.op_launch import MISSED
from tilescale.ops._common import check_input, check_same_across_ranks
from tilescale.ops.moe.buffer import Buffer, DispatchHandle, _check_routing
from tilescale.ops.moe.fp8 import Rows, is_fp8
from tilescale.ops.moe.layout import grouped_rows
from tilescale.ops.moe.routing import expert_ids
from tilescale.plans import PlanCache

# The buffer each (group, num_experts, max_tokens) dispatched through last: where a repeated
# call goes straight to its learned program (``Buffer._dispatch_direct``) before any other work.
_last_buffer = PlanCache()


def cached_buffer(group: dist.ProcessGroup | None, max_tokens: int, hidden: int, topk: int, num_experts: int,
                  dtype: torch.dtype) -> Buffer:
    """The group's buffer of these sizes, made (collectively) at its first use and kept until the
    group's release; the functional ops go through it.

    Args:
        group: The expert-parallel process group; None: the whole job.
        max_tokens: The most tokens any rank passes to one dispatch.
        hidden: Channels per row.
        topk: Experts per token.
        num_experts: Experts over the whole group.
        dtype: The dispatched rows' dtype (``torch.float8_e4m3fn``: FP8 dispatch).

    Returns:
        Buffer: The same object at every call with these arguments on this group (collective at the first).
    """
    state = runtime.group_state(group)
    return state.exchange(("moe", max_tokens, hidden, topk, num_experts, dtype),
                          lambda: Buffer(group, max_tokens, hidden, topk, num_experts, dtype))


def moe_dispatch(x: Rows, topk_idx: torch.Tensor,
                 topk_weights: torch.Tensor, num_experts: int, low_latency: bool = False, *,
                 group: dist.ProcessGroup | None = None, max_tokens: int | None = None, in_place: bool = False,
                 ) -> tuple[Rows, torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token to the ranks of its experts; return the tokens grouped by local expert.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_weights, num_experts=64)
        o = handle.offsets
        # recv_x[o[l]:o[l] + counts[l]] are the tokens of local expert l; recv_w their routing weights

    Args:
        x: this rank's (tokens, hidden) rows, or FP8 rows as DeepEP passes them: a pair
            ``(values, scales)``, (tokens, hidden) ``torch.float8_e4m3fn`` and (tokens, hidden
            // 128) float32 (``ts.ops.moe.quantize_fp8``, whose pair is views of the byte rows
            the dispatch moves: no copy; separate tensors are packed into such rows first).
            FP8 halves the bytes on the link;
            ``recv_x`` is then such a pair too (views of one byte tensor, grouped alike), which
            ``ts.ops.grouped_gemm(..., scales=)`` takes; combine stays bf16.
        topk_idx: (tokens, topk) integer expert ids (TypeError otherwise); experts are split
            evenly over the group's ranks. -1 names no expert (DeepEP's masked entry: not sent
            for, weight unused; a token of only -1 combines to zeros); other ids outside
            ``[0, num_experts)`` raise ValueError.
        topk_weights: (tokens, topk) routing weights.
        num_experts: experts over the whole group.
        low_latency: announce every row to its receiver as soon as it is out, instead of
            every few rows (decode batches, up to a few hundred tokens per rank); both modes
            give the same result. The same on every rank (checked at its first call).
        group: the expert-parallel process group (None: the whole job); the handle
            remembers it for ``moe_combine`` / ``moe_redispatch``.
        max_tokens: the most tokens any rank passes, the same on every rank; then each rank
            passes its own count up to it, 0 included, and a new count builds no kernel.
            None: every rank passes the same count (a difference raises
            ``ts.ShapeMismatchError`` on every rank), and each distinct count gets a buffer
            (collective, at its first call) and kernels of its own, kept until the group's
            release: pass ``max_tokens`` where the count changes from call to call.
        in_place: leave the received rows where they land instead of writing each once per
            local expert into grouped rows (see "In place" below); each rank chooses for itself.

    Returns:
        ``(recv_x, recv_w, counts, handle)``: ``recv_x`` (rows, hidden), ``recv_w`` (rows,),
        ``counts`` (local_experts,), with ``rows = grouped_rows(max_tokens, topk,
        local_experts)``, a bound of every routing, so no output size needs a host round trip.

    Output contract (what ``ts.ops.grouped_gemm``, ``ts.nn.ExpertParallelMoE`` and users' own
    expert GEMMs consume): expert segments start at ``handle.offsets`` and are padded to whole
    128-row tiles (``handle.row_expert`` names each row's expert, -1 for rows holding no
    token); rows past an expert's count are not written (their contents are undefined, their
    weight 0). Within a segment, rows come in (source rank, token, k) order; a token naming an
    expert twice has two rows. ``handle.source_row`` names each row's received row
    (``source * max_tokens + slot``). ``moe_combine`` takes expert outputs in this layout.

    In place: ``recv_x`` is the buffer's receive rows as the rows landed, (2 * world *
    max_tokens, hidden) (two sets, alternate calls writing alternate ones), and grouped row i
    holds row ``handle.source_row[i]`` of it (-1: no token); the rest of the layout is as
    above. A grouped GEMM reads it through that index (``ts.ops.grouped_gemm(recv_x, w,
    handle.row_expert, index=handle.source_row)``), and its outputs are grouped rows, which
    ``moe_combine`` takes. ``recv_x`` is valid until this rank's next dispatch through the
    same buffer (after it, peers may write the set again): use it, or copy it, before then.

    Buffers: the call goes through the group's ``ts.ops.moe.Buffer`` of these sizes, made at
    its first call; ``ts.ops.moe.Buffer`` sizes one up front and releases it.

    The returned tensors are the caller's: new at every call (the small layout and routing
    tensors are views of one allocation, freed when all of them are dropped), never written by
    a later call.

    No host synchronisation: the ranks compare sizes through the job's store at a buffer's
    first call, and the dispatch kernel compares every call's sizes (not the token count) on
    the device (a difference raises ``ts.ShapeMismatchError`` on every rank; see README "When
    ranks disagree"). An id outside [0, num_experts) is routed nowhere (no copy can land
    outside a buffer), and ``moe_dispatch`` raises ValueError naming the rank and the ids'
    range once its exchange has run on every rank: on the CPU path in the call that passed
    the id; on GPUs, where the host does not wait for the device, in the first dispatch or
    combine on this rank that finds the check done (usually the combine of the same step).

    CUDA graphs: a dispatch (and a combine) can be captured once its sizes have run eagerly,
    and replayed; each call's state lives on the device. Calls captured into a graph do not
    check expert ids (out-of-range ids are still routed nowhere).

    Host cost: from the third eager call of a layout on, a call goes straight to the kernels'
    launch learned at its first two (``tilescale.op_launch.Direct``) where ``x`` is a
    contiguous tensor or a pair ``quantize_fp8`` or a dispatch made, ``topk_idx`` int32 or
    int64 and ``topk_weights`` float32, both contiguous (a torch ``topk``'s outputs are);
    other tensors are converted on every call first, and take the longer path. On one H100 a
    decode batch's dispatch (one kernel) then costs ~2.3 torch kernel launches of host time
    (README "Eager host cost").
    """
    last = _last_buffer.get((group, num_experts, max_tokens))
    if last is not None:  # a layout learned there: its first call made every check but the ranks' (the kernels')
        done = last._dispatch_direct(x, topk_idx, topk_weights, low_latency, in_place)
        if done is not MISSED:
            return done
    fp8 = is_fp8(x)
    values = x[0] if fp8 else x
    tokens = _check_routing(values, topk_idx, topk_weights, fp8)
    capacity = tokens if max_tokens is None else max_tokens
    if capacity == 0:  # zero tokens on every rank: nothing to exchange
        if fp8:
            raise ValueError("moe_dispatch: FP8 rows need tokens (or max_tokens) on some rank")
        return _empty_dispatch(x, topk_idx, topk_weights, num_experts, low_latency, group)
    dtype = torch.float8_e4m3fn if fp8 else values.dtype
    buf = cached_buffer(group, capacity, values.shape[1], topk_idx.shape[1], num_experts, dtype)
    buf._check_live()
    _last_buffer.put((group, num_experts, max_tokens), buf)
    return buf._dispatch(x, values, tokens, topk_idx, topk_weights, low_latency, in_place)


def _empty_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                    low_latency: bool, group: dist.ProcessGroup | None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """``moe_dispatch``'s result for zero tokens on every rank of the group (checked, as no
    kernel runs): the documented layout with every row holding no token (in place too:
    ``recv_x`` then holds as many rows, none of which any index names)."""
    state = runtime.group_state(group)
    world, topk = state.size, topk_idx.shape[1]
    expert_ids(topk_idx, num_experts)  # the dtype check
    if num_experts % world:
        raise ValueError(f"moe_dispatch: num_experts ({num_experts}) must be divisible by the group size {world}")
    check_same_across_ranks(state, "moe_dispatch", [0, *x.shape[1:], topk, str(x.dtype), num_experts,
                                                    f"low_latency={low_latency}"], every_call=True)
    per_rank = num_experts // world
    rows = grouped_rows(0, topk, per_rank, group=group)
    i32 = dict(dtype=torch.int32, device=x.device)
    none = torch.empty(0, **i32)
    handle = DispatchHandle(tokens=0, topk_idx=torch.empty(0, topk, **i32),
                            topk_w=torch.empty(0, topk, dtype=torch.float32, device=x.device),
                            expert_slot=torch.empty(0, topk, **i32), dest=none, slot=none,
                            send_counts=torch.zeros(world, **i32), expert_send_counts=torch.zeros(num_experts, **i32),
                            recv_counts=torch.zeros(world, **i32), position=torch.empty(0, topk, **i32),
                            counts=torch.zeros(per_rank, **i32), offsets=torch.zeros(per_rank, **i32),
                            row_expert=torch.full((rows,), -1, **i32), source_row=torch.full((rows,), -1, **i32),
                            group=group)
    handle.row_expert._ts_experts = per_rank  # a layout grouped_gemm need not check on the device
    recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device)
    return recv_x, torch.zeros(rows, dtype=torch.float32, device=x.device), handle.counts, handle


def moe_redispatch(x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Send the rows of ``x`` along the routes of an earlier dispatch, grouped as it grouped them.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts)
        grad_rows = ts.ops.moe_redispatch(grad_y, handle)   # the backward of moe_combine

    Args:
        x: (tokens, any hidden), one row per token of this rank.
        handle: the dispatch's handle.

    Returns:
        (rows, hidden) in the dispatch's grouped layout, which the same routes give again
        (rows holding no token are undefined).
    """
    if handle.buffer is None:  # nothing was exchanged
        check_input(x, "x")
        if x.dim() != 2 or x.shape[0] != handle.tokens:
            raise ValueError(f"moe_redispatch: x must be (tokens={handle.tokens}, hidden), got {tuple(x.shape)}")
        return x.new_empty(handle.row_expert.shape[0], x.shape[1])
    return handle.buffer.redispatch(x, handle)


def moe_combine(expert_out: torch.Tensor, recv_weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, back on its source rank in the original order.

    Example::

        y = ts.ops.moe_combine(expert_out, recv_w, handle)     # (tokens, hidden)

    Args:
        expert_out: (rows, hidden) in ``moe_dispatch``'s grouped layout (any hidden size and
            dtype; rows holding no token are not read).
        recv_weights: the (rows,) routing weights the dispatch returned (ones to sum unweighted).
        handle: the dispatch's handle; one can be combined any number of times, and captured
            in a CUDA graph as ``moe_dispatch`` can.

    Returns:
        (tokens, hidden): this rank's tokens, each the weighted sum of its experts' outputs.
    """
    if handle.buffer is None:  # zero tokens on every rank (moe_dispatch checked): nothing to bring back
        check_input(expert_out, "expert_out")
        return expert_out.new_empty(0, expert_out.shape[1])
    return handle.buffer.combine(expert_out, recv_weights, handle)
