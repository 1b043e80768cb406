"""Expert-parallel MoE dispatch and combine: tokens cross to their experts' ranks and back.

Experts are split evenly over ranks (expert ``e`` lives on rank ``e // experts_per_rank``).
A token routed to several experts of one rank crosses the link once (DeepEP's
deduplication): every (token, destination rank) pair is one row.

Dispatch, two kernels and no host synchronisation:

1. ``route_kernel``, on the sender: each pair's destination and its slot in the
   destination's receive buffer (one slot range per source rank, token order, so senders
   never need the receivers' offsets); and each (token, k) entry's order among this rank's
   entries naming the same expert (``expert_slot``), with the entries sent to each expert.
   One block per destination rank and per expert, each a two-level scan over the tokens.
2. ``dispatch_kernel``, sending and receiving at once. Block d first sends rank d this
   rank's row count and per-expert entry counts, and raises rank d's ``arrived`` flag.
   Then each block walks its own range of tokens in groups of a few:

   * each token of the group that goes to a peer is put there (row, expert ids, weights,
     expert slots) at its slot; the group's slot range then goes to the peer, and the
     peer's ``progress`` flag of this block is raised past the group (peers interleaved,
     so no rank receives from all the others at once);
   * once every source's counts are in (first group only), the grouped layout is known:
     expert e's segment starts at the sum of the padded segments before it (segments
     padded to 128-row GEMM tiles), and source src's entries of e start at ``base[src,
     e]`` in it. Entry (token, k) of local expert e goes to grouped row ``base[src, e] +
     expert_slot``: each segment holds its entries in (source, token, k) order,
     deterministically, without a scan over the rows;
   * this rank's own tokens go straight from ``x`` to their grouped rows (no receive
     buffer), each row read once and written once per local expert;
   * the previous group of each peer's block with the same index is placed likewise
     from the receive buffer once its ``progress`` flag says it is in: a group's time
     after it was sent, so the wait is usually over, and the copy from the peers
     overlaps the block's own sends.

   The result is one flat ``(rows, hidden)`` tensor in which local expert ``l`` owns rows
   ``offsets[l]:offsets[l] + counts[l]``; its size is a bound known without a host round
   trip. A closing barrier ends the call.

Low-latency mode (decode batches) announces every row on its own (groups of one), so a
receiver never waits for a row behind others.

Combine reverses it in one kernel: each received row's expert outputs are summed with
their routing weights on the expert side and put back into the source rank's slot; after
the exchange each token sums its rows from its destination ranks.

No host state changes from call to call, so a step can be captured in a CUDA graph and
replayed. Each rank keeps device-side counts of its dispatches and its combines. A
source's ``arrived`` flag holds its dispatch count + 1, set once per call and compared for
equality (so it survives the count's wrap-around); a ``progress`` flag holds the groups
sent so far in this call, and its receiver puts it back to 0 after the last one. Dispatch
reads its receive buffers before its closing barrier, so the next call, which starts after
that barrier on every rank, may overwrite them and raise the flags again. Combine reads
its returned rows after its barrier, so its buffers come in two sets, used by alternate
calls: a rank writes a set again only after passing the barrier of the call in between,
which no rank reaches before it has read that set. No opening barrier is needed.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import tilescale.language as T
from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.jit import jit
from tilescale.language.scale import current_context
from tilescale.ops._common import (
    call_identity,
    check_input,
    check_same_across_ranks,
    poison_value,
    signature,
    sm_count,
    tl_dtype,
)
from tilescale.symmetric import allocate

# Each expert's segment of the grouped rows is padded to whole GEMM row tiles.
ROW_TILE = 128
# Routing scans take tokens in chunks of (up to) SCAN_ROWS x SCAN_COLS: each row scanned by a
# warp, then the row totals (a two-level scan: TileLang's scan gives a whole line to one warp).
SCAN_ROWS = 32
SCAN_COLS = 128
SCAN_THREADS = 512
# Tokens a dispatch block reads at once and sends to a peer between two announcements (each
# a fence and a flag): more rows in flight and fewer fences, against the receiver waiting
# longer for the first rows.
GROUP_ROWS = 4
# Grouped rows per step of the fill of rows holding no entry.
FILL = 1024


def grouped_rows(tokens: int, topk: int, experts_per_rank: int, *, group: dist.ProcessGroup | None = None) -> int:
    """Rows of ``moe_dispatch``'s grouped output: every (received row, local expert) hit of
    the worst case, plus each expert's padding to a whole row tile (``group``: the
    expert-parallel group, None: the whole job)."""
    hits = runtime.group_size(group) * tokens * min(topk, experts_per_rank)
    return -(-(hits + experts_per_rank * (ROW_TILE - 1)) // ROW_TILE) * ROW_TILE


def exchange_blocks(world: int, tokens: int, sms: int) -> int:
    """Blocks of the combine kernel: one per SM at most (so that device-wide barriers hold),
    but no fewer than the ranks."""
    return max(min(world * tokens, sms), world)


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


def dispatch_plan(world: int, tokens: int, sms: int, low_latency: bool) -> tuple[int, int, int, int]:
    """``(blocks, chunk, group, groups)`` of the dispatch kernel: block b sends tokens ``b *
    chunk .. (b + 1) * chunk - 1``, ``groups`` groups of ``group``, and announces each group to
    each peer (groups of one in low-latency mode: each row as soon as it is out). One block per
    SM at most (the closing barrier needs every block resident), and no fewer blocks than
    ranks (block d sends rank d the counts)."""
    chunk = -(-tokens // min(tokens, sms))
    group = 1 if low_latency else min(GROUP_ROWS, chunk)
    return max(-(-tokens // chunk), world), chunk, group, -(-chunk // group)


@jit
def dispatch_kernel(world: int, tokens: int, hidden: int, topk: int, per_rank: int, rows: int, dtype: str, sms: int,
                    low_latency: bool):
    """Send every token to the ranks of its experts and group what this rank receives by
    local expert, in one launch (see the module notes for the protocol).

    Inputs are the routing kernel's outputs; ``recv_*``, ``ranges``, ``progress`` and
    ``arrived`` are symmetric; the rest are this rank's grouped layout, written here.
    """
    blocks, chunk, group, groups = dispatch_plan(world, tokens, sms, low_latency)
    received = world * tokens

    @T.prim_func
    def main(x: T.Tensor((tokens, hidden), dtype), topk_idx: T.Tensor((tokens, topk), "int32"),
             topk_w: T.Tensor((tokens, topk), "float32"), expert_slot: T.Tensor((tokens, topk), "int32"),
             slot: T.Tensor((received,), "int32"), send_counts: T.Tensor((world,), "int32"),
             expert_counts: T.Tensor((world * per_rank,), "int32"),
             recv_x: T.Tensor((world, tokens, hidden), dtype), recv_idx: T.Tensor((world, tokens, topk), "int32"),
             recv_w: T.Tensor((world, tokens, topk), "float32"), recv_slot: T.Tensor((world, tokens, topk), "int32"),
             recv_counts: T.Tensor((world,), "int32"), recv_expert_counts: T.Tensor((world, per_rank), "int32"),
             ranges: T.Tensor((world, blocks, groups, 2), "int32"), progress: T.Tensor((world, blocks), "int32"),
             arrived: T.Tensor((world,), "int32"), sends: T.Tensor((1,), "int32"),
             counts: T.Tensor((per_rank,), "int32"), offsets: T.Tensor((per_rank,), "int32"),
             received_counts: T.Tensor((world,), "int32"), position: T.Tensor((received, topk), "int32"),
             weight: T.Tensor((rows,), "float32"), source_row: T.Tensor((rows,), "int32"),
             row_expert: T.Tensor((rows,), "int32"), out: T.Tensor((rows, hidden), dtype),
             board: T.Tensor((2 * world,), "int64"), ident: T.int64):
        with T.Kernel(blocks, threads=128) as b:
            with T.Scale("device") as (rank, ranks):
                # A group of rows with their entries' expert ids, weights and expert slots: read
                # once from x (or a receive buffer), used for every destination.
                tile = _Group(T.alloc_shared((group, hidden), dtype), T.alloc_shared((group, topk), "int32"),
                              T.alloc_shared((group, topk), "float32"), T.alloc_shared((group, topk), "int32"),
                              T.alloc_shared((group,), "int32"), T.alloc_shared((group, topk), "int32"))
                span = T.alloc_shared((2,), "int32")  # a group's first slot and rows, at one destination
                given = T.alloc_shared((world, per_rank), "int32")  # every source's entries of each expert
                got = T.alloc_shared((world,), "int32")  # every source's rows
                upto = T.alloc_shared((world, per_rank), "int32")
                end = T.alloc_shared((per_rank,), "int32")
                call = T.alloc_local((1,), "int32")
                call[0] = sends[0]
                if b < ranks:  # the counts first: a receiver needs every source's to place any row
                    T.announce(board, ident)  # released by the signal below: the receiver checks it
                    T.copy(send_counts[b:b + 1], recv_counts[rank:rank + 1], dst_pe=b)
                    T.copy(expert_counts[b * per_rank:b * per_rank + per_rank], recv_expert_counts[rank, 0:per_rank],
                           dst_pe=b)
                    T.signal(arrived[rank], call[0] + 1, pe=b)
                for g in T.serial(groups + 1):
                    # Group g read, sent to the peers, then placed here; group g - 1 of each peer's
                    # block b placed meanwhile (it has had a group's time to arrive).
                    if g < groups and _group_tokens(b, g, chunk, group, tokens) > 0:
                        _load(x, topk_idx, topk_w, expert_slot, b * chunk + g * group, tile)
                    if world > 1 and g < groups:
                        for j in T.serial(world - 1):
                            _put_group(tile, slot, span, recv_x, recv_idx, recv_w, recv_slot, ranges, progress,
                                       b * chunk + g * group, _group_tokens(b, g, chunk, group, tokens),
                                       _peer(b, j, world), b, g, tokens)
                    if g == 0:
                        for src in T.serial(ranks):
                            T.wait(arrived[src], "eq", call[0] + 1, agree=(board, ident))
                        _segments(recv_expert_counts, recv_counts, given, got, upto, end, world, per_rank)
                    if g < groups and _group_tokens(b, g, chunk, group, tokens) > 0:
                        for i in T.Parallel(group):  # this rank's own tokens among them: received rows
                            tile.where[i] = T.if_then_else(
                                i < _group_tokens(b, g, chunk, group, tokens)
                                and slot[rank * tokens + T.min(b * chunk + g * group + i, tokens - 1)] >= 0,
                                rank * tokens + slot[rank * tokens + T.min(b * chunk + g * group + i, tokens - 1)],
                                -1)
                        _place(tile, upto, end, given, position, weight, source_row, row_expert, out, world, tokens,
                               per_rank)
                    if world > 1 and g > 0:
                        for j in T.serial(world - 1):
                            _take_group(_peer(b, j, world), b, g - 1, groups, tile, span,
                                        upto, end, given, recv_x, recv_idx, recv_w, recv_slot, ranges, progress,
                                        position, weight, source_row, row_expert, out, world, tokens, per_rank)
                _finish_layout(b, blocks, upto, end, got, counts, offsets, received_counts, position, weight,
                               source_row, row_expert, world, tokens, per_rank, topk, rows)
                T.barrier()  # every rank has taken its rows out of the receive buffers
                if b == 0:
                    sends[0] = call[0] + 1  # every thread stores the same value

    return main


@dataclass(frozen=True)
class _Group:
    """A dispatch block's shared tiles for one group of rows."""

    rows: object  # (group, hidden)
    ids: object  # (group, topk) expert ids of each row's entries
    ws: object  # (group, topk) their routing weights
    eslots: object  # (group, topk) their expert slots
    where: object  # (group,) the received row each row is (source * tokens + slot), -1 for none
    pos: object  # (group, topk) each entry's grouped row, -1 for other ranks' experts


