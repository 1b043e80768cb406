"""Shared harness for the scripts in ``benchmarks/``: timing, correctness checks, reports.

The scripts run as ``python benchmarks/x.py`` (usually one process per rank under a
launcher) and import from here directly::

    from harness import Report, bandwidth_gbps, check_close, fmt_bytes, progress, size_sweep, time_fn

    report = Report("allreduce", columns=["size", "median_ms", "busbw_gbps"])
    for nbytes in progress(size_sweep(4096, 256 << 20), "allreduce", fmt=fmt_bytes):
        out, ref = setup(nbytes)
        check = check_close("allreduce", run(out), ref)  # raises before any number is reported
        t = time_fn(lambda: run(out), barrier=dist.barrier)
        report.add({**t.to_dict(), "bytes": nbytes, "size": fmt_bytes(nbytes),
                    "busbw_gbps": bandwidth_gbps(nbytes, t.median_ms), "check": check})
    report.print_table()
    report.save()                                        # benchmarks/results/allreduce-<device>-<time>.json
    report.plot("bytes", ["busbw_gbps"], xlabel="message size (B)", ylabel="GB/s")

Only rank 0 prints, saves and plots; the rank comes from ``torch.distributed`` when it is
initialised and from the launcher's environment otherwise.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from tilescale import runtime
from tilescale.launch.environment import detect

T = TypeVar("T")

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Environment variables recorded in every result file: they change what is measured.
_ENV_PREFIXES = ("NCCL_", "TORCH_SYMM_MEM_", "NVSHMEM_", "TILESCALE_", "CUDA_VISIBLE_DEVICES")
# Variables through which a launcher describes the job (see tilescale.launch.environment).
_LAUNCH_VARS = (
    "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE", "PMI_RANK",
    "SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_JOB_NODELIST",
)  # fmt: skip

# (atol, rtol) for check_close, by the less precise dtype of the two tensors.
_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-8, 1e-7),
    torch.float32: (1e-5, 1e-4),
    torch.float16: (1e-3, 1e-2),
    torch.bfloat16: (1e-2, 2e-2),
}
_FP8_TOLERANCE = (1e-1, 1e-1)
_EXACT = (0.0, 0.0)


def is_rank0() -> bool:
    """True on rank 0, or in a process started by no launcher.

    >>> is_rank0()
    True
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return detect().rank == 0


@dataclass
class Timing:
    """Per-iteration times in milliseconds, as measured by :func:`time_fn`.

    >>> t = Timing([1.0, 2.0, 4.0])
    >>> t.median_ms, t.min_ms, t.percentile(50)
    (2.0, 1.0, 2.0)
    """

    samples_ms: list[float] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        """The q-th percentile (0 <= q <= 100), interpolating linearly between samples."""
        if not 0 <= q <= 100:
            raise ValueError(f"percentile {q} outside [0, 100]")
        s = sorted(self.samples_ms)
        pos = (len(s) - 1) * q / 100
        lo, hi = math.floor(pos), math.ceil(pos)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)

    @property
    def min_ms(self) -> float:
        return min(self.samples_ms)

    @property
    def max_ms(self) -> float:
        return max(self.samples_ms)

    @property
    def mean_ms(self) -> float:
        return statistics.fmean(self.samples_ms)

    @property
    def std_ms(self) -> float:
        """Population standard deviation."""
        return statistics.pstdev(self.samples_ms)

    @property
    def p10_ms(self) -> float:
        return self.percentile(10)

    @property
    def p90_ms(self) -> float:
        return self.percentile(90)

    def to_dict(self) -> dict[str, Any]:
        """Summary statistics and all samples, ready for a JSON row."""
        return {
            "iters": len(self.samples_ms),
            "median_ms": self.median_ms,
            "min_ms": self.min_ms,
            "max_ms": self.max_ms,
            "mean_ms": self.mean_ms,
            "std_ms": self.std_ms,
            "p10_ms": self.p10_ms,
            "p90_ms": self.p90_ms,
            "samples_ms": list(self.samples_ms),
        }


