"""The cost model counts the op calls and Dask tasks a step dispatches as the runtime lays
them out and fuses them (``rpeg.plan.tasks`` against ``rpeg.runtime.lowering.instances`` and
``rpeg.runtime.core.fusion``), at GPU-cluster sizes: streamed chunks on their blocks, train
ranks on every device, joins for large gangs, weight syncs."""

from __future__ import annotations

import os

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.cost.profiles import builtin_cluster
from rpeg.plan.dispatchfloor import dispatch_floor
from rpeg.plan.evaluate import Evaluator
from rpeg.plan.tasks import layouts_of
from rpeg.resources import shipped
from rpeg.runtime.calibrate.simulated import scaled
from rpeg.runtime.core import fusion as F
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Engine, Zero

from .conftest import ROOT, colocated_start


def _runtime(pipeline, plan):
    """(calls, tasks, futures) of one steady step as the runtime fuses it, nothing in
    flight done."""
    calls = build_calls(pipeline, plan, 10)
    step = [c for c in calls if c.step == 6]
    groups = F.fuse(step, F.consumers_of(calls), lambda d: False, together=plan.fusion)
    where = {c.id: i for i, g in enumerate(groups) for c in g.calls}
    futures = sum(len({where.get(d, d) for c in g.calls for d in c.all_deps
                       if d not in set(g.ids)}) for g in groups)
    return len(step), len(groups), futures


def _tp(plan, stage, tp):
    return attrs.evolve(plan, placements=tuple(
        p.changed(tp=tp, dp=len(p.devices) // tp) if p.stage == stage else p
        for p in plan.placements))


def _moved(plan, stage, devices):
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, devices=tuple(devices)) if p.stage == stage else p
        for p in plan.placements))


def _plans():
    ppo = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    grpo = load(shipped("pipelines", "grpo_qwen7b.rpeg"))
    base = lambda p: scaled(split_plan(p, 2, chunks=2, dp=2, staleness=1), 32)  # noqa: E731
    return {"ppo split x32": (ppo, base(ppo)),
            "grpo split x32": (grpo, base(grpo)),
            "ppo, training at tp 4": (ppo, _tp(base(ppo), "actor_step", 4)),
            "ppo, advantages elsewhere": (ppo, _moved(base(ppo), "adv", range(32))),
            "ppo, advantages elsewhere, ref_lp and scores fused": (ppo, attrs.evolve(
                _moved(base(ppo), "adv", range(32)), fusion=(("ref_lp", "scores"),))),
            "grpo, 3 chunks a block": (grpo, attrs.evolve(base(grpo), placements=tuple(
                attrs.evolve(p, chunks=3 * len(p.devices)) if p.stage == "rollout" else p
                for p in base(grpo).placements)))}


PLANS = _plans()


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_model_counts_what_the_runtime_dispatches_at_scale(name):
    pipeline, plan = PLANS[name]
    ev = Evaluator(pipeline, builtin_cluster("gh200_64"))
    graph = ev.graph(plan)
    d = ev.dispatch(plan, graph, ev.timings(plan, graph)[0])
    calls, tasks, futures = _runtime(pipeline, plan)
    assert d.devices == plan.num_devices
    assert (d.calls, d.tasks) == (calls, tasks)
    # the futures of data, version and stream edges and of the collectives' order; the
    # runtime passes some more ordering ones
    assert 0.6 * futures <= d.args <= futures, (d.args, futures)


def test_stages_the_plan_fused_share_their_tasks():
    """Where another device reads the first of two fused stages, the second still joins
    its task: fewer tasks, as the model counts (the test above)."""
    pipeline, fused = PLANS["ppo, advantages elsewhere, ref_lp and scores fused"]
    _, plain = PLANS["ppo, advantages elsewhere"]
    assert _runtime(pipeline, fused)[1] < _runtime(pipeline, plain)[1]


@pytest.mark.parametrize("name", ("grpo_qwen7b", "ppo_llama8b"))
def test_the_model_counts_what_the_runtime_dispatches_colocated(name):
    """Every stage on all 16 devices, a generate op's chunk on each: the first chunk's
    readers on its device fuse with it, as the runtime's calls do (its chunks stream on
    their own blocks, not one after another across devices)."""
    pipeline = load(shipped("pipelines", f"{name}.rpeg"))
    plan = scaled(split_plan(pipeline, 1, chunks=1, staleness=0), 16)
    ev = Evaluator(pipeline, builtin_cluster("gh200_64"))
    graph = ev.graph(plan)
    d = ev.dispatch(plan, graph, ev.timings(plan, graph)[0])
    assert (d.calls, d.tasks) == _runtime(pipeline, plan)[:2]


