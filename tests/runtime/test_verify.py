"""The trace checker on synthetic traces: each kind of violation is found and named."""

from __future__ import annotations

import attrs

from rpeg.runtime.lowering.instances import build_calls, model_homes, placed_for
from rpeg.runtime.placement import split_plan
from rpeg.runtime.verify import check


def _trace(calls, workers):
    """A perfect trace: ops back to back in dependency order, versions as planned."""
    from rpeg.runtime.core.scheduler import submission_order
    table = {c.id: c for c in calls}
    events, t = [], 0.0
    for op in submission_order(calls):
        c = table[op]
        events.append({"id": c.id, "step": c.step, "device": c.device, "worker": workers[c.device],
                       "start": t, "end": t + 1.0, "version_read": c.version,
                       "version_written": c.writes})
        t += 1.0
    return events


def _setup(ppo, plan, steps=3):
    from rpeg.runtime.lowering.instances import graph_for
    calls = build_calls(ppo, plan, steps)
    workers = {0: "tcp://a", 1: "tcp://b"}
    return calls, workers, model_homes(ppo, plan, graph_for(ppo, plan))


def test_a_faithful_trace_passes(ppo):
    plan = split_plan(ppo, 2, staleness=1)
    calls, workers, homes = _setup(ppo, plan)
    report = check(calls, plan, _trace(calls, workers), workers, 3, homes,
                   placed_for(ppo, plan))
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
    report = check(calls, plan, list(events.values()), workers, 3, homes,
                   placed_for(ppo, plan))
    found = {(v.check, v.op, v.step) for v in report.violations}
    assert ("placement", "ref_lp/s1/c0", 1) in found
    assert ("dependency", "adv/s2/c1", 2) in found
    assert ("version", "rollout/s2/c0", 2) in found
    assert ("missing", "critic_step/s0", 0) in found
    assert not report.ok and "rollout/s2/c0 (step 2)" in str(report)


def test_an_op_ending_before_it_starts_or_at_no_time_is_a_violation(ppo):
    """A damaged trace (a negative duration, NaN) passed as ok."""
    plan = split_plan(ppo, 2, staleness=1)
    calls, workers, homes = _setup(ppo, plan)
    events = {e["id"]: e for e in _trace(calls, workers)}
    events["rollout/s0/c0"]["end"] = events["rollout/s0/c0"]["start"] - 5.0
    events["adv/s1/c0"]["end"] = float("nan")
    report = check(calls, plan, list(events.values()), workers, 3, homes,
                   placed_for(ppo, plan))
    found = {(v.check, v.op) for v in report.violations}
    assert {("time", "rollout/s0/c0"), ("time", "adv/s1/c0")} <= found, str(report)


def test_train_must_read_its_own_step(ppo, plan_by_hand):
    plan = plan_by_hand(ppo, {}, devices=1)
    calls, workers, homes = _setup(ppo, plan)
    events = _trace(calls, workers)
    for e in events:
        if e["id"] == "actor_step/s2":
            e["version_read"] = 1
    report = check(calls, plan, events, workers, 3, homes, placed_for(ppo, plan))
    assert [v.op for v in report.violations] == ["actor_step/s2"]


def test_a_rollout_reading_in_place_beside_a_loaded_copy_waits_for_its_trainer(
        ppo, plan_by_hand):
    """Actor and critic one backbone trained on device 0, the rollout there reading it in
    place (one step stale), the values split over devices 0-1: on device 1 they read a copy
    the backbone's transfers load. The rollout waits for its trainer, not for those
    transfers (the cost model prices no weight sync where the generator reads in place), and
    the placed graph a run is checked against says so: a faithful trace verifies."""
    from rpeg.graph import DepKind, Instance
    plan = plan_by_hand(ppo, {"values": (0, 1)}, staleness=1, chunks=1,
                        shared=(("actor", "critic"),))
    plan = attrs.evolve(plan, placements=tuple(
        p.changed(dp=2) if p.stage == "values" else p for p in plan.placements))
    calls, workers, homes = _setup(ppo, plan, steps=4)
    assert {c.id for c in calls} >= {"sync_actor+critic/s1/export", "sync_actor+critic/s1/load@1"}
    placed = placed_for(ppo, plan)
    assert placed.reads_of("rollout") == {0: "actor+critic"}          # in place
    assert {d.src for d in placed.edges(4).deps if d.dst == Instance("rollout", 2)
            and d.kind is DepKind.VERSION} == {Instance("actor_step+critic_step", 0)}
    report = check(calls, plan, _trace(calls, workers), workers, 4, homes, placed)
    assert report.ok, str(report)


def _traced(calls, workers, keep, shift=0.0):
    """:func:`_trace` of the steps ``keep`` accepts, with the fields a trace file records."""
    table = {c.id: c for c in calls}
    return [{**e, "op": table[e["id"]].op, "kind": table[e["id"]].kind.value,
             "role": table[e["id"]].role, "chunk": table[e["id"]].chunk,
             "rank": table[e["id"]].rank, "stats": {},
             "start": e["start"] + shift, "end": e["end"] + shift}
            for e in _trace(calls, workers) if keep(e["step"])]


