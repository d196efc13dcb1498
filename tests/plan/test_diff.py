"""diff_plans: placement and structure differences with predicted deltas."""

from __future__ import annotations

import attrs

from rpeg.plan import Plan, Predicted, StagePlacement, diff_plans
from rpeg.spec import Engine


def _plan(**kw) -> Plan:
    base = Plan("ppo", "gh200_8", 8,
                (StagePlacement.of("rollout", (0, 1, 2, 3), dp=4, engine=Engine.VLLM, chunks=4),
                 StagePlacement.of("actor_step", (4, 5, 6, 7), dp=4, zero=2)),
                predicted=Predicted(10.0, (50e9,) * 8))
    return attrs.evolve(base, **kw)


def test_same_plans():
    d = diff_plans(_plan(), _plan())
    assert d.same and str(d).startswith("plans are the same")
    assert d.step_time_delta_s == 0.0


def test_placement_structure_and_deltas():
    a = _plan()
    b = _plan(placements=(StagePlacement.of("rollout", (0, 1, 2, 3), dp=2, tp=2,
                                         engine=Engine.VLLM, chunks=4),
                          StagePlacement.of("actor_step", (4, 5, 6, 7), dp=4, zero=2)),
              staleness=(("rollout", 1),), shared=(("actor", "critic"),),
              predicted=Predicted(8.0, (60e9,) * 8))
    d = diff_plans(a, b)
    assert not d.same
    assert d.placements == (("rollout", "devices 0-3 dp4 tp1 pp1 mb1 zero0 chunks4 vllm",
                             "devices 0-3 dp2 tp2 pp1 mb1 zero0 chunks4 vllm"),)
    assert ("staleness rollout", "0", "1") in d.structure
    assert ("share", "none", "actor, critic") in d.structure
    assert d.step_time_delta_s == -2.0 and d.memory_delta == 10e9
    text = str(d)
    assert "predicted step time: 10.000 s -> 8.000 s (-2.000 s, 1.25x faster)" in text
    back = str(diff_plans(b, a))                 # the ratio says its direction
    assert "predicted step time: 8.000 s -> 10.000 s (+2.000 s, 1.25x slower)" in back
    assert "predicted peak memory: 50.0 GB -> 60.0 GB (+10.0 GB per GPU)" in text
    assert d.to_dict()["predicted"]["step_time_delta_s"] == -2.0


def test_stage_only_in_one_plan_and_unpriced_plans():
    b = _plan(placements=_plan().placements[:1], predicted=None)
    d = diff_plans(_plan(), b)
    assert ("actor_step", "devices 4-7 dp4 tp1 pp1 mb1 zero2 chunks1 torch", "-") in d.placements
    assert d.step_time_delta_s is None and "predicted step" not in str(d)


def test_the_memory_reserve_a_plan_was_made_with_is_a_difference():
    """Two plans of one spec on one cluster, one made with --memory-reserve 15%: the
    reserve is what they differ in, said even where the placements came out the same."""
    a = _plan(predicted=Predicted(10.0, (50e9,) * 8, memory_capacity=80e9, memory_reserve=8e9))
    b = _plan(predicted=Predicted(10.0, (50e9,) * 8, memory_capacity=80e9,
                                  memory_reserve=12e9))
    d = diff_plans(a, b)
    assert not d.same and d.structure == (
        ("memory reserve", "8.0 GB of 80 GB (10%)", "12.0 GB of 80 GB (15%)"),)


def test_every_priced_field_of_a_placement_is_a_difference():
    """packing, cuda_graph, the engine's batching, cp and ep change what a plan costs: two
    plans apart only there are not the same (they were, exit 0)."""
    a = _plan()
    for change in (dict(packing=True), dict(cuda_graph=True), dict(max_num_seqs=64),
                   dict(kv_fraction=0.5), dict(param_offload=True)):
        stage = "actor_step" if "packing" in change or "param_offload" in change \
            else "rollout"
        b = _plan(placements=tuple(p.changed(**change) if p.stage == stage else p
                                   for p in a.placements))
        d = diff_plans(a, b)
        assert not d.same, change
        assert next(iter(change)) in str(d) or "packed" in str(d), str(d)
