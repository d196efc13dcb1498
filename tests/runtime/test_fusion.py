"""Fused dispatch: the same numbers as one task per op, each op still traced and verified,
across checkpoint cuts (outputs carried over a cut come out of a fused task)."""

from __future__ import annotations

import json

import attrs
import pytest

from rpeg.runtime import RunOptions, verify_run
from rpeg.runtime.core.cuts import carried, closure
from rpeg.runtime.core.flight import Flight, Task
from rpeg.runtime.core.fusion import consumers_of, fuse
from rpeg.runtime.dask.runner import Resilience, run_resilient
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan

TIMING = ("step_time_s", "tokens_per_s", "client_cpu_s")


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in TIMING and "time" not in k} == \
        {k: v for k, v in b.items() if k not in TIMING and "time" not in k}


def test_groups_keep_cross_device_outputs_apart(ppo):
    calls = build_calls(ppo, split_plan(ppo, 2, staleness=1), 2)
    cons = consumers_of(calls)
    groups = fuse(calls, cons, lambda d: False)
    assert sorted(i for g in groups for i in g.ids) == sorted(c.id for c in calls)
    assert len(groups) < len(calls)
    for g in groups:
        assert len({c.device for c in g.calls}) == 1 and len({c.step for c in g.calls}) == 1
        for c in g.calls[:-1]:                       # only the last may feed another device
            assert all(r.device == g.device for r in cons.get(c.id, ()))
    seen: set[str] = set()
    for g in groups:                                 # groups only wait on earlier groups
        assert set(g.external) <= seen
        seen |= set(g.ids)
    assert len(fuse(calls, cons, lambda d: False, enabled=False)) == len(calls)


def test_a_collective_rank_starts_a_task_of_its_own(ppo):
    """On one device every op of a step fuses into one task; made a rank of a tensor-parallel
    block, the train op starts a new task (ops after it may still join that task)."""
    calls = build_calls(ppo, split_plan(ppo, 1, staleness=0), 1)
    cons = consumers_of(calls)
    assert len(fuse(calls, cons, lambda d: False)) == 1
    split = [attrs.evolve(c, tp_group=(0, 1)) if c.id == "actor_step/s0" else c for c in calls]
    groups = fuse(split, cons, lambda d: False)
    first = [g.calls[0].id for g in groups]
    assert len(groups) == 2 and first[1] == "actor_step/s0", first


@pytest.mark.parametrize("devices,k", [pytest.param(1, 0, marks=pytest.mark.slow), (2, 1)])
def test_fused_run_matches_unfused(ppo, tmp_path, devices, k, local_cluster):
    plan = split_plan(ppo, devices, staleness=k)
    with local_cluster(devices) as address:
        opts = RunOptions(steps=3, scheduler=address, root=str(tmp_path),
                          progress=False)
        every = Resilience(checkpoint_every=2)                 # a cut inside the run
        fused = run_resilient(ppo, plan, opts, spec_path=ppo.path, resilience=every)
        plain = run_resilient(ppo, plan, attrs.evolve(opts, fuse=False), spec_path=ppo.path,
                              resilience=every)
    for r in (fused, plain):
        report = verify_run(r.path)
        assert report.ok, str(report)
    meta = [json.loads((r.path / "run.json").read_text()) for r in (fused, plain)]
    tasks = [m["tasks"] for m in meta]
    assert tasks[1] == len(build_calls(ppo, plan, 3)) and tasks[0] < tasks[1]
    # where the CPU went is recorded per step: fewer tasks with fusion, every figure >= 0
    host = [m["host"] for m in meta]
    assert host[0]["tasks_per_step"] < host[1]["tasks_per_step"], host
    for h in host:
        assert h["steps"] >= 1 and h["op_cpu_per_step_s"] > 0, h
        assert h["client_cpu_per_step_s"] >= 0 and h["worker_cpu_per_step_s"] >= 0, h
    assert all(_same(a, b) for a, b in zip(fused.metrics, plain.metrics, strict=True)), \
        (fused.metrics, plain.metrics)


def test_outputs_carried_over_a_cut_are_kept_by_their_task(ppo):
    """An op whose output a later segment reads is in its task's ``keep``."""
    calls = build_calls(ppo, split_plan(ppo, 2, staleness=1), 4)
    table = {c.id: c for c in calls}
    inside = closure(table, 2)
    carry = carried(table, inside)
    assert carry
    groups = fuse([c for c in calls if c.id in inside], consumers_of(calls), lambda d: False)
    kept = set().union(*(g.keep for g in groups))
    assert carry <= kept


def test_flight_readiness_and_stuck_devices():
    fl = Flight()
    fl.add("a", Task(("x", "y"), 0, 0, 2.0, ()), now=0.0)
    fl.add("b", Task(("z",), 1, 0, 1.0, ("y",)), now=0.0)
    assert fl.stuck({0: 0.0, 1: 0.0}, now=1.5) is None        # b waits; a is within its limit
    assert fl.stuck({0: 0.0, 1: 0.0}, now=2.5)[0].ids == ("x", "y")
    fl.finish("a", now=3.0)
    assert fl.ready_at == {"b": 3.0} and fl.submitted() == {"x", "y", "z"}
    assert fl.stuck({0: 3.0, 1: 0.0}, now=3.5) is None
    assert fl.stuck({0: 3.0, 1: 0.0}, now=4.5)[0].ids == ("z",)
    assert fl.running_on(1) == ("z", 0) and fl.running_on(0) == ("(none)", -1)
    fl.finish("b", now=5.0, ok=False)                          # failed: its ops are not done
    assert "z" not in fl.done and not len(fl)


def test_a_join_starts_a_task_of_its_own_as_the_model_counts():
    """A large gang's join is a task of its own, open to no call: placed as an ordinary
    call it would join the task of the call on its device it reads (read by the join
    alone), and the gang's every rank would wait for that task's calls; the cost model
    counts the join as a task of its own (``Packer.join``, both sides)."""
    from rpeg.cost.control import JOIN_MIN
    from rpeg.graph import DataEdge, Graph, Op
    from rpeg.plan.oplayout import OpLayout
    from rpeg.plan.tasks import dispatch_per_step
    from rpeg.runtime.lowering.calls import OpCall
    from rpeg.runtime.lowering.joins import join_gang
    from rpeg.spec.model import OpKind

    n = JOIN_MIN
    gen = OpCall("gen/s0/c0", "gen", OpKind.FORWARD, 0, 0)
    ranks = [OpCall(f"train/s0/r{r}", "train", OpKind.TRAIN, 0, r, rank=r, world=n,
                    deps=(gen.id,)) for r in range(n)]
    join, ranks = join_gang(ranks)
    calls = [gen, join, *ranks]
    groups = fuse(calls, consumers_of(calls), lambda d: False)
    assert [g.ids for g in groups[:2]] == [(gen.id,), (join.id,)]
    assert len(groups) == n + 2
    g = Graph("toy", (Op("gen", OpKind.FORWARD, outputs=("x",)),
                      Op("train", OpKind.TRAIN, inputs=("x",))),
              (DataEdge("gen", "train", "x"),), (), (), ())
    d = dispatch_per_step(g, {"gen": OpLayout((0,)), "train": OpLayout(
        tuple(range(n)), everywhere=True, collective=True)})
    assert (d.calls, d.tasks) == (len(calls), len(groups))
