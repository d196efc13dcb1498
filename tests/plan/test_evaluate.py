"""Evaluations a search asks for: a bound that spares the simulation only where it cannot
change an answer, and answers from memory equal to fresh ones (rpeg.plan.evaluate)."""

from __future__ import annotations

import functools

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpeg.plan.baselines import colocated, split
from rpeg.plan.edit import Context
from rpeg.plan.evaluate import Evaluator
from rpeg.plan.search import Moves
from rpeg.plan.simulate import floor

from .conftest import EVERY_ENGINE, ROOT


@functools.cache
def _setting(spec: str):
    from rpeg.cost.profiles import cluster_of
    from rpeg.spec import load
    pipeline = load(ROOT / f"pipelines/{spec}.rpeg")
    cluster = cluster_of("gh200", gpus_per_node=4, nodes=4)
    ctx = Context.of(pipeline, cluster, EVERY_ENGINE)
    ev = Evaluator(pipeline, cluster)
    starts = [o.best.plan for o in (colocated(ctx, ev), split(ctx, ev)) if o.best]
    return pipeline, cluster, ctx, starts


def _neighbour(spec: str, seed: int, moves: int):
    """A plan a search could propose: a few random moves from a baseline."""
    pipeline, cluster, ctx, starts = _setting(spec)
    rng = np.random.default_rng(seed)
    plan = starts[seed % len(starts)]
    walk = Moves(ctx, rng)
    for _ in range(moves):
        plan = walk.propose(plan) or plan
    return pipeline, cluster, attrs.evolve(plan, predicted=None)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=st.sampled_from(["ppo_llama8b", "grpo_qwen7b"]), seed=st.integers(0, 10**6),
       moves=st.integers(1, 5), scale=st.sampled_from([0.5, 0.9, 1.0, 1.1, 3.0]))
def test_a_bounded_evaluation_never_reads_above_the_simulated_step(spec, seed, moves, scale):
    pipeline, cluster, plan = _neighbour(spec, seed, moves)
    full = Evaluator(pipeline, cluster).evaluate(plan, detail=False)
    if not full.feasible:
        return
    ev = Evaluator(pipeline, cluster)
    bound = full.step_time_s * scale
    b = ev.evaluate(plan, detail=False, bound=bound)
    if b.bounded:          # no faster than the bound says, and no faster than it really is
        assert bound <= b.step_time_s <= full.step_time_s
        assert b.timeline is None
    else:
        assert b.step_time_s == full.step_time_s
    # asked again without a bound, the same evaluator simulates it: the fresh answer
    again = ev.evaluate(plan, detail=False)
    assert not again.bounded and again.step_time_s == full.step_time_s
    assert again.plan == full.plan


def test_the_bound_is_the_simulators_floor(ppo8b):
    """The bound is what the simulator itself never reads below: the busiest device's
    work of one step (plus what the evaluator adds to every step)."""
    pipeline, cluster, _, starts = _setting("ppo_llama8b")
    plan = starts[-1]
    ev = Evaluator(pipeline, cluster)
    full = ev.evaluate(plan)
    assert full.feasible
    graph = ev.graph(full.plan)
    timings, _ = ev.timings(full.plan, graph)
    least = floor(graph, timings)
    assert least <= full.timeline.step_time_s
    busiest = max(sum(e.end - e.start for e in full.timeline.events
                      if d in e.devices and e.instance.step == 2)
                  for d in range(plan.num_devices))
    assert least == pytest.approx(busiest, rel=1e-9)


def test_answers_from_memory_are_fresh_answers(grpo):
    """A plan priced again (another walk of the ladder, a baseline of another cap) is
    answered from memory, with the caller's own strategy and seed."""
    pipeline, cluster, plan = _neighbour("grpo_qwen7b", 7, 3)
    ev = Evaluator(pipeline, cluster)
    first = ev.evaluate(plan, detail=False)
    second = ev.evaluate(attrs.evolve(plan, seed=5), detail=False)
    assert second.plan.seed == 5 and second.plan.predicted == first.plan.predicted
    assert attrs.evolve(second.plan, seed=plan.seed) == first.plan
    fresh = Evaluator(pipeline, cluster).evaluate(plan, detail=False)
    assert fresh.plan == first.plan and fresh.feasible == first.feasible


