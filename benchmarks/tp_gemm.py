"""Fused tensor-parallel GEMMs vs the plans a user would pick instead, side by side.

For each shape (M rows of the whole product, K and N as each rank holds them, bf16): the
GEMM alone (cuBLAS, no communication), NCCL + cuBLAS one after the other, torch async-TP
(``torch.ops.symm_mem`` fused ops) where torch has the op, and tilescale's fused op. Every
tilescale result is checked against the NCCL + cuBLAS one before timing.

    tilescale run -n 2 benchmarks/tp_gemm.py            # the issue's shapes (2x H200)
    tilescale run -n 2 --cpu benchmarks/tp_gemm.py --small

``--floor`` (a one-rank job) times every fused plan of every op, as one rank's GEMM of a
TP shape, against cuBLAS on the same operands: what the fused kernels cost before any link
(see :func:`floor`)::

    tilescale run -n 1 benchmarks/tp_gemm.py --floor

``--predicted`` (two ranks) checks the 2-GPU prediction the floor gave (docs/performance-log.md,
"Default plan and the 2-GPU prediction"): at each predicted shape, the op's default plan
(``plan=None``), its fused plan and NCCL + cuBLAS, interleaved, beside the predicted speed-up
(see :func:`measure_predicted`)::

    tilescale run -n 2 benchmarks/tp_gemm.py --predicted

``--pushers`` (two or more ranks) times the all-gather GEMM with its SM pushers chosen per
shape (``choose_push_blocks``) against each count it chooses from, forced (see
:func:`measure_pushers`)::

    tilescale run -n 2 benchmarks/tp_gemm.py --pushers
"""

import argparse
import json
import math
from pathlib import Path

import tilelang
import torch
import torch.distributed as dist
from gemm_tiles import Variant, build
from harness import Report, check_close, device_info, graphed, named_sizes, progress, time_interleaved
from tp_shapes import AG_SHAPES, AR_SHAPES, FLOOR_SHAPES, RS_SHAPES

import tilescale as ts
from tilescale.ops._gemm import DEFAULT, NARROW, THIN, WIDE, TileConfig
from tilescale.ops.tp_gemm import (
    PUSH_CHOICES,
    choose_push_blocks,
    choose_tile,
    default_producer,
    reduce_grid,
    scatter_tile,
)

TILES = {DEFAULT: "128x128", WIDE: "128x256", NARROW: "128x64"}


def tile_label(tile: TileConfig) -> str:
    """``128x256``: a tile's output shape (``16x64 swapped``: the batch in the wgmma's N)."""
    return f"{tile.block_M}x{tile.block_N}" + (" swapped" if tile.swap_ab else "")
SMALL = {"ag": [(64, 96, 80)], "rs": [(128, 64, 96)], "ar": [(16, 64, 96)]}


def _torch_async_tp(op: str, a: torch.Tensor, weight: torch.Tensor):
    """torch's fused op as a callable, or None with the reason when this torch lacks it."""
    if ts.device().type != "cuda":
        return None, "CUDA only"
    import torch.distributed._symmetric_memory as symm_mem

    group = dist.group.WORLD.group_name
    if op == "ag":
        shard = symm_mem.empty(a.shape, dtype=a.dtype, device=a.device)
        shard.copy_(a)
        b = weight.T.contiguous()
        return (lambda: torch.ops.symm_mem.fused_all_gather_matmul(shard, [b], 0, group)[1][0]), ""
    if op == "rs":
        b = weight.T.contiguous()
        return (lambda: torch.ops.symm_mem.fused_matmul_reduce_scatter(a, b, "sum", 0, group)), ""
    return None, "no fused GEMM + all-reduce in torch"


