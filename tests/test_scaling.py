"""benchmarks/scaling.py end to end on the CPU path, and the multi-node model of benchmarks/scaling_model.py."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import scaling_model as model  # noqa: E402
from cpu_jobs import run_python  # noqa: E402

NODES = (1, 2, 4, 8, 16)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- benchmarks/scaling.py --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_scaling_driver_runs_every_world_size_and_skips_the_missing_backend(tmp_path):
    out = tmp_path / "scaling.json"
    proc = run_python("benchmarks/scaling.py", "--cpu", "--small", "--worlds", "2,4", "--backend", "host_shm,nvshmem",
                      "--out", out, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["name"] == "scaling-cpu-path" and data["versions"]["torch"]
    assert [(r["backend"], r["world"], r["exit_status"]) for r in data["runs"]] == [
        ("host_shm", 2, 0), ("host_shm", 4, 0), ("nvshmem", 2, 0), ("nvshmem", 4, 0),
    ]  # fmt: skip
    rows = data["rows"]

    # The backend that cannot start is a skipped row per world size, with the reason.
    skipped = [r for r in rows if r["backend"] == "nvshmem"]
    assert [(r["world"], r["status"]) for r in skipped] == [(2, "skipped"), (4, "skipped")]
    assert all("nvshmem" in r["reason"] for r in skipped)

    measured = [r for r in rows if r["backend"] == "host_shm"]
    ops = {
        ("collectives", "all_gather"): {"tilescale", "gloo"},
        ("collectives", "reduce_scatter"): {"tilescale", "gloo"},
        ("collectives", "all_reduce"): {"tilescale", "gloo"},
        ("tp_gemm", "ag_gemm"): {"tilescale_fused", "nccl_cublas", "gemm_alone"},
        ("tp_gemm", "gemm_rs"): {"tilescale_fused", "nccl_cublas", "gemm_alone"},
        ("moe", "dispatch"): {"tilescale", "all_to_all"},
        ("moe", "combine"): {"tilescale", "all_to_all"},
    }
    for world in (2, 4):
        for (bench, op), impls in ops.items():
            here = [r for r in measured if (r["world"], r["bench"], r["op"]) == (world, bench, op)]
            assert {r["impl"] for r in here} == impls, (world, bench, op)
            assert all(r["correct"] and r["checks"] and all(c["ok"] for c in r["checks"]) for r in here)
    assert {(r["bench"], r["case"]) for r in measured if r["bench"] == "collectives"} == {
        ("collectives", "4 KiB"), ("collectives", "16 KiB"),
    }  # fmt: skip
    # MoE combine is a round trip minus a dispatch: on a loaded CPU that may come out as noise.
    assert {r["status"] for r in measured} <= {"ok", "noisy"}
    assert all(r["impl"] == "tilescale" and r["op"] == "combine" for r in measured if r["status"] == "noisy")
    ok = [r for r in measured if r["status"] == "ok"]
    assert len(ok) >= len(measured) - 2
    assert all(r["us"] > 0 and r["throughput"] > 0 for r in ok)

    for bench in ("collectives", "tp_gemm", "moe"):
        assert out.with_name(f"scaling-{bench}.png").read_bytes().startswith(PNG_MAGIC)


# --- benchmarks/scaling_model.py --------------------------------------------------------


def projections(op, a: model.Assumptions | None = None) -> list[model.Projection]:
    return [op(a or model.Assumptions(), nodes) for nodes in NODES]


@pytest.mark.parametrize("op", [model.ag_gemm, model.gemm_rs])
def test_tp_gemm_comm_share_grows_with_nodes_at_a_fixed_per_rank_shape(op):
    p = projections(op)
    shares = [x.comm_share for x in p]
    assert shares == sorted(shares) and shares[-1] > shares[0]
    assert len({x.compute_us for x in p}) == 1  # the per-rank GEMM does not change
    assert [x.exposed_comm_us for x in p] == sorted(x.exposed_comm_us for x in p)


@pytest.mark.parametrize("op", model.MODELS)
def test_links_never_beat_their_rate_and_fusing_never_loses(op):
    a = model.Assumptions()
    for x in projections(op, a):
        assert 0 <= x.nic_achieved_GBps <= a.nic_GBps <= a.nic_line_GBps
        assert 0 < x.nvlink_achieved_GBps <= a.nvlink_GBps
        assert max(x.compute_us, x.comm_us) <= x.fused_us <= x.sequential_us
        assert (x.nic_bytes == 0) == (x.nodes == 1)
        assert x.gpus == 8 * x.nodes


def test_all_gather_bytes_add_up_to_every_other_ranks_shard():
    m, k, _ = model.AG_SHAPE
    for x in projections(model.ag_gemm):
        shard = m * k * 2 / x.gpus
        assert x.nvlink_bytes + x.nic_bytes == pytest.approx((x.gpus - 1) * shard)


def test_moe_time_grows_with_nodes_and_a_slower_network_is_slower():
    base = model.Assumptions()
    fast = [x.fused_us for x in projections(model.moe_dispatch, base)]
    assert fast == sorted(fast)
    slow = [x.fused_us for x in projections(model.moe_dispatch, replace(base, nic_line_GBps=25.0))]
    assert slow[0] == fast[0] and all(s > f for s, f in zip(slow[1:], fast[1:], strict=True))


def test_calibration_uses_gpu_results_and_says_which_numbers_are_defaults(tmp_path):
    def write(name: str, gpus: int, rows: list[dict], stamp: str) -> None:
        device = {"gpus": ["NVIDIA H200"] * gpus, "gpu_count": gpus}
        (tmp_path / f"{name}-x-{stamp}.json").write_text(
            json.dumps({"name": name, "date": stamp, "device": device, "rows": rows})
        )

    a, notes = model.calibrate(tmp_path, model.Assumptions())
    assert a.nvlink_GBps == model.Assumptions().nvlink_GBps
    assert any("tp-gemm" in n for n in notes) and any("moe" in n for n in notes)

    write("p2p", 2, [{"put_GBps": 100.0, "size": "1 MiB"}, {"put_GBps": 300.0, "size": "256 MiB"}], "2026-01-01")
    write("p2p", 2, [{"put_GBps": 310.0, "size": "256 MiB"}], "2026-01-02")  # newer
    write("p2p", 0, [{"put_GBps": 1.0, "size": "256 MiB"}], "2026-01-03")  # the CPU path: ignored
    write("p2p-latency", 2, [{"what": "put+signal round trip (1 block)", "bytes": 8192, "us": 6.0}], "2026-01-01")
    a, notes = model.calibrate(tmp_path, model.Assumptions())
    assert (a.nvlink_GBps, a.nvlink_latency_us) == (310.0, 3.0)
    assert a.sources["nvlink_GBps"].startswith("measured on 2x NVIDIA H200")
    assert not any("nvlink" in n for n in notes) and any("fixed_us" in n for n in notes)


def test_model_cli_writes_a_labelled_projection(tmp_path, capsys):
    out = tmp_path / "projection.json"
    assert model.main(["--results", str(tmp_path), "--out", str(out), "--nic-gbps", "200"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("PROJECTION") and "stated: 8 NICs x 200 Gb/s" in printed
    data = json.loads(out.read_text())
    assert data["projection"] is True and data["assumptions"]["nic_line_GBps"] == 25.0
    assert sorted({(r["op"], r["nodes"]) for r in data["rows"]}) == sorted(
        (op, n) for op in ("ag_gemm", "gemm_rs", "moe_dispatch") for n in NODES
    )
    assert out.with_suffix(".png").read_bytes().startswith(PNG_MAGIC)
