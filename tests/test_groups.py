"""Process groups on the CPU path, in real multi-process jobs (rank programs in tests/ranks/).

``groups_ops.py``: TP / DP / EP groups used at once (4 ranks; and 2 ranks with groups of one
and of both), every op on each against gloo, release and re-init. ``groups_errors.py``: each
misuse is a clear error on the ranks concerned within seconds, and the job goes on.
``examples/dp_tp_ep_training.py``: DP x TP x EP training steps against a one-process reference.
"""

from __future__ import annotations

import re

import pytest
from cpu_jobs import run_cpu

import tilescale as ts

RANKS = "tests/ranks"
# Every misuse must fail fast: far below the collective timeout (120 s) a hang would run into.
FAST_S = 10.0


def _explain(result) -> str:
    return f"exit {result.returncode}\n--- stdout\n{result.stdout[-6000:]}\n--- stderr\n{result.stderr[-6000:]}"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ranks", [2, 4])
def test_several_groups_at_once_match_gloo_and_reinit_starts_clean(ranks):
    result = run_cpu(f"{RANKS}/groups_ops.py", ranks)
    assert result.returncode == 0, _explain(result)
    for r in range(ranks):
        assert f"GROUPS-OK rank={r} world={ranks}" in result.stdout, _explain(result)
    assert len(set(re.findall(r"JOB ([0-9a-f]+)", result.stdout))) == 2, "the re-init must be a new job"


@pytest.mark.timeout(300)
def test_a_groups_failure_is_reported_against_that_group_and_reinit_starts_clean():
    result = run_cpu(f"{RANKS}/group_status.py", 4)
    assert result.returncode == 0, _explain(result)
    for r in range(4):
        assert f"GROUP-STATUS-OK rank={r}" in result.stdout, _explain(result)


@pytest.fixture(scope="module")
def errors():
    result = run_cpu(f"{RANKS}/groups_errors.py", 4)
    assert result.returncode == 0, _explain(result)
    assert result.stdout.count("ERRORS-DONE") == 4, _explain(result)
    cases: dict[str, dict[int, tuple[str, float, str]]] = {}
    for rank, name, kind, seconds, message in re.findall(
            r"\[rank (\d)\] CASE (\S+) (\S+) ([\d.]+) ?(.*)", result.stdout):
        cases.setdefault(name, {})[int(rank)] = (kind, float(seconds), message)
    return cases


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name, kind, words", [
    ("not-a-member", "ValueError", "not a member"),
    ("not-a-member-alloc", "ValueError", "not a member"),
    ("creation-order", "ValueError", "same order on every rank"),
    ("group-identity", "ValueError", "different torch names"),
    ("tensor-of-another-group", "ValueError", "symmetric tensor of the group of ranks"),
    ("put-into-another-group", "ValueError", "symmetric tensor of the group of ranks"),
    ("peer-view-of-another-group", "ValueError", "symmetric tensor of the group of ranks"),
    ("kernel-mixing-groups", "ValueError", "mixes symmetric tensors of two groups"),
    ("kernel-built-for-another-size", "RuntimeError", "build it with group="),
    ("shapes-differ", "ValueError", "differs across ranks"),
])
def test_misuse_is_a_clear_error_on_every_rank_within_seconds(errors, name, kind, words):
    seen = errors.get(name, {})
    assert sorted(seen) == [0, 1, 2, 3], f"{name}: ranks that reported: {sorted(seen)}"
    for rank, (got, seconds, message) in seen.items():
        assert got == kind, f"rank {rank} {name}: {got} {message}"
        assert words in message, f"rank {rank} {name}: {message}"
        assert seconds < FAST_S, f"rank {rank} {name}: took {seconds} s"


@pytest.mark.timeout(400)
def test_dp_tp_ep_training_example_matches_its_single_process_reference():
    result = run_cpu("examples/dp_tp_ep_training.py", 4)
    assert result.returncode == 0, _explain(result)
    assert result.stdout.count("MATCHES-REFERENCE") == 4, _explain(result)


def test_jit_factory_keyword_group_is_reserved():
    with pytest.raises(TypeError, match="tilescale.jit's"):
        @ts.jit
        def factory(n: int, group: int):  # noqa: ARG001 - refused before any call
            raise AssertionError("never built")
