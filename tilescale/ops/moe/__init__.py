"""Expert-parallel MoE dispatch and combine: tokens cross to their experts' ranks and back.

Example::

    recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_weights, num_experts=64)
    y = ts.ops.moe_combine(expert_out, recv_w, handle)
    # or with buffers sized up front, each rank passing its own count of tokens:
    buf = ts.ops.moe.Buffer(ep, max_tokens=4096, hidden=7168, topk=8, num_experts=256)

Experts are split evenly over ranks (expert ``e`` lives on rank ``e // experts_per_rank``).
The modules, by role:

* ``routing``: on the sender, each (token, destination rank) pair's slot there and each
  (token, k) entry's order among its expert's entries (``router``: each chunk of tokens
  counted by its own block, then earlier chunks' counts added); the one check of
  expert ids (``expert_ids``, and the device's count of ids out of range, raised on the host
  once ready; -1 names no expert, as DeepEP's masked entries).
* ``dispatch``: the dispatch kernel, sending and receiving at once; ``layout``: the grouped
  layout it leaves (one flat ``(rows, hidden)`` tensor in which local expert ``l`` owns rows
  ``offsets[l]:offsets[l] + counts[l]``, segments padded to 128-row tiles), or in place
  (``in_place=True``) the same layout as an index into the receive rows, which
  ``ts.ops.grouped_gemm(..., index=)`` gathers through (no grouping copy).
* ``fp8``: FP8 rows in DeepEP's layout (e4m3 values, a float32 scale per 128 channels),
  moved as bytes by the same dispatch kernel.
* ``combine``: the combine kernel, each token's weighted expert outputs back on its rank.
* ``buffer``: ``Buffer``, the symmetric buffers of one group sized up front (DeepEP's
  ``Buffer``), and its host API; ``api``: the functional ops over a per-group cached buffer.

Three kernels per dispatch (two of routing, then the exchange; where ranks send at most 128
tokens, a decode batch, the exchange kernel routes its own tokens: one) and one per combine, no host
synchronisation, so a step can be captured in a CUDA graph and replayed. Ranks may pass
different token counts (0 included) up to a ``max_tokens`` the same on every rank: the
kernels' plans derive from it, and every call's agreement compares only what ranks must
agree on (hidden, top-k, experts, dtype, max tokens, mode).
"""

from tilescale.ops.moe.api import cached_buffer, moe_combine, moe_dispatch, moe_redispatch
from tilescale.ops.moe.buffer import Buffer, DispatchHandle
from tilescale.ops.moe.combine import combine_kernel, exchange_blocks
from tilescale.ops.moe.dispatch import GROUP_ROWS, dispatch_kernel, dispatch_plan
from tilescale.ops.moe.fp8 import dequantize_fp8, quantize_fp8
from tilescale.ops.moe.layout import ROW_TILE, grouped_rows
from tilescale.ops.moe.routing import (
    chunk_counts_shape,
    route_chunks,
    route_class,
    route_count_kernel,
    route_finish_kernel,
    router,
)

__all__ = [
    "GROUP_ROWS",
    "ROW_TILE",
    "Buffer",
    "DispatchHandle",
    "cached_buffer",
    "chunk_counts_shape",
    "combine_kernel",
    "dispatch_kernel",
    "dequantize_fp8",
    "dispatch_plan",
    "exchange_blocks",
    "grouped_rows",
    "moe_combine",
    "moe_dispatch",
    "moe_redispatch",
    "quantize_fp8",
    "route_chunks",
    "route_class",
    "route_count_kernel",
    "route_finish_kernel",
    "router",
]