@settings(deadline=None, max_examples=int(os.environ.get("RPEG_EXAMPLES", 10)))
@given(st.sampled_from(("ppo_llama8b", "grpo_qwen7b")), st.integers(2, 3),
       st.sampled_from((1, 2)), st.integers(1, 3), st.sampled_from((1, 3, 4, 8)),
       st.integers(0, 1), st.sampled_from((1, 2, 4)), st.booleans(), st.booleans(),
       st.sampled_from((None, 0, 3)))
def test_the_model_counts_what_the_runtime_dispatches_over_split_plans(
        name, devices, dp, chunks, factor, staleness, tp, elsewhere, fused, vllm):
    """Split plans at sizes from a few devices to gangs past ``JOIN_MIN`` ranks (whose
    joins both sides place by ``Packer.join``, and whose inputs are read on the join's
    device), training at some tensor-parallel degree, the advantages on every device or
    not, two forward stages fused or not, the rollout on vLLM engines or not (``vllm``:
    its trainers' ZeRO level; the weight syncs into the engines' own copies): the same
    calls and tasks a steady step."""
    pipeline = load(shipped("pipelines", f"{name}.rpeg"))
    plan = scaled(split_plan(pipeline, devices, chunks=chunks, dp=min(dp, devices),
                             staleness=staleness), factor)
    train = next(p for p in plan.placements if p.stage == "actor_step")
    if len(train.devices) % tp == 0:
        plan = _tp(plan, "actor_step", tp)
    if elsewhere:                                    # the advantages on every device
        plan = attrs.evolve(plan, placements=tuple(
            p.changed(devices=tuple(range(plan.num_devices)), dp=plan.num_devices)
            if p.stage == "adv" else p for p in plan.placements))
    if fused:
        plan = attrs.evolve(plan, fusion=(("ref_lp", "scores"),))
    if vllm is not None:
        plan = attrs.evolve(plan, placements=tuple(
            attrs.evolve(p, engine=Engine.VLLM) if p.stage == "rollout"
            else p.changed(zero=Zero(vllm)) if p.stage.endswith("_step") else p
            for p in plan.placements))
    ev = Evaluator(pipeline, builtin_cluster("gh200_64"))
    graph = ev.graph(plan)
    d = ev.dispatch(plan, graph, ev.timings(plan, graph)[0])
    assert (d.calls, d.tasks) == _runtime(pipeline, plan)[:2]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_dispatch_floor_is_no_more_than_the_count(name):
    """What a bounded proposal is priced from before its calls are packed: the same calls,
    no more tasks or futures, so no more control-plane time, than the packing counts."""
    pipeline, plan = PLANS[name]
    ev = Evaluator(pipeline, builtin_cluster("gh200_64"))
    loose = ev.graph(attrs.evolve(plan, fusion=()))
    timings = ev.timings(plan, ev.graph(plan))[0]
    layouts, chunks, _ = layouts_of(pipeline, plan, loose, timings)
    low = dispatch_floor(loose, layouts, chunks)
    d = ev.dispatch(plan, ev.graph(plan), timings)
    assert (low.devices, low.calls) == (d.devices, d.calls)
    assert 0 < low.tasks <= d.tasks and low.args <= d.args
    for step_s in (0.0, 10.0):
        assert ev.control.floor(plan, timings, 6, step_s) <= ev.control.charged(d, step_s)


@pytest.mark.parametrize("spec, cluster", [("grpo_qwen7b", "gh200_64"),
                                           ("tiny_ppo", "local_cpu")])
def test_a_bounded_step_is_no_more_than_the_simulated_one(spec, cluster):
    """The step a bounded evaluation says (the search's Metropolis draw reads it) is no
    more than the plan's simulated step: what the search rejects from it, the simulated
    step rejects too (on GPUs, and where the control plane shares the host's cores)."""
    pipeline = load(ROOT / f"pipelines/{spec}.rpeg")
    _, ev, start = colocated_start(pipeline, load_cluster(
        ROOT / f"pipelines/clusters/{cluster}.rpeg"))
    plan = attrs.evolve(start.best.plan, predicted=None)
    full = ev.evaluate(plan, detail=False)
    bounded = Evaluator(pipeline, ev.cluster).evaluate(plan, detail=False, bound=0.0)
    assert full.feasible and not full.bounded and bounded.bounded
    assert 0 < bounded.step_time_s <= full.step_time_s


