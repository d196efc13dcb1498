"""The shipped DAPO and GSPO pipelines check and compile for a GPU cluster; what their
algorithms add to a step is priced (dynamic sampling's extra rounds, TIS's extra forward)."""

from __future__ import annotations

import attrs
import pytest

from rpeg.cost.stages import estimate_stage, generation_chunks, refill_batches
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.plan import SearchOptions, compile_plan
from rpeg.plan.evaluate import Evaluator
from rpeg.plan.space import Limits
from rpeg.spec import load, load_cluster
from rpeg.spec.values import Fn

from .conftest import ROOT


@pytest.fixture(scope="module")
def h100():
    return load_cluster(ROOT / "pipelines" / "clusters" / "h100_64.rpeg")


@pytest.mark.parametrize("name", ["dapo_qwen7b", "gspo_qwen7b"])
def test_compiles_to_a_plan_that_fits(name, h100):
    p = load(ROOT / "pipelines" / f"{name}.rpeg")
    plan = compile_plan(p, h100, options=SearchOptions(seed=0, iterations=150, patience=100,
                                                       limits=Limits.runtime()))
    assert plan.predicted.step_time_s > 0
    assert max(plan.predicted.peak_memory) <= h100.gpu.memory
    assert plan.inconsistency() is None
    # dynamic sampling (DAPO's refill) generates whole groups each step: never carried over
    if int(p.stage("rollout").arg("refill_rounds")):
        assert all(pl.carry == 0 for pl in plan.placements)


def test_dynamic_sampling_is_priced_from_the_filter_rate(h100):
    p = load(ROOT / "pipelines" / "dapo_qwen7b.rpeg")
    # 2048 responses, rate 0.4: rounds regenerate 820, 328 and 132 of them
    assert refill_batches(work_of(p, "rollout"), p.workload.batch) == (820, 328, 132)
    par, devices = Layout(dp=8), tuple(range(8))
    with_refill = estimate_stage(work_of(p, "rollout"), par, devices, h100).time_s
    plain = attrs.evolve(p, stages=tuple(
        attrs.evolve(s, params=tuple(kv for kv in s.params if kv[0] not in
                                     ("refill_rounds", "filter_rate")))
        if s.name == "rollout" else s for s in p.stages))
    without = estimate_stage(work_of(plain, "rollout"), par, devices, h100).time_s
    assert with_refill > without
    # a higher declared rate, more generation
    busier = attrs.evolve(p, stages=tuple(
        attrs.evolve(s, params=tuple((k, 0.8 if k == "filter_rate" else v) for k, v in s.params))
        if s.name == "rollout" else s for s in p.stages))
    assert estimate_stage(work_of(busier, "rollout"), par, devices, h100).time_s > with_refill
    # the step's responses are known after the last round: every chunk ends there
    ends = [t for t, _ in generation_chunks(work_of(p, "rollout"), par, devices, h100, 4)]
    assert ends == pytest.approx([with_refill] * 4)


def test_truncated_importance_sampling_prices_the_extra_forward(h100):
    """tis corrects every batch, stale or not: the trainer's extra forward is priced even
    for a synchronous plan."""
    p = load(ROOT / "pipelines" / "gspo_qwen7b.rpeg")
    plan = compile_plan(p, h100, options=SearchOptions(seed=0, iterations=60, patience=40,
                                                       limits=Limits.runtime()))
    sync = attrs.evolve(plan, staleness=(), predicted=None,
                        placements=tuple(attrs.evolve(x, carry=0) for x in plan.placements))
    without = attrs.evolve(p, stages=tuple(
        attrs.evolve(s, params=(("loss", Fn("gspo")),) + tuple(
            kv for kv in s.params if kv[0] != "loss")) if s.name == "actor_step" else s
        for s in p.stages))
    a = Evaluator(p, h100).evaluate(sync).plan.predicted
    b = Evaluator(without, h100).evaluate(sync).plan.predicted
    assert dict(a.op_times)["actor_step"] > dict(b.op_times)["actor_step"]
