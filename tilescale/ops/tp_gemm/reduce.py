"""``gemm_reduce_scatter`` and ``gemm_all_reduce``: the row-parallel GEMMs whose partial
products are summed across the group (the package's docstring says how)."""

from collections.abc import Callable

import torch
import torch.distributed as dist

from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.op_launch import OpLaunch
from tilescale.ops._common import (
    call_board,
    check_same_across_ranks,
    op_plans,
    signature,
    sm_count,
    tl_dtype,
)
from tilescale.ops._gemm import SWAPPED_SLOT_ROWS, TileConfig
from tilescale.ops.tp_gemm.exchange import _exchange, _local_buffer
from tilescale.ops.tp_gemm.kernels import (
    _panel_dividing,
    all_reduce_gemm_kernel,
    gather_segments_kernel,
    gemm_push_kernel,
    gemm_reduce_scatter_kernel,
    parts_shape,
    sum_received_kernel,
)
from tilescale.ops.tp_gemm.plan import (
    FUSED_MIN_ROWS,
    HBM_GBPS,
    NCCL_GBPS,
    AgreedLaunch,
    GemmGrid,
    _cached_call,
    _check_pair,
    _choose,
    _fused_plan,
    _fused_wins,
    choose_tile,
    gemm_alone,
    one_kernel_wins,
    reduce_grid,
    scatter_tile,
)
from tilescale.plans import capturing

Launch = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _gemm_then_reduce(state: GroupState, a: torch.Tensor, weight: torch.Tensor, owners: int, grid: GemmGrid,
                      sig: int) -> Launch:
    """The plan of the GEMM pushing partial tiles, then the reduction kernel; ``grid`` is
    :func:`reduce_grid`'s, ``sig`` the call's signature (:func:`call_identity`)."""
    world, group = state.size, state.process_group
    (m, k), n = a.shape, weight.shape[0]
    rows = m // owners
    tile, padded, splits = grid.tile, grid.padded, grid.splits
    slots = world * splits
    ex = _exchange(state, ("rs" if owners > 1 else "ar", padded, n, a.dtype, splits), (slots * padded, n), a.dtype,
                   world)
    dtype = tl_dtype(a)
    push = gemm_push_kernel(world, dtype, m, k, n, owners, tile, splits, group=group)
    # Row r of a received block is contiguous in both views: padded rows come after it.
    reduce = sum_received_kernel(world, slots, dtype, padded * n, rows * n, sm_count(), group=group)
    received = ex.buffers.view(2 * slots, padded * n)
    board = call_board(state)
    return AgreedLaunch(OpLaunch([(push, lambda t, o, s: (*t, ex.buffers, ex.flags, ex.state, board, s[0])),
                                  (reduce, lambda t, o, s: (received, o[0].view(1, rows * n), ex.flags, ex.state,
                                                            board, s[0]))],
                                 [(rows, n)], group=group), state, sig)


