"""Expert-parallel MoE dispatch and combine: tokens cross to their experts' ranks and back.

Experts are split evenly over ranks (expert ``e`` lives on rank ``e // experts_per_rank``).
A token routed to several experts of one rank crosses the link once (DeepEP's
deduplication): every (token, destination rank) pair is one row.

Dispatch, three to five kernels and no host synchronisation:

1. ``route_kernel``, on the sender: each pair's destination and its slot in the
   destination's receive buffer (one slot range per source rank, token order, so senders
   never need the receivers' offsets); and each (token, k) entry's order among this rank's
   entries naming the same expert (``expert_slot``), with the entries sent to each expert.
   One block per destination rank and per expert, each a two-level scan over the tokens.
2. ``dispatch_kernel``: each token's row is read once and put, with its expert ids, weights
   and expert slots, into the receive buffers of every rank it goes to (destinations
   interleaved, so no rank receives from all the others at once); block d then sends rank d
   the row count and the per-expert entry counts. A device-scope barrier publishes everything.
3. ``layout_kernel``, on the receiver: from the (source, local expert) entry counts, each
   expert's count, its segment's first row (segments padded to 128-row GEMM tiles) and the
   first row of each source's entries in it: ``base[src, e]``.
4. ``place_kernel``: entry (src, row, k) of local expert e goes to grouped row
   ``base[src, e] + expert_slot``, i.e. each segment holds its entries in (source, token, k)
   order, deterministically and without a scan on the receiver.
5. ``group_rows_kernel``: each received row, read once, is written to its experts' grouped
   rows: one flat ``(rows, hidden)`` tensor in which expert ``l`` owns rows
   ``offsets[l]:offsets[l] + counts[l]``. Its size is a bound known without a host round trip.

In low-latency mode (decode batches) ``receive_kernel`` does 3-5 in one launch: one block
per received row, each recomputing the small (source, expert) prefix itself.

Combine reverses it in one kernel: each received row's expert outputs are summed with
their routing weights on the expert side and put back into the source rank's slot; after
the exchange each token sums its rows from its destination ranks.

No host state changes from call to call, so a step can be captured in a CUDA graph and
replayed. The receive buffers come in two sets, and each rank keeps a device-side count of
its sends and of its combines; a call uses the set its count's parity names, and the
kernel advances the count after its closing barrier. Consecutive exchanges through one
buffer thus alternate sets, and a rank can write a set again only after passing the
closing barrier of the call in between, which every rank reaches only after it has
finished reading that set (its readers run before that call on its stream): no opening
barrier is needed.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

from dataclasses import dataclass, field

import torch

import tilescale.language as T
from tilescale import runtime
from tilescale.jit import jit
from tilescale.language.scale import current_context
from tilescale.ops._common import check_input, check_same_across_ranks, sm_count, tl_dtype
from tilescale.symmetric import zeros

# Each expert's segment of the grouped rows is padded to whole GEMM row tiles.
ROW_TILE = 128
# Routing scans take tokens in chunks of (up to) SCAN_ROWS x SCAN_COLS: each row scanned by a
# warp, then the row totals (a two-level scan: TileLang's scan gives a whole line to one warp).
SCAN_ROWS = 32
SCAN_COLS = 128
SCAN_THREADS = 512
# Received rows per block of the placement kernel; grouped rows per step of the fills.
PLACE_ROWS = 64
FILL = 1024


def grouped_rows(tokens: int, topk: int, experts_per_rank: int) -> int:
    """Rows of ``moe_dispatch``'s grouped output: every (received row, local expert) hit of
    the worst case, plus each expert's padding to a whole row tile."""
    hits = runtime.world_size() * tokens * min(topk, experts_per_rank)
    return -(-(hits + experts_per_rank * (ROW_TILE - 1)) // ROW_TILE) * ROW_TILE


def exchange_blocks(world: int, tokens: int, sms: int) -> int:
    """Blocks of the combine kernel: one per SM at most (so that device-wide barriers hold),
    but no fewer than the ranks."""
    return max(min(world * tokens, sms), world)


def send_blocks(world: int, tokens: int, sms: int) -> int:
    """Blocks of the dispatch kernel (one token each at a time): one per SM at most, but no
    fewer than the ranks (block d sends the counts to rank d)."""
    return max(min(tokens, sms), world)


def _entries(idx, t, topk, lo, hi):
    """Entries k of token t whose expert id is in [lo, hi) (unrolled over k)."""
    n = 0
    for k in range(topk):
        n = n + T.if_then_else(T.And(lo <= idx[t, k], idx[t, k] < hi), 1, 0)
    return n


def _token_hits(idx, t, b, world, num_experts, topk):
    """What block b of the routing kernel counts for token t: whether it goes to rank b
    (b < world), its entries naming expert b - world, or (last block) its ids out of range."""
    per_rank = num_experts // world
    return T.if_then_else(
        b < world, T.min(_entries(idx, t, topk, b * per_rank, b * per_rank + per_rank), 1),
        T.if_then_else(b < world + num_experts, _entries(idx, t, topk, b - world, b - world + 1),
                       topk - _entries(idx, t, topk, 0, num_experts)))


def _earlier(idx, t, k, expert, topk):
    """Entries before k of token t naming ``expert`` (several only for repeated ids)."""
    n = 0
    for kk in range(topk - 1):
        n = n + T.if_then_else(T.And(kk < k, idx[t, kk] == expert), 1, 0)
    return n


@jit
def route_kernel(world: int, tokens: int, topk: int, num_experts: int):
    """Block r < world: which tokens go to rank r (``dest``), their slots there in token
    order (``slot``), how many (``send_counts[r]``); pair index ``r * tokens + t``.
    Block world + e: the order of each (token, k) entry naming expert e among this rank's
    entries naming it, in (token, k) order (``expert_slot``), and how many
    (``expert_counts[e]``). The last block counts the ids outside [0, num_experts) into
    ``bad[0]``: those are routed nowhere."""
    scan_rows = min(SCAN_ROWS, -(-tokens // SCAN_COLS))  # fewer for few tokens
    chunk = scan_rows * SCAN_COLS

    @T.prim_func
    def main(topk_idx: T.Tensor((tokens, topk), "int32"), dest: T.Tensor((world * tokens,), "int32"),
             slot: T.Tensor((world * tokens,), "int32"), send_counts: T.Tensor((world,), "int32"),
             expert_slot: T.Tensor((tokens, topk), "int32"), expert_counts: T.Tensor((num_experts,), "int32"),
             bad: T.Tensor((1,), "int32")):
        with T.Kernel(world + num_experts + 1, threads=SCAN_THREADS) as b:
            hits = T.alloc_shared((scan_rows, SCAN_COLS), "int32")  # per token: 0/1 (rank), entries (expert)
            prefix = T.alloc_shared((scan_rows, SCAN_COLS), "int32")  # inclusive, along each row
            row_end = T.alloc_shared((scan_rows,), "int32")  # inclusive prefix of the row totals
            done = T.alloc_local((1,), "int32")  # counted in earlier chunks
            done[0] = 0
            for c in T.serial(T.ceildiv(tokens, chunk)):
                for i, j in T.Parallel(scan_rows, SCAN_COLS):
                    u = c * chunk + i * SCAN_COLS + j
                    hits[i, j] = T.if_then_else(
                        u < tokens, _token_hits(topk_idx, T.min(u, tokens - 1), b, world, num_experts, topk), 0)
                T.cumsum(src=hits, dst=prefix, dim=1)
                for i in T.Parallel(scan_rows):
                    row_end[i] = prefix[i, SCAN_COLS - 1]
                T.cumsum(src=row_end, dim=0)
                # Exclusive prefix of token (i, j): done + row_end[i] - prefix[i, -1] + prefix[i, j] - hits[i, j].
                if b < world:
                    for i, j in T.Parallel(scan_rows, SCAN_COLS):
                        u = c * chunk + i * SCAN_COLS + j
                        if u < tokens:
                            dest[b * tokens + u] = T.if_then_else(hits[i, j] > 0, b, -1)
                        if u < tokens:
                            slot[b * tokens + u] = T.if_then_else(
                                hits[i, j] > 0, done[0] + row_end[i] - prefix[i, SCAN_COLS - 1] + prefix[i, j] - 1, -1)
                elif b < world + num_experts:
                    for i, j, k in T.Parallel(scan_rows, SCAN_COLS, topk):
                        u = c * chunk + i * SCAN_COLS + j
                        t = T.min(u, tokens - 1)
                        if u < tokens and topk_idx[t, k] == b - world:
                            expert_slot[t, k] = (done[0] + row_end[i] - prefix[i, SCAN_COLS - 1] + prefix[i, j]
                                                 - hits[i, j] + T.if_then_else(
                                                     hits[i, j] > 1, _earlier(topk_idx, t, k, b - world, topk), 0))
                done[0] = done[0] + row_end[scan_rows - 1]
            if b < world:
                send_counts[b] = done[0]
            elif b < world + num_experts:
                expert_counts[b - world] = done[0]
            else:
                bad[0] = done[0]

    return main


@jit
def dispatch_kernel(world: int, tokens: int, hidden: int, topk: int, per_rank: int, dtype: str, sms: int):
    """Put token t's row of ``x``, expert ids, weights and expert slots into slot
    ``slot[d * tokens + t]`` of every rank d where that is >= 0; block d also
    sends rank d the row count and this rank's entry count of each of d's experts.

    The receive buffers have two sets: this call uses set ``sends[0] % 2`` and advances
    ``sends[0]`` once every rank's puts have landed (see the module notes).
    """
    blocks = send_blocks(world, tokens, sms)

    @T.prim_func
    def main(x: T.Tensor((tokens, hidden), dtype), topk_idx: T.Tensor((tokens, topk), "int32"),
             topk_w: T.Tensor((tokens, topk), "float32"), expert_slot: T.Tensor((tokens, topk), "int32"),
             slot: T.Tensor((world * tokens,), "int32"), send_counts: T.Tensor((world,), "int32"),
             expert_counts: T.Tensor((world * per_rank,), "int32"),
             recv_x: T.Tensor((2, world, tokens, hidden), dtype), recv_idx: T.Tensor((2, world, tokens, topk), "int32"),
             recv_w: T.Tensor((2, world, tokens, topk), "float32"),
             recv_slot: T.Tensor((2, world, tokens, topk), "int32"), recv_counts: T.Tensor((2, world), "int32"),
             recv_expert_counts: T.Tensor((2, world, per_rank), "int32"), sends: T.Tensor((1,), "int32")):
        with T.Kernel(blocks, threads=128) as bx:
            with T.Scale("device") as (rank, ranks):
                row = T.alloc_shared((hidden,), dtype)
                at = T.alloc_local((world,), "int32")  # the token's slot at each destination, -1 for none
                call = T.alloc_local((1,), "int32")
                call[0] = sends[0]  # read by every block before the barrier, advanced after it
                s = call[0] % 2
                for q in T.serial(T.ceildiv(tokens - bx, blocks)):
                    t = bx + q * blocks
                    # Destinations rotate with the token: the tokens in flight go to every rank at once.
                    for i in T.unroll(ranks):
                        at[i] = slot[(rank + t + i) % ranks * tokens + t]
                    T.copy(x[t, 0:hidden], row)  # read once, put to every destination
                    for i in T.unroll(ranks):
                        if at[i] >= 0:
                            T.copy(row, recv_x[s, rank, at[i], 0:hidden], dst_pe=(rank + t + i) % ranks)
                            T.copy(topk_idx[t, 0:topk], recv_idx[s, rank, at[i], 0:topk],
                                   dst_pe=(rank + t + i) % ranks)
                            T.copy(topk_w[t, 0:topk], recv_w[s, rank, at[i], 0:topk], dst_pe=(rank + t + i) % ranks)
                            T.copy(expert_slot[t, 0:topk], recv_slot[s, rank, at[i], 0:topk],
                                   dst_pe=(rank + t + i) % ranks)
                if bx < ranks:  # there are at least as many blocks as ranks
                    T.copy(send_counts[bx:bx + 1], recv_counts[s, rank:rank + 1], dst_pe=bx)
                    T.copy(expert_counts[bx * per_rank:bx * per_rank + per_rank],
                           recv_expert_counts[s, rank, 0:per_rank], dst_pe=bx)
                T.barrier()  # everything sent has landed everywhere
                if bx == 0:
                    sends[0] = call[0] + 1  # every thread stores the same value

    return main


def _last_set(sends):
    """The receive-buffer set of this rank's latest send (its count is advanced past it)."""
    return (sends[0] + 1) % 2


@jit
def layout_kernel(world: int, per_rank: int, rows: int, sms: int):
    """Block 0: ``counts[e]`` (entries of local expert e from every source), ``offsets[e]``
    (its segment's first grouped row, segments padded to row tiles), ``base[src, e]``
    (the first grouped row of source src's entries of e) and the rows received from each
    source. Every block: the per-row outputs reset (weight 0, source row and expert -1)
    before the placement writes the rows in use."""
    blocks = max(min(sms, -(-rows // FILL)), 1)

    @T.prim_func
    def main(recv_expert_counts: T.Tensor((2, world, per_rank), "int32"), recv_counts: T.Tensor((2, world), "int32"),
             sends: T.Tensor((1,), "int32"), counts: T.Tensor((per_rank,), "int32"),
             offsets: T.Tensor((per_rank,), "int32"), base: T.Tensor((world, per_rank), "int32"),
             received_counts: T.Tensor((world,), "int32"), weight: T.Tensor((rows,), "float32"),
             source_row: T.Tensor((rows,), "int32"), row_expert: T.Tensor((rows,), "int32")):
        with T.Kernel(blocks, threads=256) as bx:
            upto = T.alloc_shared((world, per_rank), "int32")  # inclusive prefix over sources
            end = T.alloc_shared((per_rank,), "int32")  # inclusive prefix of the padded segments
            for q in T.serial(T.ceildiv(rows, FILL * blocks)):
                for i in T.Parallel(FILL):
                    _reset_row((q * blocks + bx) * FILL + i, (q * blocks + bx) * FILL + i < rows, weight, source_row,
                               row_expert)
            if bx == 0:
                _segments(recv_expert_counts, _last_set(sends), upto, end, world, per_rank)
                _write_layout(upto, end, recv_counts, _last_set(sends), counts, offsets, received_counts, world,
                              per_rank)
                for src, e in T.Parallel(world, per_rank):
                    base[src, e] = _base(recv_expert_counts, _last_set(sends), upto, end, src, e, world)

    return main


@T.macro
def _segments(recv_expert_counts, s, upto, end, world, per_rank):
    """``upto``: the (source, expert) entry counts of set ``s``, summed over sources;
    ``end``: the inclusive prefix of the experts' padded segments."""
    T.copy(recv_expert_counts[s, 0:world, 0:per_rank], upto)
    T.cumsum(src=upto, dim=0)
    for e in T.Parallel(per_rank):
        end[e] = _padded(upto, e, world)
    T.cumsum(src=end, dim=0)


@T.macro
def _write_layout(upto, end, recv_counts, s, counts, offsets, received_counts, world, per_rank):
    """Per local expert its entry count and its segment's first row; the rows received from
    each source (set ``s``)."""
    for e in T.Parallel(per_rank):
        counts[e] = upto[world - 1, e]
    for e in T.Parallel(per_rank):
        offsets[e] = end[e] - _padded(upto, e, world)
    for src in T.Parallel(world):
        received_counts[src] = recv_counts[s, src]


@T.macro
def _reset_row(p, holds_none, weight, source_row, row_expert):
    """Grouped row ``p`` marked as holding no entry (weight 0, source row and expert -1) where
    ``holds_none``; called inside a parallel loop."""
    if holds_none:
        weight[p] = 0.0
    if holds_none:
        source_row[p] = -1
    if holds_none:
        row_expert[p] = -1


@T.macro
def _record_entries(pos, first, n, topk, received, s, recv_idx, recv_w, per_rank, position, weight, source_row,
                    row_expert):
    """Received rows ``first .. first + n`` (set ``s``): each entry's grouped row ``pos[i, k]``
    into ``position``, and per grouped row in use its weight, source row and local expert.
    The rank comes from the build context, not as an argument: a macro would bind it anew."""
    for i, k in T.Parallel(n, topk):
        if first + i < received:
            position[first + i, k] = pos[i, k]
    for i, k in T.Parallel(n, topk):
        if pos[i, k] >= 0:
            weight[pos[i, k]] = recv_w[s, T.min(first + i, received - 1), k]
    for i, k in T.Parallel(n, topk):
        if pos[i, k] >= 0:
            source_row[pos[i, k]] = first + i
    for i, k in T.Parallel(n, topk):
        if pos[i, k] >= 0:
            row_expert[pos[i, k]] = recv_idx[s, T.min(first + i, received - 1), k] - current_context().rank * per_rank


def _padded(upto, e, world):
    """Rows of expert e's segment: its entries rounded up to whole row tiles."""
    return T.ceildiv(upto[world - 1, e], ROW_TILE) * ROW_TILE


def _base(recv_expert_counts, s, upto, end, src, e, world):
    """First grouped row of source src's entries of expert e."""
    return end[e] - _padded(upto, e, world) + upto[src, e] - recv_expert_counts[s, src, e]


@jit
def place_kernel(world: int, tokens: int, topk: int, per_rank: int, rows: int):
    """Entry (received row r, k) of local expert e goes to grouped row ``base[src, e] +
    recv_slot[r, k]`` (src = r // tokens): its ``position``, and per grouped row the routing
    weight, source row and expert. Entries of no local expert, and rows past the count
    received from their source, get position -1."""
    received = world * tokens

    @T.prim_func
    def main(recv_idx: T.Tensor((2, received, topk), "int32"), recv_slot: T.Tensor((2, received, topk), "int32"),
             recv_w: T.Tensor((2, received, topk), "float32"), received_counts: T.Tensor((world,), "int32"),
             sends: T.Tensor((1,), "int32"), base: T.Tensor((world, per_rank), "int32"),
             position: T.Tensor((received, topk), "int32"), weight: T.Tensor((rows,), "float32"),
             source_row: T.Tensor((rows,), "int32"), row_expert: T.Tensor((rows,), "int32")):
        with T.Kernel(T.ceildiv(received, PLACE_ROWS), threads=128) as bx:
            with T.Scale("device") as (rank, ranks):
                pos = T.alloc_shared((PLACE_ROWS, topk), "int32")
                for i, k in T.Parallel(PLACE_ROWS, topk):
                    r = T.min(bx * PLACE_ROWS + i, received - 1)
                    e = recv_idx[_last_set(sends), r, k] - rank * per_rank
                    pos[i, k] = T.if_then_else(
                        bx * PLACE_ROWS + i < received and r % tokens < received_counts[r // tokens]
                        and e >= 0 and e < per_rank,
                        base[r // tokens, T.max(T.min(e, per_rank - 1), 0)] + recv_slot[_last_set(sends), r, k], -1)
                _record_entries(pos, bx * PLACE_ROWS, PLACE_ROWS, topk, received, _last_set(sends), recv_idx, recv_w,
                                per_rank, position, weight, source_row, row_expert)

    return main


@T.macro
def _copy_row(recv_x, s, r, targets, i, out, topk, hidden, row, last):
    """Received row r of set s, read once, to grouped row ``targets[i, k]`` for every k where
    that is >= 0 (a row with no local expert, or not received, is not read)."""
    last[0] = -1
    for k in T.serial(topk):
        last[0] = T.max(last[0], targets[i, k])
    if last[0] >= 0:
        T.copy(recv_x[s, r:r + 1, 0:hidden], row)
        for k in T.serial(topk):
            if targets[i, k] >= 0:
                T.copy(row, out[targets[i, k]:targets[i, k] + 1, 0:hidden])


@jit
def group_rows_kernel(world: int, tokens: int, hidden: int, topk: int, rows: int, dtype: str):
    """Block r: copy received row r to grouped row ``position[r, k]`` for every k where it
    is >= 0 (the row is read once, into registers)."""
    received = world * tokens

    @T.prim_func
    def main(recv_x: T.Tensor((2, received, hidden), dtype), sends: T.Tensor((1,), "int32"),
             position: T.Tensor((received, topk), "int32"), out: T.Tensor((rows, hidden), dtype)):
        with T.Kernel(received, threads=128) as r:
            row = T.alloc_fragment((1, hidden), dtype)
            last = T.alloc_local((1,), "int32")
            _copy_row(recv_x, _last_set(sends), r, position, r, out, topk, hidden, row, last)

    return main


def _padding_row(upto, end, e, i, world):
    """Row i of expert e's segment past its entries, or -1 past the segment's end."""
    return T.if_then_else(upto[world - 1, e] + i < _padded(upto, e, world),
                          end[e] - _padded(upto, e, world) + upto[world - 1, e] + i, -1)


@jit
def receive_kernel(world: int, tokens: int, hidden: int, topk: int, per_rank: int, rows: int, dtype: str):
    """Low-latency mode's receiver, layout + placement + grouping in one launch: block r
    recomputes the (source, expert) prefix (a few hundred entries), places received row r's
    entries and copies the row to them; it also resets the rows of the experts ``r, r +
    received, ...`` that hold no entry, and its share of the rows past the last segment."""
    received = world * tokens

    @T.prim_func
    def main(recv_x: T.Tensor((2, received, hidden), dtype), recv_idx: T.Tensor((2, received, topk), "int32"),
             recv_slot: T.Tensor((2, received, topk), "int32"), recv_w: T.Tensor((2, received, topk), "float32"),
             recv_counts: T.Tensor((2, world), "int32"), recv_expert_counts: T.Tensor((2, world, per_rank), "int32"),
             sends: T.Tensor((1,), "int32"), counts: T.Tensor((per_rank,), "int32"),
             offsets: T.Tensor((per_rank,), "int32"), received_counts: T.Tensor((world,), "int32"),
             position: T.Tensor((received, topk), "int32"), weight: T.Tensor((rows,), "float32"),
             source_row: T.Tensor((rows,), "int32"), row_expert: T.Tensor((rows,), "int32"),
             out: T.Tensor((rows, hidden), dtype)):
        with T.Kernel(received, threads=128) as r:
            with T.Scale("device") as (rank, ranks):
                upto = T.alloc_shared((world, per_rank), "int32")
                end = T.alloc_shared((per_rank,), "int32")
                pos = T.alloc_shared((1, topk), "int32")
                row = T.alloc_fragment((1, hidden), dtype)
                last = T.alloc_local((1,), "int32")
                s = _last_set(sends)
                _segments(recv_expert_counts, s, upto, end, world, per_rank)
                for i, k in T.Parallel(1, topk):
                    e = recv_idx[s, r, k] - rank * per_rank
                    pos[i, k] = T.if_then_else(
                        r % tokens < recv_counts[s, r // tokens] and e >= 0 and e < per_rank,
                        _base(recv_expert_counts, s, upto, end, r // tokens, T.max(T.min(e, per_rank - 1), 0), world)
                        + recv_slot[s, r, k], -1)
                _record_entries(pos, r, 1, topk, received, s, recv_idx, recv_w, per_rank, position, weight, source_row,
                                row_expert)
                _copy_row(recv_x, s, r, pos, 0, out, topk, hidden, row, last)
                for q in T.serial(T.ceildiv(per_rank - r, received)):  # expert r + q * received's padding
                    for i in T.Parallel(ROW_TILE):
                        _reset_row(_padding_row(upto, end, r + q * received, i, world),
                                   _padding_row(upto, end, r + q * received, i, world) >= 0, weight, source_row,
                                   row_expert)
                for q in T.serial(T.ceildiv(rows, FILL * received)):  # rows past the last segment
                    for i in T.Parallel(FILL):
                        _reset_row((q * received + r) * FILL + i,
                                   (q * received + r) * FILL + i >= end[per_rank - 1]
                                   and (q * received + r) * FILL + i < rows, weight, source_row, row_expert)
                if r == 0:
                    _write_layout(upto, end, recv_counts, s, counts, offsets, received_counts, world, per_rank)

    return main


@jit
def combine_kernel(world: int, tokens: int, hidden: int, topk: int, rows: int, dtype: str, sms: int):
    """Sum each received row's weighted expert outputs, put it back into its source's
    ``back[set, rank]`` slot, then (once every rank's rows are back) sum each token's rows.
    Set ``combines[0] % 2``, advanced after the barrier, as the dispatch does with its sets."""
    received = world * tokens
    blocks = exchange_blocks(world, tokens, sms)

    @T.prim_func
    def main(expert_out: T.Tensor((rows, hidden), dtype), weight: T.Tensor((rows,), "float32"),
             position: T.Tensor((received, topk), "int32"), counts: T.Tensor((world,), "int32"),
             dest: T.Tensor((received,), "int32"), slot: T.Tensor((received,), "int32"),
             back: T.Tensor((2, world, tokens, hidden), dtype), out: T.Tensor((tokens, hidden), dtype),
             combines: T.Tensor((1,), "int32")):
        with T.Kernel(blocks, threads=128) as bx:
            with T.Scale("device") as (rank, ranks):
                acc = T.alloc_fragment((1, hidden), "float32")
                part = T.alloc_fragment((1, hidden), dtype)
                row = T.alloc_shared((1, hidden), dtype)
                call = T.alloc_local((1,), "int32")
                call[0] = combines[0]
                s = call[0] % 2
                for q in T.serial(T.ceildiv(received - bx, blocks)):
                    # Sources interleaved (row j of source src at step j * ranks + src): the rows
                    # in flight go back to every rank at once, not to one rank from all.
                    src = (bx + q * blocks) % ranks
                    j = (bx + q * blocks) // ranks
                    if j < counts[src]:
                        T.clear(acc)
                        for k in T.serial(topk):
                            if position[src * tokens + j, k] >= 0:
                                T.copy(expert_out[position[src * tokens + j, k]:position[src * tokens + j, k] + 1,
                                                  0:hidden], part)
                                for i, c in T.Parallel(1, hidden):
                                    acc[i, c] += T.cast(part[i, c], "float32") * weight[position[src * tokens + j, k]]
                        T.copy(acc, row)
                        T.copy(row, back[s, rank, j:j + 1, 0:hidden], dst_pe=src)
                T.barrier()  # every rank's rows are back
                if bx == 0:
                    combines[0] = call[0] + 1  # every thread stores the same value
                # Token t's row from destination rank d is back[s, d, slot[d * tokens + t]].
                for q in T.serial(T.ceildiv(tokens - bx, blocks)):
                    t = bx + q * blocks
                    T.clear(acc)
                    for d in T.serial(ranks):
                        if dest[d * tokens + t] >= 0:
                            T.copy(back[s, d, slot[d * tokens + t]:slot[d * tokens + t] + 1, 0:hidden], part)
                            for i, c in T.Parallel(1, hidden):
                                acc[i, c] += T.cast(part[i, c], "float32")
                    T.copy(acc, row)
                    T.copy(row, out[t:t + 1, 0:hidden])

    return main


@dataclass
class DispatchHandle:
    """What combine (and a re-dispatch along the same routes) needs: returned by :func:`moe_dispatch`."""

    tokens: int
    topk_idx: torch.Tensor  # (tokens, topk) int32 expert ids this rank dispatched
    topk_w: torch.Tensor  # (tokens, topk) float32 their routing weights
    expert_slot: torch.Tensor  # (tokens, topk) order of entry (t, k) among this rank's entries of its expert
    dest: torch.Tensor  # (world * tokens,) destination rank of pair (rank r, token t) at r * tokens + t, or -1
    slot: torch.Tensor  # (world * tokens,) the pair's slot at its destination (-1 where no pair)
    send_counts: torch.Tensor  # (world,) rows sent to each rank
    expert_send_counts: torch.Tensor  # (num_experts,) entries sent to each expert
    recv_counts: torch.Tensor  # (world,) rows received from each rank
    position: torch.Tensor  # (world * tokens, topk) grouped row of each received row's local experts, -1 if none
    counts: torch.Tensor  # (local_experts,) grouped rows holding tokens of each local expert
    offsets: torch.Tensor  # (local_experts,) first grouped row of each local expert
    row_expert: torch.Tensor  # (grouped rows,) local expert of each grouped row, -1 for rows holding no token
    source_row: torch.Tensor  # (grouped rows,) received row (source rank * tokens + slot) of each, -1 if none


@dataclass
class _Exchange:
    """Receive buffers of one (tokens, hidden, topk, dtype), two sets of each (the leading
    dimension), and this rank's device-side counts of the sends and combines through them,
    which pick the set (see the module notes)."""

    x: torch.Tensor  # (2, world, tokens, hidden)
    idx: torch.Tensor  # (2, world, tokens, topk) int32
    w: torch.Tensor  # (2, world, tokens, topk) float32
    expert_slot: torch.Tensor  # (2, world, tokens, topk) int32
    counts: torch.Tensor  # (2, world) int32 rows from each source
    back: torch.Tensor  # (2, world, tokens, hidden) combine's rows coming back
    sends: torch.Tensor  # (1,) int32, this rank only
    combines: torch.Tensor  # (1,) int32, this rank only
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)  # (2, world, per_rank), by per_rank

    def expert_counts_for(self, per_rank: int) -> torch.Tensor:
        """The (source, local expert) entry counts' buffer (allocated at first use: every
        rank dispatches with the same number of experts)."""
        if per_rank not in self.expert_counts:
            runtime.check_not_capturing(f"moe_dispatch with {per_rank} experts per rank")
            self.expert_counts[per_rank] = zeros((2, runtime.world_size(), per_rank), dtype=torch.int32)
        return self.expert_counts[per_rank]

    def received(self, name: str) -> torch.Tensor:
        """Buffer ``name`` with each set's (source, slot) rows as one dimension."""
        t = getattr(self, name)
        return t.view(2, t.shape[1] * t.shape[2], *t.shape[3:])


_exchanges: dict[tuple, _Exchange] = {}


def _exchange(tokens: int, hidden: int, topk: int, dtype: torch.dtype) -> _Exchange:
    key = (tokens, hidden, topk, dtype)
    if key not in _exchanges:
        runtime.check_not_capturing(f"MoE exchange of {tokens} tokens x {hidden} ({dtype}), top-{topk}")
        world = runtime.world_size()
        rows, meta = (2, world, tokens, hidden), (2, world, tokens, topk)
        _exchanges[key] = _Exchange(
            zeros(rows, dtype=dtype), zeros(meta, dtype=torch.int32), zeros(meta, dtype=torch.float32),
            zeros(meta, dtype=torch.int32), zeros((2, world), dtype=torch.int32), zeros(rows, dtype=dtype),
            torch.zeros(1, dtype=torch.int32, device=runtime.device()),
            torch.zeros(1, dtype=torch.int32, device=runtime.device()))
    return _exchanges[key]


def _capturing(t: torch.Tensor) -> bool:
    """Whether work on ``t``'s device is being captured into a CUDA graph (nothing runs now)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@dataclass
class _IdCheck:
    """The routing kernel's count of out-of-range expert ids for one call, read when ready."""

    bad: torch.Tensor  # (1,) int32 in host memory (pinned, filled by an asynchronous copy, on GPUs)
    ready: torch.cuda.Event | None  # recorded after that copy; None on the CPU path
    idx: torch.Tensor  # the call's expert ids, for the message
    num_experts: int


_id_checks: list[_IdCheck] = []
# Pinned buffers and events of finished checks, for the next calls: allocating them anew
# cost a low-latency dispatch + combine 4% of its host time (252 -> 242 us, one H200).
_spare: list[tuple[torch.Tensor, torch.cuda.Event]] = []


def _watch_ids(bad: torch.Tensor, idx: torch.Tensor, num_experts: int) -> None:
    """Queue the device's id check of this call, without waiting for it."""
    if bad.is_cuda:
        if _spare:
            host, ready = _spare.pop()
        else:  # a CPU tensor whatever the default device
            host, ready = torch.empty(1, dtype=torch.int32, device="cpu", pin_memory=True), torch.cuda.Event()
        host.copy_(bad, non_blocking=True)
        ready.record()
        _id_checks.append(_IdCheck(host, ready, idx, num_experts))
    else:
        _id_checks.append(_IdCheck(bad, None, idx, num_experts))


def _raise_bad_ids() -> None:
    """Raise for the first finished id check that found ids out of range (finished checks are dropped)."""
    while _id_checks and (_id_checks[0].ready is None or _id_checks[0].ready.query()):
        check = _id_checks.pop(0)
        found = int(check.bad[0])
        if check.ready is not None:
            _spare.append((check.bad, check.ready))
        if found:
            low, high = int(check.idx.min()), int(check.idx.max())
            raise ValueError(f"moe_dispatch: rank {runtime.rank()}: expert ids must be in [0, {check.num_experts}); "
                             f"got {low}..{high} ({found} out of range, not sent)")


def _check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int) -> None:
    """Shapes are checked locally and, at a shape's first call, across ranks.

    Expert ids are checked on the device, without a host round trip: see :func:`moe_dispatch`.
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


def _receive(ex: _Exchange, tokens: int, topk: int, per_rank: int, low_latency: bool) -> tuple[torch.Tensor, ...]:
    """The rows of the latest send grouped by local expert, with their layout; no host round trip.

    Returns ``recv_x`` (rows, hidden), per grouped row its routing weight, ``row_expert`` and
    ``source_row``; per local expert ``counts`` and ``offsets``; per received row its
    ``position`` (received rows, topk); and the rows received from each source.
    """
    world, hidden = runtime.world_size(), ex.x.shape[3]
    dev = ex.x.device
    rows = grouped_rows(tokens, topk, per_rank)
    received = world * tokens
    i32 = dict(dtype=torch.int32, device=dev)
    counts, offsets = torch.empty(per_rank, **i32), torch.empty(per_rank, **i32)
    received_counts, position = torch.empty(world, **i32), torch.empty(received, topk, **i32)
    weight = torch.empty(rows, dtype=torch.float32, device=dev)
    source_row, row_expert = torch.empty(rows, **i32), torch.empty(rows, **i32)
    if low_latency:
        recv_x = torch.empty(rows, hidden, dtype=ex.x.dtype, device=dev)
        receive_kernel(world, tokens, hidden, topk, per_rank, rows, tl_dtype(recv_x))(
            ex.received("x"), ex.received("idx"), ex.received("expert_slot"), ex.received("w"), ex.counts,
            ex.expert_counts_for(per_rank), ex.sends, counts, offsets, received_counts, position, weight, source_row,
            row_expert, recv_x)
    else:
        base = torch.empty(world, per_rank, **i32)
        layout_kernel(world, per_rank, rows, sm_count())(ex.expert_counts_for(per_rank), ex.counts, ex.sends, counts,
                                                         offsets, base, received_counts, weight, source_row,
                                                         row_expert)
        place_kernel(world, tokens, topk, per_rank, rows)(ex.received("idx"), ex.received("expert_slot"),
                                                          ex.received("w"), received_counts, ex.sends, base, position,
                                                          weight, source_row, row_expert)
        recv_x = _grouped(ex, position, rows)
    return recv_x, weight, row_expert, source_row, counts, offsets, position, received_counts


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
    Within a segment, rows come in (source rank, token, k) order. ``ts.ops.grouped_gemm``
    consumes this layout. Every rank passes the same number of tokens (pad with tokens
    weighted 0).

    ``low_latency=True`` (decode batches, up to a few hundred tokens per rank) groups the
    received rows in one launch instead of three (see the module notes); both modes give
    the same result. Every rank must pick the same mode.

    No host synchronisation: the ranks agree on shapes through the job's store at a shape's
    first call, and expert ids are checked on the device. An id outside [0, num_experts)
    is routed nowhere (no copy can land outside a buffer), and ``moe_dispatch`` raises
    ValueError naming the rank and the ids' range at its end, once its exchange has run on
    every rank: on the CPU path in the call that passed the id; on GPUs, where the host does
    not wait for the device, in the first dispatch or combine on this rank that finds the
    check done (usually the combine of the same step).

    CUDA graphs: a dispatch (and a combine) can be captured once its shapes have run
    eagerly, and replayed; each call's state lives on the device. Calls captured into a
    graph do not check expert ids (out-of-range ids are still routed nowhere).
    """
    _check_routing(x, topk_idx, topk_weights, num_experts)
    world = runtime.world_size()
    tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    per_rank = num_experts // world
    dev = x.device

    # Routing: pair (t, r) exists when token t has an expert on rank r; its slot at r is its
    # order among this rank's tokens going to r. Entry (t, k)'s expert slot is its order among
    # this rank's entries of expert topk_idx[t, k]: the receiver adds its (source, expert) base.
    idx = topk_idx.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    i32 = dict(dtype=torch.int32, device=dev)
    dest, slot = torch.empty(world * tokens, **i32), torch.empty(world * tokens, **i32)
    send_counts, expert_slot = torch.empty(world, **i32), torch.empty(tokens, topk, **i32)
    expert_send_counts, bad = torch.empty(num_experts, **i32), torch.empty(1, **i32)
    route_kernel(world, tokens, topk, num_experts)(idx, dest, slot, send_counts, expert_slot, expert_send_counts, bad)
    ex = _send(x, idx, weights, expert_slot, slot, send_counts, expert_send_counts)
    capturing = _capturing(x)
    if not capturing:
        _watch_ids(bad, idx, num_experts)  # queued behind the exchange: read at the end of this call or a later one

    recv_x, recv_w, row_expert, source_row, counts, offsets, position, recv_counts = _receive(
        ex, tokens, topk, per_rank, low_latency)
    handle = DispatchHandle(tokens=tokens, topk_idx=idx, topk_w=weights, expert_slot=expert_slot, dest=dest, slot=slot,
                            send_counts=send_counts, expert_send_counts=expert_send_counts, recv_counts=recv_counts,
                            position=position, counts=counts, offsets=offsets, row_expert=row_expert,
                            source_row=source_row)
    if not capturing:
        _raise_bad_ids()
    return recv_x, recv_w, counts, handle


def moe_redispatch(x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Send the rows of ``x`` along the routes of an earlier dispatch, grouped as it grouped them.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts)
        grad_rows = ts.ops.moe_redispatch(grad_y, handle)   # the backward of moe_combine

    ``x`` is (tokens, any hidden), one row per token of this rank; the result is (rows,
    hidden) in the dispatch's grouped layout (rows holding no token are undefined).
    """
    check_input(x, "x")
    if x.dim() != 2 or x.shape[0] != handle.tokens:
        raise ValueError(f"moe_redispatch: x must be (tokens={handle.tokens}, hidden), got {tuple(x.shape)}")
    check_same_across_ranks("moe_redispatch", [*x.shape, str(x.dtype)])
    ex = _send(x, handle.topk_idx, handle.topk_w, handle.expert_slot, handle.slot, handle.send_counts,
               handle.expert_send_counts)
    return _grouped(ex, handle.position, handle.row_expert.shape[0])


def _send(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, expert_slot: torch.Tensor, slot: torch.Tensor,
          send_counts: torch.Tensor, expert_send_counts: torch.Tensor) -> _Exchange:
    """Rows, expert ids, weights and expert slots of every pair into the destinations' receive buffers."""
    world = runtime.world_size()
    (tokens, hidden), topk = x.shape, idx.shape[1]
    per_rank = expert_send_counts.numel() // world
    ex = _exchange(tokens, hidden, topk, x.dtype)
    kernel = dispatch_kernel(world, tokens, hidden, topk, per_rank, tl_dtype(x), sm_count())
    kernel(x, idx, weights, expert_slot, slot, send_counts, expert_send_counts, ex.x, ex.idx, ex.w, ex.expert_slot,
           ex.counts, ex.expert_counts_for(per_rank), ex.sends)
    return ex


def _grouped(ex: _Exchange, position: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of the latest send copied to their experts' grouped rows."""
    world, tokens, hidden = ex.x.shape[1:]
    out = torch.empty(rows, hidden, dtype=ex.x.dtype, device=ex.x.device)
    kernel = group_rows_kernel(world, tokens, hidden, position.shape[1], rows, tl_dtype(ex.x))
    kernel(ex.received("x"), ex.sends, position, out)
    return out


def moe_combine(expert_out: torch.Tensor, recv_weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Weighted sum of each token's expert outputs, back on its source rank in the original order.

    Example::

        y = ts.ops.moe_combine(expert_out, recv_w, handle)     # (tokens, hidden)

    ``expert_out`` is (rows, hidden) in ``moe_dispatch``'s grouped layout; ``recv_weights``
    the (rows,) routing weights it returned (pass ones to sum unweighted). A handle can be
    combined any number of times, and captured in a CUDA graph as ``moe_dispatch`` can.
    """
    if not _capturing(expert_out):
        _raise_bad_ids()  # a bad expert id of an earlier dispatch, if the device has reported it by now
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
    kernel = combine_kernel(world, tokens, hidden, topk, rows, tl_dtype(expert_out), sm_count())
    out = torch.empty(tokens, hidden, dtype=expert_out.dtype, device=expert_out.device)
    kernel(expert_out, recv_weights.to(torch.float32).contiguous(), handle.position, handle.recv_counts,
           handle.dest, handle.slot, ex.back, out, ex.combines)
    return out
