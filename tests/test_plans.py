"""Call plans (tilescale.plans): reused by a shape's later calls, rebuilt when anything they
depend on changes, and never a way around the checks that ranks agree."""

import weakref
from pathlib import Path

import pytest
import torch
from cpu_jobs import run_cpu

from tilescale import plans
from tilescale.plans import PlanCache, ReusedOutputs

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


def _outputs() -> ReusedOutputs:
    return ReusedOutputs(lambda: torch.empty(100, dtype=torch.float32).split([10, 90]))


def _ids(tensors: list[torch.Tensor]) -> list[int]:
    return [id(t) for t in tensors]  # the kept sets stay alive: equal ids are the same tensors


def test_reused_outputs_come_back_once_nothing_holds_them():
    out = _outputs()
    first = out.take()
    first_ids = _ids(first)
    second = out.take()  # the first is held: a new set
    second_ids = _ids(second)
    assert not set(first_ids) & set(second_ids)
    del first
    assert _ids(out.take()) == first_ids  # a loop's pattern: the one before last comes back
    del second
    assert _ids(out.take()) in (first_ids, second_ids)


def _hold(kind: str, tensors: list[torch.Tensor]) -> object:
    """Something that holds ``tensors`` (or their storage) in the way ``kind`` names."""
    if kind == "tensor":
        return tensors[1]
    if kind == "slice":
        return tensors[1][3:5]
    if kind == "list":
        return tensors
    if kind == "dlpack":
        return torch.utils.dlpack.to_dlpack(tensors[0])
    if kind == "autograd":  # saves tensors[0] for the backward
        return (torch.ones(10, requires_grad=True) * tensors[0]).sum()
    return tensors[0].numpy()


def test_reused_outputs_keep_no_large_sets():
    n = ReusedOutputs.KEEP_BYTES // 4
    large = ReusedOutputs(lambda: torch.empty(n + 2, dtype=torch.int32).split([n, 2]))
    small = ReusedOutputs(lambda: torch.empty(n, dtype=torch.int32).split([n - 2, 2]))
    refs = [weakref.ref(out.take()[0]) for out in (large, small)]
    assert refs[0]() is None and refs[1]() is not None  # dropped: only the small set is kept
    # An owner that bounds the memory itself (a MoE buffer's one set of dispatch outputs) keeps any size.
    bounded = ReusedOutputs(lambda: torch.empty(n + 2, dtype=torch.int32).split([n, 2]), keep_bytes=None)
    ids = [id(t) for t in bounded.take()]
    assert [id(t) for t in bounded.take()] == ids


@pytest.mark.parametrize("hold", ["tensor", "slice", "list", "dlpack", "autograd", "numpy"])
def test_reused_outputs_stay_new_while_anything_holds_them(hold):
    out = _outputs()
    first = out.take()
    first_ids = _ids(first)
    holder = _hold(hold, first)
    del first
    for _ in range(3):
        taken = out.take()
        assert not set(_ids(taken)) & set(first_ids), hold
        taken_ids = _ids(taken)
        del taken
        assert _ids(out.take()) == taken_ids  # a set nothing holds does come back
    del holder
    # Let go, the first set is free again: with the set returned last held, a call gets it.
    again = out.take()
    assert not set(_ids(again)) & set(first_ids)  # the set returned last comes first
    assert _ids(out.take()) == first_ids


def test_reused_outputs_give_back_a_dropped_set_while_another_is_kept():
    # A caller that keeps one call's outputs (a handle for the backward pass) and drops the rest
    # gets the set it dropped back, without checking the kept one first.
    out = _outputs()
    kept = out.take()
    dropped_ids = _ids(out.take())
    for _ in range(3):
        assert _ids(out.take()) == dropped_ids
    assert kept


@pytest.mark.timeout(300)
def test_eager_calls_reuse_their_plans_and_rebuild_them_when_they_change():
    proc = run_cpu(str(RANKS / "plans_check.py"), 2)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("PLANS-OK") == 2, proc.stdout[-3000:]
