"""Which tile should tilescale's GEMM kernels use? TileLang GEMM configurations vs cuBLAS, one GPU.

Every variant computes ``C = A @ W.T`` (bf16 in, fp32 accumulation, bf16 out) the way the
fused tensor-parallel kernels of ``tilescale/ops/tp_gemm/kernels.py`` compute their GEMM part: one
output tile per block through ``tilescale.ops._gemm.gemm_tile`` with a ``TileConfig``, the
tile found from a linear block index as in the all-gather GEMM (``grid="1d"``, tile order
from ``_gemm.tile_coords``) or from a 2-D grid as in the reduce-scatter GEMM (``grid="2d"``,
``T.use_swizzle`` for the panel order). The winner therefore drops into ``_gemm.DEFAULT``.

Shapes are one rank's GEMMs of ``benchmarks/tp_gemm.py`` (8192^3 besides). For each: every
variant checked against cuBLAS (``torch.matmul``), then all of them and cuBLAS timed taking
turns (CUDA events, warm-up, median of ``--iters`` runs over 5 rounds). Printed: a table per shape
(ms, TFLOP/s, share of the 790 TFLOP/s dense bf16 floor, speed relative to cuBLAS), then
each variant's geometric mean over the shapes and the ``TileConfig`` of the best; the rows
go to ``benchmarks/results/gemm-tiles-<device>-<time>.json``::

    python benchmarks/gemm_tiles.py                  # one sm_90a GPU (H100/H200)
    python benchmarks/gemm_tiles.py --quick          # 7 variants, 2 shapes
    python benchmarks/gemm_tiles.py --compile-only   # no GPU: lower each variant, nvcc it for sm_90a
"""

import argparse
import concurrent.futures
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import tilelang
import tilelang.env
import torch
from harness import Report, check_close, time_interleaved
from tp_shapes import AG_SHAPES, FLOOR_SHAPES, RS_SHAPES

import tilescale.language as T
from tilescale.ops._gemm import TileConfig, gemm_tile, tile_coords

# Dense bf16 tensor-core throughput an H200 sustains (the brief's floor: 2*M*N*K / this).
FLOOR_TFLOPS = 790.0
SMS = 132  # H100 SXM / H200: the persistent variants' blocks
TARGET = {"kind": "cuda", "arch": "sm_90a"}
DTYPE = "bfloat16"


def _gemm_shape(mkn: tuple[int, int, int]) -> tuple[int, int, int]:
    m, k, n = mkn  # tp_gemm.py lists (M, K, N) with K and N as each rank holds them
    return m, n, k


# name: (M, N, K) of one rank's GEMM. AG: the gathered rows (all ranks') times this rank's
# weight columns; RS: all rows times this rank's K slice. These do not depend on the rank count.
SHAPES = {
    "8k-cube": (8192, 8192, 8192),
    "ag-4k": _gemm_shape(AG_SHAPES[1]),  # (4096, 14336, 8192): cuBLAS 1.22 ms on H200
    "ag-8k": _gemm_shape(AG_SHAPES[0]),  # (8192, 14336, 8192)
    "rs-8k": _gemm_shape(RS_SHAPES[0]),  # (8192, 8192, 14336)
}
QUICK_SHAPES = ["8k-cube", "ag-4k"]


@dataclass(frozen=True)
class Variant:
    """A tile config and how the kernel around it finds its tile.

    ``grid="1d"``: as ``ag_own_gemm_kernel`` (linear block index in a register, tile from
    ``tile_coords(..., cfg.panel)``); ``"2d"``: as ``gemm_push_kernel`` (``(N tiles, M tiles)``
    grid, ``T.use_swizzle(cfg.panel)`` when the panel is non-zero); ``"persistent"``: one
    block per SM walking the 1-D order's tiles a wave at a time, so that the producer warps
    load a tile's first stages while the consumers store the tile before it. ``ws=False``:
    compiled with warp specialisation off, as kernels linked with NVSHMEM are.
    """

    label: str
    cfg: TileConfig
    grid: str = "1d"
    ws: bool = True

    @property
    def pass_configs(self) -> dict | None:
        return None if self.ws else {"tl.disable_warp_specialized": True}

    def describe(self) -> str:
        return f"{self.cfg.name()} {self.grid}{'' if self.ws else ' noWS'}"


