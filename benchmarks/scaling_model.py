"""PROJECTION, not a measurement: AG-GEMM, GEMM-RS and MoE dispatch/combine on 1 to 16 nodes.

An analytic model, calibrated on the newest single-node GPU results in ``benchmarks/results/``
(p2p bandwidth and latency, the fastest tilescale collective, cuBLAS's GEMM rate, the MoE
low-latency dispatch; stated defaults where a result is missing) and on the inter-node
network the user states (by default 8x 400 Gb/s NICs per node of 8 GPUs). Every number it
prints is a projection; the assumptions, and where each came from, are printed with the
table and saved in the JSON.

The model, per rank, at a fixed per-rank problem (weak scaling)::

    transfer(bytes, link) = latency(link) + bytes / bandwidth(link)
    pipelined(stages, c)  = max(stages) + (sum(stages) - max(stages)) / c
    comm      = pipelined([NVLink transfer, NIC transfer], chunks)
    fused     = pipelined([compute, comm], chunks) + fixed      # tilescale's fused op
    sequential = compute + comm + fixed                        # collective, then cuBLAS

Communication is hierarchical and rail-aligned, as NCCL and DeepEP do it across nodes:
GPU i of a node talks to GPU i of the other nodes through its own NIC, and NVLink moves
data within a node; the stages overlap in ``chunks`` pieces (stated: 8). The issue's AG and
RS shapes are the two halves of one MLP: they move the same bytes and do the same FLOPs, so
the model gives them the same times.

* AG-GEMM: each rank multiplies all ``M`` rows of A (K wide, bf16) by its N-column weight
  slice, holding ``M/P`` of the rows (P ranks, G per node). The NICs carry
  ``(nodes-1) * M/P*K*2`` bytes per GPU (one shard per other node), NVLink
  ``(G-1) * nodes * M/P*K*2`` (those shards and the own node's, to the node's other GPUs).
* GEMM-RS: each rank computes an ``M x N`` partial product (K-slice) and reduce-scatters
  it: NVLink carries ``(G-1)/G * M*N*2`` bytes, then the NICs ``(nodes-1)/nodes * M*N*2/G``.
* MoE dispatch (combine moves the same rows back and is modelled with the same time):
  ``T`` tokens of ``H`` bf16 values, top-k of ``E`` experts, uniform random routing. A
  token crosses the network once per other node holding one of its experts (DeepEP's
  node-level deduplication), and NVLink once per other rank holding one of its experts.

    python benchmarks/scaling_model.py                       # 1, 2, 4, 8, 16 nodes of 8 GPUs
    python benchmarks/scaling_model.py --nic-gbps 200 --nic-latency-us 6
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from harness import RESULTS_DIR, Report

# Per-rank problems: the TP-GEMM issue's first AG and RS shapes (tp_shapes.AG_SHAPES[0] and
# RS_SHAPES[0]: M rows of the whole product, K and N as each rank holds them), DeepEP's normal size.
AG_SHAPE = (8192, 8192, 14336)
RS_SHAPE = (8192, 14336, 8192)
MOE_SHAPE = (4096, 7168, 8, 256)  # tokens per rank, hidden, top-k, experts
BF16 = 2  # bytes


@dataclass(frozen=True)
class Assumptions:
    """The machine the projection assumes; ``sources`` says where each number came from."""

    gpus_per_node: int = 8
    nvlink_GBps: float = 340.0  # per GPU, one direction, every GPU sending at once
    nvlink_latency_us: float = 3.0
    nic_line_GBps: float = 50.0  # per GPU: 8 NICs x 400 Gb/s per node of 8 GPUs
    nic_efficiency: float = 0.85  # fraction of the line rate a large RDMA write reaches
    nic_latency_us: float = 4.0  # one RDMA write through one switch tier, completion included
    fixed_us: float = 45.0  # per fused op: launch, barriers, signals; never overlapped
    moe_fixed_us: float = 60.0  # per dispatch or combine: layout, counts, host round trips
    gemm_tflops: float = 700.0  # bf16 dense rate cuBLAS reaches on large GEMMs
    chunks: int = 8  # pieces in which transfers overlap each other and the GEMM
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def nic_GBps(self) -> float:
        """The NIC bandwidth per GPU the model uses: line rate times efficiency."""
        return self.nic_line_GBps * self.nic_efficiency


DEFAULT_SOURCES = {
    "gpus_per_node": "stated (--gpus-per-node)",
    "nvlink_GBps": "stated default: ~75% of H200 NVLink's 450 GB/s per direction",
    "nvlink_latency_us": "stated default",
    "nic_line_GBps": "stated: 8 NICs x 400 Gb/s per node, one per GPU",
    "nic_efficiency": "stated (--nic-efficiency)",
    "nic_latency_us": "stated (--nic-latency-us)",
    "fixed_us": "stated default",
    "moe_fixed_us": "stated default",
    "gemm_tflops": "stated default: ~70% of H200's 989 TFLOP/s dense bf16",
    "chunks": "stated (--chunks)",
}


@dataclass(frozen=True)
class Projection:
    """One op at one node count, per rank; times in microseconds, bytes per GPU."""

    op: str
    nodes: int
    gpus: int
    compute_us: float
    nvlink_us: float
    nic_us: float
    comm_us: float
    fused_us: float
    sequential_us: float
    nvlink_bytes: float
    nic_bytes: float

    @property
    def comm_share(self) -> float:
        """Communication's share of the work: comm / (comm + compute)."""
        return self.comm_us / (self.comm_us + self.compute_us)

    @property
    def exposed_comm_us(self) -> float:
        """How much longer the fused op takes than its computation alone."""
        return self.fused_us - self.compute_us

    @property
    def nvlink_achieved_GBps(self) -> float:
        """Bandwidth of the NVLink stage, latency included (0 when it moves nothing)."""
        return self.nvlink_bytes / self.nvlink_us / 1e3 if self.nvlink_us else 0.0

    @property
    def nic_achieved_GBps(self) -> float:
        """Bandwidth of the NIC stage per GPU, latency included (0 on one node)."""
        return self.nic_bytes / self.nic_us / 1e3 if self.nic_us else 0.0

    def row(self) -> dict[str, Any]:
        """The fields and derived numbers, for the report."""
        return {**asdict(self), "comm_share": self.comm_share, "exposed_comm_us": self.exposed_comm_us,
                "nvlink_GBps": self.nvlink_achieved_GBps, "nic_GBps": self.nic_achieved_GBps}  # fmt: skip