def time_fn(
    fn: Callable[[], object],
    *,
    warmup: int = 5,
    iters: int = 50,
    device: torch.device | str | int | None = None,
    barrier: Callable[[], object] | None = None,
) -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``iters`` times, timing each call.

    On a CUDA device each call is bracketed by a pair of CUDA events on the current
    stream and the device is synchronised once at the end; on the CPU each call is
    timed with ``time.perf_counter``. ``device`` defaults to the current CUDA device
    when there is one: pass ``device="cpu"`` to time host-only work on a GPU machine.
    ``barrier`` (e.g. ``torch.distributed.barrier``) runs before every timed call,
    outside the timed region, so that all ranks start each iteration together.

    >>> t = time_fn(lambda: sum(range(1000)), warmup=1, iters=10, device="cpu")
    >>> len(t.samples_ms)
    10
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)

    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            if barrier is not None:
                barrier()
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return Timing(samples)

    with torch.cuda.device(device):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(iters):
            if barrier is not None:
                barrier()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return Timing([start.elapsed_time(end) for start, end in events])


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int = 5,
    warmup: int = 5,
    iters: int = 50,
    device: torch.device | str | int | None = None,
    barrier: Callable[[], object] | None = None,
) -> dict[str, Timing]:
    """Time every function of ``fns`` as :func:`time_fn` does, in ``rounds`` rounds of
    ``iters // rounds`` calls each, the functions taking turns, so that a drift of the GPU's
    clocks over the run (a heating H200 loses ~9% over a minute of GEMMs) moves every
    function's median alike instead of favouring the ones timed first.

    >>> order = []
    >>> t = time_interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
    ...                      rounds=2, warmup=0, iters=4, device="cpu")
    >>> "".join(order), len(t["a"].samples_ms)
    ('aabbaabb', 4)
    """
    if rounds < 1 or iters < rounds:
        raise ValueError(f"need 1 <= rounds <= iters, got rounds={rounds}, iters={iters}")
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(rounds):
        for name, fn in fns.items():
            timing = time_fn(fn, warmup=warmup if r == 0 else 0, iters=iters // rounds, device=device,
                             barrier=barrier)
            samples[name] += timing.samples_ms
    return {name: Timing(s) for name, s in samples.items()}


