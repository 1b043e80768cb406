"""Where the decode all-reduce's time goes: its GEMM loop alone against the whole kernel.

``ts.ops.gemm_all_reduce`` at up to 256 rows runs one kernel (``all_reduce_gemm_kernel``): the
GEMM in swapped tiles (K split where the tiles are too few for the SMs), then an epilogue that
sums the K parts through an fp32 buffer and the tile's own flag, stages the share the peers get
in shared memory, puts and signals it, waits for the peers' shares and sums them in rank order.
At one rank nothing crosses a link, but all of it except the puts and the peers' waits still
runs. This probe times, as CUDA-graph replays taking turns (CUDA events, median), each output
checked against cuBLAS first:

* ``cublas``: ``a @ w.T``;
* ``fused``: the op's one kernel at one rank (``plan="fused"``, the tile ``choose_tile`` picks);
* ``loop``: :func:`loop_kernel`, the same grid and tile (``reduce_grid``) and the same K loop
  (``accumulate_tile``), each block storing its K part of the tile straight from registers (in
  bf16), and nothing else.

So ``fused - loop`` is what the epilogue costs at each shape, ``loop / cublas`` what the main
loop does. The shapes are the TP floor's decode all-reduces (``tp_shapes.FLOOR_SHAPES``)::

    tilescale run -n 1 benchmarks/decode_epilogue.py                  # one sm_90a GPU
    tilescale run -n 1 --cpu benchmarks/decode_epilogue.py --small    # the checks only

The table and JSON (``benchmarks/results/decode-epilogue-<device>-<time>.json``) give each
kernel's time, its ratio to cuBLAS and ``epilogue_us``.
"""

# No `from __future__ import annotations`: TileLang evaluates T.Tensor annotations, which
# refer to the kernel factory's local variables.

import argparse

import torch
from harness import Report, check_close, columns_against, measure_shapes, replays_against
from tp_shapes import FLOOR_SHAPES

import tilescale as ts
import tilescale.language as T
from tilescale.jit import jit
from tilescale.ops._gemm import TileConfig, accumulate_tile
from tilescale.ops.tp_gemm.plan import choose_tile, reduce_grid

DECODE_SHAPES = [shape for op, shape in FLOOR_SHAPES if op == "ar" and shape[0] <= 256]
# --small (the CPU path's 4 SMs): a swapped tile, one with K split in two, and a 128x256 tile.
SMALL_SHAPES = [(24, 512, 256), (200, 1024, 128), (256, 512, 512)]


@jit
def loop_kernel(rows: int, padded: int, K: int, N: int, tile: TileConfig, splits: int, dtype: str = "bfloat16"):
    """The decode all-reduce kernel's grid and K loop alone: block ``(bx, by * splits + s)``
    computes K part ``s`` of output tile ``(by, bx)`` and stores it, rounded to ``dtype``, in
    ``out[s]`` (the K parts summed by the caller).

    Args:
        rows: Rows of ``a``.
        padded: ``rows`` rounded up to whole row tiles (``reduce_grid``).
        K: Input features.
        N: Output columns.
        tile: The GEMM tile (``swap_ab`` or not).
        splits: Parts K is split into.
        dtype: TileLang dtype of the operands and the output (default ``"bfloat16"``).

    Returns:
        The kernel's ``T.prim_func``; a call through ``ts.jit`` gives the compiled kernel.
    """
    bm, bn = tile.block_M, tile.block_N
    m_tiles, n_tiles, k_part = padded // bm, -(-N // bn), K // splits

    @T.prim_func
    def main(a: T.Tensor((rows, K), dtype), w: T.Tensor((N, K), dtype),
             out: T.Tensor((splits, padded, n_tiles * bn), dtype)):
        with T.Kernel(n_tiles, m_tiles * splits, threads=tile.threads) as (bx, bz):
            by, s = bz // splits, bz % splits
            acc = T.alloc_fragment((bn, bm) if tile.swap_ab else (bm, bn), "float32")
            T.clear(acc)
            accumulate_tile(a, by * bm, w, bx * bn, acc, s * k_part, k_part, dtype, tile.stages, tile)
            if tile.swap_ab:
                for j, i in T.Parallel(bn, bm):
                    out[s, by * bm + i, bx * bn + j] = T.cast(acc[j, i], dtype)
            else:
                T.copy(acc, out[s, by * bm, bx * bn])

    return main


def measure(shape: tuple[int, int, int], iters: int, timed: bool) -> dict:
    """One shape: the fused op and the loop alone checked against cuBLAS, then (``timed``)
    replayed taking turns with it."""
    m, k, n = shape
    g = torch.Generator(device=ts.device()).manual_seed(m + k + n)
    a = torch.randn(m, k, device=ts.device(), generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, device=ts.device(), generator=g) / k**0.5).to(torch.bfloat16)
    tile = choose_tile(m, n, split_k=True, k=k)
    grid = reduce_grid(m, k, n, 1, tile)
    loop = loop_kernel(m, grid.padded, k, n, tile, grid.splits)
    parts = torch.empty(grid.splits, grid.padded, -(-n // tile.block_N) * tile.block_N, dtype=a.dtype,
                        device=a.device)
    calls = {"cublas": lambda: a @ w.T, "fused": lambda: ts.ops.gemm_all_reduce(a, w, plan="fused"),
             "loop": lambda: loop(a, w, parts)}
    want = calls["cublas"]()
    row = {"shape": f"{m}x{k}x{n}", "tile": tile.name(), "k_splits": grid.splits, "checks": [
        check_close(f"{m}x{k}x{n} fused", calls["fused"](), want, rtol=2e-2, atol=2e-2)]}
    calls["loop"]()
    row["checks"].append(check_close(f"{m}x{k}x{n} loop", parts.float().sum(0)[:m, :n].to(a.dtype), want,
                                     rtol=2e-2, atol=2e-2))
    if timed:
        replays_against(row, calls, "cublas", iters)
        row["epilogue_us"] = row["fused_us"] - row["loop_us"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--small", action="store_true", help="three tiny shapes, checked, not timed (the CPU path)")
    args = parser.parse_args()
    ts.init()
    report = Report("decode-epilogue", columns=["shape", "tile", "k_splits", *columns_against(["fused", "loop"],
                                                                                              "cublas"), "epilogue_us"])
    measure_shapes(report, SMALL_SHAPES if args.small else DECODE_SHAPES,
                   lambda shape: measure(shape, args.iters, not args.small), not args.small)
    ts.finalize()


if __name__ == "__main__":
    main()