def transfer_us(nbytes: float, GBps: float, latency_us: float) -> float:
    """Time to move ``nbytes`` over a link: its latency plus bytes over bandwidth (0 for no bytes).

    >>> transfer_us(1e6, 100.0, 2.0)
    12.0
    """
    return latency_us + nbytes / (GBps * 1e3) if nbytes > 0 else 0.0


def pipelined(stages: Sequence[float], chunks: int) -> float:
    """Time of stages that overlap when the work is cut into ``chunks``: the slowest stage
    runs throughout, the others show only for one chunk.

    >>> pipelined([8.0, 2.0], 4), pipelined([8.0, 2.0], 1)
    (8.5, 10.0)
    """
    return max(stages) + (sum(stages) - max(stages)) / chunks


def _project(op: str, a: Assumptions, nodes: int, compute_us: float, nvlink_bytes: float, nic_bytes: float,
             fixed_us: float) -> Projection:  # fmt: skip
    gpus = nodes * a.gpus_per_node
    nvlink = transfer_us(nvlink_bytes, a.nvlink_GBps, a.nvlink_latency_us)
    nic = transfer_us(nic_bytes, a.nic_GBps, a.nic_latency_us)
    comm = pipelined([nvlink, nic], a.chunks)
    return Projection(op, nodes, gpus, compute_us, nvlink, nic, comm,
                      fused_us=pipelined([compute_us, comm], a.chunks) + fixed_us,
                      sequential_us=compute_us + comm + fixed_us,
                      nvlink_bytes=nvlink_bytes, nic_bytes=nic_bytes)  # fmt: skip


def gemm_us(a: Assumptions, m: int, k: int, n: int) -> float:
    """cuBLAS time of an ``m x k`` by ``k x n`` product at the assumed rate."""
    return 2 * m * k * n / (a.gemm_tflops * 1e6)


def ag_gemm(a: Assumptions, nodes: int, shape: tuple[int, int, int] = AG_SHAPE) -> Projection:
    """All-gather GEMM: ``shape`` = (M rows of the whole product, K, N per rank)."""
    m, k, n = shape
    shard = m * k * BF16 / (nodes * a.gpus_per_node)
    return _project("ag_gemm", a, nodes, gemm_us(a, m, k, n),
                    nvlink_bytes=(a.gpus_per_node - 1) * nodes * shard, nic_bytes=(nodes - 1) * shard,
                    fixed_us=a.fixed_us)  # fmt: skip


def gemm_rs(a: Assumptions, nodes: int, shape: tuple[int, int, int] = RS_SHAPE) -> Projection:
    """GEMM + reduce-scatter: ``shape`` = (M, K per rank, N); each rank keeps M / ranks rows."""
    m, k, n = shape
    partial = m * n * BF16
    g = a.gpus_per_node
    return _project("gemm_rs", a, nodes, gemm_us(a, m, k, n),
                    nvlink_bytes=(g - 1) / g * partial, nic_bytes=(nodes - 1) / nodes * partial / g,
                    fixed_us=a.fixed_us)  # fmt: skip


