"""What a TP GEMM call runs: its plan (``"fused"`` or ``"unfused"``: :func:`_choose`, by the
link arithmetic of :func:`_fused_wins` on GPUs) and, for the fused plan, its GEMM grid
(:class:`GemmGrid`: the tile :func:`choose_tile` picks by the wave model, rows padded, tiles,
K splits), plus the copy-engine all-gather's chunking (:func:`chunk_tiles`), the pushers of the
SM-pusher all-gather (:func:`choose_push_blocks`), and the call plan a call of the same key
resolved before (:func:`_cached_call`; a fused one stored once every rank built it: :func:`_fused_plan`)."""

import heapq
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tilescale import runtime
from tilescale.groups import GroupState
from tilescale.jit import kernel_lowering
from tilescale.language.scale import ADDRESS
from tilescale.op_launch import MISSED, Direct, OpLaunch
from tilescale.ops._common import (
    call_identity,
    check_input,
    launch_together,
    layout_key,
    op_plans,
    sm_count,
    tl_dtype,
)
from tilescale.ops._gemm import (
    DEFAULT,
    NARROW,
    SWAPPED_SLOT_ROWS,
    TALL,
    THIN,
    WIDE,
    WIDE_192,
    WIDE_224,
    TileConfig,
    swapped_tile,
)
from tilescale.plans import capturing

# Pusher blocks the SM-pusher all-gather plan may take (the rest of its first kernel computes
# the own rows; choose_push_blocks picks one per shape), and what they move: one block ~22 GB/s
# to a peer while the GEMM runs (2x H100, 2026-11-28: 4 pushers moved 33.5 MB in ~385 us),
# all of them at most what SM stores reach over NVLink (332-348 GB/s on 2x H200, DESIGN.md).
PUSH_CHOICES = (4, 8, 16, 32)
PUSH_BLOCK_GBPS = 20.0
PUSH_LINK_GBPS = 330.0
# The CPU path's default: fused from this many output rows on (GPUs decide by _fused_wins).
FUSED_MIN_ROWS = 1024
# The link arithmetic of the GPU default (_fused_wins): what the unfused plan's NCCL collective
# moves per rank per second and its fixed cost (all_gather 225 GB/s on 2x H200 NV18, DESIGN.md),
# a GEMM's rate, and what a fused call pays besides its GEMM (its first chunk or last tiles).
NCCL_GBPS = 225.0
NCCL_US = 20.0
GEMM_TFLOPS = 750.0
FUSED_US = 10.0
# An eager fused call's host time on one H100 (the floor's eager decode all-reduces and its
# 1000 x 1792 x 4096 reduce-scatter took 77-83 us whatever their GPU time): below it a fused
# call waits for the host, so _fused_wins counts at least this much outside a graph capture.
FUSED_HOST_US = 80.0
# The same for NCCL + cuBLAS eagerly (a GEMM, then a collective whose host side NCCL runs): on
# 2x H200 (2026-11-27) 88 us for a reduce-scatter whose GEMM takes ~20 us (101 us through the
# op's unfused plan), 107-184 us for the decode all-reduces; the fused reduce-scatter took 73 us.
UNFUSED_HOST_US = 85.0
# Inside a CUDA graph capture the one-kernel decode all-reduce is the default up to this many
# rows, and above them up to this many bytes of output (one_kernel_wins says why).
ONE_KERNEL_GRAPH_ROWS = 128
ONE_KERNEL_GRAPH_BYTES = 3 << 20
# Device-to-device copy rate (bytes read + written; 3.0 TB/s on one H100, 4.3 on one H200,
# /work/.library/device/KINDS.md): the gathering all-reduce's copy of the peers' segments.
HBM_GBPS = 3000.0
# The tiles choose_tile weighs where the output fills the SMs, each with its speed per FLOP
# relative to WIDE at full waves (benchmarks/gemm_tiles.py --floor on one H100, mean over the
# floor's 16 GEMMs with >= 1024 rows: 128x224 0.983, 128x192 0.948; 128x128 0.88 never wins).
TILE_RATES = ((WIDE, 1.0), (WIDE_224, 0.98), (WIDE_192, 0.95))


@dataclass(frozen=True)
class GemmGrid:
    """The fused GEMM of one call: its ``tile``, each row segment's rows padded to whole row
    tiles (``padded``), the output tiles per segment (``tiles``) and the parts K is split in
    (``splits``, each its own block and partial tile)."""

    tile: TileConfig
    padded: int
    tiles: int
    splits: int = 1