def _cfg(bm, bn, bk, stages, policy, epilogue, panel, threads=256) -> TileConfig:
    return TileConfig(bm, bn, bk, stages, threads, policy, epilogue, panel)


# Notes from the generated code (sm_90a, 2 consumer warpgroups): per warpgroup the wgmma is
# 128x128 Square/FullCol: 2x m64n64 (the current default); 128x128 FullRow: m64n128;
# 128x256 FullRow: m64n256; 128x256 Square/FullCol: 2x m64n128; 256x128 FullRow: 2x m64n128.
# Operand tiles already get 128B-swizzled TMA layouts, so T.annotate_layout adds nothing.
VARIANTS = [
    # tp_gemm's GEMMs today: the all-gather kernel's gemm_tile, the reduce-scatter kernel's loop.
    Variant("ag-today", _cfg(128, 128, 64, 3, "Square", "direct", 0)),
    Variant("rs-today", _cfg(128, 128, 64, 3, "Square", "shared", 0), grid="2d", ws=False),
    Variant("128x128-fullrow", _cfg(128, 128, 64, 3, "FullRow", "direct", 0)),
    Variant("128x128-fullrow-s4-p8", _cfg(128, 128, 64, 4, "FullRow", "shared", 8)),
    Variant("128x256-direct", _cfg(128, 256, 64, 3, "FullRow", "direct", 0)),
    Variant("128x256-direct-p8", _cfg(128, 256, 64, 3, "FullRow", "direct", 8)),
    Variant("128x256-direct-s4-p8", _cfg(128, 256, 64, 4, "FullRow", "direct", 8)),
    Variant("128x256-shared-p8", _cfg(128, 256, 64, 3, "FullRow", "shared", 8)),
    Variant("128x256-shared-p4", _cfg(128, 256, 64, 3, "FullRow", "shared", 4)),
    Variant("128x256-shared-p16", _cfg(128, 256, 64, 3, "FullRow", "shared", 16)),
    Variant("128x256-square-p8", _cfg(128, 256, 64, 3, "Square", "shared", 8)),
    Variant("128x256-k128-s2-p8", _cfg(128, 256, 128, 2, "FullRow", "direct", 8)),
    Variant("256x128-shared-p8", _cfg(256, 128, 64, 3, "FullRow", "shared", 8)),
    Variant("256x128-direct-s4-p8", _cfg(256, 128, 64, 4, "FullRow", "direct", 8)),
    Variant("tilelang-sm90-2d-swz10", _cfg(128, 256, 64, 3, "FullRow", "shared", 10), grid="2d"),
    Variant("128x256-2d-noWS", _cfg(128, 256, 64, 3, "FullRow", "shared", 0), grid="2d", ws=False),
    # Narrower tiles against wave quantisation (other tile counts per wave): tp_gemm's candidates.
    Variant("128x224-shared-p8", _cfg(128, 224, 64, 3, "FullRow", "shared", 8)),
    Variant("128x192-shared-p8", _cfg(128, 192, 64, 3, "FullRow", "shared", 8)),
    Variant("128x128-shared-p8", _cfg(128, 128, 64, 4, "FullRow", "shared", 8)),
    Variant("128x256-2d-p8", _cfg(128, 256, 64, 3, "FullRow", "shared", 8), grid="2d"),
    Variant("128x224-2d-p8", _cfg(128, 224, 64, 3, "FullRow", "shared", 8), grid="2d"),
    Variant("128x192-2d-p8", _cfg(128, 192, 64, 3, "FullRow", "shared", 8), grid="2d"),
    Variant("128x128-2d-p8", _cfg(128, 128, 64, 4, "FullRow", "shared", 8), grid="2d"),
    # Persistent twins of the 1-D candidates: the epilogue of one tile under the next one's loads.
    Variant("128x256-pers-p8", _cfg(128, 256, 64, 3, "FullRow", "shared", 8), grid="persistent"),
    Variant("128x224-pers-p8", _cfg(128, 224, 64, 3, "FullRow", "shared", 8), grid="persistent"),
    Variant("128x192-pers-p8", _cfg(128, 192, 64, 3, "FullRow", "shared", 8), grid="persistent"),
    Variant("128x128-pers-p8", _cfg(128, 128, 64, 4, "FullRow", "shared", 8), grid="persistent"),
]
QUICK_VARIANTS = ["ag-today", "rs-today", "128x128-fullrow", "128x256-direct-s4-p8", "128x256-shared-p8",
                  "256x128-shared-p8", "tilelang-sm90-2d-swz10"]


