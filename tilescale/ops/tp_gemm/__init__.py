"""Tensor-parallel GEMMs with communication overlapped tile by tile.

``all_gather_gemm(a_shard, weight)``: ``all_gather(a_shard) @ weight.T`` (column parallel).
A first kernel computes this rank's own row segment straight from ``a_shard`` while its rows
go to the peers, by the copy engines (copies on a side stream, each chunk followed by a
stream-ordered write of the call's epoch to the chunk's flag at the peer) or by pusher blocks
at the head of that kernel; a second kernel computes the peers' segments (``rank + 1, rank +
2, ...``), each tile waiting for the chunk of rows it reads. Segments are padded to whole row
tiles, so a tile never reads rows that have not arrived.

``gemm_reduce_scatter(a, weight)``: one kernel. A tile of a peer's row segment goes, as a
partial, into that peer's receive buffer with a signal; the tiles of this rank's own segment
come last and add the peers' partials to their accumulators before the one store.
``gemm_all_reduce(a, weight)``, decode sizes: one kernel in which each tile's blocks exchange
partials with every rank and sum them (K split across blocks where the tiles are few); larger
M: the reduce-scatter kernel whose owners' tiles, once summed, also go to every peer, then a
kernel copying the peers' segments into place. Where neither fits (K split for the
reduce-scatter or the larger all-reduce), a GEMM kernel pushes partial tiles and a reduction
kernel sums them once its flags say they have landed.

Flags only grow: each call adds one "epoch" of arrivals, and waits compare against the
running total, so no flag is ever reset between calls (which would race with a fast peer);
flags are per sender, so a peer already in its next call cannot stand in for a slow one.
The call count and that total live on the device, advanced by each call's first kernel
(``T.count_call``: its blocks read them, its last block advances them; a second kernel reads
the advanced ones), so a fused call launches only its own kernels and a call captured in a
CUDA graph advances them on every replay (the copy-engine all-gather counts on the host, so
captures take the pushers' plan).
Every fused call announces itself (op, shapes, tile, plan: its signature, and a call number)
on the job's call board before it signals, and its waits check the peers' announcements:
ranks whose calls differ get ``ts.ShapeMismatchError``, not each other's data (README "When
ranks disagree"). Zero rows on every rank give an empty result without a kernel.
Each op picks ``plan="fused"`` or the non-overlapped ``plan="unfused"`` (torch.distributed
collective + torch matmul): on GPUs by the GEMM's waves against the collective's bytes
(``_fused_wins``), elsewhere from the shape; pass ``plan`` to force one.

Modules: ``plan`` (fused or not, the tile by the wave model, the GEMM grid), ``kernels``
(the ``@jit`` kernels), ``exchange`` (symmetric buffers, flags, call counts),
``all_gather`` and ``reduce`` (the ops' host side).
"""

from tilescale.ops.tp_gemm.all_gather import COPY_ENGINE_MIN_BYTES, PRODUCERS, all_gather_gemm, default_producer
from tilescale.ops.tp_gemm.kernels import (
    ag_own_gemm_kernel,
    ag_peer_gemm_kernel,
    all_reduce_gemm_kernel,
    announce_kernel,
    gather_segments_kernel,
    gemm_push_kernel,
    gemm_reduce_scatter_kernel,
    sum_received_kernel,
)
from tilescale.ops.tp_gemm.plan import (
    FUSED_MIN_ROWS,
    PUSH_CHOICES,
    TILE_RATES,
    GemmGrid,
    _choose,
    _fused_wins,
    choose_push_blocks,
    choose_tile,
    chunk_tiles,
    k_splits,
    kernel_tiles,
    one_kernel_wins,
    own_kernel_us,
    reduce_grid,
    scatter_tile,
    useful_share,
    wave_efficiency,
)
from tilescale.ops.tp_gemm.reduce import gemm_all_reduce, gemm_reduce_scatter

__all__ = ["COPY_ENGINE_MIN_BYTES", "FUSED_MIN_ROWS", "PRODUCERS", "PUSH_CHOICES", "TILE_RATES", "GemmGrid",
           "_choose", "_fused_wins", "ag_own_gemm_kernel", "ag_peer_gemm_kernel", "all_gather_gemm",
           "all_reduce_gemm_kernel", "announce_kernel", "choose_push_blocks", "choose_tile", "chunk_tiles",
           "default_producer", "gather_segments_kernel", "gemm_all_reduce", "gemm_push_kernel",
           "gemm_reduce_scatter", "gemm_reduce_scatter_kernel", "k_splits", "kernel_tiles", "one_kernel_wins",
           "own_kernel_us", "reduce_grid", "scatter_tile", "sum_received_kernel", "useful_share", "wave_efficiency"]