def chunk_tiles(m_tiles: int, k: int, block_M: int, elem_bytes: int) -> int:
    """Row tiles per copy of the copy-engine all-gather: about 8 MB each, at least 2 copies per
    segment where it has 2 row tiles, so the first tiles of a segment start after a part landed.

    Example::

        chunk_tiles(64, 8192, 128, 2)     # 4: 512 rows of 8192 bf16 = 8 MB

    Args:
        m_tiles: Row tiles in a segment (one rank's rows).
        k: Elements per row.
        block_M: Rows per tile.
        elem_bytes: Bytes per element.

    Returns:
        int: Row tiles per copy, at least 1.
    """
    return max(1, min(-(-m_tiles // 2), (8 << 20) // (block_M * k * elem_bytes)))


class AgreedLaunch:
    """A fused plan's call: its ``OpLaunch`` on ``(a, weight)`` with the call's identity
    (:func:`call_identity` of ``sig`` on ``state``'s group), which its kernels check the ranks
    agree on, as its one scalar. Later calls of its layouts go straight to its learned program
    (:func:`_cached_call`, ``tilescale.op_launch.Direct``)."""

    def __init__(self, call: OpLaunch, state: GroupState, sig: int):
        self.call, self.state, self.sig = call, state, sig

    def __call__(self, a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return self.call((a, weight), (call_identity(self.state, self.sig)[1],))


# The TP GEMMs' repeated fused calls, made from C++ (a site per op and arguments besides the tensors).
_direct = Direct()


def _cached_call(op: str, a: torch.Tensor, weight: torch.Tensor, plan: str | None, tile: TileConfig | None,
                 group: dist.ProcessGroup | None, *options: object) -> tuple[tuple, torch.Tensor | None]:
    """A TP GEMM call made by the plan an earlier call of its key resolved: straight from C++
    where that plan's program was learned for these arguments and the tensors' layouts
    (``Direct``), else through the plan; at the key's first call nothing is made.

    Example::

        key, out = _cached_call("gemm_all_reduce", a, weight, plan, tile, group)
        if out is not None:
            return out
        ...                                  # checks, then op_plans.put(key, launch)(a, weight)

    Args:
        op: the op's name.
        a, weight: the operands (their layouts are part of the key: :func:`layout_key`).
        plan, tile, group: the op's arguments of those names.
        *options: the op's other arguments that change its plan.

    Returns:
        The key (with ``TILESCALE_TP_PLAN`` as ``ts.init()`` read it, which ``plan=None`` follows,
        and whether the call is being captured in a CUDA graph, which may take another plan) and
        the call's output, or None where no plan is cached yet.
    """
    site = (op, plan, tile, group, *options)
    out = _direct(site, (a, weight))
    if out is not MISSED:
        return (), out
    in_capture = capturing(a)
    key = (op, layout_key(a), layout_key(weight), plan, tile, group, runtime.current().tp_plan, *options, in_capture)
    launch = op_plans.get(key)
    if launch is None:
        return key, None
    out = launch(a, weight)
    if isinstance(launch, AgreedLaunch) and not in_capture:
        _direct.learn(site, launch.call, (a, weight), launch.state, launch.sig)
    return key, out


def _fused_plan(state: GroupState, key: tuple, op: str, launch: Callable) -> Callable:
    """``launch``, a fused plan whose kernels are built, stored as ``key``'s plan once every rank
    of the group has built its own (:func:`launch_together`)."""
    launch_together(state, op, key)
    return op_plans.put(key, launch)


def _check_pair(a: torch.Tensor, weight: torch.Tensor) -> None:
    check_input(a, "a")
    check_input(weight, "weight")
    if a.dim() != 2 or weight.dim() != 2 or a.shape[1] != weight.shape[1]:
        raise ValueError(f"need a (M, K) and weight (N, K); got {tuple(a.shape)} and {tuple(weight.shape)}")
    if a.dtype != weight.dtype:
        raise TypeError(f"a is {a.dtype} but weight is {weight.dtype}")
    tl_dtype(a)


def kernel_tiles(rows: int, n: int, tile: TileConfig, kernels: tuple[int, ...] = (1,)) -> list[int]:
    """Output tiles of each kernel that computes ``kernels[i]`` row segments of ``rows`` rows
    (each padded to whole row tiles) by ``n`` columns.

    Example::

        kernel_tiles(512, 14336, WIDE, (1, 1))     # [224, 224]: the all-gather GEMM's two kernels

    Args:
        rows: Rows of one segment.
        n: Output columns.
        tile: The GEMM tile.
        kernels: Segments each kernel computes (default one kernel of one segment); zeros are skipped.

    Returns:
        list[int]: Output tiles of each kernel with a nonzero segment count.
    """
    per_segment = -(-rows // tile.block_M) * -(-n // tile.block_N)
    return [segments * per_segment for segments in kernels if segments]


def choose_tile(rows: int, n: int, split_k: bool = False, kernels: tuple[int, ...] = (1,),
                k: int | None = None, swapped: bool = True) -> TileConfig:
    """The fused kernels' GEMM tile for row segments of ``rows`` x ``n`` outputs, computed by
    kernels of ``kernels[i]`` segments each (one kernel of one segment by default; the
    all-gather GEMM: ``(1, world - 1)``; the reduce-scatter GEMM: ``(world,)``).

    Where ``WIDE`` (128x256, TileLang's fastest) fills every SM at least once: of ``TILE_RATES``
    the one whose waves, weighted by its speed per FLOP, keep the SMs busiest with outputs
    (:func:`useful_share`): on one H100 the pick was the fastest of the three at each of
    the floor's 16 GEMMs with >= 1024 rows, e.g. 1024 x 14336 in 128x224 tiles, 512 of them =
    3.9 waves (1.05x cuBLAS) where 448 WIDE tiles = 3.4 waves (1.20x). Else, for the
    all-reduce's one segment of at most 256 rows (``split_k``, ``kernels == (1,)``): a
    ``swap_ab`` tile (:func:`swapped_tile`) whose ``n`` columns give at most one block per SM:
    the batch is the wgmma's N, rounded up to 16 rows, so almost no row of an A load falls out
    of bounds, which in a 64- or 128-row tile cost up to 1.4-2.2x cuBLAS at 1-127 rows (one
    H200, the floor's 14 decode all-reduces as graph replays: 0.94-1.32x cuBLAS in swapped
    tiles, 1.04-1.66x in the tiles before; the K loop split where tiles leave SMs idle).
    128 columns per tile where 64 would give more tiles than SMs, and above 128 rows where each
    block's K loop is long (at least 4096: 1.15-1.25x against 1.26-1.38x in 64 columns at
    14336 x 8192, where each block reads all of A's rows again per 64 weight rows; shorter
    loops lost in 128 columns, their fixed epilogue and exchange weighing more). Then, for the
    reduce-scatter and all-reduce GEMMs (``split_k``): ``THIN`` (64x64) for the all-reduce's
    one segment of at most 64 rows; ``NARROW`` (128x64) where a segment is one 128-row tile and
    its tiles give 90% of the SMs a block (decode, K whole); ``TALL`` (256x128) for 129-256
    rows, so one row tile streams the weight once; otherwise ``WIDE``; these split K
    (:func:`k_splits`). Else the 128x128 ``DEFAULT``, whose twice as many tiles keep more SMs
    busy at decode sizes.

    Example::

        choose_tile(8192, 14336)                       # WIDE
        choose_tile(1024, 14336)                       # WIDE_224 on a 132-SM GPU
        choose_tile(128, 8192, split_k=True, kernels=(2,))  # NARROW on a 132-SM H200 (128 tiles)
        choose_tile(33, 8192, split_k=True)            # swapped_tile(33): 48 x 64

    Args:
        rows: Rows of one segment.
        n: Output columns.
        split_k: Whether the caller may split K (the reduce-scatter and all-reduce GEMMs).
        kernels: Segments per kernel, as in :func:`kernel_tiles`.
        k: The reduction length, where known (the all-reduce's swapped tile above 128 rows
            takes 128 columns for long K loops; None: 64 columns where they fit).
        swapped: Whether the all-reduce may take a swapped tile (False: the tile it took
            before them, for the floor benchmark's comparison).

    Returns:
        TileConfig: One of ``WIDE``, ``WIDE_224``, ``WIDE_192``, a ``swap_ab`` tile, ``THIN``,
        ``NARROW``, ``TALL`` or ``DEFAULT`` (depends on this device's SM count).
    """
    sms = sm_count()
    if sum(kernel_tiles(rows, n, WIDE, kernels)) >= sms:
        return max(TILE_RATES, key=lambda tr: tr[1] * useful_share(rows, n, tr[0], kernels, sms))[0]
    if split_k:
        if swapped and kernels == (1,) and rows <= SWAPPED_SLOT_ROWS:
            narrow, wide = -(-n // 64) <= sms, -(-n // 128) <= sms
            long_loop = k is not None and k // k_splits(-(-n // 128), k, 64) >= 4096
            if wide and (not narrow or rows > 128 and long_loop):
                return swapped_tile(rows, 128)
            if narrow:
                return swapped_tile(rows, 64)
        if rows <= THIN.block_M and kernels == (1,):
            return THIN
        if rows <= NARROW.block_M and 10 * sum(kernel_tiles(rows, n, NARROW, kernels)) >= 9 * sms:
            return NARROW
        return TALL if NARROW.block_M < rows <= TALL.block_M else WIDE
    return DEFAULT


def scatter_tile(rows: int, n: int, world: int) -> TileConfig:
    """The reduce-scatter GEMM's tile for ``rows`` output rows per rank (``world`` owners):
    :func:`choose_tile`'s, never a swapped one (only the one-kernel decode all-reduce takes
    those), also over a group of one rank, whose one segment looks like the all-reduce's.

    Example::

        scatter_tile(64, 1024, 1)        # THIN or NARROW, not swapped_tile(64)
    """
    return choose_tile(rows, n, split_k=True, kernels=(world,), swapped=False)


def choose_push_blocks(rows: int, k: int, n: int, world: int, tile: TileConfig, elem_bytes: int) -> int:
    """Pusher blocks of the all-gather GEMM's first kernel (``producer="sm"``): of
    ``PUSH_CHOICES`` the one whose kernel ends first by :func:`own_kernel_us` (ties: the one
    whose rows land first, then the fewest). Each pusher holds an SM until the rows are out, so
    32 pushers cost a wave where the own tiles fill their waves nearly whole, and 4 leave the
    rows late where they are many: on 2x H100 (2026-11-28, graph replays) 2048 x 7168 x 9216
    took 391 us with 4 and 441 with 32, 8192 x 4096 x 6144 705 with 4 and 625-632 with 8-32.

    Example::

        choose_push_blocks(1024, 7168, 9216, 2, WIDE_192, 2)    # 4 on a 132-SM H100: 384 tiles, 3 waves

    Args:
        rows: This rank's rows (M_local).
        k: Input features.
        n: Output columns.
        world: Ranks of the group (the pushers send to ``world - 1`` peers).
        tile: The GEMM tile.
        elem_bytes: Bytes per element of the rows.

    Returns:
        int: One of ``PUSH_CHOICES``.
    """
    sms = sm_count()
    tiles = kernel_tiles(rows, n, tile)[0]
    tile_us = 2 * tile.block_M * tile.block_N * k * sms / (GEMM_TFLOPS * 1e6 * dict(TILE_RATES).get(tile, 1.0))
    row_bytes = (world - 1) * rows * k * elem_bytes

    def push_us(blocks: int) -> float:
        return row_bytes / (min(blocks * PUSH_BLOCK_GBPS, PUSH_LINK_GBPS) * 1e3)

    return min(PUSH_CHOICES, key=lambda p: (own_kernel_us(tiles, tile_us, sms, p, push_us(p)), push_us(p), p))


def own_kernel_us(tiles: int, tile_us: float, sms: int, blocks: int, push_us: float) -> float:
    """When the all-gather GEMM's first kernel ends: ``tiles`` GEMM blocks of ``tile_us`` each,
    dispatched in order to whichever SM frees first, after ``blocks`` pushers that hold an SM
    each for ``push_us`` (one block per SM: the GEMM's shared memory), and not before the
    pushers are done.

    Example::

        own_kernel_us(384, 65.0, 132, 32, 45.0)    # 240.0: 100 SMs free at once, 32 at 45 us

    Args:
        tiles: GEMM blocks of the kernel.
        tile_us: One block's time.
        sms: SMs of the GPU.
        blocks: Pusher blocks, dispatched first.
        push_us: How long the pushers take.

    Returns:
        float: The kernel's time in us.
    """
    held = min(blocks, sms)
    free = [0.0] * (sms - held) + [push_us] * held
    heapq.heapify(free)
    end = push_us
    for _ in range(tiles):
        done = heapq.heappop(free) + tile_us
        end = max(end, done)
        heapq.heappush(free, done)
    return end


def useful_share(rows: int, n: int, tile: TileConfig, kernels: tuple[int, ...], sms: int) -> float:
    """Share of the SMs' time that the kernels of :func:`kernel_tiles` spend on outputs: their
    waves' idle SMs and the padding of ragged row and column tiles are the rest.

    Example::

        useful_share(8192, 8192, WIDE_224, (1,), 132)    # 0.985: 37 column tiles, the last 4/7 full

    Args:
        rows: Rows of one segment.
        n: Output columns.
        tile: The GEMM tile.
        kernels: Segments per kernel, as in :func:`kernel_tiles`.
        sms: SMs of the GPU.

    Returns:
        float: In (0, 1].
    """
    tiles = kernel_tiles(rows, n, tile, kernels)
    waves = sum(-(-t // sms) for t in tiles)
    return rows * n * sum(kernels) / (waves * sms * tile.block_M * tile.block_N)


def wave_efficiency(tiles: list[int], sms: int) -> float:
    """Share of the SMs' time that kernels of ``tiles[i]`` one-SM blocks each, run one after
    another, keep busy: each kernel's last, partial wave leaves SMs idle.

    The fused kernels' one-rank floor follows it (one H100, 20261124-191930): 1024 x 14336
    outputs in 128x256 tiles are 448 tiles, 3.4 waves of 132 SMs, 0.85 busy: 1.21x cuBLAS.

    Example::

        wave_efficiency([448], 132)     # 0.848

    Args:
        tiles: Blocks of each kernel.
        sms: SMs of the GPU.

    Returns:
        float: Busy share in (0, 1].
    """
    return sum(tiles) / (sum(-(-t // sms) for t in tiles) * sms)


def _fused_wins(flops: float, tiles: list[int], collective_bytes: float, tail_us: float = 0.0) -> bool:
    """Whether the fused plan should beat NCCL + cuBLAS on GPUs: the fused GEMM loses its
    waves' idle share (:func:`wave_efficiency`) plus ``FUSED_US`` and what follows its last
    tiles (``tail_us``); the unfused plan waits for a collective of ``collective_bytes`` per
    rank after a GEMM at full rate. Eager (not capturing a CUDA graph) the fused call takes
    at least ``FUSED_HOST_US`` and the unfused one at least ``UNFUSED_HOST_US``: their host time."""
    gemm_us = flops / (GEMM_TFLOPS * 1e6)
    fused = gemm_us / wave_efficiency(tiles, sm_count()) + FUSED_US + tail_us
    unfused = gemm_us + collective_bytes / (NCCL_GBPS * 1e3) + NCCL_US
    if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        fused, unfused = max(fused, FUSED_HOST_US), max(unfused, UNFUSED_HOST_US)
    return fused < unfused


def one_kernel_wins(world: int, rows: int, capturing: bool, out_bytes: int) -> bool:
    """Whether the one-kernel decode all-reduce GEMM is the GPU default.

    It puts each rank's whole partial product to every peer, ``world - 1`` outputs per rank,
    where NCCL's all-reduce moves ``2 (world - 1) / world``: the same bytes at two ranks, twice
    at four. Measured at 128 x 14336 x 8192 against NCCL + cuBLAS: 2x H100 1.11x eager, 1.13x
    replayed; 2x H200 1.33x / 1.16x; 4x H100 0.89x and 0.93x eager (2026-11-26, 27), 0.78x
    replayed. So it is the default where it moves no more bytes than NCCL. Inside a CUDA
    graph capture, where neither plan pays host time, up to ``ONE_KERNEL_GRAPH_ROWS`` rows,
    and above them where the output is at most ``ONE_KERNEL_GRAPH_BYTES``: the kernel puts its
    whole partial output after its GEMM, so its exchange grows with the output's bytes, and its
    GEMM is 1.15-1.32x cuBLAS at 200-256 rows (swapped tiles, one H200). Replayed on 2x H200
    (2026-11-28, swapped tiles) against NCCL + cuBLAS: 128 rows 1.19x and 1.35x; 200 x 7168
    (2.9 MB of output) 1.35x, 256 x 4096 (2 MB) 1.12x and 1.16x, 256 x 8192 (4.2 MB) 0.98x
    (with the tiles before, all four of 200-256 rows lost, 0.85-0.99x); eagerly all won.

    Example::

        one_kernel_wins(2, 128, True, 128 * 8192 * 2), one_kernel_wins(4, 128, False, 128 * 8192 * 2)  # True, False
        one_kernel_wins(2, 256, True, 256 * 4096 * 2), one_kernel_wins(2, 256, True, 256 * 8192 * 2)  # True, False

    Args:
        world: Ranks of the tensor-parallel group.
        rows: The GEMM's rows (M).
        capturing: Whether the call is being captured in a CUDA graph.
        out_bytes: The output's bytes (M x N x element size).

    Returns:
        bool: True where the one-kernel plan is the default, as above.
    """
    return world - 1 <= 2 * (world - 1) / world and (
        not capturing or rows <= ONE_KERNEL_GRAPH_ROWS or out_bytes <= ONE_KERNEL_GRAPH_BYTES)


def gemm_alone(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The unfused plan of a group of one rank: ``a @ weight.T``, nothing to gather or sum."""
    return a @ weight.T


def _choose(plan: str | None, rows: int, fused_wins: bool, group: dist.ProcessGroup | None = None,
            dtype: torch.dtype = torch.bfloat16) -> str:
    """The plan: as asked, else ``TILESCALE_TP_PLAN`` (as ``ts.init()`` read it), else for a group of
    one rank unfused (the GEMM alone: there is nothing to overlap), else on GPUs ``fused_wins`` (the op's
    :func:`_fused_wins`, NVLink's arithmetic: where ``group``'s ranks talk through NVSHMEM calls,
    across nodes, NCCL + cuBLAS), elsewhere (the CPU path) fused from ``FUSED_MIN_ROWS`` output rows on.
    On GPUs the fused kernels take 2-byte operands (``dtype``) only: their tiles' pipelines fill
    the shared memory with bfloat16 / float16 stages (in float32 they would need 1.3-1.9x an
    SM's: TileLang's launch fails, one H200), so other dtypes run unfused, and asking for the
    fused plan with one raises.

    Raises:
        ValueError: an unknown plan.
        TypeError: the fused plan asked for (``plan`` or ``TILESCALE_TP_PLAN``) on a GPU, in a
            dtype of other than 2 bytes.
    """
    plan = plan or runtime.current().tp_plan
    if plan not in (None, "fused", "unfused"):
        raise ValueError(f"plan must be 'fused', 'unfused' or None, got {plan!r}")
    if plan is None and runtime.group_state(group).size == 1:
        return "unfused"
    if runtime.device().type == "cuda":
        if dtype.itemsize != 2:
            if plan == "fused":
                raise TypeError(f"the fused TP GEMMs take bfloat16 or float16 on GPUs, got {dtype} (their tiles' "
                                "shared memory holds 2-byte elements): use plan='unfused' (NCCL + cuBLAS) or None")
            return "unfused"
        return plan or ("fused" if fused_wins and kernel_lowering(group) in (None, ADDRESS) else "unfused")
    return plan or ("fused" if rows >= FUSED_MIN_ROWS else "unfused")


def k_splits(tiles: int, K: int, block_K: int) -> int:
    """Parts to split K into so that ``tiles`` output tiles give every SM a block (1, 2, 4 or
    8; only splits into whole K steps).

    Example::

        k_splits(32, 14336, 64)    # 4 on a 132-SM H200: 128 blocks

    Args:
        tiles: Output tiles of the GEMM.
        K: The reduction length.
        block_K: The tile's K step; every part is a whole number of steps.

    Returns:
        int: 1, 2, 4 or 8 (this device's SM count decides).
    """
    splits = 1
    while tiles * splits * 2 <= sm_count() and K % (splits * 2 * block_K) == 0 and splits < 8:
        splits *= 2
    return splits


def reduce_grid(m: int, k: int, n: int, owners: int, tile: TileConfig) -> GemmGrid:
    """The GEMM grid that ``gemm_reduce_scatter`` (``owners`` = world size) or ``gemm_all_reduce``
    (1) runs for an (m, k) x (n, k) product with ``tile``.

    Example::

        reduce_grid(128, 14336, 8192, 1, WIDE)    # GemmGrid(WIDE, 128, 32, 4) on a 132-SM H200

    Args:
        m: Rows of ``a`` (all owners' rows).
        k: The reduction length (this rank's K).
        n: Output columns.
        owners: Row segments the output is split into (world size, or 1 for the all-reduce).
        tile: The GEMM tile.

    Returns:
        GemmGrid: The tile, each segment's rows padded to whole row tiles, tiles per segment and K splits.
    """
    padded = -(-(m // owners) // tile.block_M) * tile.block_M
    tiles = (padded // tile.block_M) * -(-n // tile.block_N)
    return GemmGrid(tile, padded, tiles, k_splits(owners * tiles, k, tile.block_K))
