"""The dispatch kernel: every token to the ranks of its experts, grouped by local expert on arrival.

One launch, sending and receiving at once, after the routing kernels (``routing.py``; a
dispatch of at most ``DECODE_TOKENS`` tokens per rank routes its own tokens first,
``routing.route_block``, so a decode step's dispatch is one launch). Block
d first sends rank d this rank's row count and per-expert entry counts, and raises rank d's
``arrived`` flag. Then each block walks its own range of tokens in groups of a few:

* each token of the group that goes to a peer is put there (row, expert ids, weights,
  expert slots) at its slot, and the group's slot range after its rows (peers interleaved,
  so no rank receives from all the others at once); once the group is out to every peer,
  each peer's ``progress`` flag of this block is raised past the group (one wait for the
  block's stores to land, not one per peer);
* once every source's counts are in (first group only), the grouped layout is known
  (``layout.py``);
* this rank's own tokens go straight from ``x`` to their grouped rows (no receive buffer),
  each row read once and written once per local expert;
* the previous group of each peer's block with the same index is placed likewise from the
  receive buffer once its ``progress`` flag says it is in: a group's time after it was sent,
  so the wait is usually over, and the copy from the peers overlaps the block's own sends.

In place (``in_place=True``) no row is written a second time: the layout (each grouped row's
received row, weight and expert) is built as above, the peers' rows stay where they landed,
and this rank's own rows are written once into its own receive rows, where a grouped GEMM
gathers them (``ts.ops.grouped_gemm(..., index=)``).

Everything peers write into a rank (rows, entries, counts, group ranges and progress flags)
comes in two sets, alternate calls writing alternate sets (by the call's number, counted on
the device: ``T.count_call``), and no barrier ends a call. A peer finishing call c may start
c + 1 while this rank still reads the set of c: it writes the other set (its ``arrived``
flag, c + 1, passes this rank's wait for c: waits are ``ge``). It cannot write the set of c
again before this rank is done with c: its call c + 2 starts after its call c + 1, which
waited for this rank's counts of c + 1, sent by a launch that stream order puts after this
rank's call c. In place, the received rows of call c are thus valid until this rank's next
call. A buffer with one set (``sets=1``, less memory) ends each call with a barrier instead.

Low-latency mode (decode batches) announces every row on its own (groups of one), so a
receiver never waits for a row behind others.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

from dataclasses import dataclass

import tilescale.language as T
from tilescale.jit import jit
from tilescale.ops._common import element_bytes, vector_width
from tilescale.ops.moe.layout import Layout, Segments, _rank, finish, place, segments
from tilescale.ops.moe.routing import DECODE_TOKENS, route_block, routes_in_dispatch

# Tokens a dispatch block reads at once and sends to a peer between two announcements (each
# a fence and a flag): more rows in flight and fewer fences, against the receiver waiting
# longer for the first rows.
GROUP_ROWS = 4
# Dispatch blocks resident per SM, at most. A block waits in turn for its loads, for the fence
# that lands its stores at the peers before it announces them, and for the peers' groups;
# blocks sharing an SM fill each other's waits. Measured on 2x H200, 2 ranks, 4096 tokens,
# replayed, one block per SM against two / three: bf16 rows of 7168 361 -> 306 / 338 us, FP8
# rows of 7168 282 -> 222 / 204 us, bf16 rows of 4096 223 -> 177 / 175 us.
BLOCKS_PER_SM = 3
# Shared memory the row tiles of one SM's blocks may take together: three blocks of bf16 rows
# of 7168 (57 KB each) were slower than two, above; so are any blocks past this budget.
ROW_TILES_PER_SM = 120 << 10


def blocks_per_sm(row_bytes: int) -> int:
    """Dispatch blocks per SM for rows of ``row_bytes`` bytes: ``BLOCKS_PER_SM`` at most,
    while their tiles of ``GROUP_ROWS`` rows fit ``ROW_TILES_PER_SM`` (at least one).

    Args:
        row_bytes: Bytes of one row as the kernel moves it (hidden x element size; packed FP8 rows' bytes).

    Returns:
        int: 1 to ``BLOCKS_PER_SM``.
    """
    return max(1, min(BLOCKS_PER_SM, ROW_TILES_PER_SM // (GROUP_ROWS * row_bytes)))


def dispatch_plan(world: int, tokens: int, sms: int, low_latency: bool, row_bytes: int) -> tuple[int, int, int, int]:
    """``(blocks, chunk, group, groups)`` of the dispatch kernel: block b sends tokens ``b *
    chunk .. (b + 1) * chunk - 1``, ``groups`` groups of ``group``, and announces each group to
    each peer (groups of one in low-latency mode: each row as soon as it is out). At most
    :func:`blocks_per_sm` blocks per SM, all resident together (a closing barrier, with one set
    of buffers, needs every block resident), and no fewer blocks than ranks (block d sends
    rank d the counts).

    Args:
        world: Ranks of the group.
        tokens: Token slots per source (the capacity), at least 1.
        sms: SMs of the GPU.
        low_latency: Announce every row on its own.
        row_bytes: Bytes of one row (:func:`blocks_per_sm`).

    Returns:
        tuple[int, int, int, int]: ``(blocks, chunk, group, groups)`` as above.
    """
    chunk = -(-tokens // min(tokens, sms * blocks_per_sm(row_bytes)))
    group = 1 if low_latency else min(GROUP_ROWS, chunk)
    return max(-(-tokens // chunk), world), chunk, group, -(-chunk // group)


@dataclass(frozen=True)
class Received:
    """The symmetric receive buffers of a dispatch (prim_func parameters), bundled for its macros:
    slot j of source src at ``[src, j]``."""

    x: object  # (sets, world, capacity, hidden) rows: two sets for alternate calls, or one
    set: object  # the set this call writes: (its call number - 1) % sets
    idx: object  # (sets, world, capacity, topk) their entries' expert ids
    w: object  # (sets, world, capacity, topk) their routing weights
    slot: object  # (sets, world, capacity, topk) their expert slots
    counts: object  # (sets, world) rows from each source
    expert_counts: object  # (sets, world, per_rank) entries of each local expert from each source
    ranges: object  # (sets, world, blocks, groups, 2) first slot and rows of each group sent
    progress: object  # (sets, world, blocks) groups of each source block in so far


@dataclass(frozen=True)
class _Group:
    """A dispatch block's shared tiles for one group of rows."""

    rows: object  # (group, hidden)
    ids: object  # (group, topk) expert ids of each row's entries
    ws: object  # (group, topk) their routing weights
    eslots: object  # (group, topk) their expert slots
    where: object  # (group,) the received row each row is (source * capacity + slot), -1 for none
    pos: object  # (group, topk) each entry's grouped row, -1 for other ranks' experts
    vector: int  # elements per 16-byte access of a row copy (``vector_width``)


@jit
def dispatch_kernel(world: int, capacity: int, hidden: int, topk: int, per_rank: int, rows: int, dtype: str, sms: int,
                    low_latency: bool, in_place: bool = False, sets: int = 2, route_ids: str | None = None):
    """Send every token to the ranks of its experts and group what this rank receives by
    local expert, in one launch (see the module notes for the protocol).

    Inputs are the routing kernels' outputs (or, ``route_ids``, its own); ``recv_*``, ``ranges``, ``progress`` and
    ``arrived`` are symmetric; the rest are this rank's grouped layout, written here.
    This rank's token count is a dynamic size (the rows of ``x``; for no tokens the inputs
    hold one row routed nowhere), so one kernel sends any count; ``capacity`` is the most any
    rank sends, the same on every rank: the receive buffers hold that many slots per source,
    and the plan (blocks and groups, which receivers mirror) derives from it, so ranks may
    send different counts.

    Args:
        world: Ranks of the group.
        capacity: Token slots per source, the same on every rank.
        hidden: Elements per row (bytes for packed FP8 rows).
        topk: Experts per token.
        per_rank: Experts on each rank.
        rows: Grouped rows of the outputs (the buffer's bound).
        dtype: TileLang dtype of the rows.
        sms: SMs of the GPU (:func:`dispatch_plan`).
        low_latency: Announce every row on its own (:func:`dispatch_plan`).
        in_place: Leave the received rows where they land (``out`` is then one unused row);
            ``source_row`` names each grouped row's row of ``recv_x`` viewed as
            ``(2 * world * capacity, hidden)``. Needs two ``sets``.
        sets: Sets of receive buffers (1 or 2), the same on every rank; call number n (1, 2, ...)
            writes set ``(n - 1) % sets``. With one, each call ends with a barrier (module notes).
        route_ids: The kernel routes its tokens itself (``routing.route_block``; only where
            ``routing.routes_in_dispatch``): the dtype of the ids it takes as passed (``"int32"``
            or ``"int64"``); the routes (``dest``, ``slot``, ``send_counts``, ``expert_slot``,
            ``expert_counts``, ``bad``, ``ids``) are then its outputs, and ``bad_host`` the
            routing kernel's. None: the routing kernels' outputs are its inputs.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    if sets not in (1, 2) or (in_place and sets != 2):
        raise ValueError(f"dispatch_kernel: 1 or 2 sets of receive rows, 2 in place; got {sets}")
    if route_ids is not None and not routes_in_dispatch(capacity):
        raise ValueError(f"dispatch_kernel: routes its own tokens for at most {DECODE_TOKENS} per rank, not {capacity}")
    held = T.dynamic("tokens")  # this rank's tokens, at least one row
    row_bytes = hidden * element_bytes(dtype)
    blocks, chunk, group, groups = dispatch_plan(world, capacity, sms, low_latency, row_bytes)
    received = world * capacity
    num_experts = world * per_rank

    @T.macro
    def exchange(b, x, topk_idx, topk_w, expert_slot, slot, send_counts, expert_counts, recv_x, recv_idx, recv_w,
                 recv_slot, recv_counts, recv_expert_counts, ranges, progress, arrived, sends, counts, offsets,
                 received_counts, position, weight, source_row, row_expert, out, board, ident):
        """The kernel's body, after the routes are known (block b)."""
        with T.Scale("device") as (rank, _):  # world: the kernel factory's
            call = T.alloc_local((2,), "int32")
            T.count_call(sends, 1, call)  # call[0]: this call's number, 1, 2, ...
            recv = Received(recv_x, (call[0] - 1) % sets if sets > 1 else 0, recv_idx, recv_w, recv_slot,
                            recv_counts, recv_expert_counts, ranges, progress)
            layout = Layout(position, weight, source_row, row_expert, None if in_place else out, counts,
                            offsets, received_counts, recv.set * received if in_place else 0)
            # A group of rows with their entries' expert ids, weights and expert slots: read
            # once from x (or a receive buffer), used for every destination.
            tile = _Group(T.alloc_shared((group, hidden), dtype), T.alloc_shared((group, topk), "int32"),
                          T.alloc_shared((group, topk), "float32"), T.alloc_shared((group, topk), "int32"),
                          T.alloc_shared((group,), "int32"), T.alloc_shared((group, topk), "int32"),
                          vector_width(hidden, dtype))
            span = T.alloc_shared((2,), "int32")  # a group's first slot and rows, at one destination
            given = T.alloc_shared((world, per_rank), "int32")  # every source's entries of each expert
            got = T.alloc_shared((world,), "int32")  # every source's rows
            upto = T.alloc_shared((world, per_rank), "int32")
            end = T.alloc_shared((per_rank,), "int32")
            seg = Segments(given, got, upto, end, world, per_rank)
            if b < world:  # the counts first: a receiver needs every source's to place any row
                T.announce(board, ident)  # released by the signal below: the receiver checks it
                T.copy(send_counts[b:b + 1], recv.counts[recv.set, rank:rank + 1], dst_pe=b)
                T.copy(expert_counts[b * per_rank:b * per_rank + per_rank],
                       recv.expert_counts[recv.set, rank, 0:per_rank], dst_pe=b)
                T.signal(arrived[rank], call[0], pe=b)
            for g in T.serial(groups + 1):
                # Group g read, sent to the peers, then placed here; group g - 1 of each peer's
                # block b placed meanwhile (it has had a group's time to arrive).
                if g < groups and _group_tokens(b, g, chunk, group, held) > 0:
                    _load(x, topk_idx, topk_w, expert_slot, b * chunk + g * group, tile)
                if world > 1 and g < groups:
                    for j in T.serial(world - 1):
                        _put_group(tile, slot, span, recv, b * chunk + g * group,
                                   _group_tokens(b, g, chunk, group, held), _peer(b, j, world), b, g)
                    # Announced once every peer's rows are out: the first signal waits for all
                    # of the block's stores to land, the others find nothing left to wait for.
                    for j in T.serial(world - 1):
                        T.signal(recv.progress[recv.set, rank, b], g + 1, pe=_peer(b, j, world))
                if g == 0:
                    for src in T.serial(world):  # "ge": a peer may be a call ahead (module notes)
                        T.wait(arrived[src], "ge", call[0], agree=(board, ident))
                    segments(recv.expert_counts, recv.counts, recv.set, seg)
                if g < groups and _group_tokens(b, g, chunk, group, held) > 0:
                    for i in T.Parallel(group):  # this rank's own tokens among them: received rows
                        tile.where[i] = T.if_then_else(
                            i < _group_tokens(b, g, chunk, group, held)
                            and slot[rank, T.min(b * chunk + g * group + i, held - 1)] >= 0,
                            rank * capacity + slot[rank, T.min(b * chunk + g * group + i, held - 1)],
                            -1)
                    place(tile, seg, layout, capacity)
                    if in_place:  # this rank's own rows join the peers' in its receive rows
                        for i in T.serial(group):
                            if tile.where[i] >= 0:
                                T.copy(tile.rows[i, 0:hidden],
                                       recv.x[recv.set, rank, tile.where[i] - rank * capacity, 0:hidden],
                                       coalesced_width=tile.vector)
                if world > 1 and g > 0:
                    for j in T.serial(world - 1):
                        _take_group(_peer(b, j, world), b, g - 1, groups, tile, span, seg, recv, layout, capacity)
            finish(b, blocks, seg, layout, capacity, topk, rows)
            if sets == 1:
                T.barrier()  # every rank has taken its rows out of the one set of receive buffers

    if route_ids is None:
        @T.prim_func
        def main(x: T.Tensor((held, hidden), dtype), topk_idx: T.Tensor((held, topk), "int32"),
                 topk_w: T.Tensor((held, topk), "float32"), expert_slot: T.Tensor((held, topk), "int32"),
                 slot: T.Tensor((world, held), "int32"), send_counts: T.Tensor((world,), "int32"),
                 expert_counts: T.Tensor((world * per_rank,), "int32"),
                 recv_x: T.Tensor((sets, world, capacity, hidden), dtype),
                 recv_idx: T.Tensor((sets, world, capacity, topk), "int32"),
                 recv_w: T.Tensor((sets, world, capacity, topk), "float32"),
                 recv_slot: T.Tensor((sets, world, capacity, topk), "int32"),
                 recv_counts: T.Tensor((sets, world), "int32"),
                 recv_expert_counts: T.Tensor((sets, world, per_rank), "int32"),
                 ranges: T.Tensor((sets, world, blocks, groups, 2), "int32"),
                 progress: T.Tensor((sets, world, blocks), "int32"),
                 arrived: T.Tensor((world,), "int32"), sends: T.Tensor((3,), "int32"),
                 counts: T.Tensor((per_rank,), "int32"), offsets: T.Tensor((per_rank,), "int32"),
                 received_counts: T.Tensor((world,), "int32"), position: T.Tensor((received, topk), "int32"),
                 weight: T.Tensor((rows,), "float32"), source_row: T.Tensor((rows,), "int32"),
                 row_expert: T.Tensor((rows,), "int32"), out: T.Tensor((1 if in_place else rows, hidden), dtype),
                 board: T.Tensor((2 * world,), "int64"), ident: T.int64):
            with T.Kernel(blocks, threads=128) as b:
                T.annotate_min_blocks_per_sm(blocks_per_sm(row_bytes))  # registers for every block to be resident
                exchange(b, x, topk_idx, topk_w, expert_slot, slot, send_counts, expert_counts, recv_x, recv_idx,
                         recv_w, recv_slot, recv_counts, recv_expert_counts, ranges, progress, arrived, sends, counts,
                         offsets, received_counts, position, weight, source_row, row_expert, out, board, ident)

        return main

    @T.prim_func
    def routed(x: T.Tensor((held, hidden), dtype), topk_idx: T.Tensor((held, topk), route_ids),
               topk_w: T.Tensor((held, topk), "float32"), dest: T.Tensor((world, held), "int32"),
               slot: T.Tensor((world, held), "int32"), send_counts: T.Tensor((world,), "int32"),
               expert_slot: T.Tensor((held, topk), "int32"), expert_counts: T.Tensor((num_experts,), "int32"),
               bad: T.Tensor((1,), "int32"), ids: T.Tensor((held, topk), "int32"),
               recv_x: T.Tensor((sets, world, capacity, hidden), dtype),
               recv_idx: T.Tensor((sets, world, capacity, topk), "int32"),
               recv_w: T.Tensor((sets, world, capacity, topk), "float32"),
               recv_slot: T.Tensor((sets, world, capacity, topk), "int32"),
               recv_counts: T.Tensor((sets, world), "int32"),
               recv_expert_counts: T.Tensor((sets, world, per_rank), "int32"),
               ranges: T.Tensor((sets, world, blocks, groups, 2), "int32"),
               progress: T.Tensor((sets, world, blocks), "int32"),
               arrived: T.Tensor((world,), "int32"), sends: T.Tensor((3,), "int32"),
               counts: T.Tensor((per_rank,), "int32"), offsets: T.Tensor((per_rank,), "int32"),
               received_counts: T.Tensor((world,), "int32"), position: T.Tensor((received, topk), "int32"),
               weight: T.Tensor((rows,), "float32"), source_row: T.Tensor((rows,), "int32"),
               row_expert: T.Tensor((rows,), "int32"), out: T.Tensor((1 if in_place else rows, hidden), dtype),
               board: T.Tensor((2 * world,), "int64"), bad_host: T.int64, ident: T.int64):
        with T.Kernel(blocks, threads=128) as b:
            T.annotate_min_blocks_per_sm(blocks_per_sm(row_bytes))
            route_block(topk_idx, held, b, chunk, world, num_experts, dest, slot, send_counts, expert_slot,
                        expert_counts, bad, ids, bad_host)
            T.sync_threads()  # the block's routes, in global memory, seen by all its threads
            exchange(b, x, ids, topk_w, expert_slot, slot, send_counts, expert_counts, recv_x, recv_idx, recv_w,
                     recv_slot, recv_counts, recv_expert_counts, ranges, progress, arrived, sends, counts, offsets,
                     received_counts, position, weight, source_row, row_expert, out, board, ident)

    return routed


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
    T.copy(x[t0:t0 + group, 0:tile.rows.shape[1]], tile.rows, coalesced_width=tile.vector)
    T.copy(topk_idx[t0:t0 + group, 0:tile.ids.shape[1]], tile.ids)
    T.copy(topk_w[t0:t0 + group, 0:tile.ids.shape[1]], tile.ws)
    T.copy(expert_slot[t0:t0 + group, 0:tile.ids.shape[1]], tile.eslots)


@T.macro
def _put_group(tile, slot, span, recv, t0, n, d, b, g):
    """The group's tokens ``t0 .. t0 + n - 1`` that go to rank d into its receive buffers (row,
    expert ids, weights, expert slots, at their slots there), then the group's slot range into
    ``ranges[set, rank, b, g]`` there; the caller then raises the peer's progress flag of this
    block to g + 1 (also for a group with no token: the receiver waits for every group of the
    plan)."""
    hidden, topk = tile.rows.shape[1], tile.ids.shape[1]
    first, sent = T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32")  # per thread: no race
    first[0] = 0
    sent[0] = 0
    for i in T.serial(n):
        if slot[d, t0 + i] >= 0:
            T.copy(tile.rows[i, 0:hidden], recv.x[recv.set, _rank(), slot[d, t0 + i], 0:hidden], dst_pe=d,
                   coalesced_width=tile.vector)
            T.copy(tile.ids[i:i + 1, 0:topk], recv.idx[recv.set, _rank(), slot[d, t0 + i], 0:topk],
                   dst_pe=d)
            T.copy(tile.ws[i:i + 1, 0:topk], recv.w[recv.set, _rank(), slot[d, t0 + i], 0:topk],
                   dst_pe=d)
            T.copy(tile.eslots[i:i + 1, 0:topk], recv.slot[recv.set, _rank(), slot[d, t0 + i], 0:topk],
                   dst_pe=d)
            if sent[0] == 0:
                first[0] = slot[d, t0 + i]  # slots grow with the token: the rest follow
            sent[0] = sent[0] + 1
    span[0] = first[0]
    span[1] = sent[0]
    T.copy(span, recv.ranges[recv.set, _rank(), b, g, 0:2], dst_pe=d)


@T.macro
def _take_group(src, b, g, groups, tile, span, seg, recv, layout, capacity):
    """Once it has arrived, group g of source src's block b: its rows placed at their experts'
    grouped rows (received row ``src * capacity + slot``; in place only their layout, the rows
    stay). After the last group, the flag goes back to 0 for the next call that writes this
    set, which starts after this one ends (module notes)."""
    group, hidden, topk = tile.rows.shape[0], tile.rows.shape[1], tile.ids.shape[1]
    T.wait(recv.progress[recv.set, src, b], "ge", g + 1)
    T.copy(recv.ranges[recv.set, src, b, g, 0:2], span)
    first, n = T.alloc_local((1,), "int32"), T.alloc_local((1,), "int32")
    first[0] = span[0]
    n[0] = span[1]
    if n[0] > 0:
        if layout.out is not None:
            T.copy(recv.x[recv.set, src, first[0]:first[0] + group, 0:hidden], tile.rows, coalesced_width=tile.vector)
        T.copy(recv.idx[recv.set, src, first[0]:first[0] + group, 0:topk], tile.ids)
        T.copy(recv.w[recv.set, src, first[0]:first[0] + group, 0:topk], tile.ws)
        T.copy(recv.slot[recv.set, src, first[0]:first[0] + group, 0:topk], tile.eslots)
        for i in T.Parallel(group):
            tile.where[i] = T.if_then_else(i < n[0], src * capacity + first[0] + i, -1)
        place(tile, seg, layout, capacity)
    if g == groups - 1:
        recv.progress[recv.set, src, b] = 0
