"""The combine kernel: each token's expert outputs, weighted, back on its source rank.

Each received row's expert outputs are summed with their routing weights on the expert side
and put back into the source rank's slot; after the exchange (``T.agree``: every rank's rows
are back, if every rank runs this combine) each token sums its rows from its destination
ranks. The combine reads its returned rows after its barrier, so its buffers come in two
sets, used by alternate calls: a rank writes a set again only after passing the barrier of
the call in between, which no rank reaches before it has read that set.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import tilescale.language as T
from tilescale.jit import jit
from tilescale.ops._common import poison_value, vector_width

# Rows a sum loads at once, and the row registers each thread may hold for them (elements):
# with one row at a time a block kept 14 KB of loads in flight, too few to hide HBM's latency
# (the combine at 1.64x its HBM floor on one H100).
LOADS = 4
ROW_REGISTERS = 256
# Blocks resident per SM: two, for twice the loads in flight (a block of 128 threads never
# needs more than half an SM's registers, and its shared memory is one row).
BLOCKS_PER_SM = 2


def exchange_blocks(world: int, tokens: int, sms: int) -> int:
    """Blocks of the combine kernel: ``BLOCKS_PER_SM`` per SM at most (so that device-wide
    barriers hold: every block resident), but no fewer than the ranks.

    Args:
        world: Ranks of the group.
        tokens: Token slots per source (the buffer's capacity).
        sms: SMs of the GPU.

    Returns:
        int: ``max(min(world * tokens, BLOCKS_PER_SM * sms), world)``.
    """
    return max(min(world * tokens, BLOCKS_PER_SM * sms), world)


@jit
def combine_kernel(world: int, capacity: int, hidden: int, topk: int, rows: int, dtype: str, sms: int):
    """Sum each received row's weighted expert outputs, put it back into its source's
    ``back[set, rank]`` slot, then (once every rank's rows are back) sum each token's rows.
    Set ``combines[0] % 2``, advanced after the barrier, as the dispatch does with its sets.
    This rank's token count is a dynamic size, as the dispatch kernel's (``out`` holds one
    row, routed nowhere, for no tokens); the blocks derive from ``capacity``, the same on every rank.

    Args:
        world: Ranks of the group.
        capacity: Token slots per source, the same on every rank.
        hidden: Channels per row.
        topk: Experts per token.
        rows: Grouped rows of ``expert_out`` (the buffer's bound).
        dtype: TileLang dtype of the rows.
        sms: SMs of the GPU (:func:`exchange_blocks`).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    held = T.dynamic("tokens")  # this rank's tokens, at least one row
    received = world * capacity
    blocks = exchange_blocks(world, capacity, sms)
    # A row's registers: whole 16-byte vectors for each of the 128 threads (TileLang lays a
    # fragment out only over whole thread shares), so rows of any length move 16 bytes at a
    # time; the channels past ``hidden`` are never read or stored.
    vector = vector_width(hidden, dtype)
    width = -(-hidden // (128 * vector)) * 128 * vector
    loads = max(1, min(max(topk, world), LOADS, ROW_REGISTERS // (width // 128)))

    @T.prim_func
    def main(expert_out: T.Tensor((rows, hidden), dtype), weight: T.Tensor((rows,), "float32"),
             position: T.Tensor((received, topk), "int32"), counts: T.Tensor((world,), "int32"),
             dest: T.Tensor((world, held), "int32"), slot: T.Tensor((world, held), "int32"),
             back: T.Tensor((2, world, capacity, hidden), dtype), out: T.Tensor((held, hidden), dtype),
             combines: T.Tensor((1,), "int32"), sig: T.int32):
        with T.Kernel(blocks, threads=128) as bx:
            T.annotate_min_blocks_per_sm(BLOCKS_PER_SM)
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                acc = T.alloc_fragment((1, width), "float32")
                part = T.alloc_fragment((loads, width), dtype)  # past hidden: never loaded, summed, or stored
                ids = T.alloc_local((max(topk, world),), "int32")  # rows a sum may read, -1: none
                pick = T.alloc_shared((max(topk, world),), "int32")  # those it reads
                n = T.alloc_local((1,), "int32")
                row = T.alloc_shared((1, width), dtype)
                call = T.alloc_local((1,), "int32")
                call[0] = combines[0]
                s = call[0] % 2
                for q in T.serial(T.ceildiv(received - bx, blocks)):
                    # Sources interleaved (row j of source src at step j * ranks + src): the rows
                    # in flight go back to every rank at once, not to one rank from all.
                    src = (bx + q * blocks) % world
                    j = (bx + q * blocks) // world
                    if j < counts[src]:
                        for k in T.unroll(topk):  # the row's entries of this rank's experts, read at once
                            ids[k] = position[src * capacity + j, k]
                        _pick(ids, topk, pick, n)
                        _sum_rows(lambda r, c: expert_out[r, c], lambda r: weight[r], pick, n, part, acc, hidden)
                        T.copy(acc, row)
                        T.copy(row[0:1, 0:hidden], back[s, rank, j:j + 1, 0:hidden], dst_pe=src, coalesced_width=vector)
                agreed = T.alloc_local((1,), "int32")
                agreed[0] = T.agree(sig)  # every rank's rows are back, if every rank runs this combine
                if bx == 0:
                    combines[0] = call[0] + 1  # every thread stores the same value
                # Token t's row from destination rank d is back[s, d, slot[d, t]].
                for q in T.serial(T.ceildiv(held, blocks)):
                    t = bx + q * blocks
                    if t < held and agreed[0] == 1:
                        for d in T.unroll(world):  # the token's rows from its destination ranks, read at once
                            ids[d] = T.if_then_else(dest[d, t] >= 0, d * capacity + slot[d, t], -1)
                        _pick(ids, world, pick, n)
                        _sum_rows(lambda r, c: back[s, r // capacity, r % capacity, c], lambda r: 1.0, pick, n, part,
                                  acc, hidden)
                        T.copy(acc, row)
                        T.copy(row[0:1, 0:hidden], out[t:t + 1, 0:hidden], coalesced_width=vector)
                    elif t < held:
                        for c in T.Parallel(hidden):
                            out[t, c] = poison_value(dtype)

    return main


@T.macro
def _pick(ids, count, pick, n):
    """The ids of ``ids[0 .. count - 1]`` that are not -1, in order, into ``pick[0 .. n[0] - 1]``."""
    n[0] = 0
    for k in T.unroll(count):
        if ids[k] >= 0:
            pick[n[0]] = ids[k]
            n[0] = n[0] + 1


@T.macro
def _sum_rows(load, weight_of, pick, n, part, acc, hidden):
    """``acc`` = the sum of rows ``pick[0 .. n - 1]`` (``load(row, c)``), each times
    ``weight_of(row)``, in float32, in pick order; ``part.shape[0]`` rows loaded at once."""
    loads, width = part.shape
    T.clear(acc)
    for r in T.serial(T.ceildiv(n[0], loads)):
        for p, c in T.Parallel(loads, width):  # every load of these rows issued before the sums
            if c < hidden and r * loads + p < n[0]:
                part[p, c] = load(pick[r * loads + p], c)
        for p in T.unroll(loads):  # unrolled: the rows stay in registers
            if r * loads + p < n[0]:
                for i, c in T.Parallel(1, width):
                    acc[i, c] += T.cast(part[p, c], "float32") * weight_of(pick[r * loads + p])
