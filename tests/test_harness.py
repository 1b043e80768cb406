"""Tests for benchmarks/harness.py, run on the CPU."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import harness  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch):
    """Run as a process started by no launcher (rank 0 of 1), whatever the CI sets."""
    for var in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)


# --- timing -----------------------------------------------------------------------


def test_time_fn_times_each_iteration_and_skips_warmup():
    calls = []

    def fn():
        calls.append(None)
        time.sleep(0.001)

    t = harness.time_fn(fn, warmup=3, iters=10, device="cpu")
    assert len(calls) == 13
    assert len(t.samples_ms) == 10
    assert 0.9 <= t.min_ms <= t.median_ms <= t.max_ms
    assert t.median_ms < 50  # sleep(1 ms) plus scheduler noise on a busy CI machine
    assert t.min_ms <= t.p10_ms <= t.median_ms <= t.p90_ms <= t.max_ms
    assert t.std_ms >= 0


def test_time_fn_calls_barrier_before_each_timed_iteration_only():
    log = []
    harness.time_fn(lambda: log.append("fn"), warmup=2, iters=3, device="cpu", barrier=lambda: log.append("b"))
    assert log == ["fn", "fn", "b", "fn", "b", "fn", "b", "fn"]


def test_time_fn_rejects_zero_iters():
    with pytest.raises(ValueError, match="iters"):
        harness.time_fn(lambda: None, iters=0, device="cpu")


def test_time_interleaved_takes_turns_and_warms_up_once():
    log = []
    timings = harness.time_interleaved({"a": lambda: log.append("a"), "b": lambda: log.append("b")},
                                       rounds=3, warmup=1, iters=6, device="cpu")
    assert "".join(log) == "aaabbbaabbaabb"  # one warm-up call each, then 2 timed calls a turn
    assert {name: len(t.samples_ms) for name, t in timings.items()} == {"a": 6, "b": 6}
    with pytest.raises(ValueError, match="rounds"):
        harness.time_interleaved({"a": lambda: None}, rounds=4, iters=3, device="cpu")


def test_timing_statistics_and_dict():
    t = harness.Timing([4.0, 1.0, 3.0, 2.0, 5.0])
    assert t.median_ms == 3.0
    assert t.min_ms == 1.0 and t.max_ms == 5.0
    assert t.mean_ms == 3.0
    assert t.std_ms == pytest.approx(2**0.5)
    assert t.percentile(0) == 1.0 and t.percentile(100) == 5.0
    assert t.percentile(25) == 2.0
    assert t.p10_ms == pytest.approx(1.4) and t.p90_ms == pytest.approx(4.6)
    d = t.to_dict()
    assert d["iters"] == 5 and d["median_ms"] == 3.0 and d["samples_ms"] == [4.0, 1.0, 3.0, 2.0, 5.0]
    json.dumps(d)
    with pytest.raises(ValueError):
        t.percentile(101)


# --- correctness ------------------------------------------------------------------


def test_check_close_passes_and_reports_errors():
    ref = torch.linspace(-1, 1, 1000)
    got = ref + 1e-6
    result = harness.check_close("axpy", got, ref)
    assert result["ok"] is True
    assert result["name"] == "axpy"
    assert result["max_abs_err"] == pytest.approx(1e-6, rel=0.1)
    assert 0 < result["rel_l2_err"] < 1e-5
    assert result["mismatched"] == 0
    json.dumps(result)


def test_check_close_raises_with_useful_message():
    ref = torch.zeros(4, 8)
    got = ref.clone()
    got[2, 5] = 0.5
    with pytest.raises(AssertionError) as info:
        harness.check_close("allreduce", got, ref)
    msg = str(info.value)
    assert msg.startswith("allreduce:")
    assert "1/32" in msg and "(4, 8)" in msg and "float32" in msg
    assert "max_abs_err=0.5" in msg
    assert "(2, 5)" in msg and "got 0.5" in msg and "expected 0" in msg


def test_check_close_dtype_aware_defaults():
    ref = torch.randn(256, generator=torch.Generator().manual_seed(0))
    bf16 = ref.to(torch.bfloat16)
    assert harness.check_close("bf16", bf16, ref)["ok"]  # bf16 rounding is within its default tolerance
    with pytest.raises(AssertionError):
        harness.check_close("fp32", ref + 1e-2, ref)  # ... but far outside float32's
    assert harness.check_close("loose", ref + 1e-2, ref, atol=2e-2)["ok"]
    with pytest.raises(AssertionError):
        harness.check_close("ints", torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]))


def test_check_close_rejects_nan_and_shape_mismatch():
    ref = torch.ones(3)
    with pytest.raises(AssertionError, match="nan"):
        harness.check_close("nan", torch.tensor([1.0, float("nan"), 1.0]), ref)
    with pytest.raises(AssertionError, match=r"shape \(3,\) != reference shape \(4,\)"):
        harness.check_close("shape", ref, torch.ones(4))


# --- sizes and units --------------------------------------------------------------


def test_size_sweep_and_fmt_bytes():
    assert harness.size_sweep(4096, 65536) == [4096, 8192, 16384, 32768, 65536]
    assert harness.size_sweep(1, 100, factor=4) == [1, 4, 16, 64]
    with pytest.raises(ValueError):
        harness.size_sweep(0, 10)
    assert harness.fmt_bytes(4096) == "4 KiB"
    assert harness.fmt_bytes(256 << 20) == "256 MiB"
    assert harness.fmt_bytes(3 << 30) == "3 GiB"
    assert harness.fmt_bytes(1536) == "1.5 KiB"
    assert harness.fmt_bytes(512) == "512 B"


def test_bandwidth_gbps():
    assert harness.bandwidth_gbps(2e9, 1000.0) == pytest.approx(2.0)
    assert harness.bandwidth_gbps(1 << 30, 1.0) == pytest.approx(1073.741824)
    with pytest.raises(ValueError):
        harness.bandwidth_gbps(1, 0.0)


def test_progress_prints_one_line_per_step_to_stderr(capsys):
    items = list(harness.progress([4096, 8192, 16384], "sweep", fmt=harness.fmt_bytes))
    assert items == [4096, 8192, 16384]
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("sweep [1/3] 4 KiB")
    assert lines[2].startswith("sweep [3/3] 16 KiB")
    list(harness.progress(iter("ab"), "gen"))
    assert capsys.readouterr().err.splitlines()[1].startswith("gen [2/?] b")


def test_is_rank0_follows_the_launcher_environment(monkeypatch):
    assert harness.is_rank0()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert not harness.is_rank0()


# --- reports ----------------------------------------------------------------------


def _report() -> harness.Report:
    report = harness.Report("demo", columns=["size", "bytes", "median_ms", "busbw_gbps"])
    report.add({"size": "4 KiB", "bytes": 4096, "median_ms": 0.012345, "busbw_gbps": 0.331})
    report.add({"size": "1 MiB", "bytes": 1 << 20, "median_ms": 0.5, "busbw_gbps": 2.0971})
    report.add(
        {
            "size": "256 MiB",
            "bytes": 256 << 20,
            "median_ms": 12.5,
            "check": {"ok": True, "max_abs_err": 0.0},
        }
    )
    return report


def test_print_table_aligns_columns_and_marks_missing_values(capsys):
    _report().print_table()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "demo"
    assert lines[1].split() == ["size", "bytes", "median_ms", "busbw_gbps"]
    assert set(lines[2].replace(" ", "")) == {"-"}
    body = lines[3:]
    assert len(body) == 3
    assert body[0].split() == ["4", "KiB", "4096", "0.01235", "0.331"]
    assert body[1].split() == ["1", "MiB", "1048576", "0.5", "2.097"]
    assert body[2].split() == ["256", "MiB", "268435456", "12.500", "-"]
    assert "check" not in "\n".join(lines)
    # Numbers are right-aligned under their headers, so every row ends at the same column.
    assert len({len(line) for line in lines[1:]}) == 1


def test_save_writes_json_with_metadata_and_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("TILESCALE_TEST_KNOB", "1")
    monkeypatch.setenv("UNRELATED_VAR", "x")
    monkeypatch.setattr(sys, "argv", ["benchmarks/demo.py", "--max-size", "1 GiB"])
    path = _report().save(tmp_path / "out" / "demo.json")
    assert path == tmp_path / "out" / "demo.json"
    data = json.loads(path.read_text())
    for key in ("name", "date", "command", "device", "versions", "distributed", "env", "rows"):
        assert key in data, key
    assert data["name"] == "demo"
    assert data["date"].endswith("+00:00")
    assert data["command"]["argv"] == "benchmarks/demo.py --max-size '1 GiB'"
    assert data["command"]["launcher"] == "none"
    assert data["device"]["gpu_count"] == torch.cuda.device_count()
    assert data["device"]["cpu_cores"] >= 1 and data["device"]["cpu"]
    assert data["versions"]["torch"] == torch.__version__
    assert data["versions"]["python"].count(".") == 2
    assert data["versions"]["tilelang"] and data["versions"]["tilescale"]
    assert data["distributed"] is None
    assert data["gpus_shared"] is False
    assert data["env"]["NCCL_DEBUG"] == "INFO" and data["env"]["TILESCALE_TEST_KNOB"] == "1"
    assert "UNRELATED_VAR" not in data["env"]
    assert len(data["rows"]) == 3
    assert data["rows"][2]["check"] == {"ok": True, "max_abs_err": 0.0}


def test_default_path_is_under_benchmarks_results():
    report = harness.Report("allreduce", columns=["size"])
    path = report.default_path()
    assert path.parent == BENCHMARKS / "results"
    slug = harness.device_slug(harness.device_info())
    assert re.fullmatch(rf"allreduce-{re.escape(slug)}-\d{{8}}-\d{{6}}\.json", path.name)


def test_device_slug():
    assert harness.device_slug({"gpus": [], "gpu_count": 0}) == "cpu"
    assert harness.device_slug({"gpus": ["NVIDIA H200"], "gpu_count": 1}) == "nvidia-h200"
    assert harness.device_slug({"gpus": ["NVIDIA H100 80GB HBM3"] * 8, "gpu_count": 8}) == "nvidia-h100-80gb-hbm3-x8"


def test_plot_writes_png_beside_the_json(tmp_path):
    report = _report()
    json_path = report.save(tmp_path / "demo-cpu-20250101-000000.json")
    png = report.plot("bytes", ["median_ms", "busbw_gbps"], xlabel="bytes", ylabel="value", logy=True)
    assert png == json_path.with_suffix(".png")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    explicit = report.plot("bytes", ["median_ms"], tmp_path / "other.png", logx=False, title="t")
    assert explicit == tmp_path / "other.png" and explicit.read_bytes().startswith(PNG_MAGIC)


# --- torch.distributed ------------------------------------------------------------


def test_save_records_distributed_world(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        path = harness.Report("dist", columns=["x"]).save(tmp_path / "dist.json")
        data = json.loads(path.read_text())
    finally:
        dist.destroy_process_group()
    assert data["distributed"] == {"world_size": 1, "rank": 0, "backend": "gloo"}


def _two_rank_worker(rank: int, tmp: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    try:
        t = harness.time_fn(lambda: None, warmup=1, iters=4, device="cpu", barrier=dist.barrier)
        report = harness.Report("two", columns=["median_ms"])
        report.add({"median_ms": t.median_ms, "rank": rank})
        saved = report.save(Path(tmp) / "two.json")
        Path(tmp, f"rank{rank}.json").write_text(
            json.dumps({"iters": len(t.samples_ms), "saved": saved and str(saved)})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_only_rank0_saves_under_torch_distributed(tmp_path):
    mp.spawn(_two_rank_worker, args=(str(tmp_path),), nprocs=2)
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    rank1 = json.loads((tmp_path / "rank1.json").read_text())
    assert rank0 == {"iters": 4, "saved": str(tmp_path / "two.json")}
    assert rank1 == {"iters": 4, "saved": None}
    data = json.loads((tmp_path / "two.json").read_text())
    assert data["distributed"]["world_size"] == 2
    assert [row["rank"] for row in data["rows"]] == [0]


def test_measure_shapes_saves_after_every_shape_and_checks_only_when_untimed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path)
    seen = []

    def measure(shape):
        seen.append(shape)
        if shape == 3:
            raise AssertionError("shape 3: mismatch")
        return {"shape": shape, "us": shape * 1.5}

    report = harness.Report("shapes", columns=["shape", "us"])
    with pytest.raises(AssertionError, match="shape 3"):
        harness.measure_shapes(report, [1, 2, 3, 4], measure)
    assert seen == [1, 2, 3]  # a failed check stops the run, and what came before is saved
    assert [row["shape"] for row in json.loads(report.path.read_text())["rows"]] == [1, 2]

    checks = harness.Report("checks", columns=["shape", "us"])
    harness.measure_shapes(checks, [1, 2], measure, timed=False)
    assert checks.rows == [] and checks.path is None and list(tmp_path.iterdir()) == [report.path]
    assert "shape" in capsys.readouterr().out  # the table (its header) is printed either way


def test_named_sizes_takes_any_size_of_a_known_name_and_refuses_the_rest():
    assert harness.named_sizes("normal=2048x4096x6x64,low-latency=64x8x2x4", ("normal", "low-latency"), 4) == [
        ("normal", (2048, 4096, 6, 64)), ("low-latency", (64, 8, 2, 4))]
    assert harness.named_sizes("", ("ag",), 3, sep=":") == []
    for bad in ("rs:1x2x3", "ag:1x2", "ag:0x2x3", "ag:1xbx3"):
        with pytest.raises(SystemExit, match="is not name:NxNxN"):
            harness.named_sizes(bad, ("ag",), 3, sep=":")