def _rank():
    """This rank, inside a kernel's ``T.Scale("device")``. Use it inline: bound to a name in a
    macro, TileLang would rename the kernel's rank parameter, which ``ts.jit`` binds by name."""
    return current_context().rank


def _peer(b, j, world):
    """The j-th peer block b sends to and takes from, rotated by block so that no rank hears
    from all the others at once."""
    return (_rank() + 1 + (b + j) % (world - 1)) % world


def _group_tokens(b, g, chunk, group, tokens):
    """Tokens in group g of block b (none past the last token)."""
    return T.min(T.min(group, chunk - g * group), tokens - b * chunk - g * group)


@T.macro
def _load(x, topk_idx, topk_w, expert_slot, t0, tile):
    """Tokens ``t0 ..`` of this rank into ``tile`` (a group past the last token is cut short)."""
    group = tile.rows.shape[0]
    T.copy(x[t0:t0 + group, 0:tile.rows.shape[1]], tile.rows)
    T.copy(topk_idx[t0:t0 + group, 0:tile.ids.shape[1]], tile.ids)
    T.copy(topk_w[t0:t0 + group, 0:tile.ids.shape[1]], tile.ws)
    T.copy(expert_slot[t0:t0 + group, 0:tile.ids.shape[1]], tile.eslots)