def graphed(fn: Callable[[], object], calls: int = 1) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph (``calls`` times in a row); the result replays it
    (outputs land in the tensors the capture allocated). ``fn`` runs once eagerly first, so
    that its kernels are built and its lazily created state exists before the capture.

    Use it to time GPU work without the host's launch path, as a decode step runs; with
    ``calls`` > 1, a replay's time over ``calls`` is one call's inside a larger graph (a whole
    decode step's), without the graph's own launch.
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay


def named_sizes(text: str, names: Iterable[str], fields: int, sep: str = "=") -> list[tuple[str, tuple[int, ...]]]:
    """The ``name<sep>AxBx...`` items of a comma-separated command-line value, each name one of
    ``names`` and each size ``fields`` positive integers; SystemExit naming the first that is not.

    >>> named_sizes("ag:64x96x80,rs:128x64x96", ("ag", "rs"), 3, sep=":")
    [('ag', (64, 96, 80)), ('rs', (128, 64, 96))]
    """
    names = sorted(set(names))
    picked = []
    for item in filter(None, text.split(",")):
        name, _, dims = item.partition(sep)
        try:
            size = tuple(int(d) for d in dims.split("x"))
        except ValueError:
            size = ()
        if name not in names or len(size) != fields or min(size) < 1:
            raise SystemExit(f"{item!r} is not name{sep}{'x'.join('N' * fields)} with name one of {names}")
        picked.append((name, size))
    return picked


def columns_against(names: list[str], baseline: str) -> list[str]:
    """The report columns :func:`replays_against` fills: the baseline's time, each call's, then
    each call's ratio to the baseline.

    >>> columns_against(["ours"], "cublas")
    ['cublas_us', 'ours_us', 'ours_vs_cublas']
    """
    return [f"{baseline}_us", *[f"{n}_us" for n in names], *[f"{n}_vs_{baseline}" for n in names]]


def replays_against(row: dict[str, Any], calls: dict[str, Callable[[], object]], baseline: str, iters: int,
                    rounds: int = 5) -> None:
    """Each of ``calls`` captured once in a CUDA graph (:func:`graphed`), the replays timed
    taking turns (:func:`time_interleaved`): into ``row`` as ``{name}_us`` (median) and, for
    every call but ``baseline``, ``{name}_vs_{baseline}`` (its time over the baseline's).

    Example::

        replays_against(row, {"cublas": lambda: a @ w.T, "ours": lambda: ours(a, w)}, "cublas", iters=50)
        row["ours_vs_cublas"]

    Args:
        row: The report row to fill.
        calls: Name -> the GPU work of one call (outputs checked before).
        baseline: The name in ``calls`` the others are divided by.
        iters: Replays per call, over all rounds.
        rounds: Rounds of taking turns.
    """
    for name, timing in time_interleaved({n: graphed(fn) for n, fn in calls.items()}, rounds=rounds,
                                         iters=iters).items():
        row[f"{name}_us"] = timing.median_ms * 1e3
    for name in calls:
        if name != baseline:
            row[f"{name}_vs_{baseline}"] = row[f"{name}_us"] / row[f"{baseline}_us"]


def measure_shapes(report: Report, shapes: Iterable[Any], measure: Callable[[Any], dict[str, Any]],
                   timed: bool = True) -> None:
    """``measure(shape)`` for each of ``shapes``; with ``timed``, each row added to ``report`` and
    the report saved after every shape (a run cut off at its time limit keeps what it measured);
    the table printed at the end.

    Example::

        measure_shapes(report, SHAPES, lambda shape: measure(shape, args.iters, not args.small), not args.small)

    Args:
        report: The report the rows go to.
        shapes: The shapes, in order.
        measure: One shape's row (its checks run first, and raise on a mismatch).
        timed: Whether the rows are timings to report (False: a check-only run, e.g. on the CPU path).
    """
    for shape in shapes:
        row = measure(shape)
        if timed:
            report.add(row)
            report.save()
    report.print_table()


def _default_tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype in _TOLERANCES:
        return _TOLERANCES[dtype]
    if dtype.is_floating_point:  # the float8 family
        return _FP8_TOLERANCE
    return _EXACT  # integers and bool compare exactly


def check_close(
    name: str,
    got: torch.Tensor,
    ref: torch.Tensor,
    *,
    atol: float | None = None,
    rtol: float | None = None,
) -> dict[str, Any]:
    """Check ``|got - ref| <= atol + rtol * |ref|`` everywhere; raise AssertionError if not.

    Defaults for ``atol``/``rtol`` follow the less precise dtype of the two tensors
    (float32: 1e-5/1e-4, float16: 1e-3/1e-2, bfloat16: 1e-2/2e-2, float8: 0.1/0.1,
    integers: exact). NaN anywhere in ``got`` fails. Returns the errors for the report.
    In a tilescale job a device-side failure (a wait that timed out, ranks that disagreed) is
    raised first, as what it is: the kernels after it ran on, so ``got`` would only look wrong.

    >>> check_close("copy", torch.ones(4), torch.ones(4))["ok"]
    True
    """
    if runtime.is_initialized():
        runtime.synchronize()
    if got.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != reference shape {tuple(ref.shape)}")
    default_atol = max(_default_tolerance(got.dtype)[0], _default_tolerance(ref.dtype)[0])
    default_rtol = max(_default_tolerance(got.dtype)[1], _default_tolerance(ref.dtype)[1])
    atol = default_atol if atol is None else atol
    rtol = default_rtol if rtol is None else rtol

    compute = torch.float64 if torch.float64 in (got.dtype, ref.dtype) else torch.float32
    g = got.detach().to(compute)
    r = ref.detach().to(device=g.device, dtype=compute)
    diff = g - r
    err = diff.abs()
    bad = ~(err <= atol + rtol * r.abs())  # NaN compares False, so it counts as bad
    n_bad = int(bad.sum())
    max_abs = float(err.max()) if err.numel() else 0.0
    ref_norm = float(torch.linalg.vector_norm(r))
    err_norm = float(torch.linalg.vector_norm(diff))
    rel_l2 = err_norm / ref_norm if ref_norm > 0 else err_norm
    result = {
        "name": name,
        "ok": n_bad == 0,
        "max_abs_err": max_abs,
        "rel_l2_err": rel_l2,
        "mismatched": n_bad,
        "numel": got.numel(),
        "atol": atol,
        "rtol": rtol,
        "dtype": str(got.dtype).removeprefix("torch."),
    }
    if n_bad:
        first = tuple(int(i) for i in torch.nonzero(bad)[0].tolist())
        raise AssertionError(
            f"{name}: {n_bad}/{got.numel()} elements of {result['dtype']} {tuple(got.shape)} are not close "
            f"(atol={atol:g}, rtol={rtol:g}): max_abs_err={max_abs:.4g}, rel_l2_err={rel_l2:.4g}; "
            f"first at index {first}: got {g[first].item():.6g}, expected {r[first].item():.6g}"
        )
    return result


def size_sweep(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """Sizes from ``min_bytes`` up to at most ``max_bytes``, each ``factor`` times the last.

    >>> size_sweep(1024, 8192)
    [1024, 2048, 4096, 8192]
    """
    if min_bytes < 1 or factor < 2 or max_bytes < min_bytes:
        raise ValueError(f"bad sweep: min_bytes={min_bytes}, max_bytes={max_bytes}, factor={factor}")
    sizes = [min_bytes]
    while sizes[-1] * factor <= max_bytes:
        sizes.append(sizes[-1] * factor)
    return sizes


def fmt_bytes(n: int) -> str:
    """Human-readable binary size.

    >>> fmt_bytes(4096), fmt_bytes(256 << 20), fmt_bytes(1536), fmt_bytes(100)
    ('4 KiB', '256 MiB', '1.5 KiB', '100 B')
    """
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f} {unit}" if value.is_integer() else f"{value:.1f} {unit}"
    return f"{n} B"


def bandwidth_gbps(nbytes: float, ms: float) -> float:
    """Bandwidth in GB/s (1e9 bytes per second) for ``nbytes`` moved in ``ms`` milliseconds.

    >>> bandwidth_gbps(1e9, 1000.0)
    1.0
    """
    if ms <= 0:
        raise ValueError(f"time must be positive, got {ms} ms")
    return nbytes / (ms * 1e6)


def progress(iterable: Iterable[T], desc: str, *, fmt: Callable[[T], str] = str) -> Iterator[T]:
    """Yield the items of ``iterable``, printing ``desc [i/n] item`` to stderr on rank 0.

    One line per step, so it reads well in non-tty job logs too.

    >>> sizes = [s for s in progress([4096, 8192], "sweep", fmt=fmt_bytes)]  # sweep [1/2] 4 KiB ...
    """
    total = len(iterable) if hasattr(iterable, "__len__") else "?"
    show = is_rank0()
    start = time.perf_counter()
    for i, item in enumerate(iterable, 1):
        if show:
            elapsed = time.perf_counter() - start
            print(f"{desc} [{i}/{total}] {fmt(item)} ({elapsed:.1f}s)", file=sys.stderr, flush=True)
        yield item


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_info() -> dict[str, Any]:
    """The visible GPUs (names and count) and the host CPU model and core count."""
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpus": gpus, "gpu_count": len(gpus), "cpu": _cpu_model(), "cpu_cores": os.cpu_count()}


def gpus_shared() -> bool:
    """Whether this job's ranks share GPUs (``tilescale run --share-gpus``): its timings mean nothing."""
    import tilescale

    return tilescale.is_initialized() and tilescale.runtime.current().gpus_shared


def device_slug(info: dict[str, Any]) -> str:
    """Short file-name-safe device name: ``nvidia-h200-x8``, ``nvidia-h100-80gb-hbm3``, ``cpu``."""
    if not info["gpus"]:
        return "cpu"
    slug = _slug(info["gpus"][0])
    return f"{slug}-x{info['gpu_count']}" if info["gpu_count"] > 1 else slug


def _module_version(name: str) -> str | None:
    try:
        return importlib.import_module(name).__version__
    except Exception:  # not installed, no __version__, or fails to load (e.g. missing CUDA libs)
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None


def versions() -> dict[str, str | None]:
    """Versions of Python, torch, CUDA, NCCL, tilelang and tilescale (None where absent)."""
    nccl = None
    if torch.cuda.is_available():
        with contextlib.suppress(AttributeError, RuntimeError):  # a build without NCCL
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": nccl,
        "tilelang": _module_version("tilelang"),
        "tilescale": _module_version("tilescale"),
    }


