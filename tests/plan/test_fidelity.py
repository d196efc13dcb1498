"""The evaluator's generation waves and the optimizer-offload choice, on ppo_llama8b."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from rpeg.cost.memory import optimizer_state_bytes
from rpeg.cost.stages import generation_rows, stage_memory
from rpeg.plan import Evaluator, Strategy
from rpeg.plan.baselines import colocated
from rpeg.plan.edit import Context
from rpeg.plan.evaluate import parallel_of
from rpeg.plan.search import Moves
from rpeg.spec import load_cluster

from .conftest import EVERY_ENGINE, ROOT


@pytest.fixture(scope="module")
def gh8():
    return load_cluster(ROOT / "pipelines/clusters/gh200_8.rpeg")


@pytest.fixture(scope="module")
def coloc(ppo8b, gh8):
    ctx, ev = Context.of(ppo8b, gh8, EVERY_ENGINE), Evaluator(ppo8b, gh8)
    return ctx, ev, colocated(ctx, ev)


def test_colocated_fits_on_8_gh200_with_generation_in_waves(ppo8b, gh8, coloc):
    _, ev, out = coloc
    assert out.best is not None and out.best.plan.strategy is Strategy.COLOCATED
    plan = out.best.plan
    graph = ev.graph(plan)
    resident, _ = ev.resident_bytes(plan, graph)
    gen = plan.placement("rollout")
    free = gh8.gpu.memory - resident[list(gen.devices)].max()
    rows = generation_rows(ppo8b, "rollout", parallel_of(gen), gh8, free)
    assert ev.rows_of(plan, graph)["rollout"] == rows
    kv = stage_memory(ppo8b, "rollout", parallel_of(gen), gh8, rows=rows).total
    assert resident[list(gen.devices)].max() + kv <= gh8.gpu.memory
    again = ev.evaluate(attrs.evolve(plan, predicted=None))
    assert again.feasible and max(again.plan.predicted.peak_memory) <= gh8.gpu.memory


def test_offload_is_a_search_move_priced_by_the_evaluator(ppo8b, gh8, coloc):
    ctx, ev, out = coloc
    plan = attrs.evolve(out.best.plan, predicted=None)
    moves = Moves(ctx, np.random.default_rng(0))
    flipped = moves.offload(plan)
    (stage,) = [p.stage for p, q in zip(plan.placements, flipped.placements, strict=True)
                if p.offload != q.offload]
    before, after = plan.placement(stage), flipped.placement(stage)
    model = ppo8b.model(ppo8b.stage(stage).target)
    state = optimizer_state_bytes(model, parallel_of(before), gh8.gpu)
    on, off = (after, before) if after.offload else (before, after)
    r_on = ev.resident(model.name, on, trained=True)
    r_off = ev.resident(model.name, off, trained=True)
    assert r_off - r_on == pytest.approx(state)
    t_on, t_off = ev.stage_time(stage, on), ev.stage_time(stage, off)
    assert t_on - t_off == pytest.approx(2 * state / gh8.gpu.get("host_bandwidth"))