@pytest.mark.parametrize("share", [0.5, 0.99, 0.999, 1.0, 1.01])
def test_a_bound_anywhere_says_the_step_or_a_step_no_more_than_it(share):
    """Whichever check stops an evaluation at the bound (the busiest device's work, or the
    simulated step, each with the least control plane), it says a step no more than the
    counted one and no less than the bound; asked again without a bound, the same step as a
    fresh evaluation (the simulated step it kept is the one simulated again)."""
    pipeline = load(ROOT / "pipelines/grpo_qwen7b.rpeg")
    _, ev, start = colocated_start(pipeline, builtin_cluster("gh200_64"))
    plan = attrs.evolve(start.best.plan, predicted=None)
    full = Evaluator(pipeline, ev.cluster).evaluate(plan, detail=False).step_time_s
    fresh = Evaluator(pipeline, ev.cluster)
    r = fresh.evaluate(plan, detail=False, bound=share * full)
    assert r.step_time_s <= full
    if r.bounded:
        assert r.step_time_s >= share * full
    else:
        assert r.step_time_s == full
    assert fresh.evaluate(plan, detail=False).step_time_s == full


@pytest.mark.parametrize("spec, cluster", [("tiny_ppo", "local_cpu"), ("tiny_grpo", "gh200_8"),
                                           ("grpo_qwen7b", "gh200_8")])
def test_the_floor_is_no_more_than_the_count_on_every_baseline(spec, cluster):
    """Each baseline plan, fused as planned and not: the floor's every count no more than
    the packing's, whatever the steps simulated."""
    from rpeg.plan.baselines import BASELINES, run_baselines
    from rpeg.plan.edit import Context
    from rpeg.plan.space import Limits
    from rpeg.plan.tasks import dispatch_per_step, shared_of

    pipeline = load(ROOT / f"pipelines/{spec}.rpeg")
    c = load_cluster(ROOT / f"pipelines/clusters/{cluster}.rpeg")
    ev = Evaluator(pipeline, c)
    plans = [o.best or o.closest for o in run_baselines(
        tuple(BASELINES), Context.of(pipeline, c, Limits.runtime()), ev)]
    assert any(plans)
    for e in filter(None, plans):
        for fusion in {(), e.plan.fusion}:
            plan = ev.settle(attrs.evolve(e.plan, predicted=None, fusion=fusion))
            timings = ev.timings(plan, ev.graph(plan))[0]
            loose, layouts, chunks, _, placed = ev.control.layouts(plan, timings)
            shared = shared_of(placed, plan)
            for steps in (6, 10):
                low = dispatch_floor(loose, layouts, chunks, steps)
                d = dispatch_per_step(loose, layouts, chunks, steps, plan.fusion,
                                      shared=shared)
                assert (low.devices, low.calls) == (d.devices, d.calls)
                assert 0 < low.tasks <= d.tasks and low.args <= d.args, (low, d)


def test_a_fused_op_takes_its_stages_time_and_saves_their_tasks():
    """Fused stages run as calls of their own inside one task: the op's time is their sum
    (each pays its own call overhead), and what fusion saves is dispatch, in the control
    plane's task count."""
    pipeline, fused = PLANS["ppo, advantages elsewhere, ref_lp and scores fused"]
    _, plain = PLANS["ppo, advantages elsewhere"]
    ev = Evaluator(pipeline, builtin_cluster("gh200_64"))
    op = next(o for o in ev.graph(fused).ops if o.stages == ("ref_lp", "scores"))
    timings = ev.timings(fused, ev.graph(fused))[0]
    apart = ev.timings(plain, ev.graph(plain))[0]
    per_chunk = timings[op.name].chunk_times
    assert per_chunk and len(per_chunk) == len(apart["ref_lp"].chunk_times)
    for both, a, b in zip(per_chunk, apart["ref_lp"].chunk_times,
                          apart["scores"].chunk_times, strict=True):
        assert both == pytest.approx(a + b, rel=1e-9)
    assert ev.dispatch(fused, ev.graph(fused), timings).tasks \
        < ev.dispatch(plain, ev.graph(plain), apart).tasks