def build(v: Variant, M: int, N: int, K: int):
    """The variant's kernel for ``C (M, N) = A (M, K) @ W (N, K).T``."""
    cfg, dtype = v.cfg, DTYPE
    bm, bn = cfg.block_M, cfg.block_N
    m_tiles, n_tiles = -(-M // bm), -(-N // bn)

    if v.grid == "persistent":
        sms, tiles = SMS, m_tiles * n_tiles

        @T.prim_func
        def gemm_persistent(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
            with T.Kernel(sms, threads=cfg.threads) as b:
                for wave in T.serial(-(-tiles // sms)):
                    if wave * sms + b < tiles:
                        by, bx = tile_coords(wave * sms + b, m_tiles, n_tiles, cfg.panel)
                        gemm_tile(A, by * bm, W, bx * bn, C, by * bm, bx * bn, K, dtype, cfg.stages, cfg)

        return gemm_persistent

    if v.grid == "1d":

        @T.prim_func
        def gemm_1d(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
            with T.Kernel(m_tiles * n_tiles, threads=cfg.threads) as b:
                tile = T.alloc_local((1,), "int32")  # as ag_own_gemm_kernel holds it
                tile[0] = b
                by, bx = tile_coords(tile[0], m_tiles, n_tiles, cfg.panel)
                gemm_tile(A, by * bm, W, bx * bn, C, by * bm, bx * bn, K, dtype, cfg.stages, cfg)

        return gemm_1d

    @T.prim_func
    def gemm_2d(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(n_tiles, m_tiles, threads=cfg.threads) as (bx, by):
            T.use_swizzle(max(cfg.panel, 1), enable=cfg.panel > 0)
            gemm_tile(A, by * bm, W, bx * bn, C, by * bm, bx * bn, K, dtype, cfg.stages, cfg)

    return gemm_2d


def wgmma_shape(src: str) -> str:
    """The wgmma instruction(s) in generated CUDA source, e.g. ``m64n256k16``."""
    found = sorted(set(re.findall(r"wgmma_[rs]s<[^,]+,[^,]+,[^,]+, (\d+), (\d+), (\d+),", src)))
    return ",".join(f"m{m}n{n}k{k}" for m, n, k in found) or "none"


def _error(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:300]


# --------------------------------------------------------------------------- compile only


def _lower_and_nvcc(v: Variant, shape: tuple[int, int, int], workdir: Path) -> dict:
    """Lower for sm_90a as tilelang.compile would, then nvcc the source to a cubin (no GPU needed)."""
    row = {"variant": v.label, "config": v.describe(), "shape": "x".join(map(str, shape)),
           "smem_kb": v.cfg.shared_bytes() / 1024}
    t = time.perf_counter()
    try:
        func = build(v, *shape)
        with tilelang.tvm.target.Target(TARGET), \
                tilelang.tvm.transform.PassContext(opt_level=3, config=v.pass_configs or {}):
            src = tilelang.lower(func, target=TARGET).kernel_source
    except Exception as e:  # noqa: BLE001 - report and go on with the other variants
        return {**row, "ok": False, "error": "lower: " + _error(e), "trace": traceback.format_exc()}
    row["lower_s"] = time.perf_counter() - t
    row["wgmma"] = wgmma_shape(src)
    row["ws"] = "warpgroup_reg_alloc" in src
    stem = workdir / f"{v.label}-{row['shape']}"
    stem.with_suffix(".cu").write_text(src)
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    cmd = [nvcc, "-std=c++17", "-O3", "-arch=sm_90a", "-cubin", "-o", str(stem.with_suffix(".cubin")),
           f"-I{tilelang.env.TILELANG_TEMPLATE_PATH}", f"-I{tilelang.env.CUTLASS_INCLUDE_DIR}", "-DENABLE_BF16",
           "--expt-relaxed-constexpr", "-Xptxas=-v", str(stem.with_suffix(".cu"))]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    row["nvcc_s"] = time.perf_counter() - t
    log = proc.stdout + proc.stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores", log)
    row["regs"] = int(regs[-1]) if regs else None
    row["spill_bytes"] = int(spills[-1]) if spills else None
    row["serialized"] = "wgmma.mma_async instructions are serialized" in log
    row["ok"] = proc.returncode == 0 and not row["serialized"]
    if proc.returncode:
        row["error"] = "nvcc: " + log.strip()[-600:]
    return row


def compile_only(cases: dict[str, list[Variant]], shapes: dict, jobs: int) -> int:
    workdir = Path(tempfile.mkdtemp(prefix="gemm-tiles-"))
    cases = [(v, name) for name in shapes for v in cases[name]]
    print(f"lowering and compiling {len(cases)} kernels for sm_90a with {jobs} jobs in {workdir}", flush=True)
    start = time.perf_counter()
    rows = []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(_lower_and_nvcc, v, shapes[name], workdir): (v, name) for v, name in cases}
        for fut in concurrent.futures.as_completed(futures):
            v, name = futures[fut]
            row = {**fut.result(), "shape": name}
            rows.append(row)
            status = "ok" if row["ok"] else "FAILED " + row.get("error", "wgmma serialized")
            print(f"[{len(rows)}/{len(cases)} {time.perf_counter() - start:.0f}s] {name} {v.label}: {status}",
                  flush=True)
    order = {(v.label, name): i for i, (v, name) in enumerate(cases)}
    rows.sort(key=lambda r: order[(r["variant"], r["shape"])])
    report = Report("gemm-tiles-compile", columns=["shape", "variant", "config", "wgmma", "ws", "smem_kb", "regs",
                                                   "spill_bytes", "lower_s", "nvcc_s", "ok"])
    for row in rows:
        report.add(row)
    report.print_table()
    failed = [r for r in rows if not r["ok"]]
    for r in failed:
        print(f"\n{r['shape']} {r['variant']}: {r.get('error', 'wgmma serialized')}\n{r.get('trace', '')}")
    print(f"\n{len(rows) - len(failed)}/{len(rows)} kernels lowered and compiled for sm_90a "
          f"in {time.perf_counter() - start:.0f}s")
    return 1 if failed else 0


# --------------------------------------------------------------------------- GPU run


def compile_all(cases: dict[str, list[Variant]], shapes: dict, jobs: int) -> dict:
    """{(label, shape name): JITKernel or error string} for the variants ``cases`` lists per
    shape name, compiled in parallel threads (TileLang's lowering releases the GIL and nvcc is
    a subprocess, as in tilelang.par_compile)."""
    out: dict = {}
    funcs = {}
    for name, shape in shapes.items():
        for v in cases[name]:
            try:
                funcs[(v.label, name)] = (build(v, *shape), v)
            except Exception as e:  # noqa: BLE001 - skip the variant, say why
                out[(v.label, name)] = "build: " + _error(e)
                print(f"{name} {v.label}: build failed: {_error(e)}", flush=True)
    start = time.perf_counter()
    print(f"compiling {len(funcs)} kernels with {jobs} threads", file=sys.stderr, flush=True)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        futures = {pool.submit(tilelang.compile, func, pass_configs=v.pass_configs): key
                   for key, (func, v) in funcs.items()}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            key = futures[fut]
            try:
                out[key] = fut.result()
                msg = "ok"
            except Exception as e:  # noqa: BLE001 - skip the variant, say why
                out[key] = "compile: " + _error(e)
                msg = out[key]
                print(f"{key[1]} {key[0]} failed to compile:\n{traceback.format_exc()[-3000:]}", flush=True)
            print(f"compile [{i}/{len(funcs)} {time.perf_counter() - start:.0f}s] {key[1]} {key[0]}: {msg}",
                  file=sys.stderr, flush=True)
    return out


def run_shape(name: str, shape: tuple[int, int, int], variants: list[Variant], kernels: dict, args) -> list[dict]:
    M, N, K = shape
    flops = 2 * M * N * K
    floor_ms = flops / (FLOOR_TFLOPS * 1e9)
    g = torch.Generator(device="cuda").manual_seed(0)
    A = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    W = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(torch.bfloat16)
    ref = A @ W.T  # cuBLAS, bf16 out; outputs are about N(0, 1)
    C = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    base = {"shape": name, "M": M, "N": N, "K": K, "floor_ms": floor_ms}

    fns = {"cublas": lambda: torch.matmul(A, W.T)}
    rows = []
    broken = None
    for v in variants:
        row = {**base, "variant": v.label, "config": v.describe(), "cfg": asdict(v.cfg), "grid": v.grid, "ws": v.ws,
               "smem_kb": v.cfg.shared_bytes() / 1024}
        rows.append(row)
        kernel = kernels.get((v.label, name))
        if broken or not hasattr(kernel, "get_kernel_source"):
            row.update(correct=False, error=broken or kernel or "not compiled")
            continue
        row["wgmma"] = wgmma_shape(kernel.get_kernel_source())
        try:
            C.fill_(float("nan"))  # a tile the kernel does not write fails the check
            kernel(A, W, C)
            torch.cuda.synchronize()
            # bf16 outputs of two fp32-accumulated K=8192..14336 dot products: about 1 ulp apart.
            row["check"] = check_close(f"{name} {v.label}", C, ref, rtol=2e-2, atol=2e-2)
            row["correct"] = True
            fns[v.label] = lambda kernel=kernel: kernel(A, W, C)
        except AssertionError as e:
            row.update(correct=False, error=_error(e))
        except Exception as e:  # noqa: BLE001 - a launch failure; CUDA errors poison the context
            row.update(correct=False, error=_error(e))
            if "CUDA" in str(e) or "cuda" in str(e):
                broken = f"not run: an earlier variant's CUDA error ({_error(e)})"
    if broken:  # the context is gone: nothing more can be timed
        return rows
    # cuBLAS and the variants take turns (time_interleaved): a drift of the clocks over the
    # shape's run moves them all alike.
    timings = time_interleaved(fns, rounds=min(5, args.iters), warmup=args.warmup, iters=args.iters)
    cublas_ms = timings["cublas"].median_ms
    out = [{**base, "variant": "cublas", "config": "torch.matmul", "correct": True}] + rows
    for row in out:
        timing = timings.get(row["variant"])
        if timing is not None:
            row.update(ms=timing.median_ms, tflops=flops / timing.median_ms / 1e9, of_floor=floor_ms / timing.median_ms,
                       vs_cublas=cublas_ms / timing.median_ms, timing=timing.to_dict())
            print(f"  {name} {row['variant']:24s} {row['ms']:.3f} ms {row['tflops']:.0f} TFLOP/s", file=sys.stderr,
                  flush=True)
    return out


# The floor's tile candidates (tp_gemm.choose_tile's): 1-D grid as the all-gather GEMM's
# kernels, 2-D with T.use_swizzle as the reduce-scatter and all-reduce GEMMs'.
FLOOR_VARIANTS = {"1d": ["128x256-shared-p8", "128x224-shared-p8", "128x192-shared-p8", "128x128-shared-p8"],
                  "2d": ["128x256-2d-p8", "128x224-2d-p8", "128x192-2d-p8", "128x128-2d-p8"],
                  "persistent": ["128x256-pers-p8", "128x224-pers-p8", "128x192-pers-p8", "128x128-pers-p8"]}


def floor_cases(persistent: bool = False) -> tuple[dict, dict[str, list[Variant]]]:
    """The GEMMs of ``tp_gemm.py --floor`` with >= 1024 rows as ({name: (M, N, K)}, {name:
    variants}): every candidate width, and the 128x128 tile only where its waves are at least
    3% fuller than the 128x256 tile's (it is slower per FLOP, so elsewhere it cannot win);
    with ``persistent``, each candidate's persistent twin besides."""
    by_label = {v.label: v for v in VARIANTS}
    shapes, cases = {}, {}
    for op, (m, k, n) in FLOOR_SHAPES:
        if m < 1024:
            continue
        name = f"{op}-{m}x{k}x{n}"
        shapes[name] = (m, n, k)
        labels = FLOOR_VARIANTS["1d" if op == "ag" else "2d"]
        full = {lb: _waves_busy(m, n, by_label[lb].cfg) for lb in labels}
        chosen = [0, 1, 2] + ([3] if full[labels[3]] >= full[labels[0]] + 0.03 else [])
        cases[name] = [by_label[labels[i]] for i in chosen]
        if persistent:
            cases[name] += [by_label[FLOOR_VARIANTS["persistent"][i]] for i in chosen]
    return shapes, cases


def _waves_busy(m: int, n: int, cfg: TileConfig) -> float:
    """Share of 132 SMs' time an (m, n) output in ``cfg``'s tiles keeps busy (whole waves)."""
    tiles = -(-m // cfg.block_M) * -(-n // cfg.block_N)
    return m * n / (-(-tiles // 132) * 132 * cfg.block_M * cfg.block_N)


def summary(rows: list[dict], variants: list[Variant]) -> list[dict]:
    """Each variant's geometric mean speed relative to cuBLAS over the shapes, best first."""
    out = []
    for v in variants:
        mine = [r for r in rows if r["variant"] == v.label]
        ratios = [r["vs_cublas"] for r in mine if r.get("correct") and "vs_cublas" in r]
        if not mine:
            continue
        complete = len(ratios) == len(mine)
        out.append({"variant": v.label, "config": v.describe(), "shapes": len(ratios),
                    "geomean_vs_cublas": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None,
                    "worst_vs_cublas": min(ratios) if ratios else None,
                    "all_correct": complete, "cfg": asdict(v.cfg), "grid": v.grid, "ws": v.ws})
    return sorted(out, key=lambda r: (not r["all_correct"], -(r["geomean_vs_cublas"] or 0)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"{len(QUICK_VARIANTS)} variants, shapes "
                        f"{', '.join(QUICK_SHAPES)}")
    parser.add_argument("--compile-only", action="store_true",
                        help="no GPU: lower every variant for sm_90a and compile it with nvcc (ptxas -v)")
    parser.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--floor", action="store_true",
                        help="the tile candidates at tp_gemm.py --floor's GEMMs with >= 1024 rows (floor_cases)")
    parser.add_argument("--persistent", action="store_true", help="with --floor: each candidate's persistent twin too")
    parser.add_argument("--variants", help="comma-separated labels (default: all, or the quick set; with --floor, "
                        "of the floor's candidates)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    args = parser.parse_args()

    names = args.shapes.split(",") if args.shapes else QUICK_SHAPES if args.quick else list(SHAPES)
    shapes = {n: SHAPES[n] for n in names}
    labels = args.variants.split(",") if args.variants else QUICK_VARIANTS if args.quick else None
    by_label = {v.label: v for v in VARIANTS}
    unknown = [lb for lb in labels or [] if lb not in by_label]
    if unknown:
        parser.error(f"unknown variants {unknown}; known: {', '.join(by_label)}")
    variants = [by_label[lb] for lb in labels] if labels else VARIANTS
    cases = {name: variants for name in shapes}
    if args.floor:
        shapes, cases = floor_cases(args.persistent)
        if labels:
            cases = {name: [v for v in vs if v.label in labels] for name, vs in cases.items()}
        variants = list({v.label: v for vs in cases.values() for v in vs}.values())

    if args.compile_only:
        return compile_only(cases, shapes, args.jobs)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (sm_90a); without one, use --compile-only")
    if torch.cuda.get_device_capability() != (9, 0):
        print(f"warning: {torch.cuda.get_device_name()} is not sm_90: these wgmma tiles are Hopper's", file=sys.stderr)

    start = time.perf_counter()
    kernels = compile_all(cases, shapes, args.jobs)
    print(f"compiled in {time.perf_counter() - start:.0f}s", file=sys.stderr, flush=True)
    columns = ["shape", "variant", "config", "wgmma", "ms", "tflops", "of_floor", "vs_cublas", "correct"]
    report = Report("gemm-tiles", columns=columns)
    for name, shape in shapes.items():
        print(f"timing {name} {shape}", file=sys.stderr, flush=True)
        for row in run_shape(name, shape, cases[name], kernels, args):
            report.add(row)
        report.save()  # after every shape: a cut-off run keeps what it measured
    report.print_table()
    for row in report.rows:
        if row.get("error"):
            print(f"{row['shape']} {row['variant']}: {row['error']}")
    best = summary(report.rows, variants)
    table = Report("gemm-tiles-summary", columns=["variant", "config", "shapes", "geomean_vs_cublas",
                                                  "worst_vs_cublas", "all_correct"])
    for row in best:
        table.add(row)
    print()
    table.print_table()
    if best and best[0]["geomean_vs_cublas"]:
        b = best[0]
        print(f"\nbest: {b['variant']} at {b['geomean_vs_cublas']:.3f}x cuBLAS (geomean over {b['shapes']} shapes): "
              f"tilescale/ops/_gemm.py DEFAULT = {TileConfig(**b['cfg'])!r}"
              f"{'' if b['grid'] == '1d' else ' (measured with a 2-D grid)'}"
              f"{'' if b['ws'] else ' (measured without warp specialisation)'}")
    path = report.save()
    table.save()
    print(f"results: {path} and {table.path} ({time.perf_counter() - start:.0f}s in all)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
