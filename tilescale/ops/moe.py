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
   them; a device-scope barrier (or, in low-latency mode, per-source arrival counts)
   publishes everything.
3. The receiver sorts the (row, local expert) hits by expert on the device (torch) and
   ``group_rows_kernel`` copies each received row to its experts' segments: one flat
   ``(rows, hidden)`` tensor in which expert ``l`` owns rows ``offsets[l]:offsets[l] +
   counts[l]``, each segment padded to whole 128-row GEMM tiles. Its size is a bound known
   without a host round trip.

Combine reverses it in one kernel: each received row's expert outputs are summed with
their routing weights on the expert side and put back into the source rank's slot; after
the exchange each token sums its rows from its destination ranks.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

from dataclasses import dataclass

import torch

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit
from tilescale.language.scale import current_context
from tilescale.ops._common import check_input, check_same_across_ranks, sm_count, tl_dtype
from tilescale.symmetric import zeros

# Each expert's segment of the grouped rows is padded to whole GEMM row tiles.
ROW_TILE = 128
# Block-wide scans (routing, expert grouping) take flags in chunks of this many, with these threads.
SCAN_CHUNK = 4096
SCAN_THREADS = 512


def grouped_rows(tokens: int, topk: int, experts_per_rank: int) -> int:
    """Rows of ``moe_dispatch``'s grouped output: every (received row, local expert) hit of
    the worst case, plus each expert's padding to a whole row tile."""
    hits = runtime.world_size() * tokens * min(topk, experts_per_rank)
    return -(-(hits + experts_per_rank * (ROW_TILE - 1)) // ROW_TILE) * ROW_TILE


def exchange_blocks(world: int, tokens: int, sms: int) -> int:
    """Blocks of the dispatch and combine kernels: one per SM at most (so that device-wide
    barriers hold), but no fewer than the ranks (block d sends the row count to rank d)."""
    return max(min(world * tokens, sms), world)


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
    """Put pair p's row of ``x`` (token ``p % tokens``) into slot ``slot[p]`` of rank ``dest[p]``.

    ``low_latency``: no barriers; the receive buffers alternate between two sets from call to
    call (so the opening barrier is not needed) and per-source arrival counts end the kernel.
    """
    pairs = tokens * world
    blocks = exchange_blocks(world, tokens, sms)

    @T.prim_func
    def main(x: T.Tensor((tokens, hidden), dtype), topk_idx: T.Tensor((tokens, topk), "int32"),
             topk_w: T.Tensor((tokens, topk), "float32"),
             dest: T.Tensor((pairs,), "int32"), slot: T.Tensor((pairs,), "int32"),
             send_counts: T.Tensor((world,), "int32"),
             recv_x: T.Tensor((world, tokens, hidden), dtype), recv_idx: T.Tensor((world, tokens, topk), "int32"),
             recv_w: T.Tensor((world, tokens, topk), "float32"), recv_counts: T.Tensor((world,), "int32"),
             arrivals: T.Tensor((world,), "int32"), arrived: T.int32):
        with T.Kernel(blocks, threads=128) as bx:
            with T.Scale("device") as (rank, ranks):
                _open(low_latency)
                for q in T.serial(T.ceildiv(pairs - bx, blocks)):
                    p = bx + q * blocks
                    if dest[p] >= 0:
                        t = p % tokens
                        T.copy(x[t, 0:hidden], recv_x[rank, slot[p], 0:hidden], dst_pe=dest[p])
                        T.copy(topk_idx[t, 0:topk], recv_idx[rank, slot[p], 0:topk], dst_pe=dest[p])
                        T.copy(topk_w[t, 0:topk], recv_w[rank, slot[p], 0:topk], dst_pe=dest[p])
                if bx < ranks:  # there are at least as many blocks as ranks
                    T.copy(send_counts[bx:bx + 1], recv_counts[rank:rank + 1], dst_pe=bx)
                _close(low_latency, arrivals, arrived)

    return main


@jit
def route_kernel(world: int, tokens: int, topk: int, per_rank: int):
    """Block r: which tokens go to rank r (``dest``), their slots there in token order
    (``slot``), and how many (``send_counts[r]``). Pair index ``r * tokens + t``."""

    @T.prim_func
    def main(topk_idx: T.Tensor((tokens, topk), "int32"), dest: T.Tensor((world * tokens,), "int32"),
             slot: T.Tensor((world * tokens,), "int32"), send_counts: T.Tensor((world,), "int32")):
        with T.Kernel(world, threads=SCAN_THREADS) as r:
            flags = T.alloc_shared((SCAN_CHUNK,), "int32")
            prefix = T.alloc_shared((SCAN_CHUNK,), "int32")
            sent = T.alloc_local((1,), "int32")
            sent[0] = 0
            for c in T.serial(T.ceildiv(tokens, SCAN_CHUNK)):
                T.clear(flags)
                for j, k in T.Parallel(SCAN_CHUNK, topk):
                    t = T.min(c * SCAN_CHUNK + j, tokens - 1)
                    if c * SCAN_CHUNK + j < tokens and topk_idx[t, k] // per_rank == r:
                        flags[j] = 1
                T.cumsum(src=flags, dst=prefix, dim=0)
                for j in T.Parallel(SCAN_CHUNK):
                    if c * SCAN_CHUNK + j < tokens:
                        dest[r * tokens + c * SCAN_CHUNK + j] = T.if_then_else(flags[j] == 1, r, -1)
                for j in T.Parallel(SCAN_CHUNK):
                    if c * SCAN_CHUNK + j < tokens:
                        slot[r * tokens + c * SCAN_CHUNK + j] = sent[0] + prefix[j] - 1
                sent[0] = sent[0] + prefix[SCAN_CHUNK - 1]
            send_counts[r] = sent[0]

    return main




@T.macro
def _expert_hits(idx, recv_counts, flags, prefix, chunk, expert, tokens, topk, entries):
    """flags[j] = 1 where entry ``chunk * SCAN_CHUNK + j`` of the received (source, token, k)
    expert ids names local expert ``expert`` of a row that arrived; prefix: their running count."""
    for j in T.Parallel(SCAN_CHUNK):
        flags[j] = T.if_then_else(
            (chunk * SCAN_CHUNK + j < entries)
            and (idx[T.min(chunk * SCAN_CHUNK + j, entries - 1)] == expert)
            and ((chunk * SCAN_CHUNK + j) // topk % tokens
                 < recv_counts[T.min(chunk * SCAN_CHUNK + j, entries - 1) // (topk * tokens)]),
            1, 0)
    T.cumsum(src=flags, dst=prefix, dim=0)


@jit
def count_hits_kernel(world: int, tokens: int, topk: int, per_rank: int):
    """``counts[e]``: received (row, k) entries naming local expert e (one block per expert)."""
    entries = world * tokens * topk

    @T.prim_func
    def main(idx: T.Tensor((entries,), "int32"), recv_counts: T.Tensor((world,), "int32"),
             counts: T.Tensor((per_rank,), "int32")):
        with T.Kernel(per_rank, threads=SCAN_THREADS) as e:
            with T.Scale("device") as (rank, ranks):
                flags = T.alloc_shared((SCAN_CHUNK,), "int32")
                prefix = T.alloc_shared((SCAN_CHUNK,), "int32")
                total = T.alloc_local((1,), "int32")
                total[0] = 0
                for c in T.serial(T.ceildiv(entries, SCAN_CHUNK)):
                    _expert_hits(idx, recv_counts, flags, prefix, c, rank * per_rank + e, tokens, topk, entries)
                    total[0] = total[0] + prefix[SCAN_CHUNK - 1]
                counts[e] = total[0]

    return main


@jit
def place_hits_kernel(world: int, tokens: int, topk: int, per_rank: int, rows: int):
    """Give each hit of local expert e its grouped row, in (source, token, k) order: its
    ``position``, and per grouped row the routing weight, source row and expert."""
    entries = world * tokens * topk

    @T.prim_func
    def main(idx: T.Tensor((entries,), "int32"), recv_counts: T.Tensor((world,), "int32"),
             recv_w: T.Tensor((entries,), "float32"), counts: T.Tensor((per_rank,), "int32"),
             offsets: T.Tensor((per_rank,), "int32"), position: T.Tensor((entries,), "int32"),
             weight: T.Tensor((rows,), "float32"), source_row: T.Tensor((rows,), "int32"),
             row_expert: T.Tensor((rows,), "int32")):
        with T.Kernel(per_rank, threads=SCAN_THREADS) as e:
            with T.Scale("device") as (rank, ranks):
                flags = T.alloc_shared((SCAN_CHUNK,), "int32")
                prefix = T.alloc_shared((SCAN_CHUNK,), "int32")
                start = T.alloc_local((1,), "int32")
                start[0] = 0
                for f in T.serial(e):  # segments before this expert's, padded to row tiles
                    start[0] = start[0] + T.ceildiv(counts[f], ROW_TILE) * ROW_TILE
                offsets[e] = start[0]
                for c in T.serial(T.ceildiv(entries, SCAN_CHUNK)):
                    _expert_hits(idx, recv_counts, flags, prefix, c, rank * per_rank + e, tokens, topk, entries)
                    for j in T.Parallel(SCAN_CHUNK):
                        if flags[j] == 1:
                            position[c * SCAN_CHUNK + j] = start[0] + prefix[j] - 1
                    for j in T.Parallel(SCAN_CHUNK):
                        if flags[j] == 1:
                            weight[start[0] + prefix[j] - 1] = recv_w[T.min(c * SCAN_CHUNK + j, entries - 1)]
                    for j in T.Parallel(SCAN_CHUNK):
                        if flags[j] == 1:
                            source_row[start[0] + prefix[j] - 1] = (c * SCAN_CHUNK + j) // topk
                    for j in T.Parallel(SCAN_CHUNK):
                        if flags[j] == 1:
                            row_expert[start[0] + prefix[j] - 1] = e
                    start[0] = start[0] + prefix[SCAN_CHUNK - 1]

    return main


@jit
def group_rows_kernel(world: int, tokens: int, hidden: int, topk: int, rows: int, dtype: str, sms: int):
    """Copy received row r to grouped row ``position[r, k]`` for every k where it is >= 0."""
    received = world * tokens

    @T.prim_func
    def main(recv_x: T.Tensor((received, hidden), dtype), position: T.Tensor((received, topk), "int32"),
             out: T.Tensor((rows, hidden), dtype)):
        with T.Kernel(T.min(received, sms), threads=128) as bx:
            row = T.alloc_shared((1, hidden), dtype)
            last = T.alloc_local((1,), "int32")
            for q in T.serial(T.ceildiv(received - bx, T.min(received, sms))):
                r = bx + q * T.min(received, sms)
                last[0] = -1
                for k in T.serial(topk):
                    last[0] = T.max(last[0], position[r, k])
                if last[0] >= 0:  # a row with no local expert is not read
                    T.copy(recv_x[r:r + 1, 0:hidden], row)
                    for k in T.serial(topk):
                        if position[r, k] >= 0:
                            T.copy(row, out[position[r, k]:position[r, k] + 1, 0:hidden])

    return main


@jit
def combine_kernel(world: int, tokens: int, hidden: int, topk: int, rows: int, dtype: str, sms: int,
                   low_latency: bool):
    """Sum each received row's weighted expert outputs, put it back into its source's
    ``back[rank]`` slot, then (once every rank's rows are back) sum each token's rows."""
    received = world * tokens
    blocks = exchange_blocks(world, tokens, sms)

    @T.prim_func
    def main(expert_out: T.Tensor((rows, hidden), dtype), weight: T.Tensor((rows,), "float32"),
             position: T.Tensor((received, topk), "int32"), counts: T.Tensor((world,), "int32"),
             dest: T.Tensor((received,), "int32"), slot: T.Tensor((received,), "int32"),
             back: T.Tensor((world, tokens, hidden), dtype), out: T.Tensor((tokens, hidden), dtype),
             arrivals: T.Tensor((world,), "int32"), arrived: T.int32):
        with T.Kernel(blocks, threads=128) as bx:
            with T.Scale("device") as (rank, ranks):
                acc = T.alloc_fragment((1, hidden), "float32")
                part = T.alloc_fragment((1, hidden), dtype)
                row = T.alloc_shared((1, hidden), dtype)
                _open(low_latency)
                for q in T.serial(T.ceildiv(received - bx, blocks)):
                    r = bx + q * blocks
                    if r % tokens < counts[r // tokens]:
                        T.clear(acc)
                        for k in T.serial(topk):
                            if position[r, k] >= 0:
                                T.copy(expert_out[position[r, k]:position[r, k] + 1, 0:hidden], part)
                                for i, j in T.Parallel(1, hidden):
                                    acc[i, j] += T.cast(part[i, j], "float32") * weight[position[r, k]]
                        T.copy(acc, row)
                        T.copy(row, back[rank, r % tokens:r % tokens + 1, 0:hidden], dst_pe=r // tokens)
                _close(low_latency, arrivals, arrived)
                # Token t's row from destination rank d is back[d, slot[d * tokens + t]].
                for q in T.serial(T.ceildiv(tokens - bx, blocks)):
                    t = bx + q * blocks
                    T.clear(acc)
                    for d in T.serial(ranks):
                        if dest[d * tokens + t] >= 0:
                            T.copy(back[d, slot[d * tokens + t]:slot[d * tokens + t] + 1, 0:hidden], part)
                            for i, j in T.Parallel(1, hidden):
                                acc[i, j] += T.cast(part[i, j], "float32")
                    T.copy(acc, row)
                    T.copy(row, out[t:t + 1, 0:hidden])

    return main


@dataclass
class DispatchHandle:
    """What combine (and a re-dispatch along the same routes) needs: returned by :func:`moe_dispatch`."""

    tokens: int
    topk_idx: torch.Tensor  # (tokens, topk) int32 expert ids this rank dispatched
    topk_w: torch.Tensor  # (tokens, topk) float32 their routing weights
    dest: torch.Tensor  # (world * tokens,) destination rank of pair (rank r, token t) at r * tokens + t, or -1
    slot: torch.Tensor  # (world * tokens,) the pair's slot at its destination
    send_counts: torch.Tensor  # (world,) rows sent to each rank
    recv_counts: torch.Tensor  # (world,) rows received from each rank
    position: torch.Tensor  # (world * tokens, topk) grouped row of each received row's local experts, -1 if none
    counts: torch.Tensor  # (local_experts,) grouped rows holding tokens of each local expert
    offsets: torch.Tensor  # (local_experts,) first grouped row of each local expert
    row_expert: torch.Tensor  # (grouped rows,) local expert of each grouped row, -1 for rows holding no token
    source_row: torch.Tensor  # (grouped rows,) received row (source rank * tokens + slot) of each, -1 if none
    set_index: int  # which of the two receive-buffer sets the dispatch used (combine answers through it)
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
    """Shapes are checked locally and, at a shape's first call, across ranks; expert ids locally.

    An expert id out of range would make a remote copy land outside its buffer, so it is
    checked before anything is sent (one device-to-host read). The rank with the bad id
    raises; a rank whose input was fine goes on and its bounded waits report the rank that
    never arrived.
    """
    check_input(x, "x")
    world = runtime.world_size()
    if x.dim() != 2:
        raise ValueError(f"moe_dispatch: x must be (tokens, hidden), got {tuple(x.shape)}")
    if topk_idx.shape != topk_weights.shape or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"moe_dispatch: topk_idx {tuple(topk_idx.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be (tokens={x.shape[0]}, topk)")
    if num_experts % world:
        raise ValueError(f"moe_dispatch: num_experts ({num_experts}) must be divisible by the world size {world}")
    check_same_across_ranks("moe_dispatch", [*x.shape, *topk_idx.shape, str(x.dtype), num_experts])
    if topk_idx.numel():
        low, high = torch.stack([topk_idx.min(), topk_idx.max()]).tolist()
        if low < 0 or high >= num_experts:
            raise ValueError(f"moe_dispatch: rank {runtime.rank()}: expert ids must be in [0, {num_experts}); "
                             f"got {low}..{high}")


def _group_by_expert(buf: _Buffers, tokens: int, per_rank: int) -> tuple[torch.Tensor, ...]:
    """Where each received row goes among the grouped rows: two kernels, no host round trip.

    Returns ``position`` (received rows, topk), per-expert ``counts`` and ``offsets``, and
    per grouped row its ``row_expert``, ``source_row`` and routing weight.
    """
    world, topk = buf.idx.shape[0], buf.idx.shape[2]
    dev = buf.idx.device
    rows = grouped_rows(tokens, topk, per_rank)
    entries = world * tokens * topk
    counts = torch.empty(per_rank, dtype=torch.int32, device=dev)
    offsets = torch.empty(per_rank, dtype=torch.int32, device=dev)
    position = torch.full((entries,), -1, dtype=torch.int32, device=dev)
    weight = torch.zeros(rows, dtype=torch.float32, device=dev)
    source_row = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    row_expert = torch.full((rows,), -1, dtype=torch.int32, device=dev)
    idx = buf.idx.view(-1)
    count_hits_kernel(world, tokens, topk, per_rank)(idx, buf.counts, counts)
    place_hits_kernel(world, tokens, topk, per_rank, rows)(idx, buf.counts, buf.w.view(-1), counts, offsets,
                                                          position, weight, source_row, row_expert)
    return position.view(world * tokens, topk), counts, offsets, row_expert, source_row, weight


def moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                 low_latency: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """Send each token to the ranks of its experts; return the tokens grouped by local expert.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_weights, num_experts=64)
        o = handle.offsets
        # recv_x[o[l]:o[l] + counts[l]] are the tokens of local expert l; recv_w their routing weights

    Shapes: ``recv_x`` (rows, hidden), ``recv_w`` (rows,), ``counts`` (local_experts,), where
    ``rows = grouped_rows(tokens, topk, local_experts)`` bounds every routing, so no output
    size needs a host round trip. Expert segments start at ``handle.offsets`` and are padded
    to whole 128-row tiles (``handle.row_expert`` names each row's expert, -1 past the
    last); rows past an expert's count are not written (their contents are undefined).
    ``ts.ops.grouped_gemm`` consumes this layout. Every rank passes the same number of
    tokens (pad with tokens weighted 0).

    ``low_latency=True`` (decode batches) drops the kernel's two device-wide barriers: the
    receive buffers alternate between two sets, and each rank waits only until every other
    rank's blocks have reported their rows sent. Every rank must pick the same mode, and a
    low-latency handle must be combined before two more low-latency dispatches reuse its set.

    One device-to-host read remains per call: the expert ids are range-checked (a bad id
    would make a remote copy land outside its buffer). The ranks agree on shapes through
    the job's store at a shape's first call.
    """
    _check_routing(x, topk_idx, topk_weights, num_experts)
    world = runtime.world_size()
    tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    per_rank = num_experts // world
    dev = x.device

    # Layout: pair (t, r) exists when token t has an expert on rank r; its slot at r is its
    # order among this rank's tokens going to r.
    idx = topk_idx.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    dest = torch.empty(world * tokens, dtype=torch.int32, device=dev)
    slot = torch.empty(world * tokens, dtype=torch.int32, device=dev)
    send_counts = torch.empty(world, dtype=torch.int32, device=dev)
    route_kernel(world, tokens, topk, per_rank)(idx, dest, slot, send_counts)
    buf, set_index = _send(x, idx, weights, dest, slot, send_counts, low_latency)

    position, counts, offsets, row_expert, source_row, recv_w = _group_by_expert(buf, tokens, per_rank)
    recv_x = _grouped(buf, position, row_expert.shape[0])
    handle = DispatchHandle(tokens, idx, weights, dest, slot, send_counts, buf.counts.clone(), position, counts,
                            offsets, row_expert, source_row, set_index, low_latency)
    return recv_x, recv_w, counts, handle


def moe_redispatch(x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Send the rows of ``x`` along the routes of an earlier dispatch, grouped as it grouped them.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts)
        grad_rows = ts.ops.moe_redispatch(grad_y, handle)   # the backward of moe_combine

    ``x`` is (tokens, any hidden), one row per token of this rank; the result is (rows,
    hidden) in the dispatch's grouped layout (rows holding no token are undefined). Uses the
    normal (barrier) exchange whatever mode the dispatch used.
    """
    check_input(x, "x")
    if x.dim() != 2 or x.shape[0] != handle.tokens:
        raise ValueError(f"moe_redispatch: x must be (tokens={handle.tokens}, hidden), got {tuple(x.shape)}")
    check_same_across_ranks("moe_redispatch", [*x.shape, str(x.dtype)])
    buf, _ = _send(x, handle.topk_idx, handle.topk_w, handle.dest, handle.slot, handle.send_counts, False)
    return _grouped(buf, handle.position, handle.row_expert.shape[0])


def _send(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, dest: torch.Tensor, slot: torch.Tensor,
          send_counts: torch.Tensor, low_latency: bool) -> tuple[_Buffers, int]:
    """Rows, expert ids and weights of every pair into the destinations' receive buffers."""
    world = runtime.world_size()
    (tokens, hidden), topk = x.shape, idx.shape[1]
    ex = _exchange(tokens, hidden, topk, x.dtype)
    if low_latency:
        ex.low_latency_calls += 1
    set_index = ex.low_latency_calls % 2
    buf = ex.sets[set_index]
    sms = sm_count()
    kernel = dispatch_kernel(world, tokens, hidden, topk, tl_dtype(x), sms, low_latency)
    arrived = ex.low_latency_calls * exchange_blocks(world, tokens, sms)  # every block of every rank, every call
    kernel(x, idx, weights, dest, slot, send_counts, buf.x, buf.idx, buf.w, buf.counts, ex.dispatch_arrivals,
           arrived)
    return buf, set_index


def _grouped(buf: _Buffers, position: torch.Tensor, rows: int) -> torch.Tensor:
    """The received rows copied to their experts' grouped rows."""
    world, tokens, hidden = buf.x.shape
    out = torch.empty(rows, hidden, dtype=buf.x.dtype, device=buf.x.device)
    kernel = group_rows_kernel(world, tokens, hidden, position.shape[1], rows, tl_dtype(buf.x), sm_count())
    kernel(buf.x.view(world * tokens, hidden), position, out)
    return out


def moe_combine(expert_out: torch.Tensor, recv_weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, back on its source rank in the original order.

    Example::

        y = ts.ops.moe_combine(expert_out, recv_w, handle)     # (tokens, hidden)

    ``expert_out`` is (rows, hidden) in ``moe_dispatch``'s grouped layout; ``recv_weights``
    the (rows,) routing weights it returned (pass ones to sum unweighted).
    """
    check_input(expert_out, "expert_out")
    check_input(recv_weights, "recv_weights")
    world = runtime.world_size()
    tokens = handle.tokens
    rows, hidden = expert_out.shape
    if rows != handle.row_expert.shape[0] or recv_weights.shape != (rows,):
        raise ValueError(f"expert_out must be ({handle.row_expert.shape[0]}, hidden) and recv_weights "
                         f"({handle.row_expert.shape[0]},), got {tuple(expert_out.shape)} and "
                         f"{tuple(recv_weights.shape)}")
    topk = handle.position.shape[1]
    ex = _exchange(tokens, hidden, topk, expert_out.dtype)  # expert_out's hidden size and dtype may differ from x's
    if handle.low_latency:
        ex.low_latency_combines += 1
    sms = sm_count()
    kernel = combine_kernel(world, tokens, hidden, topk, rows, tl_dtype(expert_out), sms, handle.low_latency)
    arrived = ex.low_latency_combines * exchange_blocks(world, tokens, sms)
    out = torch.empty(tokens, hidden, dtype=expert_out.dtype, device=expert_out.device)
    kernel(expert_out, recv_weights.to(torch.float32).contiguous(), handle.position, handle.recv_counts,
           handle.dest, handle.slot, ex.sets[handle.set_index].back, out, ex.combine_arrivals, arrived)
    return out
