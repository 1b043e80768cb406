"""The tile GEMM the library's GEMM kernels share: tile shape and one output tile's K loop.

``TileConfig`` says how one output tile is computed; ``DEFAULT`` is what the kernels use
(``BLOCK_M`` ... ``THREADS`` are its fields, for the kernels' grid arithmetic).
``benchmarks/gemm_tiles.py`` times the alternatives against cuBLAS::

    python benchmarks/gemm_tiles.py                  # one sm_90 GPU
"""

from dataclasses import dataclass

import tilescale.language as T

POLICIES = ("Square", "FullRow", "FullCol")
EPILOGUES = ("direct", "shared")


@dataclass(frozen=True)
class TileConfig:
    """One output tile's computation.

    ``block_M`` x ``block_N``: the output tile; ``block_K``: the K step; ``stages``: pipeline
    depth of the K loop; ``threads``: the block's threads as the kernel declares them (128 per
    warpgroup; on sm_90 TileLang adds a 128-thread producer warpgroup when it warp-specialises
    the loop). ``policy``: how ``T.gemm`` splits the tile among the warps (a
    ``T.GemmWarpPolicy`` name). ``epilogue``: ``"direct"`` stores the fp32 accumulator's
    casts from registers to global memory; ``"shared"`` stages the tile in shared memory
    first (whole-row, vectorised stores; costs ``block_M * block_N`` elements of shared
    memory). ``panel``: tile rows per panel of :func:`tile_coords` (0: row-major tile order).
    ``swap_ab``: the MMA computes the tile transposed, ``W @ A.T``: the weight's ``block_N``
    rows fill the wgmma's M (64 per warpgroup) and the tile's ``block_M`` rows its N, which
    may be any multiple of 8, so a decode batch of a few rows loads (almost) no rows out of
    bounds; only the one-kernel decode all-reduce takes it (:func:`check_unswapped`).
    """

    block_M: int = 128
    block_N: int = 128
    block_K: int = 64
    stages: int = 3
    threads: int = 256
    policy: str = "Square"
    epilogue: str = "direct"
    panel: int = 0
    swap_ab: bool = False

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.epilogue not in EPILOGUES:
            raise ValueError(f"epilogue must be one of {EPILOGUES}, got {self.epilogue!r}")
        if min(self.block_M, self.block_N, self.block_K, self.stages, self.threads) < 1 or self.panel < 0:
            raise ValueError(f"bad tile config {self}")
        if self.swap_ab and (self.block_M % 8 or self.block_N % 64):
            raise ValueError(f"a swap_ab tile needs block_M a multiple of 8 and block_N of 64: {self}")

    @property
    def warp_policy(self) -> "T.GemmWarpPolicy":
        return getattr(T.GemmWarpPolicy, self.policy)

    def shared_bytes(self, elem_bytes: int = 2) -> int:
        """Shared memory the tile's buffers take (the pipeline's stages and the epilogue tile)."""
        stage = (self.block_M + self.block_N) * self.block_K * elem_bytes
        out = self.block_M * self.block_N * elem_bytes if self.epilogue == "shared" else 0
        return self.stages * stage + out

    def name(self) -> str:
        """Short label: ``128x256x64 s3 t256 FullRow shared p8``."""
        panel = f" p{self.panel}" if self.panel else ""
        swap = " swap_ab" if self.swap_ab else ""
        return (f"{self.block_M}x{self.block_N}x{self.block_K} s{self.stages} t{self.threads} "
                f"{self.policy} {self.epilogue}{panel}{swap}")


def check_unswapped(cfg: TileConfig, kernel: str) -> None:
    """Refuse a ``swap_ab`` tile in a kernel that computes its tiles the usual way round.

    Example::

        check_unswapped(tile_cfg, "gemm_push_kernel")

    Args:
        cfg: The tile a kernel factory was given.
        kernel: The kernel's name, for the message.

    Raises:
        ValueError: ``cfg.swap_ab`` is set.
    """
    if cfg.swap_ab:
        raise ValueError(f"{kernel} does not take swap_ab tiles (only the one-kernel decode all-reduce does): {cfg}")


