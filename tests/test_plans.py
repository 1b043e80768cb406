"""Call plans (tilescale.plans): reused by a shape's later calls, rebuilt when anything they
depend on changes, and never a way around the checks that ranks agree."""

from pathlib import Path

import pytest
from cpu_jobs import run_cpu

from tilescale import plans
from tilescale.plans import PlanCache

RANKS = Path(__file__).parent / "ranks"


def test_plan_cache_drops_its_plans_at_invalidate_and_keeps_at_most_its_limit():
    cache = PlanCache(limit=2)
    assert cache.get("a") is None
    assert cache.put("a", 1) == 1 and cache.get("a") == 1
    cache.put("b", 2)
    cache.put("c", 3)  # over the limit: the oldest goes
    assert cache.get("a") is None and cache.get("b") == 2 and cache.get("c") == 3 and len(cache) == 2
    plans.invalidate()
    assert len(cache) == 0 and cache.get("b") is None
    cache.put("b", 4)
    assert cache.get("b") == 4


@pytest.mark.timeout(300)
def test_eager_calls_reuse_their_plans_and_rebuild_them_when_they_change():
    proc = run_cpu(str(RANKS / "plans_check.py"), 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("PLANS-OK") == 2, proc.stdout[-3000:]
