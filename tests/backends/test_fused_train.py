"""A shared backbone's train stages run as one train op: one combined loss, one optimizer
step a minibatch, on one schedule. Which schedule is one function both sides call
(``rpeg.plan.oplayout.fused_train``: the most minibatches, epochs and micro-batches any of
the stages asks): the runtime's train step runs it (``backends.torch_backend.executor``)
and the cost model prices it (``rpeg.plan.prices.Prices.trained``), its time and its
memory. Priced on the first stage's schedule, a critic declared after the actor and
asking more minibatches and epochs (tests/fixtures/shared_schedules.rpeg) ran eight times
the optimizer steps it was priced at."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

torch = pytest.importorskip("torch")

from backends.torch_backend import executor  # noqa: E402
from rpeg.cost.profiles import builtin_cluster  # noqa: E402
from rpeg.plan import oplayout, prices  # noqa: E402
from rpeg.plan.evaluate import Evaluator  # noqa: E402
from rpeg.runtime.placement import split_plan  # noqa: E402
from rpeg.spec import load  # noqa: E402
from rpeg.spec.model import OpKind  # noqa: E402
from tests.backends.one_process import run_step  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "shared_schedules.rpeg"
FUSED = "actor_step+critic_step"


@pytest.fixture(scope="module")
def shared():
    pipeline = load(FIXTURE)
    return pipeline, split_plan(pipeline, 1, share=True, staleness=0)


def _run(pipeline, plan, monkeypatch) -> list[dict]:
    """The schedules (minibatches, epochs, micro-batches) the runtime's train steps of one
    step run, in one process on the CPU."""
    ran: list[dict] = []
    real = executor.train_step

    def spy(*args, **kw):
        ran.append({k: kw[k] for k in ("minibatches", "epochs", "microbatches")})
        return real(*args, **kw)

    monkeypatch.setattr(executor, "train_step", spy)
    run_step(pipeline, plan)
    return ran


def _priced(pipeline, plan) -> tuple[float, float]:
    """(seconds, transient bytes) the cost model prices the fused train op at."""
    ev = Evaluator(pipeline, builtin_cluster("gh200_8"))
    graph = ev.graph(plan)
    walk = ev.walk(plan, graph)
    op = next(o for o in graph.ops if o.kind is OpKind.TRAIN)
    assert op.name == FUSED
    timings, _ = ev.timings(plan, graph, walk)
    at = plan.placement(op.stages[0]).devices
    return timings[op.name].time_s, max(b for s, d, b in walk.needs if s == op.stages[0]
                                        and d == at)


def _schedule(pipeline, stage: str, **keys):
    """``pipeline`` with ``stage``'s schedule keywords set to ``keys``."""
    def set_(s):
        params = tuple((k, v) for k, v in s.params if k not in keys) + tuple(keys.items())
        return attrs.evolve(s, params=params) if s.name == stage else s
    return attrs.evolve(pipeline, stages=tuple(set_(s) for s in pipeline.stages))


def test_both_sides_hold_the_one_schedule_rule():
    assert executor.fused_train is prices.fused_train is oplayout.fused_train


def test_the_price_follows_the_schedule_the_fused_train_runs(shared, monkeypatch):
    """The critic's 4 minibatches and 2 epochs, not the actor's 1 and 1: the runtime runs
    them, and the fused op is priced as a train of that schedule (both stages asking it)."""
    pipeline, plan = shared
    assert _run(pipeline, plan, monkeypatch) == [
        {"minibatches": 4, "epochs": 2, "microbatches": 1}]
    alike = _schedule(pipeline, "actor_step", minibatches=4, epochs=2)
    own = _schedule(pipeline, "critic_step", minibatches=1, epochs=1)
    runs, as_run, first = _priced(pipeline, plan), _priced(alike, plan), _priced(own, plan)
    assert runs == as_run
    assert runs[0] > first[0]


def test_one_edit_of_the_schedule_changes_both_sides(shared, monkeypatch):
    """Micro-batches doubled in the one function: the runtime's train step runs twice as
    many, and the cost model prices (and holds in memory) the op in them: half the
    activations at a micro-batch's loss, beside the gradients the first one made."""
    pipeline, plan = shared
    usual = _priced(pipeline, plan)

    def doubled(works, places):
        work, place = oplayout.fused_train(works, places)
        return work, place.changed(microbatches=2 * place.microbatches)

    for side in (executor, prices):
        monkeypatch.setattr(side, "fused_train", doubled)
    assert _run(pipeline, plan, monkeypatch) == [
        {"minibatches": 4, "epochs": 2, "microbatches": 2}]
    edited = _priced(pipeline, plan)
    assert edited != usual and edited[1] != usual[1]
