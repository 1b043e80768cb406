"""Distributed shared memory (Hopper): tiles of the other blocks of a thread-block cluster.

Example (split-K: every block of a cluster of 4 reduces one quarter of the partial sums)::

    with T.Kernel(N // 128, 4, threads=128, cluster_dims=(1, 4, 1)) as (bx, by):
        with T.Scale("cta_cluster") as (cta_rank, cluster_size):
            partial = T.alloc_shared((64, 128), "float32")     # this block's K-partial
            inbox = T.alloc_shared((4, 16, 128), "float32")    # quarter rows from every block
            ...                                                # partial = A[:, my K] @ B[my K, :]
            T.barrier()                                        # every inbox is free
            for r in T.serial(cluster_size):
                T.copy(partial[r * 16, 0], inbox[cta_rank, 0, 0], dst_cta=r)
            T.barrier()                                        # every quarter has landed
            ...                                                # sum inbox over its first axis

``T.copy(src, dst, dst_cta=r)`` writes into block ``r``'s copy of the shared tile ``dst``;
``T.copy(src, dst, src_cta=r)`` reads block ``r``'s copy of ``src``. The remote side is a
view of the peer's tile at the generic address ``mapa`` gives, so TileLang lowers the copy
like any other (vectorised loads and stores, which reach the peer's shared memory through
the SM-to-SM network); only its TMA lowering is turned off, as bulk copies to global
memory cannot target another block's shared memory.

Rules, as in CUDA's distributed shared memory:

* Remote accesses are ordinary (generic-proxy) loads and stores: ``T.barrier()`` in the
  ``"cta_cluster"`` scope (``barrier.cluster.arrive.release`` + ``wait.acquire``) makes a
  block's writes visible to the whole cluster, and orders reads before later overwrites.
* Put into a peer's tile only after a ``T.barrier()`` that follows the peer's last other
  use of that memory (TileLang may place several tiles in the same shared memory when
  their lifetimes do not overlap), and let no block finish while another may still read
  its tiles: end with a ``T.barrier()`` after the last remote read.
* The remote side is addressed in the tile's logical row-major layout. A tile that
  TileLang lays out otherwise (an operand of ``T.gemm``, which it swizzles) must not be a
  remote side; copy it to or from a plain tile.
"""

from __future__ import annotations

import tilelang.language as tl
from tvm import tirx

from tilescale.language.scale import current_context

# The externs the CPU path interprets (tilescale.interpreter) and the prelude defines.
MAP_EXTERN = "tilescale::cluster_map"
BARRIER_EXTERN = "tilescale::cluster_barrier"


def _cluster_size(what: str) -> int:
    ctx = current_context()
    if ctx.cluster_size is None:
        raise RuntimeError(
            f'{what} reaches another block of the cluster: it must be inside `with T.Scale("cta_cluster")`, '
            "in a T.Kernel launched with cluster_dims=..."
        )
    return ctx.cluster_size


def peer_tile(buf: tirx.Buffer, cta: int | tirx.PrimExpr, what: str) -> tirx.Buffer:
    """A view of block ``cta``'s copy of the shared tile ``buf`` (``cta``: rank in the cluster).

    Example::

        left = peer_tile(tile, (cta_rank + cluster_size - 1) % cluster_size, "halo exchange")

    Args:
        buf: A shared-memory tile (``T.alloc_shared``) of this block.
        cta: The block's rank in the cluster, in ``[0, cluster_size)`` (constant or runtime expression).
        what: The operation's name, used in error messages.

    Returns:
        tirx.Buffer: A buffer with ``buf``'s shape, dtype and strides at block ``cta``'s address of the tile.

    Raises:
        RuntimeError: not inside ``T.Scale("cta_cluster")`` of a kernel launched with ``cluster_dims``.
        TypeError: ``buf`` is not a shared-memory tile.
        IndexError: a constant ``cta`` is outside the cluster.
    """
    size = _cluster_size(what)
    if not buf.scope().startswith("shared") or buf.scope() == "shared.cluster_barrier":
        raise TypeError(
            f"{what} '{buf.name}' is a {buf.scope()} buffer; only shared-memory tiles (T.alloc_shared) live "
            "in the other blocks of a cluster"
        )
    rank = cta.value if isinstance(cta, tirx.IntImm) else cta
    if isinstance(rank, int) and not 0 <= rank < size:
        raise IndexError(f"{what} '{buf.name}': block {rank} out of range for a cluster of {size} blocks")
    base = tl.address_of(tirx.BufferLoad(buf, [0] * len(buf.shape)))
    address = tl.call_extern("int64", MAP_EXTERN, base, cta)
    strides = list(buf.strides) if len(buf.strides) else None
    return tl.make_tensor_from_addr(address, list(buf.shape), str(buf.dtype), strides=strides)


def cluster_barrier() -> tirx.PrimExpr:
    """Every thread of every block of the cluster arrives (release) and waits (acquire)."""
    _cluster_size("T.barrier()")
    return tl.call_extern("handle", BARRIER_EXTERN)