@T.macro
def _put_group(tile, slot, span, recv_x, recv_idx, recv_w, recv_slot, ranges, progress, t0, n, d, b, g, tokens):
    """The group's tokens ``t0 .. t0 + n - 1`` that go to rank d into its receive buffers (row,
    expert ids, weights, expert slots, at their slots there), then the group's slot range into
    ``ranges[rank, b, g]`` there and its progress flag raised to g + 1."""
    hidden, topk = tile.rows.shape[1], tile.ids.shape[1]
    first, sent = T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32")  # per thread: no race
    first[0] = 0
    sent[0] = 0
    for i in T.serial(n):
        if slot[d * tokens + t0 + i] >= 0:
            T.copy(tile.rows[i, 0:hidden], recv_x[_rank(), slot[d * tokens + t0 + i], 0:hidden], dst_pe=d)
            T.copy(tile.ids[i:i + 1, 0:topk], recv_idx[_rank(), slot[d * tokens + t0 + i], 0:topk], dst_pe=d)
            T.copy(tile.ws[i:i + 1, 0:topk], recv_w[_rank(), slot[d * tokens + t0 + i], 0:topk], dst_pe=d)
            T.copy(tile.eslots[i:i + 1, 0:topk], recv_slot[_rank(), slot[d * tokens + t0 + i], 0:topk], dst_pe=d)
            if sent[0] == 0:
                first[0] = slot[d * tokens + t0 + i]  # slots grow with the token: the rest follow
            sent[0] = sent[0] + 1
    span[0] = first[0]
    span[1] = sent[0]
    T.copy(span, ranges[_rank(), b, g, 0:2], dst_pe=d)
    T.signal(progress[_rank(), b], g + 1, pe=d)


