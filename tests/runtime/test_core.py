"""The scheduling core, driven by hand: no Dask, no clock."""

from __future__ import annotations

from rpeg.runtime.core import (
    Abort,
    Core,
    Finish,
    OpDone,
    OpFailed,
    Release,
    Started,
    StepDone,
    Submit,
)
from rpeg.runtime.instances import build_calls
from rpeg.runtime.placement import split_plan


def _submitted(out):
    return [i.call.id for i in out if isinstance(i, Submit)]


def _drain(core, out, stop_at=None):
    """Complete every submitted op in order, as a cluster would; collect instructions."""
    queue = _submitted(out)
    log = list(out)
    while queue:
        op = queue.pop(0)
        if op == stop_at:
            break
        new = core.handle(OpDone(op))
        log += new
        queue += _submitted(new)
    return log


def test_synchronous_runs_one_step_at_a_time(ppo, plan_by_hand):
    calls = build_calls(ppo, plan_by_hand(ppo, {}, devices=1), steps=3)
    core = Core.create(calls, steps=3, window=1)
    first = core.handle(Started())
    assert {core.calls[i].step for i in _submitted(first)} == {0}
    log = _drain(core, first)
    steps = [i.step for i in log if isinstance(i, StepDone)]
    assert steps == [0, 1, 2] and isinstance(log[-1], Finish)
    # every op submitted exactly once, and only after everything it depends on
    order = _submitted(log)
    assert sorted(order) == sorted(c.id for c in calls)
    pos = {op: n for n, op in enumerate(order)}
    assert all(pos[d] < pos[c.id] for c in calls for d in c.all_deps)


def test_staleness_one_submits_the_next_generation_before_training_ends(ppo):
    plan = split_plan(ppo, 2, staleness=1)
    calls = build_calls(ppo, plan, steps=4)
    core = Core.create(calls, steps=4, window=2)
    first = _submitted(core.handle(Started()))
    assert "rollout/s1/c0" in first and "actor_step/s0" in first
    assert "rollout/s2/c0" not in first          # step 2 waits for step 0 to finish


def test_results_are_released_when_every_consumer_is_done(ppo, plan_by_hand):
    calls = build_calls(ppo, plan_by_hand(ppo, {}, devices=1), steps=1)
    core = Core.create(calls, steps=1, window=1)
    log = _drain(core, core.handle(Started()))
    released = {i.op_id for i in log if isinstance(i, Release)}
    assert released == {c.id for c in calls}


def test_a_failed_op_aborts(ppo, plan_by_hand):
    calls = build_calls(ppo, plan_by_hand(ppo, {}, devices=1), steps=2)
    core = Core.create(calls, steps=2, window=1)
    core.handle(Started())
    out = core.handle(OpFailed("rollout/s0/c0", "boom"))
    assert out == [Abort("rollout/s0/c0", "boom")]
