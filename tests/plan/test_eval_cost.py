"""The eval block is priced as an op: its time in the plan's op times, a share of it
(``1 / every``) in the step time the planner optimises."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rpeg.cost.checkpoint import CHECKPOINT_EVERY, cuts
from rpeg.plan.evalcost import count_rows, eval_prompts, eval_time
from rpeg.plan.evaluate import Evaluator
from rpeg.runtime.placement import split_plan
from rpeg.spec import load, load_cluster
from rpeg.spec.overrides import parse_overrides

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "pipelines" / "tiny_grpo.rpeg"
CLUSTER = ROOT / "pipelines" / "clusters" / "local_cpu.rpeg"


@pytest.fixture(scope="module")
def priced():
    cluster = load_cluster(CLUSTER)
    plain = load(SPEC)
    # a path typed on the command line is relative to the current directory
    with_eval = load(SPEC, parse_overrides([f'eval.dataset="{ROOT}/pipelines/data/toy.jsonl"',
                                            "eval.every=4",
                                            "eval.samples=2"]))
    plan = split_plan(plain, 2, staleness=0)
    a = Evaluator(plain, cluster).evaluate(plan).plan.predicted
    b = Evaluator(with_eval, cluster).evaluate(attrs.evolve(plan, predicted=None)).plan.predicted
    return with_eval, plan, cluster, a, b


def test_the_eval_op_is_in_the_plan_and_a_quarter_of_it_in_the_step(priced):
    pipeline, plan, cluster, a, b = priced
    times = dict(b.op_times)
    assert "eval" not in dict(a.op_times) and times["eval"] > 0
    # and the checkpoints the run writes at the eval's cuts too (rpeg.cost.checkpoint)
    one, steps = times["checkpoint"], pipeline.workload.steps
    more = one * (cuts(steps, CHECKPOINT_EVERY, 4) - cuts(steps, CHECKPOINT_EVERY, None)) / steps
    assert more > 0
    assert b.step_time_s == pytest.approx(a.step_time_s + times["eval"] / 4 + more, abs=1e-6)
    devices = plan.placement("actor_step").devices
    assert times["eval"] == pytest.approx(eval_time(pipeline, devices, cluster), rel=1e-9)


def test_the_held_out_prompts_are_counted_from_the_dataset(priced):
    pipeline = priced[0]
    assert eval_prompts(pipeline) == 48 == count_rows(ROOT / "pipelines/data/toy.jsonl")
    fewer = attrs.evolve(pipeline, evaluation=attrs.evolve(pipeline.evaluation, prompts=8))
    assert eval_prompts(fewer) == 8
    more = attrs.evolve(pipeline, evaluation=attrs.evolve(pipeline.evaluation, prompts=1000))
    assert eval_prompts(more) == 48               # the run evaluates the rows there are
    devices = priced[1].placement("actor_step").devices
    assert eval_time(fewer, devices, priced[2]) < eval_time(pipeline, devices, priced[2])
