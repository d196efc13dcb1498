"""Joins (``rpeg.runtime.lowering.joins``): a large gang waits through one call, with the same
orderings, the same data and the same results as when every rank waits for everything.
Here gangs of 2 are joined (the runtime's ``join_of`` lowered), so the tiny pipelines
have joins."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from rpeg.runtime import RunOptions, run_pipeline, verify_run
from rpeg.runtime.dask import worker as W
from rpeg.runtime.lowering import joins
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan

HERE = Path(__file__).resolve().parent


@pytest.fixture
def joined(monkeypatch):
    monkeypatch.setattr(joins, "join_of", lambda ds: ds[0] if len(ds) >= 2 else None)


def _instance_graph_test():
    spec = importlib.util.spec_from_file_location("instance_graph", HERE / "test_instance_graph.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("shape", ["chunked x4, dp 2", "tensor parallel", "shared backbone"])
def test_the_runtime_with_joins_executes_the_placed_graph(shape, ppo, joined):
    mod = _instance_graph_test()
    plan = mod.PLANS[shape](ppo)
    assert any(c.role == joins.JOIN for c in build_calls(ppo, plan, 3))
    mod.assert_realises_placed(ppo, plan)


def test_a_gang_waits_through_its_join_alone(ppo, joined):
    calls = build_calls(ppo, split_plan(ppo, 2, staleness=0, dp=2), 3)
    table = {c.id: c for c in calls}
    for j in (c for c in calls if c.role == joins.JOIN):
        ranks = [c for c in calls if j.id in c.after]
        assert len(ranks) == 2 and all(r.after == (j.id,) for r in ranks)
        if j.deps:                       # the data every rank reads, taken from the join
            assert all(r.deps == (j.id,) for r in ranks)
            assert {r.inputs for r in ranks} == {ranks[0].inputs}
            assert sum(n for _, n in ranks[0].inputs) == len(j.deps)
        assert j.device == ranks[0].device and all(d in table for d in j.all_deps)


class _Recorder:
    """An executor that records the inputs each call got."""

    def __init__(self):
        self.seen = {}

    def run(self, call, inputs):
        self.seen[call.id] = inputs
        return {"y": call.id}, {}


def test_a_rank_gets_from_a_join_the_arguments_it_would_have_had(monkeypatch):
    from rpeg.runtime.lowering.instances import OpCall
    from rpeg.spec.model import OpKind
    rec = _Recorder()
    monkeypatch.setitem(W._STATE, "executor", rec)
    monkeypatch.setitem(W._STATE, "device", 0)
    monkeypatch.setitem(W._STATE, "address", "here")
    join = OpCall("t/s0/r0/join", "t", OpKind.TRAIN, 0, 0, role=joins.JOIN,
                  deps=("a/c0", "a/c1"))
    rank = OpCall("t/s0/r1", "t", OpKind.TRAIN, 0, 1, rank=1, world=2,
                  inputs=(("y", 2),), deps=(join.id,), after=(join.id,))
    a0, a1 = {"a/c0": {"y": 1}}, {"a/c1": {"y": 2}}
    out = W.run_group((join,), frozenset({join.id}), (((0, "a/c0"), (1, "a/c1")),), a0, a1)
    assert isinstance(out[join.id], joins.Joined) and join.id not in rec.seen
    W.run_group((rank,), frozenset({rank.id}), (((0, join.id),),), out)
    assert rec.seen[rank.id] == {"y": [1, 2]}
    W.drain()


@pytest.mark.slow
def test_data_parallel_training_through_joins_learns_the_same(ppo, tmp_path, local_cluster,
                                                              monkeypatch):
    """The same run with and without joins: the same metrics, and both verify."""
    plan = split_plan(ppo, 2, staleness=0, dp=2)
    rows = {}
    with local_cluster(2) as address:
        for name, at in (("plain", 10 ** 9), ("joined", 2)):
            monkeypatch.setattr(joins, "join_of",
                                lambda ds, at=at: ds[0] if len(ds) >= at else None)
            result = run_pipeline(ppo, plan, RunOptions(steps=2, scheduler=address,
                                                        root=str(tmp_path / name),
                                                        progress=False), spec_path=ppo.path)
            assert verify_run(result.path).ok
            rows[name] = result.metrics
    for a, b in zip(rows["plain"], rows["joined"], strict=True):
        for key in ("reward", "policy_loss", "value_loss"):
            assert math.isclose(a[key], b[key], rel_tol=1e-9, abs_tol=1e-12), (key, a, b)