def _colocated_vllm(name: str, devices: int, tp: int, zero: int, carry: int,
                    train: int = 0):
    """Every stage on all ``devices`` (a shipped plan's shape on a GH200 cluster), the
    models the spec shares on one backbone, the rollout on vLLM engines of ``tp`` devices
    (a chunk on each), its trainers at ZeRO ``zero``: weight syncs into the engines' own
    copies, and to the copies the other stages read beside sharded trainers; ``train``:
    the trainers on that many devices alone, not all."""
    pipeline = load(shipped("pipelines", f"{name}.rpeg"))
    plan = split_plan(pipeline, 1, chunks=1, staleness=0, share=True)
    every = tuple(range(devices))
    out = []
    for p in plan.placements:
        if p.stage == "rollout":
            p = p.changed(devices=every, dp=devices // tp, tp=tp, chunks=devices // tp,
                             engine=Engine.VLLM, carry=carry)
        elif p.stage.endswith("_step"):
            p = p.changed(devices=every[:train or devices], dp=train or devices,
                             zero=Zero(zero))
        else:
            p = p.changed(devices=every, dp=devices)
        out.append(p)
    homes = tuple((m, every[:train or devices]) for m, _ in plan.model_homes)
    return pipeline, attrs.evolve(plan, num_devices=devices, placements=tuple(out),
                                  model_homes=homes)


@pytest.mark.parametrize("name, devices, tp, zero, carry, train", [
    ("ppo_llama8b", 64, 1, 3, 1, 0),    # the shipped plan on gh200_64: 643 calls, 577 tasks
    ("ppo_llama8b", 8, 2, 2, 1, 0),     # and on gh200_8
    ("ppo_llama8b", 16, 1, 0, 0, 0),    # engines updated in memory beside the trainer
    ("grpo_qwen7b", 64, 1, 3, 0, 0),
    ("grpo_qwen7b", 8, 2, 3, 0, 0),
    ("grpo_qwen7b", 8, 1, 0, 0, 1)])    # one engine so, beside a trainer on one device
def test_the_model_counts_the_weight_syncs_the_runtime_dispatches(name, devices, tp, zero,
                                                                   carry, train):
    """Weight syncs into vLLM engines' own copies (a receive on each engine's host, a send
    on each of the trainer's senders) and, beside a trainer whose ZeRO shards no other
    stage reads, to the copies the other stages read (an export on each sender, a load on
    each reader's device), each gang with its join: the count lays out the calls the
    runtime's lowering makes and packs them into as many tasks."""
    pipeline, plan = _colocated_vllm(name, devices, tp, zero, carry, train)
    ev = Evaluator(pipeline, builtin_cluster("gh200_8" if devices == 8 else "gh200_64"))
    graph = ev.graph(plan)
    d = ev.dispatch(plan, graph, ev.timings(plan, graph)[0])
    assert (d.calls, d.tasks) == _runtime(pipeline, plan)[:2]


@pytest.mark.parametrize("stages", [("ref_lp",), ("ref_lp", "values", "scores", "adv")])
def test_the_model_counts_the_parts_of_a_pass_split_over_its_blocks(stages):
    """Passes and host ops at dp 2 in a step streaming one chunk run a part of the batch on
    each block (``rpeg.plan.oplayout.split_parts``), read whole by their readers: the same
    calls and tasks a steady step as the runtime's fusion."""
    pipeline = load(shipped("pipelines", "tiny_ppo.rpeg"))
    plan = split_plan(pipeline, 2, staleness=0, chunks=1)
    plan = attrs.evolve(plan, placements=tuple(
        p.changed(devices=(0, 1), dp=2) if p.stage in stages else p
        for p in plan.placements))
    ev = Evaluator(pipeline, builtin_cluster("local_cpu"))
    graph = ev.graph(plan)
    d = ev.dispatch(plan, graph, ev.timings(plan, graph)[0])
    calls, tasks, _ = _runtime(pipeline, plan)
    assert (d.calls, d.tasks) == (calls, tasks)
    assert calls > len([c for c in build_calls(pipeline, split_plan(
        pipeline, 2, staleness=0, chunks=1), 10) if c.step == 6])
