"""The cost model's answers a planner asks again and again: the cost model's own, each
computed once per what it reads of a placement (rpeg.plan.prices)."""

from __future__ import annotations

import attrs
import pytest

from rpeg.cost.memory import resident_memory
from rpeg.cost.profiles import cluster_of
from rpeg.cost.stages import estimate_stage, stage_memory
from rpeg.graph.work import work_of
from rpeg.plan.model import StagePlacement
from rpeg.plan.prices import Prices


@pytest.fixture(scope="module")
def gh16():
    return cluster_of("gh200", gpus_per_node=4, nodes=4)


def _on(stage: str, first: int, **layout) -> StagePlacement:
    p = StagePlacement.of(stage, (), **layout)
    n = p.dp * p.tp * p.pp * p.cp
    return attrs.evolve(p, devices=tuple(range(first, first + n)))


@pytest.mark.parametrize("stage,layout", [("actor_step", dict(dp=2, tp=2, zero=1)),
                                          ("ref_lp", dict(dp=4)),
                                          ("rollout", dict(dp=2, tp=2, chunks=4))])
def test_answers_are_the_cost_models(ppo8b, gh16, stage, layout):
    prices = Prices.of(ppo8b, gh16)
    p = _on(stage, 4, **layout)
    work = work_of(ppo8b, stage)
    direct = estimate_stage(work, p.layout, p.devices, gh16, engine=p.engine)
    assert prices.stage_cost(stage, p).time_s == pytest.approx(direct.time_s, rel=1e-12)
    assert prices.transient(stage, p) == stage_memory(work, p.layout, gh16,
                                                      engine=p.engine).total
    model = ppo8b.model(ppo8b.stage(stage).target)
    trained = stage == "actor_step"
    assert prices.resident(model.name, p, trained) == resident_memory(
        model, p.layout, gh16, trained=trained, engine=p.engine).total


def test_a_layout_is_priced_once_wherever_the_tree_looks_the_same(ppo8b, gh16):
    """The same layout on another node of the same shape, or with its responses in more
    chunks, is the same question for time; on any devices, the same one for memory."""
    prices = Prices.of(ppo8b, gh16)
    first = _on("ref_lp", 0, dp=4)
    prices.stage_cost("ref_lp", first)
    prices.transient("ref_lp", first)
    asked = prices.sizes()
    for moved in (_on("ref_lp", 4, dp=4), _on("ref_lp", 12, dp=4),
                  _on("ref_lp", 8, dp=4, chunks=8)):
        assert prices.stage_cost("ref_lp", moved) is prices.stage_cost("ref_lp", first)
        prices.transient("ref_lp", moved)
    after = prices.sizes()
    assert after["stage_cost"] == asked["stage_cost"] and after["transient"] == asked["transient"]
    # a different layout, or the same one across two nodes, is a new question
    prices.stage_cost("ref_lp", _on("ref_lp", 2, dp=4))
    prices.stage_cost("ref_lp", _on("ref_lp", 0, dp=2, tp=2))
    assert prices.sizes()["stage_cost"] == asked["stage_cost"] + 2


def test_wave_sizes_are_priced_on_whole_mebibytes(ppo8b, gh16):
    """What is free is counted in whole MiB, so the answer does not depend on which plan
    asked first."""
    prices = Prices.of(ppo8b, gh16)
    p = _on("rollout", 0, dp=4)
    mib = 2 ** 20
    a = prices.gen_rows("rollout", p, 40_000 * mib + 0.9 * mib)
    b = prices.gen_rows("rollout", p, 40_000 * mib + 0.1 * mib)
    assert a == b and prices.sizes()["gen_rows"] == 1
    assert prices.gen_rows("rollout", p, 2_000 * mib) <= a