# What the kernels use (gemm_tile's policy and epilogue, and the BLOCK_* below). Its Square
# policy gives each warpgroup 2x m64n64 wgmmas: 0.62-0.75x cuBLAS on H200
# (benchmarks/gemm_tiles.py, log benchmarks/results/logs/gpu-gemm-tiles-x8-20261122.log).
DEFAULT = TileConfig()
# TileLang's sm_90 recipe with panel order (one m64n256 wgmma per warpgroup): 0.97-1.01x
# cuBLAS at the TP GEMM shapes, timed taking turns with it on one H200
# (gemm-tiles-nvidia-h200-20261123-161931.json); the fused kernels' default tile where
# choose_tile (tp_gemm/plan.py) finds enough output tiles.
WIDE = TileConfig(128, 256, 64, 3, 256, "FullRow", "shared", 8)
# Narrower wide tiles: other tile counts per wave where WIDE's last wave is far from full
# (tp_gemm.choose_tile weighs them). Per FLOP at full waves 0.98x (128x224, one m64n224
# wgmma per warpgroup) and 0.95x (128x192) of WIDE's speed, measured at the TP floor's 16
# GEMMs with >= 1024 rows on one H100 (gemm-tiles-nvidia-h100-80gb-hbm3-20261124-215914.json).
WIDE_224 = TileConfig(128, 224, 64, 3, 256, "FullRow", "shared", 8)
WIDE_192 = TileConfig(128, 192, 64, 3, 256, "FullRow", "shared", 8)
# Segments of 129-256 rows (the reduce-scatter GEMM's, and the all-reduce's where no swapped
# tile fits): all rows in one tile (each warpgroup 2x m64n128), so the K loop streams each
# weight tile once, where two 128-row tiles would read it twice.
TALL = TileConfig(256, 128, 64, 3, 256, "FullRow", "shared", 8)
# Segments of at most 128 rows (the reduce-scatter GEMM's at decode sizes): 64 columns per
# tile give 128 tiles at N = 8192, about one per SM, without splitting K; each warpgroup one
# m64n64 wgmma, six stages of loads in flight for a K loop that streams the weight.
NARROW = TileConfig(128, 64, 64, 6, 256, "FullRow", "direct")
# The all-reduce's batches of at most 64 rows where no swapped tile fits (N > 128 x SMs; else
# swapped_tile, which since 2026-11-28 also leaves fewer rows out of bounds): one warpgroup's
# m64n64 wgmma per K step, twelve stages of loads in flight. In a 128-row tile such rows leave half
# or more of each A load out of bounds (TMA fills it with zeros), and that costs: the all-reduce's
# one kernel at 8-64 rows, 8 shapes, one H100, took 1.18-2.76x cuBLAS in the tiles picked before
# (NARROW, or 128x256 with K split) against 0.99-2.17x in this tile, slower at one of 27 points (8 x
# 13824 x 5120: 1.30 vs 1.21); the floor's 6 shapes of 1-64 rows 1.04-1.18x against 1.34-1.64x
# (benchmarks/results/logs/gpu-h100-20261128-decode-64-row-tile.log).
THIN = TileConfig(64, 64, 64, 12, 128, "FullRow", "direct")


# The largest batch a swap_ab tile takes: wgmma's largest N.
SWAPPED_SLOT_ROWS = 256