def test_memory_and_time_read_one_walk(ppo8b):
    """The wave sizes and streamed chunks time reads are those memory found."""
    pipeline, cluster, _, starts = _setting("ppo_llama8b")
    ev = Evaluator(pipeline, cluster)
    settled = ev.settle(starts[0])
    graph = ev.graph(settled)
    walk = ev.walk(settled, graph)
    assert walk.rows == ev.rows_of(settled, graph)
    assert walk.streamed == ev.streamed(settled, graph, walk.rows)
    peak, _ = ev.memory(settled, graph, walk)
    assert (peak == walk.resident + walk.transient).all()
    assert ev.timings(settled, graph, walk) == ev.timings(settled, graph)


def test_only_devices_that_are_a_hosts_cores_contend():
    """The CPU profile's ``concurrency_slowdown`` slows the ops of a plan that overlap on
    the two devices, and the step with them; GPU clusters price no contention."""
    from rpeg.cost.profiles import builtin_cluster, cluster_of
    from rpeg.plan.simulate import Contention
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    pipeline = load(ROOT / "pipelines/tiny_grpo.rpeg")
    assert Evaluator(pipeline, cluster_of("gh200", 4, 4)).contention is None
    local = builtin_cluster("local_cpu")
    plan = split_plan(pipeline, 2, staleness=1, chunks=1)      # generation beside training

    def step(slowdown: float) -> float:
        cluster = attrs.evolve(local, gpu=attrs.evolve(local.gpu,
                                                       concurrency_slowdown=slowdown))
        ev = Evaluator(pipeline, cluster)
        assert ev.contention == (Contention(slowdown, 2) if slowdown != 1.0 else None)
        return ev.evaluate(plan).step_time_s
    assert step(1.0) < step(1.2) < step(1.4)


@pytest.mark.parametrize("stages", [("ref_lp",), ("ref_lp", "values", "adv")])
def test_a_pass_at_dp_2_in_a_step_of_one_chunk_is_priced_split_over_its_blocks(stages):
    """A forward or host op placed on two devices in a step that streams one chunk runs a
    part of the batch on each (``rpeg.plan.oplayout.split_parts``): its timing is the dp-2
    placement's, on both devices, as on a GPU cluster; what `rpeg compile` shows of it is
    on two devices."""
    from rpeg.cost.profiles import builtin_cluster
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    pipeline = load(ROOT / "pipelines/tiny_ppo.rpeg")
    ev = Evaluator(pipeline, builtin_cluster("local_cpu"))
    one = split_plan(pipeline, 2, staleness=1, chunks=1)
    two = attrs.evolve(one, placements=tuple(
        p.changed(devices=(0, 1), dp=2) if p.stage in stages else p
        for p in one.placements))
    t2, _ = ev.timings(two, ev.graph(two))
    for op in stages:
        assert t2[op].devices == (0, 1)
    uses = {u.stage: u for u in ev.evaluate(two).plan.predicted.ops}
    assert uses["ref_lp"].devices == 2


def test_a_checkpoint_is_shown_on_its_writers_with_the_bytes_it_writes():
    """The checkpoint op of `rpeg compile`'s ops table: the trained models' devices and
    their checkpoint's bytes (it said 0 GPUs and 0 B)."""
    from rpeg.cost.checkpoint import checkpoint_bytes
    from rpeg.cost.profiles import builtin_cluster
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    pipeline = load(ROOT / "pipelines/tiny_ppo.rpeg")
    cluster = builtin_cluster("local_cpu")
    plan = split_plan(pipeline, 2, staleness=1)
    uses = {u.stage: u for u in Evaluator(pipeline, cluster).evaluate(plan).plan.predicted.ops}
    trained = {d for s in ("actor_step", "critic_step") for d in plan.placement(s).devices}
    assert uses["checkpoint"].devices == len(trained)
    assert uses["checkpoint"].bytes == pytest.approx(sum(
        checkpoint_bytes(pipeline.model(m), cluster.gpu) for m in ("actor", "critic")))