@T.macro
def _take_group(src, b, g, groups, tile, span, upto, end, given, recv_x, recv_idx, recv_w, recv_slot, ranges,
                progress, position, weight, source_row, row_expert, out, world, tokens, per_rank):
    """Once it has arrived, group g of source src's block b: its rows placed at their experts'
    grouped rows. After the last group, the flag goes back to 0 for the next call, whose
    sender starts after this call's closing barrier."""
    group, hidden, topk = tile.rows.shape[0], tile.rows.shape[1], tile.ids.shape[1]
    T.wait(progress[src, b], "ge", g + 1)
    T.copy(ranges[src, b, g, 0:2], span)
    first, n = T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32")
    first[0] = span[0]
    n[0] = span[1]
    if n[0] > 0:
        T.copy(recv_x[src, first[0]:first[0] + group, 0:hidden], tile.rows)
        T.copy(recv_idx[src, first[0]:first[0] + group, 0:topk], tile.ids)
        T.copy(recv_w[src, first[0]:first[0] + group, 0:topk], tile.ws)
        T.copy(recv_slot[src, first[0]:first[0] + group, 0:topk], tile.eslots)
        for i in T.Parallel(group):
            tile.where[i] = T.if_then_else(i < n[0], src * tokens + first[0] + i, -1)
        _place(tile, upto, end, given, position, weight, source_row, row_expert, out, world, tokens, per_rank)
    if g == groups - 1:
        progress[src, b] = 0


@T.macro
def _place(tile, upto, end, given, position, weight, source_row, row_expert, out, world, tokens, per_rank):
    """The group's rows that are received rows (``tile.where[i] >= 0``, slot ``where % tokens``
    of source ``src = where // tokens``): entry k of local expert e goes to grouped row
    ``base[src, e] + eslots[i, k]``. Records each entry's grouped row in ``position`` (-1 for
    other ranks' experts), per grouped row its weight, source row and expert, and writes the
    row to each."""
    group, hidden, topk = tile.rows.shape[0], tile.rows.shape[1], tile.ids.shape[1]
    lo = _rank() * per_rank
    for i, k in T.Parallel(group, topk):
        tile.pos[i, k] = T.if_then_else(
            tile.where[i] >= 0 and lo <= tile.ids[i, k] and tile.ids[i, k] < lo + per_rank,
            _base(given, upto, end, T.max(tile.where[i], 0) // tokens,
                  T.max(T.min(tile.ids[i, k] - lo, per_rank - 1), 0), world) + tile.eslots[i, k], -1)
    for i, k in T.Parallel(group, topk):
        if tile.where[i] >= 0:
            position[tile.where[i], k] = tile.pos[i, k]
    for i, k in T.Parallel(group, topk):
        if tile.pos[i, k] >= 0:
            weight[tile.pos[i, k]] = tile.ws[i, k]
    for i, k in T.Parallel(group, topk):
        if tile.pos[i, k] >= 0:
            source_row[tile.pos[i, k]] = tile.where[i]
    for i, k in T.Parallel(group, topk):
        if tile.pos[i, k] >= 0:
            row_expert[tile.pos[i, k]] = tile.ids[i, k] - lo
    for i in T.serial(group):
        for k in T.serial(topk):
            if tile.pos[i, k] >= 0:
                T.copy(tile.rows[i, 0:hidden], out[tile.pos[i, k], 0:hidden])


