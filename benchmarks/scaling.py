"""Scaling with the number of GPUs: collectives, AG-GEMM / GEMM-RS and MoE dispatch/combine.

For every communication backend and world size (2, 4 and 8 by default, as many as the
machine has GPUs for), the driver starts one job, ``tilescale run -n W benchmarks/scaling.py
--worker ...``. Each job measures with the functions of ``collectives.py``, ``tp_gemm.py``
and ``moe.py`` -- every result is checked against its baseline before it is timed -- beside
the baselines of those scripts (NCCL, cuBLAS, NCCL + cuBLAS, torch async-TP, the
``all_to_all_single`` pipeline), measured in the same job. The driver merges the jobs' rows
into one JSON under ``benchmarks/results/`` and plots time and throughput against the number
of GPUs (one PNG per benchmark, beside the JSON).

A backend that cannot start (``nvshmem`` today) and a world size with too few GPUs become
``skipped`` rows with the reason; a job that fails becomes an ``error`` row with the end of its
output, and the driver then exits 1 after writing everything else.

::

    python benchmarks/scaling.py --quick --worlds 2,4        # GPUs: sized for ~8 min, JIT included
    python benchmarks/scaling.py                             # the full shapes of the issues
    python benchmarks/scaling.py --cpu --small --worlds 2,4  # the CPU path (a smoke test)

Suites: ``full`` -- collectives from 4 KiB to 256 MiB, the TP-GEMM issue's AG and RS
shapes, MoE at DeepEP's normal (4096 tokens/rank, hidden 7168, top-8, 256 experts) and
low-latency (128 tokens) sizes; ``--quick`` -- collectives at 64 KiB, 4 MiB and 256 MiB, one
AG and one RS shape, MoE at DeepEP's normal size; ``--small`` -- tiny sizes for the CPU path.
"""

from __future__ import annotations

import argparse
import collections
import json
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import collectives
import moe
import torch
import tp_gemm
import tp_shapes
from harness import Report, fmt_bytes, is_rank0, progress, size_sweep

import tilescale as ts
from tilescale.launch.environment import detect

HERE = Path(__file__).resolve()
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
GEMM_PLANS = ("tilescale_fused", "nccl_cublas", "torch_async_tp", "gemm_alone")
COLUMNS = ["world", "backend", "bench", "op", "case", "impl", "us", "throughput", "unit", "status"]
# Kept in the error row of a failed job: enough to see its traceback.
TAIL_LINES = 25


@dataclass(frozen=True)
class Suite:
    """What one job measures."""

    collective_bytes: tuple[int, ...]  # bytes per rank (shard for all_gather, input otherwise)
    gemm_shapes: dict[str, list[tuple[int, int, int]]]  # "ag"/"rs" -> (M, K, N), as tp_gemm.measure takes them
    moe_cases: dict[str, tuple[int, int, int, int]]  # case -> (tokens per rank, hidden, top-k, experts)
    iters: int  # timed iterations per measurement


SUITES = {
    "full": Suite(
        tuple(size_sweep(4 << 10, 256 << 20, factor=4)),
        {"ag": tp_shapes.AG_SHAPES, "rs": tp_shapes.RS_SHAPES},
        moe.CASES,
        20,
    ),
    "quick": Suite(
        (64 << 10, 4 << 20, 256 << 20),
        {"ag": [tp_shapes.AG_SHAPES[1]], "rs": [tp_shapes.RS_SHAPES[1]]},
        {"normal": moe.CASES["normal"]},
        20,
    ),
    "small": Suite(
        (4 << 10, 16 << 10),
        {op: tp_gemm.SMALL[op] for op in ("ag", "rs")},
        {"normal": moe.SMALL["normal"]},
        5,
    ),
}


# --- worker: one job of W ranks ---------------------------------------------------------