def _chosen(experts: int, topk: int, owned: int) -> float:
    """Probability that a token's ``topk`` distinct experts include one of ``owned`` given experts."""
    return 1 - math.comb(experts - owned, topk) / math.comb(experts, topk)


def moe_dispatch(a: Assumptions, nodes: int, shape: tuple[int, int, int, int] = MOE_SHAPE) -> Projection:
    """MoE dispatch (and, by symmetry, combine): ``shape`` = (tokens per rank, hidden, top-k, experts)."""
    tokens, hidden, topk, experts = shape
    gpus = nodes * a.gpus_per_node
    row = hidden * BF16
    other_ranks = (gpus - 1) * _chosen(experts, topk, experts // gpus)
    other_nodes = (nodes - 1) * _chosen(experts, topk, experts // nodes)
    return _project("moe_dispatch", a, nodes, 0.0, nvlink_bytes=tokens * row * other_ranks,
                    nic_bytes=tokens * row * other_nodes, fixed_us=a.moe_fixed_us)  # fmt: skip


MODELS = (ag_gemm, gemm_rs, moe_dispatch)


# --- calibration from measured results --------------------------------------------------


def newest_result(name: str, results: Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest GPU result file of benchmark ``name`` (by its recorded date), or None."""
    found = []
    for path in results.glob(f"{name}-*.json"):
        data = json.loads(path.read_text())
        if data.get("name") == name and data.get("device", {}).get("gpu_count", 0) > 0:
            found.append((data["date"], path, data))
    if not found:
        return None
    _, path, data = max(found, key=lambda f: f[0])
    return path, data


def calibrate(results: Path, base: Assumptions) -> tuple[Assumptions, list[str]]:
    """``base`` with the numbers the newest measured results give; notes on what was missing."""
    values: dict[str, float] = {}
    sources = dict(DEFAULT_SOURCES, **base.sources)
    notes = []

    def take(key: str, value: float, path: Path, data: dict[str, Any], how: str) -> None:
        values[key] = value
        gpus = data["device"]["gpu_count"]
        sources[key] = f"measured on {gpus}x {data['device']['gpus'][0]}: {how} ({path.name})"

    if found := newest_result("p2p", results):
        best = max(found[1]["rows"], key=lambda r: r["put_GBps"])
        take("nvlink_GBps", best["put_GBps"], *found, f"tilescale put at {best['size']}, every rank sending")
    if found := newest_result("p2p-latency", results):
        rows = [r for r in found[1]["rows"] if r["what"].startswith("put+signal round trip")]
        if rows:
            take("nvlink_latency_us", rows[0]["us"] / 2, *found, "half a put+signal round trip")
    if found := newest_result("collectives", results):
        fastest = min(found[1]["rows"], key=lambda r: r["tilescale_us"])
        take("fixed_us", fastest["tilescale_us"], *found, f"the fastest tilescale collective ({fastest['op']} "
             f"of {fastest['size']})")  # fmt: skip
    if found := newest_result("tp-gemm", results):
        rate = max(2 * r["M"] * r["K"] * r["N"] / r["gemm_alone_ms"] / 1e9 for r in found[1]["rows"])
        take("gemm_tflops", rate, *found, "the fastest cuBLAS GEMM alone")
    else:
        notes.append("no tp-gemm results: the GEMM rate is a stated default")
    if found := newest_result("moe", results):
        ll = [r for r in found[1]["rows"] if r["case"] == "low-latency"]
        if ll:
            take("moe_fixed_us", ll[0]["dispatch_us"], *found, "tilescale low-latency dispatch (128 tokens)")
    else:
        notes.append("no moe results: the MoE fixed cost is a stated default")
    for key in ("nvlink_GBps", "nvlink_latency_us", "fixed_us"):
        if key not in values:
            notes.append(f"no measured {key}: a stated default")
    return replace(base, **values, sources=sources), notes


# --- report -----------------------------------------------------------------------------


class ProjectionReport(Report):
    """A :class:`Report` labelled as a projection, with its assumptions in the JSON."""

    def __init__(self, assumptions: Assumptions, notes: list[str]) -> None:
        super().__init__("scaling-projection", columns=[
            "op", "nodes", "gpus", "compute_us", "comm_us", "fused_us", "sequential_us", "exposed_comm_us",
            "comm_share", "nvlink_GBps", "nic_GBps",
        ])  # fmt: skip
        self.assumptions = assumptions
        self.notes = notes

    def metadata(self) -> dict[str, Any]:
        """The harness metadata, marked ``projection: true``, with the assumptions and notes."""
        return {**super().metadata(), "projection": True, "assumptions": asdict(self.assumptions),
                "notes": self.notes}  # fmt: skip

    def default_path(self) -> Path:
        """``benchmarks/results/scaling-projection-<YYYYmmdd-HHMMSS>.json``: no device, nothing ran on one."""
        return RESULTS_DIR / f"{self.name}-{self.created.strftime('%Y%m%d-%H%M%S')}.json"


def print_assumptions(a: Assumptions, notes: list[str]) -> None:
    """The assumptions, each with its source, and the notes on defaults used."""
    print("PROJECTION -- a model, not a measurement. Assumptions:")
    for key, value in asdict(a).items():
        if key != "sources":
            print(f"  {key:18} {value:10.4g}   {a.sources.get(key, '')}")
    print(f"  {'nic_GBps':18} {a.nic_GBps:10.4g}   line rate x efficiency, per GPU")
    for note in notes:
        print(f"  note: {note}")


def plot(report: ProjectionReport, path: Path) -> Path:
    """Time (fused, sequential, compute, comm) and link bandwidth vs GPUs, per op, titled PROJECTION."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ops = list(dict.fromkeys(r["op"] for r in report.rows))
    fig = Figure(figsize=(11, 3.4 * len(ops) + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(ops), 2, squeeze=False)
    a = report.assumptions
    for op, (ax_time, ax_bw) in zip(ops, axes, strict=True):
        rows = [r for r in report.rows if r["op"] == op]
        gpus = [r["gpus"] for r in rows]
        for key in ("fused_us", "sequential_us", "compute_us", "comm_us"):
            if any(r[key] for r in rows):
                ax_time.plot(gpus, [r[key] for r in rows], marker="o", label=key.removesuffix("_us"))
        for key, rate in (("nvlink_GBps", a.nvlink_GBps), ("nic_GBps", a.nic_line_GBps)):
            achieved = [r[key] or math.nan for r in rows]  # no point where the link carries nothing
            line = ax_bw.plot(gpus, achieved, marker="o", label=f"{key.removesuffix('_GBps')} achieved")
            ax_bw.axhline(rate, linestyle="--", color=line[0].get_color(), label=f"{key.removesuffix('_GBps')} limit")
        for ax, ylabel in ((ax_time, "us per rank"), (ax_bw, "GB/s per GPU")):
            ax.set_xscale("log", base=2)
            ax.set_xticks(gpus, [f"{g}\n({g // a.gpus_per_node} node{'s' * (g > a.gpus_per_node)})" for g in gpus])
            ax.set_ylim(bottom=0)
            ax.set_xlabel("GPUs")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{op} (PROJECTION)", fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"PROJECTION, not measured: {a.gpus_per_node} GPUs/node, NIC {a.nic_line_GBps:g} GB/s per GPU "
                 f"x {a.nic_efficiency:g}, NVLink {a.nvlink_GBps:.0f} GB/s", color="darkred")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    """Print the assumptions and the projected table; save the JSON and the plot."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="1,2,4,8,16", help="node counts, comma-separated")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--nics-per-node", type=int, default=8)
    parser.add_argument("--nic-gbps", type=float, default=400.0, help="line rate of one NIC in Gb/s (default 400)")
    parser.add_argument("--nic-efficiency", type=float, default=0.85)
    parser.add_argument("--nic-latency-us", type=float, default=4.0)
    parser.add_argument("--chunks", type=int, default=8, help="pieces in which transfers and GEMM overlap")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where the measured results are")
    parser.add_argument("--out", type=Path, help="the JSON (default: benchmarks/results/scaling-projection-...)")
    args = parser.parse_args(argv)
    stated = Assumptions(
        gpus_per_node=args.gpus_per_node,
        nic_line_GBps=args.nics_per_node * args.nic_gbps / 8 / args.gpus_per_node,
        nic_efficiency=args.nic_efficiency,
        nic_latency_us=args.nic_latency_us,
        chunks=args.chunks,
        sources={"nic_line_GBps": f"stated: {args.nics_per_node} NICs x {args.nic_gbps:g} Gb/s per node "
                 f"of {args.gpus_per_node} GPUs"},
    )  # fmt: skip
    assumptions, notes = calibrate(args.results, stated)
    report = ProjectionReport(assumptions, notes)
    for model in MODELS:
        for nodes in (int(n) for n in args.nodes.split(",")):
            report.add(model(assumptions, nodes).row())
    print_assumptions(assumptions, notes)
    print(f"\nper-rank problems: AG-GEMM {AG_SHAPE}, GEMM-RS {RS_SHAPE} (M, K, N), MoE {MOE_SHAPE} "
          "(tokens, hidden, top-k, experts)")  # fmt: skip
    report.print_table()
    path = report.save(args.out)
    print(f"plot: {plot(report, path.with_suffix('.png'))}")
    print(f"results: {path} (PROJECTION)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