def gemm_reduce_scatter(a: torch.Tensor, weight: torch.Tensor, plan: str | None = None,
                        tile: TileConfig | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Reduce-scatter over rows of ``a @ weight.T`` (row parallel), the sends overlapped with the GEMM.

    Example::

        y = ts.ops.gemm_reduce_scatter(h, w_rows)     # (M // world, N)

    ``a``: (M, K_local), M divisible by the world size and equal on every rank; ``weight``:
    (N, K_local). ``tile``: the fused kernel's GEMM tile (:func:`choose_tile`; K is split
    where its tiles are too few for the SMs, see :func:`k_splits`). ``group``: the
    tensor-parallel process group (None: the whole job); ``world`` is its size.

    Fused calls whose ranks differ (shapes, dtype, tile, K split) raise
    ``ts.ShapeMismatchError`` on every rank; zero rows on every rank give an empty result.

    Args:
        a: (M, K_local); M divisible by the group size and the same on every rank.
        weight: (N, K_local), ``a``'s dtype.
        plan: ``"fused"`` (tilescale kernels), ``"unfused"`` (cuBLAS + NCCL) or None: then
            ``TILESCALE_TP_PLAN``, else unfused for a group of one rank (the GEMM alone), by the link
            arithmetic on GPUs and from ``FUSED_MIN_ROWS`` output rows on the CPU path.
        tile: The fused kernels' GEMM tile; None picks one with :func:`choose_tile`.
        group: The tensor-parallel process group; None is the whole job.

    Returns:
        torch.Tensor: (M // world, N): rank r's rows ``[r * M // world:(r + 1) * M // world]`` of the sum.

    Raises:
        TypeError: ``a`` and ``weight`` differ in dtype, or the dtype is not supported (on GPUs
            the fused plan takes bfloat16 / float16: other dtypes run unfused by default).
        ValueError: not 2-D tensors with the same K, not contiguous on this rank's device, or an
            unknown ``plan``, or M not divisible by the group size;
            or the ranks' shapes or dtype differ at a shape's first call (checked on the host).
        ts.ShapeMismatchError: a later fused call differs across ranks (checked on the device).
    """
    key, out = _cached_call("gemm_reduce_scatter", a, weight, plan, tile, group)  # calls reuse its plan
    if out is not None:
        return out
    _check_pair(a, weight)
    state = runtime.group_state(group)
    world = state.size
    (m, k), n = a.shape, weight.shape[0]
    if m % world:
        raise ValueError(f"gemm_reduce_scatter needs M ({m}) divisible by the group size {world}")
    check_same_across_ranks(state, "gemm_reduce_scatter", [m, k, n, str(a.dtype)], every_call=m == 0)
    if m == 0:
        return a.new_empty(0, n)
    tile = tile or scatter_tile(m // world, n, world)
    grid = reduce_grid(m, k, n, world, tile)
    padded, tiles, splits = grid.padded, grid.tiles, grid.splits
    wins = _fused_wins(2 * m * k * n, [world * tiles * splits], (world - 1) * m * n * a.element_size() / world)
    if _choose(plan, m, wins, group, a.dtype) == "unfused":
        if world == 1:
            return op_plans.put(key, gemm_alone)(a, weight)

        def launch(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            out = torch.empty(m // world, n, dtype=a.dtype, device=a.device)
            dist.reduce_scatter_tensor(out, a @ weight.T, group=group)
            return out

        return op_plans.put(key, launch)(a, weight)
    # Remote writes go only to the peers' copies of this call's own exchange (symmetric, sized
    # alike on every rank), so a peer whose call differs is not written out of bounds.
    sig = signature("gemm_reduce_scatter", a, f"N={n}", tile, f"splits={splits}")
    if splits > 1:  # K parts are separate partial tiles: the reduction kernel sums them
        two_kernels = _gemm_then_reduce(state, a, weight, world, grid, sig)
        return _fused_plan(state, key, "gemm_reduce_scatter", two_kernels)(a, weight)
    ex = _exchange(state, ("rs-in-gemm", padded, n, a.dtype, tiles, tile.threads), (world * padded, n), a.dtype,
                   world * tiles)
    panel = _panel_dividing(padded // tile.block_M, tile.panel)
    kernel = gemm_reduce_scatter_kernel(world, tl_dtype(a), m, k, n, tile, panel, group=group)
    board = call_board(state)
    call = OpLaunch([(kernel, lambda t, out, s: (*t, ex.buffers, out[0], ex.flags, ex.state, board, s[0]))],
                    [(m // world, n)], group=group)
    return _fused_plan(state, key, "gemm_reduce_scatter", AgreedLaunch(call, state, sig))(a, weight)


def gemm_all_reduce(a: torch.Tensor, weight: torch.Tensor, plan: str | None = None,
                    tile: TileConfig | None = None, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``all_reduce(a @ weight.T)``: partial tiles are pushed as they finish.

    Example::

        y = ts.ops.gemm_all_reduce(h, w_rows)          # (M, N) on every rank

    Fused, where every block has an SM of its own (decode shapes: output tiles times K
    splits, :func:`k_splits`), one kernel does it all (:func:`all_reduce_gemm_kernel`).
    Above, where M divides by the group size and K is not split: the reduce-scatter GEMM with
    the reduction in the owners' tiles, each of which then sends its summed tile to every
    peer (``gemm_reduce_scatter_kernel(gather=True)``), and a kernel that copies the peers'
    summed segments into place (:func:`gather_segments_kernel`): with one rank, only the GEMM.
    Else a GEMM kernel pushes partial tiles and a second kernel sums them. Every rank gets
    the same bits: partials are summed in rank order. ``tile``: the fused kernels' GEMM tile
    (:func:`choose_tile`). ``group``: the tensor-parallel process group (None: the whole job).

    Fused calls whose ranks differ (shapes, dtype, tile, plan) raise ``ts.ShapeMismatchError``
    on every rank; zero rows on every rank give an empty result.

    Args:
        a: (M, K_local), the same shape on every rank.
        weight: (N, K_local), ``a``'s dtype.
        plan: ``"fused"`` (tilescale kernels), ``"unfused"`` (cuBLAS + NCCL) or None: then
            ``TILESCALE_TP_PLAN``, else unfused for a group of one rank (the GEMM alone), by the link
            arithmetic on GPUs and from ``FUSED_MIN_ROWS`` output rows on the CPU path.
        tile: The fused kernels' GEMM tile; None picks one with :func:`choose_tile`.
        group: The tensor-parallel process group; None is the whole job.

    Returns:
        torch.Tensor: (M, N), the sum over the group's ranks, identical on every rank.

    Raises:
        TypeError: ``a`` and ``weight`` differ in dtype, or the dtype is not supported (on GPUs
            the fused plan takes bfloat16 / float16: other dtypes run unfused by default).
        ValueError: not 2-D tensors with the same K, not contiguous on this rank's device, or an
            unknown ``plan``;
            or the ranks' shapes or dtype differ at a shape's first call (checked on the host).
        ts.ShapeMismatchError: a later fused call differs across ranks (checked on the device).
    """
    # Calls reuse its plan; a capture may take another plan than eager calls (one_kernel_wins).
    key, out = _cached_call("gemm_all_reduce", a, weight, plan, tile, group)
    if out is not None:
        return out
    in_capture = capturing(a)
    _check_pair(a, weight)
    state = runtime.group_state(group)
    world = state.size
    (m, k), n = a.shape, weight.shape[0]
    check_same_across_ranks(state, "gemm_all_reduce", [m, k, n, str(a.dtype)], every_call=m == 0)
    if m == 0:
        return a.new_empty(0, n)
    grid = reduce_grid(m, k, n, 1, tile or choose_tile(m, n, split_k=True, k=k))
    one_kernel = grid.tiles * grid.splits <= sm_count()  # one kernel needs every block resident
    gather = False
    if not one_kernel and m % world == 0:
        scattered = reduce_grid(m, k, n, world, tile or scatter_tile(m // world, n, world))
        if scattered.splits == 1:  # each owner's tile holds the whole sum
            grid, gather = scattered, True
    # On GPUs the one-kernel plan (decode) is fused where it moves no more than NCCL (two
    # ranks) and, in a capture, up to 128 rows or 3 MiB of output (one_kernel_wins): as graph
    # replays its floor was 2-12 us over cuBLAS at the decode shapes of benchmarks/tp_gemm.py
    # --floor (one H200), while NCCL's all-reduce of 2-4 MB took 37-58 us in a graph (2x H200). The
    # gathering plan is fused where it beats NCCL's all-reduce (2 (world - 1) / world of the output per
    # rank) counting, besides its waves, its tail: the last wave's summed tiles to the peers
    # and the copy of the peers' segments into place.
    elem = a.element_size()
    tail_us = (min(grid.tiles, sm_count()) * grid.tile.block_M * grid.tile.block_N * elem * (world - 1)
               / (NCCL_GBPS * 1e3) + 2 * (world - 1) * m * n * elem / world / (HBM_GBPS * 1e3))
    wins = one_kernel_wins(world, m, in_capture, m * n * elem) if one_kernel else gather and world > 1 and _fused_wins(
        2 * m * k * n, [world * grid.tiles], 2 * (world - 1) * m * n * elem / world, tail_us)
    if _choose(plan, FUSED_MIN_ROWS, wins, group, a.dtype) == "unfused":
        if world == 1:
            return op_plans.put(key, gemm_alone)(a, weight)

        def launch(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            out = a @ weight.T
            dist.all_reduce(out, group=group)
            return out

        return op_plans.put(key, launch)(a, weight)
    sig = signature("gemm_all_reduce", a, f"N={n}", grid.tile, f"splits={grid.splits}",
                    "one kernel" if one_kernel else "gather" if gather else "two kernels")
    if gather:
        return _fused_plan(state, key, "gemm_all_reduce", _gemm_scatter_gather(state, a, weight, grid, sig))(a, weight)
    if not one_kernel:
        return _fused_plan(state, key, "gemm_all_reduce", _gemm_then_reduce(state, a, weight, 1, grid, sig))(a, weight)
    tile, padded, tiles, splits = grid.tile, grid.padded, grid.tiles, grid.splits
    # Swapped tiles are one per 16 rows of batch: their kernels share one exchange, its slots
    # laid out for the largest batch, so a server's every decode batch size adds no memory.
    slot = max(padded, SWAPPED_SLOT_ROWS) if tile.swap_ab else padded
    # Keyed by the tile count too: it is the number of flags (tiles of another height can pad alike).
    ex = _exchange(state, ("ar-in-gemm", slot, n, a.dtype, tiles, tile.threads, splits), (world * slot, n),
                   a.dtype, world * tiles)
    parts = _local_buffer(state, ("ar-in-gemm parts", parts_shape(splits, slot, n, tile.block_N)), torch.float32)
    # Any m of its tiles.
    kernel = all_reduce_gemm_kernel(world, tl_dtype(a), padded, k, n, tile, splits, slot, group=group)
    board = call_board(state)
    call = OpLaunch([(kernel, lambda t, out, s: (*t, ex.buffers, out[0], parts, ex.flags, ex.state, board, s[0]))],
                    [(m, n)], group=group)
    return _fused_plan(state, key, "gemm_all_reduce", AgreedLaunch(call, state, sig))(a, weight)


def _gemm_scatter_gather(state: GroupState, a: torch.Tensor, weight: torch.Tensor, grid: GemmGrid,
                         sig: int) -> Launch:
    """The plan of the all-reduce as the reduce-scatter GEMM whose owners send their summed tiles
    to every peer, then the copy of the peers' segments (``grid``: :func:`reduce_grid` with
    ``world`` owners; ``sig``: the call's signature, :func:`call_identity`)."""
    world, group = state.size, state.process_group
    (m, k), n = a.shape, weight.shape[0]
    tile, dtype = grid.tile, tl_dtype(a)
    # Per buffer set: a slot per sender for the partials, then one per sender for the finals.
    ex = _exchange(state, ("ar-rs-ag", grid.padded, n, a.dtype, grid.tiles, tile.threads), (2 * world * grid.padded, n),
                   a.dtype, 2 * world * grid.tiles)
    panel = _panel_dividing(grid.padded // tile.block_M, tile.panel)
    kernel = gemm_reduce_scatter_kernel(world, dtype, m, k, n, tile, panel, True, group=group)
    board = call_board(state)
    steps = [(kernel, lambda t, o, s: (*t, ex.buffers, o[0], ex.flags, ex.state, board, s[0]))]
    if world > 1:  # the copy of the peers' segments into place
        steps.append((gather_segments_kernel(world, dtype, m, n, tile, group=group),
                      lambda t, o, s: (ex.buffers, o[0], ex.flags, ex.state, board, s[0])))
    return AgreedLaunch(OpLaunch(steps, [(m, n)], group=group), state, sig)