def _rows(
    bench: str,
    op: str,
    case: str,
    unit: str,
    timings: dict[str, tuple[float, float | None]],
    checks: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """One row per implementation: its median time (us) and throughput (in ``unit``).

    A time that is not positive (MoE combine is timed as a round trip minus a dispatch, which
    noise can turn negative on a loaded CPU) makes the row ``noisy``, not ``ok``.
    """
    correct = all(c["ok"] for c in checks)
    rows = []
    for impl, (us, throughput) in timings.items():
        row = {"bench": bench, "op": op, "case": case, "impl": impl, "us": us, "throughput": throughput, "unit": unit,
               "correct": correct, "checks": checks, "status": "ok" if us > 0 else "noisy"}  # fmt: skip
        if us <= 0:
            row["reason"] = f"{op} time {us:.4g} us is not positive: timing noise"
        rows.append(row)
    return rows


def measure_collective(op: str, nbytes: int, iters: int, baseline: str) -> list[dict[str, Any]]:
    """Rows for one collective at ``nbytes`` per rank: tilescale and ``baseline`` (nccl or gloo), bus GB/s."""
    r = collectives.measure(op, nbytes, ts.world_size(), iters)
    timings = {"tilescale": (r["tilescale_us"], r["tilescale_busbw_GBps"]),
               baseline: (r["nccl_us"], r["nccl_busbw_GBps"])}  # fmt: skip
    return _rows("collectives", op, fmt_bytes(nbytes), "bus GB/s", timings, r["checks"])


def measure_gemm(op: str, shape: tuple[int, int, int], iters: int) -> list[dict[str, Any]]:
    """Rows for AG-GEMM ("ag") or GEMM-RS ("rs") at ``shape`` per rank, every plan, in TFLOP/s per GPU."""
    r = tp_gemm.measure(op, shape, iters)
    m, k, n = shape
    flops = 2 * m * k * n  # per rank: AG multiplies all M gathered rows, RS all M rows of its partial product
    timings = {plan: (r[f"{plan}_ms"] * 1e3, flops / r[f"{plan}_ms"] / 1e9) for plan in GEMM_PLANS
               if f"{plan}_ms" in r}  # fmt: skip
    return _rows(
        "tp_gemm", {"ag": "ag_gemm", "rs": "gemm_rs"}[op], f"{m}x{k}x{n}", "TFLOP/s per GPU", timings, r["checks"]
    )


def measure_moe(case: str, shape: tuple[int, int, int, int], iters: int) -> list[dict[str, Any]]:
    """Rows for MoE dispatch and combine (tilescale and all_to_all), in GB/s of token rows received."""
    r = moe.measure(case, *shape, iters)
    label = "{} {}x{} top{} E{}".format(case, *shape)
    rows = []
    for op in ("dispatch", "combine"):
        times = {"tilescale": r[f"{op}_us"], "all_to_all": r[f"a2a_{op}_us"]}
        timings = {impl: (us, r["recv_bytes"] / us / 1e3 if us > 0 else None) for impl, us in times.items()}
        rows += _rows("moe", op, label, "GB/s", timings, r["checks"])
    return rows


def _write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    if is_rank0():  # rewritten after every measurement: a job that dies later keeps what it measured
        path.write_text(json.dumps(rows, indent=1, default=str) + "\n")


def worker(backend: str, suite: Suite, rows_out: Path) -> None:
    """One rank of a job: join it with ``backend``, measure ``suite``, rank 0 writes the rows to ``rows_out``."""
    try:
        ts.init(backend=backend)
    except (NotImplementedError, ImportError, ValueError) as err:
        _write_rows(rows_out, [{"status": "skipped", "reason": f"{type(err).__name__}: {err}"}])
        return
    baseline = "nccl" if ts.device().type == "cuda" else "gloo"
    plan = [("collectives", op, nbytes) for op in COLLECTIVES for nbytes in suite.collective_bytes]
    plan += [("moe", case, shape) for case, shape in suite.moe_cases.items()]
    plan += [("tp_gemm", op, shape) for op, shapes in suite.gemm_shapes.items() for shape in shapes]
    rows: list[dict[str, Any]] = []
    desc = f"scaling W={ts.world_size()} {backend}"
    for bench, what, size in progress(
        plan, desc, fmt=lambda p: f"{p[1]} {fmt_bytes(p[2]) if p[0] == 'collectives' else p[2]}"
    ):
        if bench == "collectives":
            rows += measure_collective(what, size, suite.iters, baseline)
        elif bench == "tp_gemm":
            rows += measure_gemm(what, size, suite.iters)
        else:
            rows += measure_moe(what, size, suite.iters)
        _write_rows(rows_out, rows)
    ts.synchronize()
    ts.finalize()


# --- driver: one job per (backend, world size), merged ----------------------------------


def _run_teed(cmd: list[str], timeout_s: float) -> tuple[int, list[str]]:
    """Run ``cmd``, copying its output to ours; return its exit status and last lines.

    Past ``timeout_s`` the launcher gets SIGTERM (it stops its ranks), SIGKILL 60 s later.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def pump() -> None:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        tail.append(f"(stopped after the {timeout_s:g} s timeout)")
        code = 124
    reader.join(timeout=5)
    return code, list(tail)


def run_job(
    world: int, backend: str, suite: str, iters: int, cpu: bool, workdir: Path, timeout_s: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run one job of ``world`` ranks; return its rows (world and backend added) and how it ran."""
    rows_out = workdir / f"rows-{backend}-{world}.json"
    cmd = [sys.executable, "-m", "tilescale.launch", "run", "-n", str(world), *(["--cpu"] if cpu else []),
           str(HERE), "--worker", "--backend", backend, "--suite", suite, "--iters", str(iters),
           "--rows-out", str(rows_out)]  # fmt: skip
    print(f"== {backend}, {world} ranks: {shlex.join(cmd)}", flush=True)
    start = time.monotonic()
    code, tail = _run_teed(cmd, timeout_s)
    rows = json.loads(rows_out.read_text()) if rows_out.exists() else []
    if code != 0:
        rows.append({"status": "error", "reason": f"the job exited with status {code}:\n" + "\n".join(tail)})
    run = {"world": world, "backend": backend, "command": shlex.join(cmd), "seconds": time.monotonic() - start,
           "exit_status": code}  # fmt: skip
    return [{"world": world, "backend": backend, **row} for row in rows], run


class ScalingReport(Report):
    """A :class:`Report` whose JSON also lists the jobs that produced its rows."""

    def __init__(self, name: str, *, columns: list[str]) -> None:
        super().__init__(name, columns=columns)
        self.runs: list[dict[str, Any]] = []

    def metadata(self) -> dict[str, Any]:
        """The harness metadata plus ``runs``: each job's command, duration and exit status."""
        return {**super().metadata(), "runs": self.runs}


def plot(rows: list[dict[str, Any]], json_path: Path, title: str) -> list[Path]:
    """Per benchmark, a PNG beside ``json_path``: for each (op, case), time and throughput vs GPUs.

    One line per implementation (and backend, when the rows hold several); baselines dashed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in rows if r["status"] == "ok"]
    several_backends = len({r["backend"] for r in ok}) > 1
    paths = []
    for bench in dict.fromkeys(r["bench"] for r in ok):
        panels = list(dict.fromkeys((r["op"], r["case"]) for r in ok if r["bench"] == bench))
        fig = Figure(figsize=(11, 3.2 * len(panels) + 0.6))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(panels), 2, squeeze=False)
        for (op, case), (ax_time, ax_tput) in zip(panels, axes, strict=True):
            sel = [r for r in ok if (r["bench"], r["op"], r["case"]) == (bench, op, case)]
            for impl, backend in dict.fromkeys((r["impl"], r["backend"]) for r in sel):
                pts = sorted((r["world"], r["us"], r["throughput"]) for r in sel
                             if (r["impl"], r["backend"]) == (impl, backend))  # fmt: skip
                style = {"marker": "o", "linestyle": "-" if impl.startswith("tilescale") else "--",
                         "label": f"{impl} [{backend}]" if several_backends else impl}  # fmt: skip
                ax_time.plot([p[0] for p in pts], [p[1] for p in pts], **style)
                ax_tput.plot([p[0] for p in pts], [p[2] for p in pts], **style)
            worlds = sorted({r["world"] for r in sel})
            for ax, ylabel, what in ((ax_time, "median time, us", "time"), (ax_tput, sel[0]["unit"], "throughput")):
                ax.set_xscale("log", base=2)
                ax.set_xticks(worlds, [str(w) for w in worlds])
                ax.set_ylim(bottom=0)
                ax.set_xlabel("GPUs (ranks)")
                ax.set_ylabel(ylabel)
                ax.set_title(f"{op} {case}: {what}", fontsize=10)
                ax.grid(True, alpha=0.3)
            ax_tput.legend(fontsize=8)
        fig.suptitle(f"{bench} scaling, {title}")
        fig.tight_layout()
        path = json_path.with_name(f"{json_path.stem}-{bench}.png")
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The driver's options, and the hidden ones of worker mode."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the jobs on the CPU path (tilescale run --cpu)")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a reduced set of sizes (~8 min on GPUs for 2 and 4)")
    size.add_argument("--small", action="store_true", help="tiny sizes: a smoke test, e.g. on the CPU path")
    parser.add_argument("--worlds", default="2,4,8", help="world sizes, comma-separated (default 2,4,8)")
    parser.add_argument(
        "--backend", help="backends, comma-separated (default: cuda_ipc,nvshmem on GPUs, host_shm with --cpu)"
    )
    parser.add_argument("--iters", type=int, help="timed iterations per measurement (default: the suite's)")
    parser.add_argument("--timeout-s", type=float, default=1800, help="limit for one job (default 1800 s)")
    parser.add_argument("--out", type=Path, help="the merged JSON (default: benchmarks/results/scaling-...json)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--suite", choices=sorted(SUITES), help=argparse.SUPPRESS)
    parser.add_argument("--rows-out", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Driver (or, with ``--worker``, one rank of a job); returns the exit status."""
    args = parse_args(argv)
    suite = args.suite or ("small" if args.small else "quick" if args.quick else "full")
    iters = args.iters or SUITES[suite].iters
    if args.worker:
        worker(args.backend, replace(SUITES[suite], iters=iters), args.rows_out)
        return 0
    if detect().world_size > 1:
        sys.exit("scaling.py starts its own jobs: run it with python, not under a launcher")
    worlds = [int(w) for w in args.worlds.split(",")]
    backends = (args.backend or ("host_shm" if args.cpu else "cuda_ipc,nvshmem")).split(",")
    gpus = torch.cuda.device_count()
    report = ScalingReport("scaling-cpu-path" if args.cpu else "scaling", columns=COLUMNS)
    with tempfile.TemporaryDirectory(prefix="tilescale-scaling-") as workdir:
        for backend in backends:
            for world in worlds:
                if not args.cpu and world > gpus:
                    report.add({"world": world, "backend": backend, "status": "skipped",
                                "reason": f"needs {world} GPUs, {gpus} present"})  # fmt: skip
                    continue
                rows, run = run_job(world, backend, suite, iters, args.cpu, Path(workdir), args.timeout_s)
                for row in rows:
                    report.add(row)
                report.runs.append(run)
    report.print_table()
    for row in report.rows:
        if row["status"] != "ok":
            print(f"{row['status']}: {row['backend']}, {row['world']} ranks: {row['reason']}")
    path = report.save(args.out)
    where = "CPU path (interpreted: not GPU performance)" if args.cpu else f"{gpus} GPUs present"
    for png in plot(report.rows, path, f"{suite} suite, {where}"):
        print(f"plot: {png}")
    print(f"results: {path}")
    return 1 if any(r["status"] == "error" for r in report.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