def _format_cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return f"{value:g}"
        if abs(value) >= 100:
            return f"{value:.1f}"
        if abs(value) >= 1:
            return f"{value:.3f}"
        return f"{value:.4g}"
    return str(value)


class Report:
    """Rows of benchmark results: printed as a table, saved as JSON, plotted as PNG.

    >>> r = Report("demo", columns=["size", "median_ms"])
    >>> r.add({"size": "4 KiB", "median_ms": 0.0123, "check": {"ok": True}})
    >>> r.print_table()  # doctest: +NORMALIZE_WHITESPACE
    demo
    size   median_ms
    -----  ---------
    4 KiB    0.0123

    Extra keys of a row (correctness dicts, full timings) go to the JSON only.
    """

    def __init__(self, name: str, *, columns: list[str]) -> None:
        self.name = name
        self.columns = list(columns)
        self.rows: list[dict[str, Any]] = []
        self.created = datetime.now(timezone.utc)
        self.path: Path | None = None  # where save() wrote the JSON

    def add(self, row: dict[str, Any]) -> None:
        """Append a row; keys outside ``columns`` are kept for the JSON."""
        self.rows.append(dict(row))

    def print_table(self) -> None:
        """Print the rows as an aligned table on rank 0 ('-' where a row lacks a column)."""
        if not is_rank0():
            return
        cells = [[_format_cell(row.get(c)) for c in self.columns] for row in self.rows]
        widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(self.columns)]
        numeric = [
            all(isinstance(row.get(c), int | float) or row.get(c) is None for row in self.rows) for c in self.columns
        ]

        def line(values: list[str]) -> str:
            return "  ".join(
                v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
            ).rstrip()

        print(self.name)
        if gpus_shared():
            print("warning: ranks share GPUs and their kernels run by turns; these timings mean nothing")
        print(line(self.columns))
        print(line(["-" * w for w in widths]))
        for r in cells:
            print(line(r))

    def default_path(self) -> Path:
        """``benchmarks/results/<name>-<device-slug>-<YYYYmmdd-HHMMSS>.json`` (UTC time of creation)."""
        stamp = self.created.strftime("%Y%m%d-%H%M%S")
        return RESULTS_DIR / f"{self.name}-{device_slug(device_info())}-{stamp}.json"

    def metadata(self) -> dict[str, Any]:
        """Everything that says where, when and how these numbers were measured."""
        distributed = None
        if dist.is_available() and dist.is_initialized():
            distributed = {
                "world_size": dist.get_world_size(),
                "rank": dist.get_rank(),
                "backend": str(dist.get_backend()),
            }
        return {
            "name": self.name,
            "date": self.created.isoformat(timespec="seconds"),
            "command": {
                "argv": shlex.join(sys.argv),
                "launcher": detect().launcher,
                "env": {k: os.environ[k] for k in _LAUNCH_VARS if k in os.environ},
            },
            "device": device_info(),
            "gpus_shared": gpus_shared(),
            "versions": versions(),
            "distributed": distributed,
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
            "columns": self.columns,
        }

    def save(self, path: str | Path | None = None) -> Path | None:
        """Write metadata and rows as JSON (on rank 0 only; other ranks return None).

        >>> Report("demo", columns=["x"]).save("/tmp/demo.json")
        PosixPath('/tmp/demo.json')
        """
        if not is_rank0():
            return None
        path = Path(path) if path is not None else self.default_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {**self.metadata(), "rows": self.rows}
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        self.path = path
        return path

    def plot(
        self,
        x: str,
        ys: list[str],
        path: str | Path | None = None,
        *,
        xlabel: str | None = None,
        ylabel: str | None = None,
        logx: bool = True,
        logy: bool = False,
        title: str | None = None,
    ) -> Path | None:
        """Plot one line per column in ``ys`` against column ``x`` to a PNG (rank 0 only).

        The PNG goes beside the saved JSON, with the same stem, unless ``path`` is given.
        Rows lacking ``x`` or a ``y`` value are skipped for that line.

        >>> report.plot("bytes", ["busbw_gbps"], xlabel="bytes", ylabel="GB/s")  # doctest: +SKIP
        """
        if not is_rank0():
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 4.5))
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for y in ys:
            points = [(r[x], r[y]) for r in self.rows if r.get(x) is not None and r.get(y) is not None]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=y)
        ax.set_xscale("log" if logx else "linear")
        ax.set_yscale("log" if logy else "linear")
        ax.set_xlabel(xlabel if xlabel is not None else x)
        ax.set_ylabel(ylabel if ylabel is not None else ", ".join(ys))
        ax.set_title(title if title is not None else self.name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        if path is None:
            path = (self.path or self.default_path()).with_suffix(".png")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        return path