def _plans(op: str, a: torch.Tensor, weight: torch.Tensor):
    """(the GEMM's A operand, the NCCL + cuBLAS plan, the fused op taking ``tile=`` and keywords)."""
    world = ts.world_size()
    if op == "ag":
        operand = torch.empty(world * a.shape[0], a.shape[1], dtype=a.dtype, device=a.device)

        def unfused():
            dist.all_gather_into_tensor(operand, a)
            return operand @ weight.T

        fused = lambda tile=None, **kw: ts.ops.all_gather_gemm(a, weight, plan="fused", tile=tile, **kw)  # noqa: E731
    elif op == "rs":
        operand, out = a, torch.empty(a.shape[0] // world, weight.shape[0], dtype=a.dtype, device=a.device)

        def unfused():
            dist.reduce_scatter_tensor(out, a @ weight.T)
            return out

        fused = lambda tile=None: ts.ops.gemm_reduce_scatter(a, weight, plan="fused", tile=tile)  # noqa: E731
    else:
        operand = a

        def unfused():
            c = a @ weight.T
            dist.all_reduce(c)
            return c

        fused = lambda tile=None: ts.ops.gemm_all_reduce(a, weight, plan="fused", tile=tile)  # noqa: E731
    return operand, unfused, fused


def tolerance(op: str, shape: tuple[int, int, int], tile: TileConfig | None) -> float:
    """Absolute and relative tolerance of ``op`` against NCCL + cuBLAS.

    RS and AR sum bf16 partial products in another order than NCCL, one partial per rank and,
    for tilescale's fused kernels (``tile``; None: a plan that does not split K), per K split
    (:func:`reduce_grid`), each rounded before the sum: the tolerance grows with their count.
    """
    if op == "ag":
        return 2e-2
    m, k, n = shape
    world = ts.world_size()
    splits = 1 if tile is None else reduce_grid(m, k, n, world if op == "rs" else 1, tile).splits
    return 1e-2 * max(2, world * splits)


def measure(op: str, shape: tuple[int, int, int], iters: int, push_blocks: tuple[int, ...] = (),
            graph: bool = False) -> dict:
    """Check, then time, every plan of ``op`` ("ag", "rs", "ar") at ``shape`` (also used by scaling.py).

    The fused op runs with each GEMM tile (``fused_128x128``, ``fused_128x256``);
    ``tilescale_fused`` is the one the op picks by itself (``choose_tile``). On GPUs,
    ``tilescale_gemm_alone`` is the fused kernels' GEMM without communication (TileLang, the
    chosen tile): the gap between it and ``gemm_alone`` is TileLang's vs cuBLAS, the rest the
    cost of the overlap. ``push_blocks``: all-gather GEMMs also timed with these pusher counts.
    ``graph``: every plan is captured in a CUDA graph and timed replaying it (no host launch
    path, as in a decode step); a plan that cannot be captured is reported, not timed.
    """
    m, k, n = shape
    g = torch.Generator(device=ts.device()).manual_seed(ts.rank())
    # M counts the rows of the whole product: all-gather GEMM inputs are its row shards.
    rows = m // ts.world_size() if op == "ag" else m
    a = torch.randn(rows, k, device=ts.device(), generator=g).to(torch.bfloat16)
    weight = (torch.randn(n, k, device=ts.device(), generator=g) / k**0.5).to(torch.bfloat16)
    operand, unfused, fused = _plans(op, a, weight)
    expected = unfused().clone()
    world = ts.world_size()
    chosen = scatter_tile(m // world, n, world) if op == "rs" else \
        choose_tile(m, n, split_k=True, k=k) if op == "ar" else choose_tile(m // world, n, kernels=(1, world - 1))
    row = {"op": op, "M": m, "K": k, "N": n, "tile": tile_label(chosen), "checks": []}
    timings = {"gemm_alone": lambda: operand @ weight.T, "nccl_cublas": unfused}
    for tile in {**TILES, chosen: tile_label(chosen)}:  # the fixed tiles and the one choose_tile picks
        label = tile_label(tile)
        tol = tolerance(op, shape, tile)
        row["checks"].append(check_close(f"{op} {shape} fused {label}", fused(tile), expected, rtol=tol, atol=tol))
        timings[f"fused_{label}"] = lambda tile=tile: fused(tile)
    async_tp, why = _torch_async_tp(op, a, weight)
    if async_tp is not None:
        tol = tolerance(op, shape, None)
        row["checks"].append(check_close(f"{op} {shape} torch async-TP", async_tp(), expected, rtol=tol, atol=tol))
        timings["torch_async_tp"] = async_tp
    else:
        row["torch_async_tp"] = f"n/a ({why})"
    if ts.device().type == "cuda":  # the fused kernels' GEMM part alone, same tile and tile order
        gemm = tilelang.compile(build(Variant("tilescale", chosen, "1d" if op == "ag" else "2d"), m, n, k))
        c = torch.empty(m, n, dtype=a.dtype, device=a.device)
        gemm(operand, weight, c)
        row["checks"].append(check_close(f"{op} {shape} TileLang GEMM alone", c, operand @ weight.T))
        timings["tilescale_gemm_alone"] = lambda: gemm(operand, weight, c)
    for blocks in push_blocks if op == "ag" else ():
        timings[f"fused_push{blocks}"] = lambda blocks=blocks: fused(chosen, push_blocks=blocks)
    if graph:
        timings = _graphed_plans(timings, row)
    # Interleaved: the plans are compared within a few percent, less than an H200's clock drift
    # over the seconds that timing them one after another takes.
    for name, timing in time_interleaved(timings, rounds=min(5, iters), iters=iters, barrier=dist.barrier).items():
        row[f"{name}_ms"] = timing.median_ms
    row["tilescale_fused_ms"] = row[f"fused_{tile_label(chosen)}_ms"]
    for ratio, over, under in (("fused_vs_gemm_alone", "tilescale_fused", "gemm_alone"),
                               ("speedup_vs_nccl_cublas", "nccl_cublas", "tilescale_fused"),
                               ("speedup_vs_async_tp", "torch_async_tp", "tilescale_fused")):
        if all(isinstance(row.get(f"{plan}_ms"), float) for plan in (over, under)):  # both timed
            row[ratio] = row[f"{over}_ms"] / row[f"{under}_ms"]
    return row


def _graphed_plans(timings: dict, row: dict) -> dict:
    """Each plan as a CUDA-graph replay; those torch cannot capture are noted in ``row``."""
    replays = {}
    for name, fn in timings.items():
        try:
            replays[name] = graphed(fn)
        except RuntimeError as err:  # e.g. a collective without graph support
            row[f"{name}_ms"] = f"n/a (capture failed: {str(err).splitlines()[0][:120]})"
    return replays


def plot(report: Report) -> None:
    """Each shape's plans as bars, in units of its GEMM-alone time (rank 0 only)."""
    if not report.path:
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    plans = ["nccl_cublas", "torch_async_tp", "tilescale_fused"]
    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(plans)
    for i, plan in enumerate(plans):
        xs = [j + i * width for j, r in enumerate(report.rows) if r.get(f"{plan}_ms")]
        ys = [r[f"{plan}_ms"] / r["gemm_alone_ms"] for r in report.rows if r.get(f"{plan}_ms")]
        ax.bar(xs, ys, width, label=plan)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.08, color="gray", linestyle="--", linewidth=0.8, label="goal (1.08x GEMM alone)")
    ax.set_xticks([j + width for j in range(len(report.rows))])
    ax.set_xticklabels([f"{r['op']} {r['M']}x{r['K']}x{r['N']}" for r in report.rows], rotation=30, ha="right",
                       fontsize=8)
    ax.set_ylabel("time / GEMM alone (cuBLAS)")
    ax.set_title(f"{report.name}, {ts.world_size()} ranks, bf16 (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(report.path.with_suffix(".png"), dpi=120)


# Goals of issue 22 (one-rank job, fused / cuBLAS).
FLOOR_GOAL, FLOOR_GEOMEAN_GOAL, DECODE_GRAPH_GOAL, DECODE_EAGER_GOAL = 1.03, 1.01, 1.05, 1.10

# The 2-GPU prediction from the one-H100 floor of 2026-11-24 (docs/performance-log.md, "Default
# plan and the 2-GPU prediction"): per floor shape, the predicted fused and NCCL + cuBLAS times
# (us) and the plan ``_choose`` defaults to. Decode all-reduces were predicted as graph replays.
PREDICTED_TP2 = {
    ("ag", (8192, 8192, 14336)): (2733, 2957, "fused"), ("ag", (4096, 8192, 14336)): (1390, 1501, "fused"),
    ("ag", (1024, 8192, 14336)): (350, 379, "fused"), ("ag", (8192, 4096, 6144)): (646, 784, "fused"),
    ("ag", (16384, 8192, 3584)): (1367, 1967, "fused"), ("ag", (3000, 8192, 7392)): (536, 644, "fused"),
    ("ag", (2048, 7168, 9216)): (420, 481, "fused"), ("ag", (1500, 4096, 7168)): (157, 164, "fused"),
    ("rs", (8192, 14336, 8192)): (2691, 3025, "fused"), ("rs", (4096, 14336, 8192)): (1468, 1616, "fused"),
    ("rs", (1024, 14336, 8192)): (340, 378, "fused"), ("rs", (4096, 7168, 8192)): (734, 871, "fused"),
    ("rs", (16384, 3696, 8192)): (1601, 2154, "fused"), ("rs", (3000, 4608, 7168)): (299, 378, "fused"),
    ("rs", (2048, 7168, 4096)): (174, 216, "fused"), ("rs", (1000, 1792, 4096)): (92, 72, "unfused"),
    ("ar", (128, 14336, 8192)): (116, 176, "fused"), ("ar", (1024, 14336, 8192)): (379, 414, "fused"),
    ("ar", (256, 14336, 8192)): (144, 170, "fused"), ("ar", (128, 7392, 8192)): (65, 124, "fused"),
    ("ar", (200, 2304, 7168)): (54, 91, "fused"), ("ar", (256, 11008, 4096)): (88, 126, "fused"),
    ("ar", (256, 3584, 4096)): (60, 93, "fused"),
}


def _rank_operands(op: str, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's bf16 ``a`` (an all-gather's row shard, else all M rows) and ``weight`` for ``op``
    at ``shape``, drawn from a generator seeded by the rank and M."""
    m, k, n = shape
    g = torch.Generator(device=ts.device()).manual_seed(ts.rank() + m)
    rows = m // ts.world_size() if op == "ag" else m
    a = torch.randn(rows, k, device=ts.device(), generator=g).to(torch.bfloat16)
    weight = (torch.randn(n, k, device=ts.device(), generator=g) / k**0.5).to(torch.bfloat16)
    return a, weight


def _time_plans(row: dict, fns: dict, iters: int, prefix: str = "") -> None:
    """``fns`` timed taking turns on every rank (CUDA events, median), into ``row`` as
    ``{prefix}{name}_us``."""
    for name, timing in time_interleaved(fns, rounds=min(5, iters), iters=iters, barrier=dist.barrier).items():
        row[f"{prefix}{name}_us"] = timing.median_ms * 1e3


def measure_predicted(op: str, shape: tuple[int, int, int], iters: int) -> dict:
    """The op at ``shape`` as a user calls it (``plan=None``: the default ``_choose`` picks),
    its fused plan and NCCL + cuBLAS, checked against NCCL + cuBLAS, then timed taking turns
    (CUDA events, median); decode all-reduces (M <= 256) also as CUDA-graph replays, as they
    were predicted. Beside them, the prediction (``PREDICTED_TP2``; None for shapes it lacks)."""
    m, k, n = shape
    a, weight = _rank_operands(op, shape)
    _, unfused, fused = _plans(op, a, weight)
    call = {"ag": ts.ops.all_gather_gemm, "rs": ts.ops.gemm_reduce_scatter, "ar": ts.ops.gemm_all_reduce}[op]
    plans = {"nccl_cublas": unfused, "default": lambda: call(a, weight), "fused": fused}
    if op == "ag":  # the copy-engine producer beside the default SM pushers
        plans["fused_copy_engine"] = lambda: fused(producer="copy_engine")
    expected = unfused().clone()
    tol = max(tolerance(op, shape, None), tolerance(op, shape, choose_tile(m, n, split_k=op != "ag", k=k)))
    row = {"op": op, "M": m, "K": k, "N": n, "checks": [
        check_close(f"{op} {shape} {name}", fn(), expected, rtol=tol, atol=tol) for name, fn in plans.items()]}
    timed = {"": plans}
    if op == "ar" and m <= 256 and ts.device().type == "cuda":
        timed["graph_"] = {name: graphed(fn) for name, fn in plans.items()}
    for prefix, fns in timed.items():
        _time_plans(row, fns, iters, prefix)
        row[f"{prefix}speedup"] = row[f"{prefix}nccl_cublas_us"] / row[f"{prefix}default_us"]
    predicted = PREDICTED_TP2.get((op, shape))
    if predicted is not None:
        fused_us, nccl_us, default = predicted
        basis = "graph_" if "graph_speedup" in row else ""
        row.update(predicted_fused_us=fused_us, predicted_nccl_cublas_us=nccl_us, predicted_default=default,
                   predicted_speedup=nccl_us / min(fused_us, nccl_us), measured_basis=basis or "eager",
                   measured_speedup=row[f"{basis}speedup"])
    return row


# --pushers: the all-gathers of the 2-GPU prediction and two more whose pushers the chooser
# sets to 16 and 8 (M: all ranks' rows).
PUSHER_SHAPES = [*(s for op, s in PREDICTED_TP2 if op == "ag"), (2048, 4096, 14336), (6144, 5120, 13824)]


def measure_pushers(shape: tuple[int, int, int], iters: int) -> dict:
    """The all-gather GEMM at ``shape`` with the SM pushers (``producer="sm"``) as the op picks
    them (``chosen``: :func:`choose_push_blocks`) and with each count of ``PUSH_CHOICES``
    forced (``push4``, ...), beside NCCL + cuBLAS: every plan checked against NCCL + cuBLAS,
    then timed taking turns (CUDA events, median), eagerly and, on GPUs, as CUDA-graph replays
    (``graph_`` columns), which leave the kernels' own time."""
    m, k, n = shape
    world = ts.world_size()
    a, weight = _rank_operands("ag", shape)
    _, unfused, _ = _plans("ag", a, weight)
    tile = choose_tile(m // world, n, kernels=(1, world - 1))
    plans = {"nccl_cublas": unfused,
             "chosen": lambda: ts.ops.all_gather_gemm(a, weight, plan="fused", producer="sm"),
             **{f"push{b}": lambda b=b: ts.ops.all_gather_gemm(a, weight, plan="fused", producer="sm", push_blocks=b)
                for b in PUSH_CHOICES}}
    expected = unfused().clone()
    tol = tolerance("ag", shape, tile)
    row = {"op": "ag", "M": m, "K": k, "N": n, "tile": tile_label(tile),
           "pushers": choose_push_blocks(m // world, k, n, world, tile, a.element_size()),
           "checks": [check_close(f"ag {shape} {name}", fn(), expected, rtol=tol, atol=tol)
                      for name, fn in plans.items() if name != "nccl_cublas"]}
    timed = {"": plans}
    if ts.device().type == "cuda":
        timed["graph_"] = {name: graphed(fn) for name, fn in plans.items()}
    for prefix, fns in timed.items():
        _time_plans(row, fns, iters, prefix)
        fixed = min(PUSH_CHOICES, key=lambda b: row[f"{prefix}push{b}_us"])
        row[f"{prefix}best_fixed"] = fixed
        row[f"{prefix}chosen_vs_best"] = row[f"{prefix}chosen_us"] / row[f"{prefix}push{fixed}_us"]
        row[f"{prefix}chosen_vs_push32"] = row[f"{prefix}chosen_us"] / row[f"{prefix}push32_us"]
        row[f"{prefix}speedup"] = row[f"{prefix}nccl_cublas_us"] / row[f"{prefix}chosen_us"]
    return row


def floor_plans(op: str, a: torch.Tensor, weight: torch.Tensor, tile: TileConfig) -> dict:
    """Every fused plan of ``op`` as a callable (a one-rank job: the whole product is this rank's);
    where ``choose_tile`` picks another ``tile`` than the 128x256 ``WIDE`` (or, for decode
    all-reduces, than the tile it would pick without swapped tiles), the default plan again with
    that fixed tile (``fixed_tile``)."""
    if op == "ag":
        plans = {f"fused_{label}": lambda tile=None, producer=producer: ts.ops.all_gather_gemm(
                     a, weight, plan="fused", producer=producer, tile=tile)
                 for label, producer in _PRODUCER_LABELS.items()}
        default = plans[f"fused_{_tp2_producer(*a.shape)}"]
    else:
        op_fn = ts.ops.gemm_reduce_scatter if op == "rs" else ts.ops.gemm_all_reduce
        plans = {"fused": lambda tile=None: op_fn(a, weight, plan="fused", tile=tile)}
        default = plans["fused"]
    fixed = choose_tile(a.shape[0], weight.shape[0], split_k=True, swapped=False) if tile.swap_ab else \
        NARROW if tile in (NARROW, THIN) else WIDE
    if tile != fixed:
        plans["fixed_tile"] = lambda: default(fixed)
    return plans


def floor(op: str, shape: tuple[int, int, int], iters: int, compile_only: bool = False) -> dict:
    """One rank's GEMM of ``shape`` through every fused plan of ``op``, checked against cuBLAS
    (``torch.matmul``) on the same random operands, then timed taking turns with it (CUDA
    events, warm-up, median); decode all-reduces (M <= 256) also as CUDA-graph replays."""
    m, k, n = shape
    g = torch.Generator(device=ts.device()).manual_seed(m * 7 + k * 3 + n)
    a = torch.randn(m, k, device=ts.device(), generator=g).to(torch.bfloat16)
    weight = (torch.randn(n, k, device=ts.device(), generator=g) / k**0.5).to(torch.bfloat16)
    cublas = lambda: a @ weight.T  # noqa: E731
    expected = cublas()
    tile = choose_tile(m, n, split_k=op != "ag", k=k)
    plans = floor_plans(op, a, weight, tile)
    splits = 1 if op == "ag" else reduce_grid(m, k, n, 1, tile).splits
    row = {"op": op, "M": m, "K": k, "N": n, "tile": tile_label(tile), "k_splits": splits, "checks": []}
    tol = max(tolerance(op, shape, tile), tolerance(op, shape, WIDE))  # fixed_tile may split K otherwise
    for name, fn in plans.items():
        row["checks"].append(check_close(f"{op} {shape} {name}", fn(), expected, rtol=tol, atol=tol))
    if compile_only:
        return row
    timings = {"cublas": cublas, **plans}
    for name, timing in time_interleaved(timings, rounds=5, iters=iters).items():
        row[f"{name}_ms"] = timing.median_ms
        row[f"{name}_samples_ms"] = timing.samples_ms
    for name in plans:
        row[f"{name}_vs_cublas"] = row[f"{name}_ms"] / row["cublas_ms"]
    if op == "ar" and m <= 256 and ts.device().type == "cuda":
        replays = {"cublas": graphed(cublas), **{name: graphed(fn) for name, fn in plans.items()}}
        for name, timing in time_interleaved(replays, rounds=5, iters=iters).items():
            row[f"graph_{name}_ms"] = timing.median_ms
        for name in plans:
            row[f"graph_{name}_vs_cublas"] = row[f"graph_{name}_ms"] / row["graph_cublas_ms"]
    return row


# The floor's plan labels of the all-gather's producers.
_PRODUCER_LABELS = {"sm_pushers": "sm", "copy_engine": "copy_engine"}


def _tp2_producer(m: int, k: int) -> str:
    """The floor's plan label of the producer ``all_gather_gemm`` takes by default at TP 2 (bf16,
    eager, peers mapped) for the whole product's ``m`` rows (``default_producer``)."""
    producer = default_producer(m // 2 * k * 2, capturing=False, mapped=True)
    return next(label for label, p in _PRODUCER_LABELS.items() if p == producer)


def shape_rows(rows: list[dict]) -> list[dict]:
    """A floor run's rows of shapes: ``run_floor`` saves its summary (:func:`floor_summary`) as a last row."""
    return [r for r in rows if r["op"] != "summary"]


def floor_summary(rows: list[dict]) -> dict:
    """Worst and geometric-mean fused/cuBLAS over the shapes with >= 1024 rows, per plan, and
    the decode all-reduces against their goals."""
    summary = {}
    for plan in sorted({key[:-len("_vs_cublas")] for r in rows for key in r
                        if key.endswith("_vs_cublas") and not key.startswith("graph_")}):
        ratios = [(r[f"{plan}_vs_cublas"], f"{r['op']} {r['M']}x{r['K']}x{r['N']}") for r in rows
                  if r["M"] >= 1024 and f"{plan}_vs_cublas" in r]
        if ratios:
            worst = max(ratios)
            summary[plan] = {"shapes": len(ratios), "worst": worst[0], "worst_shape": worst[1],
                             "geomean": math.exp(sum(math.log(x) for x, _ in ratios) / len(ratios)),
                             "over_goal": [s for x, s in ratios if x > FLOOR_GOAL]}
    # The default plan of each op (for the all-gather, the producer it takes at TP 2).
    default = [r.get(f"fused_{_tp2_producer(r['M'], r['K'])}_vs_cublas", r.get("fused_vs_cublas"))
               for r in rows if r["M"] >= 1024]
    if default:  # none where --shapes picks decode shapes only
        summary["default_plans"] = {"worst": max(default), "goal_worst": FLOOR_GOAL, "goal_geomean": FLOOR_GEOMEAN_GOAL,
                                    "geomean": math.exp(sum(map(math.log, default)) / len(default))}
    summary["decode"] = [{"shape": f"{r['M']}x{r['K']}x{r['N']}", "eager": r["fused_vs_cublas"],
                          "graph": r["graph_fused_vs_cublas"], "goal_eager": DECODE_EAGER_GOAL,
                          "goal_graph": DECODE_GRAPH_GOAL} for r in rows if "graph_fused_vs_cublas" in r]
    return summary


def measured_on(device: dict) -> str:
    """The device a run's rows were measured on, from its metadata (``harness.device_info``)."""
    return device["gpus"][0] if device["gpus"] else device["cpu"]


def plot_floor(rows: list[dict], png: Path, device: str) -> None:
    """fused / cuBLAS per shape and plan of a floor run's ``rows`` measured on ``device``, with
    the goal line, into ``png``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    series = ["fused_copy_engine_vs_cublas", "fused_sm_pushers_vs_cublas", "fused_vs_cublas", "graph_fused_vs_cublas",
              "fixed_tile_vs_cublas"]
    labels = ["AG, copy-engine producer", "AG, SM pushers", "RS / AR fused", "AR fused, graph replay",
              "default plan with the fixed tile (128x256 / 128x64: before)"]
    fig = Figure(figsize=(13, 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(zip(series, labels, strict=True)):
        points = [(j, r[key]) for j, r in enumerate(rows) if key in r]
        if points:
            ax.bar([j + i * width for j, _ in points], [y for _, y in points], width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(FLOOR_GOAL, color="gray", linestyle="--", linewidth=0.8, label=f"goal ({FLOOR_GOAL}x, >= 1024 rows)")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"{r['op']} {r['M']}x{r['K']}x{r['N']}" for r in rows], rotation=40, ha="right",
                       fontsize=7)
    ax.set_ylabel("fused / cuBLAS (one rank's GEMM)")
    ax.set_ylim(0.8, max(1.3, *(r.get(k, 0) for r in rows for k in series)) + 0.05)
    ax.set_title(f"TP GEMM floor: fused plans vs cuBLAS, one-rank job on one {device}, bf16 (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def selected(shapes: list[tuple[str, tuple[int, int, int]]], wanted: str) -> list[tuple[str, tuple[int, int, int]]]:
    """The (op, shape) pairs ``wanted`` names (``op:MxKxN,...``), of the ops ``shapes`` has: any
    shape, listed or not, so a run can check others than the lists'; empty: all of ``shapes``."""
    if not wanted:  # e.g. ag:1500x4096x7168,rs:3000x4608x7168
        return shapes
    return named_sizes(wanted, (op for op, _ in shapes), 3, sep=":")


def run_floor(args: argparse.Namespace) -> None:
    if ts.world_size() != 1:
        raise SystemExit("--floor is a one-rank job: tilescale run -n 1 benchmarks/tp_gemm.py --floor")
    shapes = selected(FLOOR_SHAPES, args.shapes)
    if args.part:  # i/n: every n-th shape from the i-th, e.g. to build kernels in parallel processes
        i, n = map(int, args.part.split("/"))
        shapes = shapes[i::n]
    columns = ["op", "M", "K", "N", "tile", "k_splits", "cublas_ms", "fused_copy_engine_ms", "fused_sm_pushers_ms",
               "fused_ms", "fused_copy_engine_vs_cublas", "fused_sm_pushers_vs_cublas", "fixed_tile_vs_cublas",
               "fused_vs_cublas",
               "graph_cublas_ms", "graph_fused_ms", "graph_fused_vs_cublas", "graph_fixed_tile_vs_cublas"]
    report = Report("tp-gemm-floor", columns=columns)
    for op, shape in progress(shapes, "tp_gemm floor", fmt=str):
        report.add(floor(op, shape, args.iters, compile_only=args.compile_only))
        if not args.compile_only:
            report.save()  # after every shape: a job cut off at its time limit keeps what it measured
    if args.compile_only:
        print(f"built and checked {len(shapes)} shapes")
        return
    report.print_table()
    summary = floor_summary(report.rows)
    print(json.dumps(summary, indent=1))
    report.add({"op": "summary", "M": 0, "K": 0, "N": 0, **summary})
    report.save()
    if report.path:  # rank 0 saved it
        plot_floor(shape_rows(report.rows), report.path.with_suffix(".png"), measured_on(device_info()))


def run_predicted(args: argparse.Namespace) -> None:
    shapes = [(op, s) for op, ss in SMALL.items() for s in ss] if args.small else list(PREDICTED_TP2)
    shapes = selected([(op, s) for op, s in shapes if op in args.ops.split(",")], args.shapes)
    columns = ["op", "M", "K", "N", "nccl_cublas_us", "default_us", "fused_us", "fused_copy_engine_us", "speedup",
               "graph_nccl_cublas_us",
               "graph_default_us", "graph_fused_us", "graph_speedup", "predicted_default", "predicted_speedup",
               "measured_speedup"]
    report = Report(f"tp-gemm-predicted-x{ts.world_size()}", columns=columns)
    for op, shape in progress(shapes, "tp_gemm predicted", fmt=str):
        report.add(measure_predicted(op, shape, args.iters))
        report.save()  # after every shape: a job cut off at its time limit keeps what it measured
    report.print_table()
    report.save()


def run_pushers(args: argparse.Namespace) -> None:
    if ts.world_size() < 2:
        raise SystemExit("--pushers needs peers to push to: tilescale run -n 2 benchmarks/tp_gemm.py --pushers")
    shapes = [s for _, s in selected([("ag", s) for s in (SMALL["ag"] if args.small else PUSHER_SHAPES)],
                                     args.shapes)]
    columns = ["op", "M", "K", "N", "tile", "pushers", "nccl_cublas_us", "chosen_us",
               *(f"push{b}_us" for b in PUSH_CHOICES), "chosen_vs_best", "chosen_vs_push32", "speedup",
               "graph_nccl_cublas_us", "graph_chosen_us", *(f"graph_push{b}_us" for b in PUSH_CHOICES),
               "graph_chosen_vs_best", "graph_chosen_vs_push32", "graph_speedup"]
    report = Report(f"tp-gemm-pushers-x{ts.world_size()}", columns=columns)
    for shape in progress(shapes, "tp_gemm pushers", fmt=str):
        report.add(measure_pushers(shape, args.iters))
        report.save()  # after every shape: a job cut off at its time limit keeps what it measured
    report.print_table()
    report.save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="tiny shapes (a smoke test, e.g. on the CPU path)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--ops", default="ag,rs,ar", help="which of ag, rs, ar to run")
    parser.add_argument("--quick", action="store_true", help="only the first (largest) shape of each op")
    parser.add_argument("--push-blocks", default="", help="all-gather GEMMs also timed with these pushers, e.g. 8,32")
    parser.add_argument("--graph", action="store_true", help="time every plan as a CUDA-graph replay (GPUs)")
    parser.add_argument("--floor", action="store_true", help="one-rank job: every fused plan vs cuBLAS (see floor)")
    parser.add_argument("--part", default="", help="--floor: only shapes i, i + n, ... of the list (i/n)")
    parser.add_argument("--shapes", default="", help="--floor, --predicted, --pushers: only these (op:MxKxN,...)")
    parser.add_argument("--compile-only", action="store_true", help="--floor: build and check, no timing")
    parser.add_argument("--plot", default="", help="plot a saved --floor run's JSON (the PNG beside it) and exit")
    parser.add_argument("--predicted", action="store_true", help="two ranks: check the 2-GPU prediction per shape")
    parser.add_argument("--pushers", action="store_true", help="two or more ranks: the all-gather's pushers, "
                        "chosen per shape against each count forced")
    args = parser.parse_args()
    if args.plot:  # a saved floor run's plot, again (no GPU needed)
        data = json.loads(Path(args.plot).read_text())
        plot_floor(shape_rows(data["rows"]), Path(args.plot).with_suffix(".png"), measured_on(data["device"]))
        return
    ts.init()
    if args.floor:
        run_floor(args)
        ts.finalize()
        return
    if args.predicted:
        run_predicted(args)
        ts.finalize()
        return
    if args.pushers:
        run_pushers(args)
        ts.finalize()
        return
    shapes = SMALL if args.small else {"ag": AG_SHAPES, "rs": RS_SHAPES, "ar": AR_SHAPES}
    shapes = {op: shapes[op][:1] if args.quick else shapes[op] for op in args.ops.split(",")}
    pushers = [f"fused_push{b}_ms" for b in args.push_blocks.split(",") if b]
    columns = ["op", "M", "K", "N", "gemm_alone_ms", "nccl_cublas_ms", "torch_async_tp_ms", "tilescale_gemm_alone_ms",
               *(f"fused_{label}_ms" for label in TILES.values()), "tile", *pushers, "tilescale_fused_ms",
               "fused_vs_gemm_alone", "speedup_vs_nccl_cublas", "speedup_vs_async_tp"]
    report = Report("tp-gemm-graph" if args.graph else "tp-gemm", columns=columns)
    for op, shape in progress([(op, s) for op, ss in shapes.items() for s in ss], "tp_gemm", fmt=str):
        report.add(measure(op, shape, args.iters, tuple(int(b) for b in args.push_blocks.split(",") if b), args.graph))
        report.save()  # after every shape: a job cut off at its time limit keeps what it measured
    report.print_table()
    report.save()
    plot(report)
    ts.finalize()


if __name__ == "__main__":
    main()
