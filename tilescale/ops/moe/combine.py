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


def exchange_blocks(world: int, tokens: int, sms: int) -> int:
    """Blocks of the combine kernel: one per SM at most (so that device-wide barriers hold),
    but no fewer than the ranks.

    Args:
        world: Ranks of the group.
        tokens: Token slots per source (the buffer's capacity).
        sms: SMs of the GPU.

    Returns:
        int: ``max(min(world * tokens, sms), world)``.
    """
    return max(min(world * tokens, sms), world)


@jit
def combine_kernel(world: int, tokens: int, hidden: int, topk: int, rows: int, dtype: str, sms: int,
                   capacity: int | None = None):
    """Sum each received row's weighted expert outputs, put it back into its source's
    ``back[set, rank]`` slot, then (once every rank's rows are back) sum each token's rows.
    Set ``combines[0] % 2``, advanced after the barrier, as the dispatch does with its sets.
    ``tokens`` and ``capacity`` as the dispatch kernel's (``out`` holds one unused row for 0
    tokens); the blocks derive from ``capacity``, the same on every rank.

    Args:
        world: Ranks of the group.
        tokens: This rank's tokens (0 allowed).
        hidden: Channels per row.
        topk: Experts per token.
        rows: Grouped rows of ``expert_out`` (the buffer's bound).
        dtype: TileLang dtype of the rows.
        sms: SMs of the GPU (:func:`exchange_blocks`).
        capacity: Token slots per source, the same on every rank; None: ``tokens``.

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    capacity = tokens if capacity is None else capacity
    held = max(tokens, 1)
    received = world * capacity
    blocks = exchange_blocks(world, capacity, sms)
    # A row's registers: whole 16-byte vectors for each of the 128 threads (TileLang lays a
    # fragment out only over whole thread shares), so rows of any length move 16 bytes at a
    # time; the channels past ``hidden`` are never read or stored.
    vector = vector_width(hidden, dtype)
    width = -(-hidden // (128 * vector)) * 128 * vector

    @T.prim_func
    def main(expert_out: T.Tensor((rows, hidden), dtype), weight: T.Tensor((rows,), "float32"),
             position: T.Tensor((received, topk), "int32"), counts: T.Tensor((world,), "int32"),
             dest: T.Tensor((world * held,), "int32"), slot: T.Tensor((world * held,), "int32"),
             back: T.Tensor((2, world, capacity, hidden), dtype), out: T.Tensor((held, hidden), dtype),
             combines: T.Tensor((1,), "int32"), sig: T.int32):
        with T.Kernel(blocks, threads=128) as bx:
            with T.Scale("device") as (rank, _):  # world: the kernel factory's
                acc = T.alloc_fragment((1, width), "float32")
                part = T.alloc_fragment((1, width), dtype)  # past hidden: never loaded, summed, or stored
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
                        T.clear(acc)
                        for k in T.serial(topk):
                            if position[src * capacity + j, k] >= 0:
                                for i, c in T.Parallel(1, width):  # every load issued before the sums
                                    if c < hidden:
                                        part[i, c] = expert_out[position[src * capacity + j, k], c]
                                for i, c in T.Parallel(1, width):
                                    acc[i, c] += T.cast(part[i, c], "float32") * weight[position[src * capacity + j, k]]
                        T.copy(acc, row)
                        T.copy(row[0:1, 0:hidden], back[s, rank, j:j + 1, 0:hidden], dst_pe=src, coalesced_width=vector)
                agreed = T.alloc_local((1,), "int32")
                agreed[0] = T.agree(sig)  # every rank's rows are back, if every rank runs this combine
                if bx == 0:
                    combines[0] = call[0] + 1  # every thread stores the same value
                # Token t's row from destination rank d is back[s, d, slot[d * held + t]].
                for q in T.serial(T.ceildiv(tokens, blocks)):
                    t = bx + q * blocks
                    if t < tokens and agreed[0] == 1:
                        T.clear(acc)
                        for d in T.serial(world):
                            if dest[d * held + t] >= 0:
                                for i, c in T.Parallel(1, width):
                                    if c < hidden:
                                        part[i, c] = back[s, d, slot[d * held + t], c]
                                for i, c in T.Parallel(1, width):
                                    acc[i, c] += T.cast(part[i, c], "float32")
                        T.copy(acc, row)
                        T.copy(row[0:1, 0:hidden], out[t:t + 1, 0:hidden], coalesced_width=vector)
                    elif t < tokens:
                        for c in T.Parallel(hidden):
                            out[t, c] = poison_value(dtype)

    return main