@T.macro
def _segments(recv_expert_counts, recv_counts, given, got, upto, end, world, per_rank):
    """Every source's counts into ``given`` (entries per expert) and ``got`` (rows); ``upto``,
    the (source, expert) entry counts summed over sources; ``end``, the inclusive prefix of
    the experts' padded segments."""
    T.copy(recv_expert_counts[0:world, 0:per_rank], given)
    T.copy(recv_counts[0:world], got)
    T.copy(given, upto)
    T.cumsum(src=upto, dim=0)
    for e in T.Parallel(per_rank):
        end[e] = _padded(upto, e, world)
    T.cumsum(src=end, dim=0)


def _padded(upto, e, world):
    """Rows of expert e's segment: its entries rounded up to whole row tiles."""
    return T.ceildiv(upto[world - 1, e], ROW_TILE) * ROW_TILE


def _base(given, upto, end, src, e, world):
    """First grouped row of source src's entries of expert e."""
    return end[e] - _padded(upto, e, world) + upto[src, e] - given[src, e]


def _padding_row(upto, end, e, i, world):
    """Row i of expert e's segment past its entries, or -1 past the segment's end."""
    return T.if_then_else(upto[world - 1, e] + i < _padded(upto, e, world),
                          end[e] - _padded(upto, e, world) + upto[world - 1, e] + i, -1)


