"""The trace checker on synthetic traces: each kind of violation is found and named."""

from __future__ import annotations

from rpeg.runtime.instances import build_calls, model_homes
from rpeg.runtime.placement import split_plan
from rpeg.runtime.verify import check


def _trace(calls, workers):
    """A perfect trace: ops back to back in dependency order, versions as planned."""
    from rpeg.runtime.core import _submission_order
    table = {c.id: c for c in calls}
    events, t = [], 0.0
    for op in _submission_order(calls):
        c = table[op]
        events.append({"id": c.id, "step": c.step, "device": c.device, "worker": workers[c.device],
                       "start": t, "end": t + 1.0, "version_read": c.version,
                       "version_written": c.writes})
        t += 1.0
    return events


def _setup(ppo, plan, steps=3):
    from rpeg.runtime.instances import graph_for
    calls = build_calls(ppo, plan, steps)
    workers = {0: "tcp://a", 1: "tcp://b"}
    return calls, workers, model_homes(ppo, plan, graph_for(ppo, plan))


def test_a_faithful_trace_passes(ppo):
    plan = split_plan(ppo, 2, staleness=1)
    calls, workers, homes = _setup(ppo, plan)
    report = check(calls, plan, _trace(calls, workers), workers, 3, homes)
    assert report.ok, str(report)


def test_each_kind_of_violation_is_reported_with_op_and_step(ppo):
    plan = split_plan(ppo, 2, staleness=1)
    calls, workers, homes = _setup(ppo, plan)
    events = {e["id"]: e for e in _trace(calls, workers)}
    events["ref_lp/s1/c0"]["device"] = 0                      # wrong device
    events["ref_lp/s1/c0"]["worker"] = "tcp://a"
    events["adv/s2/c1"]["start"] = events["scores/s2/c1"]["start"]   # before its input ended
    events["rollout/s2/c0"]["version_read"] = 0                # older than s - 1
    del events["critic_step/s0"]                               # never ran
    report = check(calls, plan, list(events.values()), workers, 3, homes)
    found = {(v.check, v.op, v.step) for v in report.violations}
    assert ("placement", "ref_lp/s1/c0", 1) in found
    assert ("dependency", "adv/s2/c1", 2) in found
    assert ("version", "rollout/s2/c0", 2) in found
    assert ("missing", "critic_step/s0", 0) in found
    assert not report.ok and "rollout/s2/c0 (step 2)" in str(report)


def test_train_must_read_its_own_step(ppo, plan_by_hand):
    plan = plan_by_hand(ppo, {}, devices=1)
    calls, workers, homes = _setup(ppo, plan)
    events = _trace(calls, workers)
    for e in events:
        if e["id"] == "actor_step/s2":
            e["version_read"] = 1
    report = check(calls, plan, events, workers, 3, homes)
    assert [v.op for v in report.violations] == ["actor_step/s2"]