def swapped_tile(rows: int, block_N: int = 64, elem_bytes: int = 2) -> TileConfig:
    """The ``swap_ab`` tile of a decode batch of ``rows`` (at most 256, wgmma's largest N): the
    batch rounded up to 16 rows (TileLang issues one m64nRk16 wgmma for R a multiple of 16,
    nine m64n8k16 for R = 72), ``block_N`` weight rows per tile (a consumer warpgroup per 64),
    and as many pipeline stages as fit in about 208 KB of shared memory with the tile's
    epilogue buffer (at most 12).

    Example::

        swapped_tile(33)      # 48 x 64, 12 stages: 15 rows out of bounds where THIN has 31

    Args:
        rows: Rows of the batch (1-256).
        block_N: Weight rows (output columns) per tile, a multiple of 64 (default 64).
        elem_bytes: Bytes per operand element (default 2: bfloat16 / float16).

    Returns:
        TileConfig: ``block_M`` = rows rounded up to 16 (at least 16), ``swap_ab`` set.
    """
    if not 0 < rows <= SWAPPED_SLOT_ROWS:
        raise ValueError(f"swapped_tile: rows must be 1-{SWAPPED_SLOT_ROWS}, got {rows}")
    block_M = -(-rows // 16) * 16
    stage = (block_M + block_N) * 64 * elem_bytes
    stages = min(12, (208 * 1024 - block_M * block_N * elem_bytes) // stage)
    return TileConfig(block_M, block_N, 64, stages, 128 * (block_N // 64), "FullRow", "direct", swap_ab=True)

# Output tile, K step, pipeline depth of the K loop, and threads per block.
BLOCK_M, BLOCK_N, BLOCK_K, STAGES, THREADS = DEFAULT.block_M, DEFAULT.block_N, DEFAULT.block_K, DEFAULT.stages, \
    DEFAULT.threads


def tile_coords(tile, m_tiles: int, n_tiles: int, panel: int = 0):
    """(row tile, column tile) of linear tile index ``tile`` (>= 0) of an ``m_tiles x n_tiles`` grid.

    ``panel == 0``: row-major order. Otherwise tiles go column by column through panels of
    ``panel`` tile rows (the last panel may be shorter), so the blocks running at once share
    a few A row tiles and W column tiles in L2 instead of sweeping all of W.

    Args:
        tile: The linear tile index (an int or a kernel expression).
        m_tiles: Row tiles of the grid.
        n_tiles: Column tiles of the grid.
        panel: Tile rows per panel (default 0: row-major).

    Returns:
        tuple: ``(row tile, column tile)``, expressions inside a kernel.
    """
    if panel <= 0:
        return tile // n_tiles, tile % n_tiles
    if panel >= m_tiles:  # one panel: column-major order
        return tile % m_tiles, tile // m_tiles
    per_panel = panel * n_tiles
    first = tile // per_panel * panel
    within = tile % per_panel
    if m_tiles % panel == 0:
        return first + within % panel, within // panel
    # The last panel is shorter. Non-negative operands: C division (TVM's floor division by
    # a non-constant divisor expands into sign tests).
    rows = T.min(panel, m_tiles - first)
    return first + T.truncmod(within, rows), T.truncdiv(within, rows)


@T.macro
def gemm_tile(A, a_row, W, w_row, C, c_row, c_col, K, dtype, stages, cfg=DEFAULT, c_segment=None):
    """C[c_row:+BM, c_col:+BN] = A[a_row:+BM, :] @ W[w_row:+BN, :].T, accumulated in fp32.

    ``cfg`` gives the tile and K step, the warp policy and the epilogue; ``stages`` the
    pipeline depth (the kernels pass ``STAGES``). ``c_segment``: for an output of segments
    (``C`` of shape (segments, rows, N)), the segment the tile goes to, at ``(c_row, c_col)``
    within it; rows past the segment's end are clipped, as rows past a 2-D ``C``'s end are.

    Args:
        A: The (M, K) operand; rows from ``a_row``.
        a_row: First row of ``A``.
        W: The (N, K) weight; rows from ``w_row``.
        w_row: First row of ``W``.
        C: The output; the tile is stored at ``(c_row, c_col)``.
        c_row: First output row.
        c_col: First output column.
        K: The reduction length.
        dtype: TileLang dtype of the operands and output.
        stages: Pipeline depth of the K loop.
        cfg: The tile (:class:`TileConfig`; default ``DEFAULT``).
        c_segment: The output segment where ``C`` is 3-D (default None: ``C`` is 2-D).
    """
    acc = T.alloc_fragment((cfg.block_M, cfg.block_N), "float32")
    T.clear(acc)
    accumulate_tile(A, a_row, W, w_row, acc, 0, K, dtype, stages, cfg)
    store_tile(acc, C, c_row, c_col, dtype, cfg, c_segment)


@T.macro
def accumulate_tile(A, a_row, W, w_row, acc, k_first, K, dtype, stages, cfg=DEFAULT):
    """``acc += A[a_row:+BM, k_first:+K] @ W[w_row:+BN, k_first:+K].T``: one tile's K loop, in
    TileLang's pipeline (on sm_90 warp-specialised: TMA loads, wgmma). For a ``cfg.swap_ab``
    tile ``acc`` holds the tile transposed, (block_N, block_M): the MMA computes ``W @ A.T``.

    Example (the K half ``s`` of a tile, as the decode all-reduce splits K)::

        accumulate_tile(A, by * bm, W, bx * bn, acc, s * (K // 2), K // 2, dtype, cfg.stages, cfg)

    Args:
        A: The (M, K) operand; rows from ``a_row``.
        a_row: First row of ``A``.
        W: The (N, K) weight; rows from ``w_row``.
        w_row: First row of ``W``.
        acc: The fp32 accumulator fragment, added to.
        k_first: First column of ``A`` and ``W`` the loop reads.
        K: Columns it reads (from ``k_first``).
        dtype: TileLang dtype of the operands.
        stages: Pipeline depth of the K loop.
        cfg: The tile (:class:`TileConfig`; default ``DEFAULT``).
    """
    a = T.alloc_shared((cfg.block_M, cfg.block_K), dtype)
    w = T.alloc_shared((cfg.block_N, cfg.block_K), dtype)
    for k in T.Pipelined(T.ceildiv(K, cfg.block_K), num_stages=stages):
        T.copy(A[a_row, k_first + k * cfg.block_K], a)
        T.copy(W[w_row, k_first + k * cfg.block_K], w)
        if cfg.swap_ab:  # the weight's rows in the wgmma's M, A's rows in its N
            T.gemm(w, a, acc, transpose_B=True, policy=cfg.warp_policy)
        else:
            T.gemm(a, w, acc, transpose_B=True, policy=cfg.warp_policy)


@T.macro
def store_tile(acc, C, c_row, c_col, dtype, cfg=DEFAULT, c_segment=None):
    """The fp32 tile ``acc`` into ``C[c_row:+BM, c_col:+BN]`` as ``dtype``: from registers, or
    staged in shared memory first where ``cfg.epilogue`` is ``"shared"``. With ``c_segment``,
    into ``C[c_segment, c_row:+BM, c_col:+BN]`` of a 3-D ``C``: each segment's rows are
    bounded by its own end (a per-dimension bound of the store, TMA's box clipping), so a
    segment whose rows are not whole tiles needs no padding in the output.

    Args:
        acc: The (block_M, block_N) fp32 accumulator fragment.
        C: The output; the tile is stored at ``(c_row, c_col)``.
        c_row: First output row.
        c_col: First output column.
        dtype: TileLang dtype of ``C``.
        cfg: The tile (:class:`TileConfig`; default ``DEFAULT``).
        c_segment: The output segment where ``C`` is 3-D (default None: ``C`` is 2-D).
    """
    if cfg.epilogue == "shared":
        out = T.alloc_shared((cfg.block_M, cfg.block_N), dtype)
        T.copy(acc, out)
        if c_segment is None:
            T.copy(out, C[c_row, c_col])
        else:
            T.copy(out, C[c_segment, c_row, c_col])
    elif c_segment is None:
        T.copy(acc, C[c_row, c_col])
    else:
        T.copy(acc, C[c_segment, c_row, c_col])
