"""Decode all-reduce tiles at 129-256 rows: the batch whole, split between two consumers, or halved?

``ts.ops.gemm_all_reduce`` (one-kernel plan) at one rank on one GPU, three ways taking turns
as CUDA-graph replays (CUDA events, median), each output checked against cuBLAS first:

* ``today``: the tile ``choose_tile`` picks (above 128 rows and for long K loops: 128 weight
  rows per block, two consumer warp groups of 64 weight rows each, K split to fill the SMs);
* ``two``: 64 weight rows per block (128 blocks for 8192 columns, K whole) whose two consumer
  warp groups take half the batch each (``FullCol``), the form cuBLAS runs at these sizes and
  ``benchmarks/decode_multicast.py``'s ``two_consumers`` (the GEMM alone: 1.055x cuBLAS at
  192 x 14336 x 8192 against 1.30x for half-batch blocks);
* ``halves``: half the batch per block (rounded up to 16 rows: two row tiles), 64 weight rows,
  one consumer warp group, K whole (2 x 64 blocks for 4096 columns): the weight tile read
  twice, through L2, where today's tile splits K and sums fp32 parts (the GEMM alone at
  256 x 3584 x 4096 in ``decode_multicast.py``: 1.07x cuBLAS, the fused kernel today 1.39x);
* cuBLAS (``a @ w.T``).

``--tiles`` picks them (default ``today,two``; with ``halves``, the shapes where it fits the
one-kernel plan, N <= 4224 on 132 SMs).

::

    tilescale run -n 1 benchmarks/decode_tiles.py                 # one sm_90a GPU
    tilescale run -n 1 --cpu benchmarks/decode_tiles.py --small   # the checks only

Ran on one H200 on 2026-11-29 as ``.cache/gpu/ar_tiles.py`` (the same measurement, before
this file took it into functions): ``benchmarks/results/ar-two-consumers-nvidia-h200-20261129-005618.json``.
"""
import argparse

import torch
from harness import Report, check_close, columns_against, measure_shapes, replays_against

import tilescale as ts
from tilescale.ops._gemm import TileConfig
from tilescale.ops.tp_gemm.plan import choose_tile, swapped_tile

SHAPES = [(136, 14336, 8192), (160, 14336, 8192), (192, 14336, 8192), (224, 14336, 8192), (256, 14336, 8192),
          (192, 7168, 8192), (256, 11008, 4096), (200, 2304, 7168), (176, 8192, 7168)]
# Where two row tiles of half the batch fit the one-kernel plan (2 x N / 64 blocks at most one per SM).
HALVES_SHAPES = [(256, 3584, 4096), (256, 11008, 4096), (256, 14336, 4096), (192, 7168, 4096), (160, 14336, 4096),
                 (224, 5120, 4096), (144, 8192, 4096), (256, 8192, 2048), (200, 2304, 3584)]
TILES = ("today", "two", "halves")


def two_consumers(rows: int) -> TileConfig:
    """64 weight rows per block, the batch (rounded up to 16 rows) split between two consumer
    warp groups, as many stages as fit in 208 KB of shared memory beside the epilogue (at most 12)."""
    bm = -(-rows // 16) * 16
    stages = min(12, (208 * 1024 - bm * 64 * 2) // ((bm + 64) * 64 * 2))
    return TileConfig(bm, 64, 64, stages, 256, "FullCol", "direct", swap_ab=True)


def measure(shape: tuple[int, int, int], iters: int, timed: bool, names: list[str]) -> dict:
    """One shape: the tiles of ``names`` (of :data:`TILES`) checked against cuBLAS, then
    (``timed``) replayed taking turns with it."""
    m, k, n = shape
    g = torch.Generator(device=ts.device()).manual_seed(m + k + n)
    a = torch.randn(m, k, device=ts.device(), generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=ts.device(), generator=g) / k**0.5).to(torch.bfloat16)
    want = a @ w.T
    tiles = {"today": choose_tile(m, n, split_k=True, k=k), "two": two_consumers(m),
             "halves": swapped_tile(-(-m // 32) * 16)}
    tiles = {name: tile for name, tile in tiles.items() if name in names}
    calls = {"cublas": lambda: a @ w.T}
    for name, tile in tiles.items():
        calls[name] = lambda tile=tile: ts.ops.gemm_all_reduce(a, w, plan="fused", tile=tile)
    row = {"shape": f"{m}x{k}x{n}", "today": choose_tile(m, n, split_k=True, k=k).name(), "checks": []}
    for name in tiles:
        row["checks"].append(check_close(f"{row['shape']} {name}", calls[name](), want, rtol=2e-2, atol=2e-2))
    if timed:
        replays_against(row, calls, "cublas", iters)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--small", action="store_true", help="one tiny shape, checked, not timed (the CPU path)")
    parser.add_argument("--tiles", default="today,two", help=f"which of {', '.join(TILES)} (halves: its own shapes)")
    args = parser.parse_args()
    names = args.tiles.split(",")
    ts.init()
    report = Report("decode-tiles", columns=["shape", "today", *columns_against(names, "cublas")])
    shapes = HALVES_SHAPES if "halves" in names else SHAPES
    measure_shapes(report, [(192, 512, 128)] if args.small else shapes,
                   lambda shape: measure(shape, args.iters, not args.small, names), not args.small)
    ts.finalize()


if __name__ == "__main__":
    main()
