"""One fetch per copy: two passes reading one copy of a trained model on a device are
charged one weight fetch, as the runtime fills the copy once a step (one load of the
model's weight transfer, ``rpeg.plan.lower.fills``), and two copies two."""

from __future__ import annotations

import shutil
from pathlib import Path

import attrs
import pytest

from rpeg.plan.evaluate import Evaluator
from rpeg.plan.lower import PASSES, lower
from rpeg.runtime.placement import split_plan
from rpeg.spec import load, load_cluster

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    d = tmp_path_factory.mktemp("two_readers")
    shutil.copy(ROOT / "tests" / "fixtures" / "two_readers.rpeg", d / "two_readers.rpeg")
    shutil.copy(ROOT / "pipelines" / "rewards.py", d / "rewards.py")
    return load(d / "two_readers.rpeg")


def _priced(pipeline, on: dict[str, tuple[int, ...]]):
    cluster = load_cluster(ROOT / "pipelines" / "clusters" / "gh200_8.rpeg")
    plan = split_plan(pipeline, 3, staleness=0)
    plan = attrs.evolve(plan, placements=tuple(
        attrs.evolve(x, devices=on.get(x.stage, x.devices)) for x in plan.placements))
    ev = Evaluator(pipeline, cluster)
    times = dict(ev.evaluate(plan).plan.predicted.op_times)
    fetch = ev.sync_time("critic", plan.placement("critic_step"), plan.placement("values"))
    placed = lower(ev.graph(plan), plan, 32, lambda o: plan.placement(o.stages[0]),
                   passes=PASSES)
    fills = next(t.fills for t in placed.transfers if t.model == "critic")
    return times, fetch, fills


def test_two_readers_of_one_copy_are_charged_one_fetch(pipeline):
    times, fetch, fills = _priced(pipeline, {"critic_step": (0,), "values": (1,),
                                                "old_values": (1,)})
    assert fetch > 0
    assert [str(k) for k, _ in fills] == ["critic"] and [d for _, d in fills] == [1]
    # the same pass, the same devices: the first reader carries the one fetch
    assert times["values"] - times["old_values"] == pytest.approx(fetch, abs=2e-6)


def test_readers_of_two_copies_are_charged_a_fetch_each(pipeline):
    times, fetch, fills = _priced(pipeline, {"critic_step": (0,), "values": (1,),
                                                "old_values": (2,)})
    assert sorted(d for _, d in fills) == [1, 2]
    assert times["values"] == pytest.approx(times["old_values"], abs=2e-6)
    assert fetch > 0
