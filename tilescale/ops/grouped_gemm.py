"""Grouped GEMM for the experts of an MoE layer, over ``moe_dispatch``'s grouped row layout.

The A rows come either grouped already (row ``i`` of ``x`` is output row ``i``; TMA tile
loads) or gathered through an index (output row ``i`` reads row ``index[i]`` of ``x``): the
received rows of an in-place dispatch, which never writes them a second time to group them.
FP8 rows (e4m3 values with a float32 scale per 128 channels, DeepEP's layout) are
dequantised as the A tile is loaded, in either case: grouped FP8 rows by TMA (values and
scales) into the warp-specialised pipeline, whose consumer warps scale each e4m3 tile into
the bf16 tile the tensor cores read; gathered ones by ``cp.async``.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import functools
from collections.abc import Callable

import torch

import tilescale.language as T
from tilescale.jit import jit
from tilescale.op_launch import MISSED, Direct, OpLaunch, Output
from tilescale.ops._common import check_input, layout_key, op_plans, tl_dtype
from tilescale.ops._gemm import DEFAULT, TileConfig, check_unswapped, gemm_tile, store_tile
from tilescale.ops.grouped_layout import check_layout
from tilescale.ops.moe.buffer import check_in_place_rows
from tilescale.ops.moe.fp8 import BLOCK, kernel_views, pack, packed_width
from tilescale.ops.moe.layout import ROW_TILE
from tilescale.ops.tp_gemm.plan import choose_tile

_FP8 = "float8_e4m3fn"


@jit
def grouped_gemm_kernel(experts: int, rows: int, K: int, N: int, dtype: str, cfg: TileConfig = DEFAULT):
    """Row tile ``by`` belongs to expert ``row_expert[by * block_M]``; tiles of none are skipped.

    Args:
        experts: Experts whose weights ``w`` stacks, (experts * N, K).
        rows: Rows of ``x`` and ``out``, a multiple of the tile's ``block_M``.
        K: Input features.
        N: Output features per expert.
        dtype: TileLang dtype of ``x``, ``w`` and ``out``.
        cfg: The GEMM tile (``block_M`` dividing the layout's 128-row segments).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """

    @T.prim_func
    def main(x: T.Tensor((rows, K), dtype), w: T.Tensor((experts * N, K), dtype),
             row_expert: T.Tensor((rows,), "int32"), out: T.Tensor((rows, N), dtype)):
        with T.Kernel(T.ceildiv(N, cfg.block_N), rows // cfg.block_M, threads=cfg.threads) as (bx, by):
            if row_expert[by * cfg.block_M] >= 0:
                # A last, partial column tile reads the next expert's rows of w: the columns
                # they give fall past N and are cut off when stored.
                gemm_tile(x, by * cfg.block_M, w, row_expert[by * cfg.block_M] * N + bx * cfg.block_N, out,
                          by * cfg.block_M, bx * cfg.block_N, K, dtype, cfg.stages, cfg)

    return main


def tma_rows(K: int) -> bool:
    """Whether grouped FP8 rows of ``K`` channels can be TMA boxes: a packed row
    (``packed_width(K)`` bytes) must be a multiple of 16 bytes, and its scales come four at a
    time (a 16-byte box), so ``K`` a multiple of 512; other FP8 rows go the gathered way."""
    return K % (4 * BLOCK) == 0


@jit
def grouped_fp8_gemm_kernel(experts: int, rows: int, K: int, N: int, dtype: str, cfg: TileConfig = DEFAULT):
    """As :func:`grouped_gemm_kernel`, for grouped FP8 rows (``ts.ops.moe.fp8.pack``: K e4m3
    values, then K / 128 float32 scales) dequantised in the pipeline: the values tile and the
    rows' scales arrive by TMA, and the consumer warps scale the values into the bf16 tile
    that the tensor cores read (no dequantised copy in HBM).

    Args:
        experts: Experts whose weights ``w`` stacks, (experts * N, K).
        rows: Rows of ``x`` and ``out``, a multiple of the tile's ``block_M``.
        K: Input features, a multiple of 512 (:func:`tma_rows`).
        N: Output features per expert.
        dtype: TileLang dtype of ``w`` and ``out``.
        cfg: The GEMM tile (``block_M`` dividing the layout's 128-row segments; ``block_K`` divides 128).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    width, bm, bn, bk = packed_width(K), cfg.block_M, cfg.block_N, cfg.block_K

    @T.prim_func
    def main(x: T.Tensor((rows, width), _FP8), scales: T.Tensor((rows, width // 4), "float32"),
             w: T.Tensor((experts * N, K), dtype), row_expert: T.Tensor((rows,), "int32"),
             out: T.Tensor((rows, N), dtype)):
        with T.Kernel(T.ceildiv(N, bn), rows // bm, threads=cfg.threads) as (bx, by):
            if row_expert[by * bm] >= 0:
                q = T.alloc_shared((bm, bk), _FP8)
                s = T.alloc_shared((bm, 4), "float32")  # four scale columns, the K step's among them
                a = T.alloc_shared((bm, bk), dtype)
                b = T.alloc_shared((bn, bk), dtype)
                acc = T.alloc_fragment((bm, bn), "float32")
                T.clear(acc)
                for k in T.Pipelined(T.ceildiv(K, bk), num_stages=cfg.stages):
                    T.copy(x[by * bm, k * bk], q)
                    T.copy(scales[by * bm, K // 4 + k * bk // BLOCK // 4 * 4], s)
                    T.copy(w[row_expert[by * bm] * N + bx * bn, k * bk], b)
                    for i, c in T.Parallel(bm, bk):
                        a[i, c] = T.cast(T.cast(q[i, c], "float32") * s[i, k * bk // BLOCK % 4], dtype)
                    T.gemm(a, b, acc, transpose_B=True, policy=cfg.warp_policy)
                store_tile(acc, out, by * bm, bx * bn, dtype, cfg)

    return main


# A gathered A tile is no TMA box: both operands' tiles are loaded by every thread with
# cp.async, the tile's stages deep (TileLang's sm_80-style pipeline, the wgmma kept), where the
# TMA + warp-specialised form would load the gathered rows synchronously in the consumer warps.
_CP_ASYNC = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True}


@jit(pass_configs=_CP_ASYNC)
def gathered_gemm_kernel(experts: int, rows: int, K: int, N: int, dtype: str, sources: int, fp8: bool = False,
                         cfg: TileConfig = DEFAULT):
    """As :func:`grouped_gemm_kernel`, with output row ``i`` reading row ``index[i]`` of ``x``.

    Args:
        experts: Experts whose weights ``w`` stacks, (experts * N, K).
        rows: Rows of ``out`` and ``index``, a multiple of the tile's ``block_M``.
        K: Input features.
        N: Output features per expert.
        dtype: TileLang dtype of ``w`` and ``out`` (and of ``x`` unless FP8).
        sources: Rows of ``x``.
        fp8: ``x`` holds packed FP8 rows (``ts.ops.moe.fp8.pack``: K e4m3 values, then K / 128
            float32 scales), passed twice: as e4m3 values and as float32 words of the same bytes.
        cfg: The GEMM tile (``block_M`` dividing the layout's 128-row segments).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel, cached per arguments.
    """
    if fp8:
        width = packed_width(K)

        @T.prim_func
        def gathered_fp8(x: T.Tensor((sources, width), _FP8), scales: T.Tensor((sources, width // 4), "float32"),
                         index: T.Tensor((rows,), "int32"), w: T.Tensor((experts * N, K), dtype),
                         row_expert: T.Tensor((rows,), "int32"), out: T.Tensor((rows, N), dtype)):
            _gathered_grid(x, scales, index, w, row_expert, out, K, dtype, cfg)

        return gathered_fp8

    @T.prim_func
    def gathered(x: T.Tensor((sources, K), dtype), index: T.Tensor((rows,), "int32"),
                 w: T.Tensor((experts * N, K), dtype), row_expert: T.Tensor((rows,), "int32"),
                 out: T.Tensor((rows, N), dtype)):
        _gathered_grid(x, None, index, w, row_expert, out, K, dtype, cfg)

    return gathered


@T.macro
def _gathered_grid(x, scales, index, w, row_expert, out, K, dtype, cfg):
    """The gathered kernel's blocks: one per output tile, each of an expert's (``row_expert`` of
    its first row) or skipped (-1); :func:`_gathered_tile` computes it."""
    rows, N = out.shape
    with T.Kernel(T.ceildiv(N, cfg.block_N), rows // cfg.block_M, threads=cfg.threads) as (bx, by):
        if row_expert[by * cfg.block_M] >= 0:
            _gathered_tile(x, scales, index, w, row_expert[by * cfg.block_M] * N + bx * cfg.block_N, out,
                           by * cfg.block_M, bx * cfg.block_N, K, dtype, cfg)


@T.macro
def _gathered_tile(x, scales, index, W, w_row, C, c_row, c_col, K, dtype, cfg):
    """``C[c_row:+BM, c_col:+BN] = A @ W[w_row:+BN, :].T`` with A's row i read from row
    ``index[c_row + i]`` of ``x`` (row 0 where it is -1: a row of no token, whose output is
    undefined). FP8 rows (``scales`` given: the packed rows as float32 words, the scale of
    channel c at word ``K / 4 + c / 128``) land in shared memory as bytes, then are scaled
    into the bf16 tile the tensor cores read.

    Args:
        x: The rows gathered from (bf16/fp16, or the FP8 values of packed rows).
        scales: None, or the packed rows as float32 words (FP8).
        index: (rows,) row of ``x`` of each output row, -1 for none.
        W, w_row, C, c_row, c_col, K, dtype, cfg: as :func:`tilescale.ops._gemm.gemm_tile`'s
            (``dtype`` also the A tile's).
    """
    bm, bk = cfg.block_M, cfg.block_K
    a = T.alloc_shared((bm, bk), dtype)
    w = T.alloc_shared((cfg.block_N, bk), dtype)
    src = T.alloc_shared((bm,), "int32")
    acc = T.alloc_fragment((bm, cfg.block_N), "float32")
    for i in T.Parallel(bm):
        src[i] = T.max(index[c_row + i], 0)
    T.clear(acc)
    if scales is None:
        for k in T.Pipelined(T.ceildiv(K, bk), num_stages=cfg.stages):
            for i, c in T.Parallel(bm, bk):
                if K % bk:  # zeros past K (a guarded load: no cp.async, for odd K only)
                    a[i, c] = T.if_then_else(k * bk + c < K, x[src[i], T.min(k * bk + c, K - 1)], T.cast(0, dtype))
                else:  # a plain copy: cp.async
                    a[i, c] = x[src[i], k * bk + c]
            T.copy(W[w_row, k * bk], w)
            T.gemm(a, w, acc, transpose_B=True, policy=cfg.warp_policy)
    else:
        q = T.alloc_shared((bm, bk), _FP8)
        s = T.alloc_shared((bm,), "float32")  # each row's scale of this K step (bk divides 128)
        for k in T.Pipelined(T.ceildiv(K, bk), num_stages=cfg.stages):
            for i, c in T.Parallel(bm, bk):
                q[i, c] = x[src[i], k * bk + c]
            for i in T.Parallel(bm):
                s[i] = scales[src[i], K // 4 + k * bk // BLOCK]
            T.copy(W[w_row, k * bk], w)
            for i, c in T.Parallel(bm, bk):
                a[i, c] = T.cast(T.cast(q[i, c], "float32") * s[i], dtype)
            T.gemm(a, w, acc, transpose_B=True, policy=cfg.warp_policy)
    store_tile(acc, C, c_row, c_col, dtype, cfg)


# Experts of at most this many rows on average: 64-row tiles. An expert's segment is whole
# 128-row tiles, so below 64 rows most of a 128-row tile is padding, computed all the same
# (skipped only where a 64-row tile starts on it). One H200, 64 experts x top-6 at 512 tokens
# (48 rows each) and 256 x top-8 (16 each), K 1408-7168, taking turns with 128-row tiles and
# torch._grouped_mm: the gathering kernel 0.66-0.76x its time in 128x256 tiles, the grouped
# one 0.87-0.93x; at 96 and 128 rows 64-row tiles took 1.17-1.56x the time of the best 128-row one.
SMALL_SEGMENT_ROWS = 64
SMALL_SEGMENT_TILE = TileConfig(64, 128, 64, 6, 128, "FullRow", "shared")  # grouped rows (TMA)
SMALL_SEGMENT_GATHERED_TILE = TileConfig(64, 256, 64, 4, 128, "FullRow", "shared")  # gathered (cp.async)


@functools.lru_cache(maxsize=256)
def _tile(rows: int, n: int, small_segments: bool, gathered: bool) -> TileConfig:
    """The tile of a grouped GEMM of ``rows x n`` outputs (a bound: tiles of no expert are
    skipped) whose experts hold at most ``SMALL_SEGMENT_ROWS`` rows on average or not."""
    if small_segments:
        return SMALL_SEGMENT_GATHERED_TILE if gathered else SMALL_SEGMENT_TILE
    return choose_tile(rows, n)


_identity: dict[tuple[int, torch.device], torch.Tensor] = {}  # (rows, device) -> arange(rows), int32
# Repeated calls on a dispatch's grouped bf16 rows, made from C++ (a site per tile choice and layout's experts).
_direct = Direct()


def _identity_index(rows: int, device: torch.device) -> torch.Tensor:
    """The index of grouped FP8 rows (output row i reads row i), made once per size and device."""
    key = (rows, device)
    if key not in _identity:
        _identity[key] = torch.arange(rows, dtype=torch.int32, device=device)
    return _identity[key]


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, row_expert: torch.Tensor, scales: torch.Tensor | None = None,
                 index: torch.Tensor | None = None, tile: TileConfig | None = None,
                 rows_per_expert: float | None = None) -> torch.Tensor:
    """``out[i] = x[i] @ w[row_expert[i]].T`` (or ``x[index[i]]``) for rows grouped by expert in 128-row tiles.

    Example::

        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts)
        h = ts.ops.grouped_gemm(recv_x, w1, handle.row_expert)   # (rows, K) x (experts, N, K)
        # an in-place dispatch: the received rows, gathered through the handle's index
        recv_x, recv_w, counts, handle = ts.ops.moe_dispatch(x, topk_idx, topk_w, num_experts, in_place=True)
        h = ts.ops.grouped_gemm(recv_x, w1, handle.row_expert, index=handle.source_row)

    Every 128-row tile of the output belongs to one expert (the expert of its first row; -1:
    no expert, the tile's output rows are left undefined), as ``moe_dispatch`` lays rows out.
    A layout of the caller's own (not a dispatch's ``handle.row_expert``) is checked on the
    device for that contract, without a synchronisation (``ts.ops.grouped_layout``: one small
    kernel per call); a breach raises :class:`tilescale.GroupedLayoutError` at the next grouped
    GEMM, ``ts.synchronize()`` or ``ts.finalize()``.

    Args:
        x: (rows, K) rows in ``w``'s dtype, or FP8 values (``torch.float8_e4m3fn``, e.g. an
            FP8 dispatch's) with their ``scales``: dequantised as the GEMM loads them (grouped
            rows of an FP8 dispatch or ``quantize_fp8`` with K a multiple of 512 by TMA, see
            :func:`tma_rows`; others by ``cp.async``).
        w: (experts, N, K) expert weights.
        row_expert: (rows,) expert of each output row.
        scales: (rows of x, K // 128) float32 scales of FP8 ``x`` (``ts.ops.moe.quantize_fp8``).
        index: (rows,) int32 row of ``x`` each output row reads (-1: none, the row is
            undefined), e.g. an in-place dispatch's ``handle.source_row``; ``x`` may then
            have any number of rows. None: row i reads row i.
        tile: the GEMM tile (``ts.ops._gemm.TileConfig`` with 128- or 64-row tiles); None: 64-row
            tiles where ``rows_per_expert`` is at most ``SMALL_SEGMENT_ROWS`` (bf16 rows), else the
            TP GEMMs' choice for ``rows x N`` outputs (``tp_gemm.plan.choose_tile``: 128x256-wide
            tiles where they fill the SMs, else 128x128).
        rows_per_expert: the rows an expert holds on average, if known (e.g. ``tokens * topk *
            world / experts``, as ``ts.nn.ExpertParallelMoE`` passes): few rows per expert leave
            most of each 128-row tile padding, which 64-row tiles halve. None: not known.

    Returns:
        (rows, N) in ``w``'s dtype.

    Raises:
        ValueError: shapes or dtypes that do not fit; a dispatch's layout of more local experts than ``w`` holds.
        tilescale.GroupedLayoutError: an earlier call's layout of the caller's own broke the contract.
        RuntimeError: ``index`` is an in-place dispatch's whose rows a later dispatch through
            the same buffer may have overwritten.
    """
    # Only a tile left to the choice depends on the segments' size (one plan for an explicit tile).
    small = tile is None and rows_per_expert is not None and rows_per_expert <= SMALL_SEGMENT_ROWS
    made_for = getattr(row_expert, "_ts_experts", None)  # moe_dispatch's layout: its experts
    # A dispatch's bf16 rows, grouped or in place through its own index: nothing to check per call
    # but the layouts (made_for keys the site: its calls' w had these layouts, so as many experts
    # as checked) and, in place, that no later dispatch has overwritten the rows; so calls go
    # straight to the learned program (op_launch.Direct). Other indexes (checked on the device)
    # and FP8 rows take the path below.
    in_place = index is not None and getattr(index, "_ts_in_place", None) is not None
    direct = made_for is not None and scales is None and (index is None or in_place)
    site = (tile, small, made_for, in_place) if direct else None
    tensors = (x, w, row_expert) if index is None else (x, w, row_expert, index)
    found = None if site is None else _direct.find(site)
    if found is not None:
        if in_place and isinstance(x, torch.Tensor):
            check_in_place_rows(index, x.shape[0])  # every call: its rows may be stale by now
        if (out := _direct(site, tensors, (), found)) is not MISSED:
            return out
    key = ("grouped_gemm", layout_key(x), layout_key(w), layout_key(row_expert),
           "none" if scales is None else layout_key(scales), "none" if index is None else layout_key(index), tile,
           small)
    plan = op_plans.get(key)
    if plan is None:  # the first call of these layouts: every check, then the plan
        plan = op_plans.put(key, _plan(x, w, row_expert, scales, index, tile, small))
    if index is not None:
        check_in_place_rows(index, x.shape[0])  # the index's rows themselves: every call
    launch, call = plan
    out = launch(x, w, row_expert, scales, index)
    if site is not None:
        _direct.learn(site, call, tensors)
    return out


def _plan(x: torch.Tensor, w: torch.Tensor, row_expert: torch.Tensor, scales: torch.Tensor | None,
          index: torch.Tensor | None, tile: TileConfig | None,
          small_segments: bool) -> tuple[Callable[..., torch.Tensor], OpLaunch]:
    """:func:`grouped_gemm`'s arguments checked, and its launch for tensors of their layouts
    (``small_segments``: at most ``SMALL_SEGMENT_ROWS`` rows per expert on average) with the
    ``OpLaunch`` it calls."""
    fp8 = x.dtype == torch.float8_e4m3fn
    if fp8 and scales is None:
        raise ValueError("grouped_gemm: FP8 rows need their scales")
    check_input(w, "w")
    check_input(row_expert, "row_expert")
    rows = row_expert.shape[0]
    held, k = x.shape
    experts = w.shape[0]
    if w.dim() != 3 or w.shape[2] != k or (not fp8 and w.dtype != x.dtype):
        raise ValueError(f"w must be (experts, N, {k}) {x.dtype}, got {tuple(w.shape)} {w.dtype}")
    if rows % ROW_TILE or row_expert.dim() != 1 or (index is None and held != rows):
        raise ValueError(f"grouped_gemm: row_expert needs a multiple of {ROW_TILE} rows ({tuple(row_expert.shape)}), "
                         f"one per row of x ({held}) unless an index is given")
    if index is not None and (index.shape != (rows,) or index.dtype != torch.int32):
        raise ValueError(f"grouped_gemm: index must be ({rows},) int32, got {tuple(index.shape)} {index.dtype}")
    n = w.shape[1]
    # FP8 rows keep 128-row tiles (64-row ones measured for bf16 only).
    cfg = _tile(rows, n, small_segments and not fp8, index is not None) if tile is None else tile
    if ROW_TILE % cfg.block_M:  # a tile must not straddle two experts' segments
        raise ValueError(f"grouped_gemm: tiles of {ROW_TILE} rows or a divisor (an expert's segment is whole "
                         f"{ROW_TILE}-row tiles), got {cfg.name()}")
    check_unswapped(cfg, "grouped_gemm")
    # The kernel's operands before the weights, by variant, from the call's rows: ``x`` (bf16), or
    # an FP8 pair's byte rows (values and scales, as the dispatch moves them), and the index.
    out_shape = Output((rows, n), w.dtype)
    weights = (experts * n, k)
    if fp8:
        if tuple(scales.shape) != (held, k // BLOCK) or k % BLOCK:
            raise ValueError(f"grouped_gemm: FP8 scales must be ({held}, {k // BLOCK}), got {tuple(scales.shape)}")
        if index is not None:
            check_input(index, "index")
        if index is None and tma_rows(k):
            kernel = grouped_fp8_gemm_kernel(experts, rows, k, n, tl_dtype(w), cfg)
            call = OpLaunch([(kernel, lambda t, o, s: (*kernel_views(t[0]), t[1].view(weights), t[2], o[0]))],
                            [out_shape])
        else:
            identity = _identity_index(rows, w.device) if index is None else None  # the same in every call
            kernel = gathered_gemm_kernel(experts, rows, k, n, tl_dtype(w), held, fp8=True, cfg=cfg)
            call = OpLaunch([(kernel, lambda t, o, s: (*kernel_views(t[0]), t[3] if len(t) > 3 else identity,
                                                       t[1].view(weights), t[2], o[0]))], [out_shape])
    elif index is None:
        check_input(x, "x")
        kernel = grouped_gemm_kernel(experts, rows, k, n, tl_dtype(x), cfg)
        call = OpLaunch([(kernel, lambda t, o, s: (t[0], t[1].view(weights), t[2], o[0]))], [out_shape])
    else:
        check_input(x, "x")
        check_input(index, "index")
        kernel = gathered_gemm_kernel(experts, rows, k, n, tl_dtype(x), held, cfg=cfg)
        call = OpLaunch([(kernel, lambda t, o, s: (t[0], t[3], t[1].view(weights), t[2], o[0]))], [out_shape])

    def launch(x: torch.Tensor, w: torch.Tensor, row_expert: torch.Tensor, scales: torch.Tensor | None,
               index: torch.Tensor | None) -> torch.Tensor:
        made_for = getattr(row_expert, "_ts_experts", None)  # moe_dispatch's layout: its experts
        row_expert = row_expert.to(torch.int32)
        if made_for is None or (index is not None and getattr(index, "_ts_in_place", None) is None):
            # A layout or index of the caller's own: checked on the device, raised at a later call.
            check_layout(row_expert, index, cfg.block_M, experts, held)
        if made_for is not None and made_for > experts:
            raise ValueError(f"grouped_gemm: the layout comes from a dispatch to {made_for} local experts, "
                             f"but w holds {experts}")
        rows_in = pack((x, scales)) if fp8 else x  # FP8: a dispatch's pair is its own bytes, no copy
        return call((rows_in, w, row_expert) if index is None else (rows_in, w, row_expert, index))

    return launch, call
