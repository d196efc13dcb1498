"""The graph the cost model prices is the graph the runtime executes: for the shipped tiny
pipelines under plans of every shape (synchronous, stale, carried, fused, chunked, tensor
parallel, split, data parallel, shared backbone), the runtime's op calls projected onto
instances (op, step, chunk) are the simulator's instances, their data dependencies its data
edges, and every ordering either side keeps is one the other keeps too."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rpeg.graph import DepKind
from rpeg.plan.compile import compile_plan
from rpeg.plan.evaluate import Evaluator, settle_batching, streams_of
from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.plan.simulate import priced_graph
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.lowering.projection import closure, project
from rpeg.runtime.placement import split_plan
from rpeg.spec import load_cluster

STEPS = 5
LOCAL = Path(__file__).resolve().parents[2] / "pipelines" / "clusters" / "local_cpu.rpeg"


def _carry(plan: Plan, n: int) -> Plan:
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, carry=n) if p.stage == "rollout" else p for p in plan.placements))


def _tp(pipeline, staleness: int = 0) -> Plan:
    """Actor, critic and reference split over devices 0-1 (tp 2); the rest on device 0."""
    places = []
    for s in pipeline.stages:
        if s.target in ("actor", "critic", "ref") and s.kind.value != "compute":
            places.append(StagePlacement(s.name, (0, 1), dp=1, tp=2,
                                         chunks=2 if s.kind.value == "generate" else 1))
        else:
            places.append(StagePlacement(s.name, (0,)))
    return Plan(pipeline.name, "test", 2, tuple(places),
                model_homes=(("actor", (0, 1)), ("critic", (0, 1))),
                staleness=tuple((st, min(k, staleness)) for st, k in pipeline.staleness),
                strategy=Strategy.MANUAL)


PLANS = {
    "sync, split": lambda p: split_plan(p, 2, staleness=0),
    "stale, split": lambda p: split_plan(p, 2, staleness=1),
    "stale, one device": lambda p: split_plan(p, 1),
    "carried, split": lambda p: _carry(split_plan(p, 2, staleness=0), 1),
    "carried, one device": lambda p: _carry(split_plan(p, 1, staleness=0), 1),
    "chunked x4, dp 2": lambda p: split_plan(p, 2, dp=2, chunks=4, staleness=0),
    "fused": lambda p: attrs.evolve(split_plan(p, 1, staleness=0),
                                    fusion=(("ref_lp", "scores"),)),
    "shared backbone": lambda p: split_plan(p, 2, share=True, staleness=1)
    if p.shares else split_plan(p, 2),
    "tensor parallel": lambda p: _tp(p, staleness=1),
    "the planner's": lambda p: compile_plan(p, load_cluster(LOCAL)),
}


@pytest.mark.parametrize("shape", sorted(PLANS))
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_runtime_executes_the_graph_the_simulator_priced(shape, name, ppo, grpo):
    pipeline = {"ppo": ppo, "grpo": grpo}[name]
    if shape == "tensor parallel" and name == "grpo":
        pytest.skip("tiny_grpo has no critic to split beside the actor")
    plan = PLANS[shape](pipeline)
    cluster = load_cluster(LOCAL)
    ev = Evaluator(pipeline, cluster)
    settled = settle_batching(pipeline, plan, cluster)
    graph = ev.graph(settled)
    timings, _ = ev.timings(settled, graph)
    priced = priced_graph(graph, timings, STEPS, streams=streams_of(settled, graph), horizon=STEPS)
    ran = project(build_calls(pipeline, plan, STEPS), graph)

    assert ran.instances == set(priced.instances)
    assert ran.data == {(d.src, d.dst) for d in priced.of_kind(DepKind.DATA)}
    # every version and ordering edge priced is kept by the runtime's waits ...
    kept = {(d.src, d.dst) for d in priced.deps}
    missed = sorted(f"{a} -> {b}" for a, b in kept if a not in ran.waits.get(b, ()))
    assert not missed, missed
    # ... and the runtime keeps no order the graph does not imply, but for the one order of
    # collectives on common devices
    implied = closure(kept)
    extra = sorted(f"{a} -> {b}" for a, b in ran.order if a not in implied.get(b, ()))
    assert not extra, extra

