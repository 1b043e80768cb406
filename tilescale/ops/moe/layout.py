"""The grouped layout a dispatch leaves on the receiving rank, and the kernel macros that write it.

Expert e's segment starts at the sum of the padded segments before it (segments padded to
whole ``ROW_TILE``-row GEMM tiles), and source src's entries of e start at ``base[src, e]``
in it: entry (token, k) of local expert e goes to grouped row ``base[src, e] +
expert_slot``, so each segment holds its entries in (source, token, k) order,
deterministically, without a scan over the rows.
"""

from dataclasses import dataclass

import tilescale.language as T
from tilescale import runtime
from tilescale.language.scale import current_context

# Each expert's segment of the grouped rows is padded to whole GEMM row tiles.
ROW_TILE = 128
# Grouped rows per step of the fill of rows holding no entry.
FILL = 1024


def grouped_rows(tokens: int, topk: int, experts_per_rank: int, *, group=None) -> int:  # noqa: ANN001 - a ProcessGroup
    """Rows of ``moe_dispatch``'s grouped output: every (received row, local expert) hit of
    the worst case, plus each expert's padding to a whole row tile.

    Args:
        tokens: the most tokens a rank sends (its ``max_tokens``).
        topk: experts per token.
        experts_per_rank: local experts.
        group: the expert-parallel group (None: the whole job).

    Returns:
        The rows, a multiple of ``ROW_TILE``.
    """
    hits = runtime.group_size(group) * tokens * min(topk, experts_per_rank)
    return -(-(hits + experts_per_rank * (ROW_TILE - 1)) // ROW_TILE) * ROW_TILE


@dataclass(frozen=True)
class Layout:
    """The dispatch kernel's outputs (its prim_func parameters), bundled for its macros."""

    position: object  # (world * capacity, topk) grouped row of each received row's entries, -1 for none
    weight: object  # (rows,) routing weight of each grouped row
    source_row: object  # (rows,) received row (plus row_base) of each grouped row, -1 for none
    row_expert: object  # (rows,) local expert of each grouped row, -1 for none
    out: object  # (rows, hidden) the grouped rows; None in place (no row is written)
    counts: object  # (per_rank,) entries of each local expert
    offsets: object  # (per_rank,) first grouped row of each local expert
    received_counts: object  # (world,) rows received from each source
    row_base: object = 0  # added to the received rows in source_row: in place, the first row of the call's set


@dataclass(frozen=True)
class Segments:
    """A dispatch block's view of every source's counts (shared tiles) and the layout they give."""

    given: object  # (world, per_rank) every source's entries of each expert
    got: object  # (world,) every source's rows
    upto: object  # (world, per_rank) inclusive prefix of ``given`` over sources
    end: object  # (per_rank,) inclusive prefix of the experts' padded segments
    world: int
    per_rank: int


def _rank():
    """This rank, inside a kernel's ``T.Scale("device")``: the macros reach it without a parameter."""
    return current_context().rank


def _first_expert(per_rank: int):
    """This rank's first expert, inside a kernel's ``T.Scale("device")``."""
    return _rank() * per_rank


@T.macro
def segments(recv_expert_counts, recv_counts, s, seg):
    """Every source's counts into ``seg.given`` (entries per expert) and ``seg.got`` (rows);
    ``seg.upto``, the (source, expert) entry counts summed over sources; ``seg.end``, the
    inclusive prefix of the experts' padded segments.

    Args:
        recv_expert_counts: (sets, world, per_rank) entries of each local expert from each source (symmetric,
            received).
        recv_counts: (sets, world) rows from each source (symmetric, received).
        s: The set of counts this call's sources wrote.
        seg: The block's :class:`Segments` tiles, written here.
    """
    T.copy(recv_expert_counts[s, 0:seg.world, 0:seg.per_rank], seg.given)
    T.copy(recv_counts[s, 0:seg.world], seg.got)
    # Each source's row added to the sum before it, every expert at once: T.cumsum along
    # dim 0 scans each column with a warp's shuffles, one column after another (64 scans a
    # warp for 256 experts), which took ~40% of the low-latency dispatch kernel's warp time
    # on one H100.
    T.copy(seg.given, seg.upto)
    for src in T.serial(1, seg.world):
        for e in T.Parallel(seg.per_rank):
            seg.upto[src, e] = seg.upto[src - 1, e] + seg.given[src, e]
    for e in T.Parallel(seg.per_rank):
        seg.end[e] = _padded(seg, e)
    T.cumsum(src=seg.end, dim=0)


def _padded(seg, e):
    """Rows of expert e's segment: its entries rounded up to whole row tiles."""
    return T.ceildiv(seg.upto[seg.world - 1, e], ROW_TILE) * ROW_TILE


def _base(seg, src, e):
    """First grouped row of source src's entries of expert e."""
    return seg.end[e] - _padded(seg, e) + seg.upto[src, e] - seg.given[src, e]


def _padding_row(seg, e, i):
    """Row i of expert e's segment past its entries, or -1 past the segment's end."""
    return T.if_then_else(seg.upto[seg.world - 1, e] + i < _padded(seg, e),
                          seg.end[e] - _padded(seg, e) + seg.upto[seg.world - 1, e] + i, -1)


@T.macro
def place(tile, seg, layout, capacity):
    """The group's rows that are received rows (``tile.where[i] >= 0``, slot ``where % capacity``
    of source ``src = where // capacity``): entry k of local expert e goes to grouped row
    ``base[src, e] + eslots[i, k]``. Records each entry's grouped row in ``position`` (-1 for
    other ranks' experts), per grouped row its weight, source row and expert, and writes the
    row to each (not in place: ``layout.out`` None).

    Args:
        tile: The block's tiles of received rows (rows, ids, weights, expert slots, receive row ``where``).
        seg: The :class:`Segments` from :func:`segments`.
        layout: The dispatch's :class:`Layout` outputs, written here.
        capacity: Receive slots per source.
    """
    group, hidden, topk = tile.rows.shape[0], tile.rows.shape[1], tile.ids.shape[1]
    per_rank = seg.per_rank
    for i, k in T.Parallel(group, topk):
        tile.pos[i, k] = T.if_then_else(
            tile.where[i] >= 0 and _first_expert(per_rank) <= tile.ids[i, k]
            and tile.ids[i, k] < _first_expert(per_rank) + per_rank,
            _base(seg, T.max(tile.where[i], 0) // capacity,
                  T.max(T.min(tile.ids[i, k] - _first_expert(per_rank), per_rank - 1), 0)) + tile.eslots[i, k], -1)
    for i, k in T.Parallel(group, topk):
        if tile.where[i] >= 0:
            layout.position[tile.where[i], k] = tile.pos[i, k]
    for i, k in T.Parallel(group, topk):
        if tile.pos[i, k] >= 0:
            layout.weight[tile.pos[i, k]] = tile.ws[i, k]
    for i, k in T.Parallel(group, topk):
        if tile.pos[i, k] >= 0:
            layout.source_row[tile.pos[i, k]] = tile.where[i] + layout.row_base
    for i, k in T.Parallel(group, topk):
        if tile.pos[i, k] >= 0:
            layout.row_expert[tile.pos[i, k]] = tile.ids[i, k] - _first_expert(per_rank)
    if layout.out is not None:
        for i in T.serial(group):
            for k in T.serial(topk):
                if tile.pos[i, k] >= 0:
                    T.copy(tile.rows[i, 0:hidden], layout.out[tile.pos[i, k], 0:hidden], coalesced_width=tile.vector)


@T.macro
def finish(b, blocks, seg, layout, capacity, topk, rows):
    """What no row placement writes, shared out over the blocks: the entries of receive slots
    past their source's count (-1), the grouped rows holding no entry (each expert's padding
    and the rows past the last segment: weight 0, source row and expert -1), and (block 0)
    each expert's count and first row and the rows received from each source.

    Args:
        b: This block's index.
        blocks: Blocks of the kernel.
        seg: The :class:`Segments` from :func:`segments`.
        layout: The dispatch's :class:`Layout` outputs, written here.
        capacity: Receive slots per source.
        topk: Experts per token.
        rows: Grouped rows of the outputs.
    """
    world, per_rank = seg.world, seg.per_rank
    for q in T.serial(T.ceildiv(world * capacity, blocks)):
        if b + q * blocks < world * capacity and (b + q * blocks) % capacity >= seg.got[
                T.min((b + q * blocks) // capacity, world - 1)]:
            for k in T.Parallel(topk):
                layout.position[b + q * blocks, k] = -1
    for q in T.serial(T.ceildiv(per_rank, blocks)):
        if b + q * blocks < per_rank:
            for i in T.Parallel(ROW_TILE):
                _reset_row(_padding_row(seg, b + q * blocks, i), _padding_row(seg, b + q * blocks, i) >= 0, layout)
    for q in T.serial(T.ceildiv(rows, FILL * blocks)):
        for i in T.Parallel(FILL):
            _reset_row((q * blocks + b) * FILL + i,
                       (q * blocks + b) * FILL + i >= seg.end[per_rank - 1] and (q * blocks + b) * FILL + i < rows,
                       layout)
    if b == 0:
        for e in T.Parallel(per_rank):
            layout.counts[e] = seg.upto[world - 1, e]
        for e in T.Parallel(per_rank):
            layout.offsets[e] = seg.end[e] - _padded(seg, e)
        for src in T.Parallel(world):
            layout.received_counts[src] = seg.got[src]


@T.macro
def _reset_row(p, holds_none, layout):
    """Grouped row ``p`` marked as holding no entry (weight 0, source row and expert -1) where
    ``holds_none``; called inside a parallel loop."""
    if holds_none:
        layout.weight[p] = 0.0
    if holds_none:
        layout.source_row[p] = -1
    if holds_none:
        layout.row_expert[p] = -1