@T.macro
def _finish_layout(b, blocks, upto, end, got, counts, offsets, received_counts, position, weight, source_row,
                   row_expert, world, tokens, per_rank, topk, rows):
    """What no row placement writes, shared out over the blocks: the entries of receive slots
    past their source's count (-1), the grouped rows holding no entry (each expert's padding
    and the rows past the last segment: weight 0, source row and expert -1), and (block 0)
    each expert's count and first row and the rows received from each source."""
    for q in T.serial(T.ceildiv(world * tokens, blocks)):
        if b + q * blocks < world * tokens and (b + q * blocks) % tokens >= got[
                T.min((b + q * blocks) // tokens, world - 1)]:
            for k in T.Parallel(topk):
                position[b + q * blocks, k] = -1
    for q in T.serial(T.ceildiv(per_rank, blocks)):
        if b + q * blocks < per_rank:
            for i in T.Parallel(ROW_TILE):
                _reset_row(_padding_row(upto, end, b + q * blocks, i, world),
                           _padding_row(upto, end, b + q * blocks, i, world) >= 0, weight, source_row, row_expert)
    for q in T.serial(T.ceildiv(rows, FILL * blocks)):
        for i in T.Parallel(FILL):
            _reset_row((q * blocks + b) * FILL + i,
                       (q * blocks + b) * FILL + i >= end[per_rank - 1] and (q * blocks + b) * FILL + i < rows, weight,
                       source_row, row_expert)
    if b == 0:
        for e in T.Parallel(per_rank):
            counts[e] = upto[world - 1, e]
        for e in T.Parallel(per_rank):
            offsets[e] = end[e] - _padded(upto, e, world)
        for src in T.Parallel(world):
            received_counts[src] = got[src]


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
             combines: T.Tensor((1,), "int32"), sig: T.int32):
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
                agreed = T.alloc_local((1,), "int32")
                agreed[0] = T.agree(sig)  # every rank's rows are back, if every rank runs this combine
                if bx == 0:
                    combines[0] = call[0] + 1  # every thread stores the same value
                # Token t's row from destination rank d is back[s, d, slot[d * tokens + t]].
                for q in T.serial(T.ceildiv(tokens, blocks)):
                    t = bx + q * blocks
                    if t < tokens and agreed[0] == 1:
                        T.clear(acc)
                        for d in T.serial(ranks):
                            if dest[d * tokens + t] >= 0:
                                T.copy(back[s, d, slot[d * tokens + t]:slot[d * tokens + t] + 1, 0:hidden], part)
                                for i, c in T.Parallel(1, hidden):
                                    acc[i, c] += T.cast(part[i, c], "float32")
                        T.copy(acc, row)
                        T.copy(row, out[t:t + 1, 0:hidden])
                    elif t < tokens:
                        for c in T.Parallel(hidden):
                            out[t, c] = poison_value(dtype)

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
    group: dist.ProcessGroup | None = None  # the expert-parallel group the dispatch ran over (None: the whole job)


@dataclass
class _Exchange:
    """Receive buffers of one (tokens, hidden, topk, dtype), and this rank's device-side counts
    of the dispatches and combines through them (see the module notes)."""

    x: torch.Tensor  # (world, tokens, hidden): slot j of source src at [src, j]
    idx: torch.Tensor  # (world, tokens, topk) int32
    w: torch.Tensor  # (world, tokens, topk) float32
    expert_slot: torch.Tensor  # (world, tokens, topk) int32
    counts: torch.Tensor  # (world,) int32 rows from each source
    arrived: torch.Tensor  # (world,) int32: source src's counts are in once [src] > its dispatch count
    back: torch.Tensor  # (2, world, tokens, hidden) combine's rows coming back, two sets
    sends: torch.Tensor  # (1,) int32, this rank only
    combines: torch.Tensor  # (1,) int32, this rank only
    group: GroupState  # whose symmetric memory the buffers are
    by_shape: dict[tuple, torch.Tensor] = field(default_factory=dict)  # int32 buffers by (name, shape)

    def int32(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """Symmetric int32 buffer ``name`` of ``shape``, allocated (zeroed) at first use: its
        shape depends on the call (experts, the dispatch plan), the same on every rank."""
        key = (name, shape)
        if key not in self.by_shape:
            runtime.check_not_capturing(f"moe_dispatch's {name} buffer of {shape}")
            self.by_shape[key] = allocate(self.group, shape, torch.int32)
        return self.by_shape[key]


def _exchange(state: GroupState, tokens: int, hidden: int, topk: int, dtype: torch.dtype) -> _Exchange:
    """The group's exchange of (tokens, hidden, topk, dtype), allocated (collectively) at first use."""

    def create() -> _Exchange:
        runtime.check_not_capturing(f"MoE exchange of {tokens} tokens x {hidden} ({dtype}), top-{topk}")
        world = state.size
        rows, meta = (world, tokens, hidden), (world, tokens, topk)
        return _Exchange(
            allocate(state, rows, dtype), allocate(state, meta, torch.int32), allocate(state, meta, torch.float32),
            allocate(state, meta, torch.int32), allocate(state, (world,), torch.int32),
            allocate(state, (world,), torch.int32), allocate(state, (2, *rows), dtype),
            torch.zeros(1, dtype=torch.int32, device=runtime.device()),
            torch.zeros(1, dtype=torch.int32, device=runtime.device()), state)

    return state.exchange(("moe", tokens, hidden, topk, dtype), create)


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


def _check_routing(state: GroupState, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                   num_experts: int, low_latency: bool) -> None:
    """Shapes are checked locally and, at a shape's first call, across ranks, with what the
    dispatch kernel's plan derives from (its blocks and groups must match across ranks).

    Expert ids are checked on the device, without a host round trip: see :func:`moe_dispatch`.
    """
    check_input(x, "x")
    world = state.size
    if x.dim() != 2:
        raise ValueError(f"moe_dispatch: x must be (tokens, hidden), got {tuple(x.shape)}")
    if topk_idx.shape != topk_weights.shape or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"moe_dispatch: topk_idx {tuple(topk_idx.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must both be (tokens={x.shape[0]}, topk)")
    if num_experts % world:
        raise ValueError(f"moe_dispatch: num_experts ({num_experts}) must be divisible by the group size {world}")
    check_same_across_ranks(state, "moe_dispatch", [*x.shape, *topk_idx.shape, str(x.dtype), num_experts,
                                                    f"low_latency={low_latency}", f"SMs={sm_count()}"],
                            every_call=x.shape[0] == 0)


def _expert_ids(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The routing kernel's int32 expert ids. It counts and drops ids outside [0, num_experts)
    (the one check of id values); ids of wider types are clamped to [-1, num_experts] first,
    which keeps every bad id bad, so that no cast wraps one into range (2**32 + 1 would
    become expert 1)."""
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        raise TypeError(f"moe_dispatch: topk_idx must hold integer expert ids, got {topk_idx.dtype}")
    info = torch.iinfo(topk_idx.dtype)
    if info.min < torch.iinfo(torch.int32).min or info.max > torch.iinfo(torch.int32).max:
        topk_idx = topk_idx.to(torch.int64).clamp(-1, num_experts)  # uint64 ids past 2**63 turn negative: bad
    return topk_idx.to(torch.int32).contiguous()


def _empty_dispatch(state: GroupState, x: torch.Tensor, topk: int, num_experts: int,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
    """``moe_dispatch``'s result for zero tokens on every rank of the group: nothing sent or
    received, the documented layout with every row holding no token."""
    world, group = state.size, state.process_group
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
    recv_x = torch.empty(rows, x.shape[1], dtype=x.dtype, device=x.device)
    return recv_x, torch.zeros(rows, dtype=torch.float32, device=x.device), handle.counts, handle


def _dispatch(state: GroupState, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor,
              expert_slot: torch.Tensor, slot: torch.Tensor, send_counts: torch.Tensor,
              expert_send_counts: torch.Tensor, low_latency: bool) -> tuple[torch.Tensor, ...]:
    """Every token to its destinations, and what this rank receives grouped by local expert,
    from the routing kernel's outputs; no host round trip.

    Returns ``recv_x`` (rows, hidden), per grouped row its routing weight, ``row_expert`` and
    ``source_row``; per local expert ``counts`` and ``offsets``; per received row its
    ``position`` (received rows, topk); and the rows received from each source.
    """
    world, group = state.size, state.process_group
    (tokens, hidden), topk = x.shape, idx.shape[1]
    per_rank = expert_send_counts.numel() // world
    rows = grouped_rows(tokens, topk, per_rank, group=group)
    ex = _exchange(state, tokens, hidden, topk, x.dtype)
    sms = sm_count()
    blocks, _, _, groups = dispatch_plan(world, tokens, sms, low_latency)
    i32 = dict(dtype=torch.int32, device=x.device)
    counts, offsets = torch.empty(per_rank, **i32), torch.empty(per_rank, **i32)
    received_counts, position = torch.empty(world, **i32), torch.empty(world * tokens, topk, **i32)
    weight = torch.empty(rows, dtype=torch.float32, device=x.device)
    source_row, row_expert = torch.empty(rows, **i32), torch.empty(rows, **i32)
    recv_x = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    kernel = dispatch_kernel(world, tokens, hidden, topk, per_rank, rows, tl_dtype(x), sms, low_latency, group=group)
    board, ident = call_identity(state, signature("moe_dispatch", x, f"topk={topk}", f"experts={per_rank * world}",
                                                  f"low_latency={low_latency}", f"SMs={sms}"))
    kernel(x, idx, weights, expert_slot, slot, send_counts, expert_send_counts, ex.x, ex.idx, ex.w, ex.expert_slot,
           ex.counts, ex.int32("expert counts", (world, per_rank)),
           ex.int32("ranges", (world, blocks, groups, 2)), ex.int32("progress", (world, blocks)),
           ex.arrived, ex.sends, counts, offsets, received_counts, position, weight, source_row, row_expert, recv_x,
           board, ident, group=group)
    return recv_x, weight, row_expert, source_row, counts, offsets, position, received_counts


def moe_dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                 low_latency: bool = False, *, group: dist.ProcessGroup | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, DispatchHandle]:
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
    weighted 0); zero tokens (on every rank) give that layout with no token in it.

    ``low_latency=True`` (decode batches, up to a few hundred tokens per rank) announces
    every row to its receiver as soon as it is out, instead of every few rows (see the
    module notes); both modes give the same result. Every rank must pick the same mode
    (checked at a shape's first call).

    No host synchronisation: the ranks compare shapes through the job's store at a shape's
    first call, and the dispatch kernel compares every call's shapes on the device (a
    difference raises ``ts.ShapeMismatchError`` on every rank; see README "When ranks
    disagree"). ``topk_idx`` holds integer ids (TypeError otherwise), checked on the device
    without a cast that could wrap one into range. An id outside [0, num_experts) is routed
    nowhere (no copy can land outside a buffer), and ``moe_dispatch`` raises
    ValueError naming the rank and the ids' range at its end, once its exchange has run on
    every rank: on the CPU path in the call that passed the id; on GPUs, where the host does
    not wait for the device, in the first dispatch or combine on this rank that finds the
    check done (usually the combine of the same step).

    ``group``: the expert-parallel process group (None: the whole job); experts are split
    over its ranks, and the handle remembers it for ``moe_combine`` / ``moe_redispatch``.

    CUDA graphs: a dispatch (and a combine) can be captured once its shapes have run
    eagerly, and replayed; each call's state lives on the device. Calls captured into a
    graph do not check expert ids (out-of-range ids are still routed nowhere).
    """
    state = runtime.group_state(group)
    _check_routing(state, x, topk_idx, topk_weights, num_experts, low_latency)
    world = state.size
    tokens, hidden = x.shape
    topk = topk_idx.shape[1]
    dev = x.device
    idx = _expert_ids(topk_idx, num_experts)
    if tokens == 0:
        return _empty_dispatch(state, x, topk, num_experts)

    # Routing: pair (t, r) exists when token t has an expert on rank r; its slot at r is its
    # order among this rank's tokens going to r. Entry (t, k)'s expert slot is its order among
    # this rank's entries of expert topk_idx[t, k]: the receiver adds its (source, expert) base.
    weights = topk_weights.to(torch.float32).contiguous()
    i32 = dict(dtype=torch.int32, device=dev)
    dest, slot = torch.empty(world * tokens, **i32), torch.empty(world * tokens, **i32)
    send_counts, expert_slot = torch.empty(world, **i32), torch.empty(tokens, topk, **i32)
    expert_send_counts, bad = torch.empty(num_experts, **i32), torch.empty(1, **i32)
    route_kernel(world, tokens, topk, num_experts, group=group)(idx, dest, slot, send_counts, expert_slot,
                                                                expert_send_counts, bad)
    capturing = _capturing(x)
    recv_x, recv_w, row_expert, source_row, counts, offsets, position, recv_counts = _dispatch(
        state, x, idx, weights, expert_slot, slot, send_counts, expert_send_counts, low_latency)
    if not capturing:  # queued behind the exchange: read at the end of this call or a later one
        _watch_ids(bad, topk_idx, num_experts)  # the ids as passed, for the message
    handle = DispatchHandle(tokens=tokens, topk_idx=idx, topk_w=weights, expert_slot=expert_slot, dest=dest, slot=slot,
                            send_counts=send_counts, expert_send_counts=expert_send_counts, recv_counts=recv_counts,
                            position=position, counts=counts, offsets=offsets, row_expert=row_expert,
                            source_row=source_row, group=group)
    if not capturing:
        _raise_bad_ids()
    return recv_x, recv_w, counts, handle


def moe_redispatch(x: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Send the rows of ``x`` along the routes of an earlier dispatch, grouped as it grouped them.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts)
        grad_rows = ts.ops.moe_redispatch(grad_y, handle)   # the backward of moe_combine

    ``x`` is (tokens, any hidden), one row per token of this rank; the result is (rows,
    hidden) in the dispatch's grouped layout, which the same routes give again (rows
    holding no token are undefined).
    """
    check_input(x, "x")
    if x.dim() != 2 or x.shape[0] != handle.tokens:
        raise ValueError(f"moe_redispatch: x must be (tokens={handle.tokens}, hidden), got {tuple(x.shape)}")
    state = runtime.group_state(handle.group)
    check_same_across_ranks(state, "moe_redispatch", [*x.shape, str(x.dtype)], every_call=handle.tokens == 0)
    if handle.tokens == 0:
        return x.new_empty(handle.row_expert.shape[0], x.shape[1])
    return _dispatch(state, x, handle.topk_idx, handle.topk_w, handle.expert_slot, handle.slot, handle.send_counts,
                     handle.expert_send_counts, low_latency=False)[0]


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
    state = runtime.group_state(handle.group)
    world = state.size
    tokens = handle.tokens
    rows, hidden = expert_out.shape
    if rows != handle.row_expert.shape[0] or recv_weights.shape != (rows,):
        raise ValueError(f"expert_out must be ({handle.row_expert.shape[0]}, hidden) and recv_weights "
                         f"({handle.row_expert.shape[0]},), got {tuple(expert_out.shape)} and "
                         f"{tuple(recv_weights.shape)}")
    topk = handle.position.shape[1]
    out = torch.empty(tokens, hidden, dtype=expert_out.dtype, device=expert_out.device)
    if tokens == 0:  # zero tokens on every rank (moe_dispatch checked): nothing to bring back
        return out
    # expert_out's hidden size and dtype may differ from x's
    ex = _exchange(state, tokens, hidden, topk, expert_out.dtype)
    kernel = combine_kernel(world, tokens, hidden, topk, rows, tl_dtype(expert_out), sm_count(), group=handle.group)
    kernel(expert_out, recv_weights.to(torch.float32).contiguous(), handle.position, handle.recv_counts,
           handle.dest, handle.slot, ex.back, out, ex.combines,
           signature("moe_combine", expert_out, f"tokens={tokens}", f"topk={topk}"), group=handle.group)
    return out