def _replanned_run_dir(ppo, tmp_path, from_step=2, steps=4):
    """A run directory as a 2-device run re-planned onto 1 device at ``from_step`` leaves
    it: the old plan in plan.0.json, the new one in plan.json, both traces in trace.json."""
    from rpeg.runtime.rundir.directory import RunDir
    from rpeg.runtime.rundir.serial import dumps, plan_to_json
    old, new = split_plan(ppo, 2, staleness=1), split_plan(ppo, 1, staleness=1)
    rd = RunDir.create(tmp_path, ppo.name, tmp_path / "run")
    before = _traced(build_calls(ppo, old, steps), {0: "tcp://a", 1: "tcp://b"},
                     lambda s: s < from_step)
    after = _traced(build_calls(ppo, new, steps), {0: "tcp://c"}, lambda s: s >= from_step,
                    shift=1e4)
    rd.write_text("pipeline.json", dumps(ppo))
    rd.write_text("plan.0.json", plan_to_json(old))
    rd.write_text("plan.json", plan_to_json(new))
    meta = {"steps": steps, "status": "ok", "workers": {"0": "tcp://c"},
            "worker_history": {"0": ["tcp://a", "tcp://c"], "1": ["tcp://b"]},
            "replans": [{"why": "resumed onto 1 device(s)", "from_devices": 2,
                         "to_devices": 1, "from_step": from_step, "at": 0.0}]}
    rd.write_json("run.json", meta)
    rd.write_trace(before + after, {0: "tcp://c", 1: "tcp://b"}, 0.0)
    for s in range(steps):                       # verify reads the metrics too: each step once
        rd.append_metrics({"step": s})
    return rd, meta, before, after


def test_a_replanned_run_is_checked_step_by_step_against_the_plan_that_governed_it(
        ppo, tmp_path):
    from rpeg.runtime.verify import verify_run
    rd, meta, before, after = _replanned_run_dir(ppo, tmp_path)
    report = verify_run(rd.path)
    assert report.ok, str(report)
    assert len(report.checked) == len(before) + len(after)
    assert {e["device"] for e in before} == {0, 1} and {e["device"] for e in after} == {0}

    # an op of the early steps on a device the old plan did not give it is still caught
    moved = next(e for e in before if e["device"] == 1 and e["step"] == 1)
    rd.write_trace([{**e, "device": 0} if e is moved else e for e in before + after],
                   {0: "tcp://c", 1: "tcp://b"}, 0.0)
    found = {(v.check, v.op) for v in verify_run(rd.path).violations}
    assert ("placement", moved["id"]) in found

    # a run directory written before replans said where they apply: plan.json alone, as before
    rd.write_trace(before + after, {0: "tcp://c", 1: "tcp://b"}, 0.0)
    for r in meta["replans"]:
        del r["from_step"]
    rd.write_json("run.json", meta)
    old_style = verify_run(rd.path)
    assert not old_style.ok
    assert all(v.step < 2 for v in old_style.violations)


def test_a_trace_is_checked_against_the_placed_graph(ppo):
    plan = split_plan(ppo, 2, staleness=1)
    calls, workers, homes = _setup(ppo, plan)
    placed = placed_for(ppo, plan)
    assert check(calls, plan, _trace(calls, workers), workers, 3, homes, placed).ok
    events = {e["id"]: e for e in _trace(calls, workers)}
    events["ref_lp/s1/c0"]["device"] = 0                      # off the instance's devices
    events["adv/s2/c1"]["start"] = events["scores/s2/c1"]["start"]   # before its data edge
    report = check(calls, plan, list(events.values()), workers, 3, homes, placed)
    said = [str(v) for v in report.violations]
    assert any("ref_lp/s1/c0" in s and "the placed graph runs ref_lp@1 on [1]" in s
               for s in said), said
    assert any("adv@2#1 started" in s and "data dependency scores@2#1" in s for s in said), said
    # calls laid out from another plan (four chunks a step) are no instances of this one
    four = split_plan(ppo, 2, staleness=1, chunks=4)
    calls4, _, _ = _setup(ppo, four)
    report = check(calls4, four, _trace(calls4, workers), workers, 3, homes, placed)
    assert any("rollout@0#3, no instance of the placed graph" in str(v)
               for v in report.violations), str(report)


def test_verify_says_which_steps_began_and_which_never_ran(tmp_path):
    """A run of 4 steps that failed in step 2: steps 0 and 1 finished, step 2 began (some
    of its ops ran) and did not finish, step 3 never ran."""
    from types import SimpleNamespace

    from rpeg.runtime.rundir.check import check_metrics
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    steps, problems = check_metrics(SimpleNamespace(path=tmp_path),
                                    {"steps": 4, "status": "failed"}, [{"step": 2}])
    assert (steps.done, steps.checked) == (2, 3)
    assert problems == [(3, "steps 3..3 never ran (the run ended 'failed'; step 2 began and "
                            "did not finish)")]
