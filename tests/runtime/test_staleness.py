"""Staleness has one meaning: the plan records every bounded stage's choice (0 included),
the cost model, the runtime and ``rpeg verify`` read it one way (a stage a plan does not
list is synchronous, never the spec's bound), a partial rollout's carry spends the spec's
bound, ``rpeg verify`` checks the spec's bound as well as the plan's, and ``rpeg run
--staleness K`` plans the run again under the capped bound."""

from __future__ import annotations

import json
import re
from pathlib import Path

import attrs
import pytest

from rpeg.cli import main
from rpeg.errors import PlanError
from rpeg.plan.evaluate import plan_graph
from rpeg.plan.model import Plan
from rpeg.runtime.lowering.instances import build_calls, graph_for, model_homes, placed_for
from rpeg.runtime.placement import split_plan
from rpeg.runtime.plans import plan_for_run
from rpeg.runtime.verify import check

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "pipelines" / "tiny_ppo.rpeg"
LOCAL = ROOT / "pipelines" / "clusters" / "local_cpu.rpeg"


def _rollouts(calls):
    return {c.step: c.version for c in calls if c.op == "rollout"}


def _with_carry(plan, carry: int):
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, carry=carry) if p.stage == "rollout" else p for p in plan.placements))


def _compiled(tmp_path, capsys, *flags) -> tuple[Plan, str]:
    out = tmp_path / "c.json"
    assert main(["compile", str(SPEC), "--cluster", str(LOCAL), "--strategy", "colocated",
                 "--runnable", "-o", str(out), "--no-gantt", *flags]) == 0
    return Plan.load(out), capsys.readouterr().out


def test_a_synchronous_plan_records_zero_and_runs_synchronously(ppo, tmp_path, capsys):
    """The colocated baseline is synchronous: plan.json says rollout 0, and every op call
    of the run reads this step's weights (it read s - 1, the spec's bound, before)."""
    plan, text = _compiled(tmp_path, capsys)
    assert plan.staleness == (("rollout", 0),)
    assert "staleness: rollout synchronous (staleness 0 of the spec's bound 1)" in text
    assert _rollouts(build_calls(ppo, plan, steps=5)) == {s: s for s in range(5)}


def test_a_plan_listing_no_stage_is_read_as_synchronous_by_every_reader(ppo, tmp_path,
                                                                       trace_of):
    """Plans written before every stage was listed stored a synchronous choice as []: the
    cost model priced them synchronous, and the runtime and verify now read them so."""
    old = attrs.evolve(split_plan(ppo, 2, staleness=0), staleness=())
    assert _rollouts(build_calls(ppo, old, steps=4)) == {s: s for s in range(4)}
    assert graph_for(ppo, old).lag_of("rollout") == plan_graph(ppo, old).lag_of("rollout") == 0
    old.save(tmp_path / "plan.json")
    _, plan, _ = plan_for_run(tmp_path / "plan.json", spec=SPEC)
    assert plan.staleness == (("rollout", 0),)
    # a trace reading one update old breaks such a plan
    calls = build_calls(ppo, old, steps=3)
    workers = {0: "tcp://a", 1: "tcp://b"}
    events = trace_of(calls, workers, lambda c: max(0, c.step - 1) if c.op == "rollout"
                    else c.version)
    report = check(calls, old, events, workers, 3, model_homes(ppo, old, graph_for(ppo, old)),
                   placed_for(ppo, old))
    assert {(v.check, v.op) for v in report.violations} == {
        ("version", "rollout/s1/c0"), ("version", "rollout/s2/c0"),
        ("version", "rollout/s1/c1"), ("version", "rollout/s2/c1")}


def test_a_carry_spends_the_spec_bound_and_never_adds_to_it(ppo):
    """A carry plan as the planner wrote it (staleness [] and carry 1 under a bound of 1):
    its rollout reads this step's weights, so no token is more than 1 update old."""
    plan = _with_carry(attrs.evolve(split_plan(ppo, 2, staleness=0), staleness=()), 1)
    calls = [c for c in build_calls(ppo, plan, steps=4) if c.op == "rollout"]
    assert {c.step: c.version for c in calls} == {s: s for s in range(4)}
    assert all(c.step - (c.version - c.carry) <= 1 and c.limit == 1 for c in calls)
    with pytest.raises(PlanError, match=r"not 2 \(staleness 1 \+ carry 1"):
        build_calls(ppo, _with_carry(split_plan(ppo, 2, staleness=1), 1), steps=2)


def test_the_planners_carrying_plans_stay_in_the_bound(ppo):
    """Every plan the planner offers spending the bound on a carry is priced, run and
    verified with the same lag: lag + carry within the spec's bound."""
    from rpeg.plan.compile import _carrying
    from rpeg.plan.edit import Context
    from rpeg.plan.evaluate import Evaluator
    from rpeg.runtime.plans import runtime_limits
    from rpeg.spec import load_cluster
    cluster = load_cluster(LOCAL)
    ctx = Context.of(ppo, cluster, runtime_limits())
    ev = Evaluator(ppo, cluster)
    carried = _carrying(ctx, ev, split_plan(ppo, 2, staleness=1))
    assert carried is not None
    plan = carried.plan
    assert plan.placement("rollout").carry == 1
    lag = graph_for(ppo, plan).lag_of("rollout")
    assert lag == plan_graph(ppo, plan).lag_of("rollout") == 0
    calls = build_calls(ppo, plan, steps=3)
    assert all(c.bound + c.carry <= 1 for c in calls if c.op == "rollout")


def test_verify_checks_the_spec_bound_apart_from_the_plan(ppo, trace_of):
    """Calls as a plan past the spec's bound would lay them out (the plan's window 2 steps
    wide) are still held to the spec's: a version 2 updates old is a staleness violation."""
    plan = split_plan(ppo, 2, staleness=1)
    calls = tuple(attrs.evolve(c, bound=2) if c.op == "rollout" else c
                  for c in build_calls(ppo, plan, steps=4))
    workers = {0: "tcp://a", 1: "tcp://b"}
    events = trace_of(calls, workers, lambda c: max(0, c.step - 2) if c.op == "rollout"
                    else c.version)
    report = check(calls, plan, events, workers, 4, model_homes(ppo, plan, graph_for(ppo, plan)),
                   placed_for(ppo, plan))
    assert {v.check for v in report.violations} == {"staleness"}
    assert {v.op.split("/c")[0] for v in report.violations} == {"rollout/s2", "rollout/s3"}
    assert "the spec's 'staleness rollout <= 1' allows 2..3" in str(report)


# --- rpeg run --staleness K ------------------------------------------------------------------

def test_a_staleness_cap_plans_the_pipeline_again(ppo):
    _, free, _ = plan_for_run(SPEC, cluster=LOCAL)
    _, sync, _ = plan_for_run(SPEC, cluster=LOCAL, staleness=0)
    # free: the bound spent on staleness or a carry (partial rollouts), whichever the model
    # prices lower; capped at 0: neither
    assert dict(free.staleness)["rollout"] + free.placement("rollout").carry == 1
    assert sync.staleness == (("rollout", 0),) and sync.placement("rollout").carry == 0
    assert sync.search.options.staleness_cap == 0          # `rpeg compile plan.json` remakes it
    assert sync.predicted.step_time_s != free.predicted.step_time_s


def test_a_staleness_cap_prices_a_plan_file_again(ppo, tmp_path, capsys):
    plan, _ = _compiled(tmp_path, capsys)
    asynchronous = attrs.evolve(plan, staleness=(("rollout", 1),), predicted=None)
    from rpeg.plan.evaluate import Evaluator
    from rpeg.spec import load_cluster
    priced = Evaluator(ppo, load_cluster(LOCAL)).evaluate(asynchronous).plan
    priced.save(tmp_path / "async.json")
    _, same, _ = plan_for_run(tmp_path / "async.json", spec=SPEC, staleness=1)
    _, capped, _ = plan_for_run(tmp_path / "async.json", spec=SPEC, staleness=0)
    assert same == priced
    assert capped.staleness == (("rollout", 0),)
    assert capped.predicted == plan.predicted != priced.predicted
    capped.save(tmp_path / "sync.json")
    assert main(["diff", str(tmp_path / "async.json"), str(tmp_path / "sync.json")]) == 1
    out = capsys.readouterr().out
    assert "staleness rollout: 1 -> 0" in out and "predicted step time:" in out


def test_a_staleness_above_the_spec_bound_is_refused_before_anything_runs(tmp_path, capsys):
    assert main(["run", str(SPEC), "--staleness", "2", "--cluster", str(LOCAL),
                 "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "--staleness must be at most the spec's largest staleness bound 1, not 2" in err
    assert not (tmp_path / "run").exists()


# --- real runs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def scheduler(local_cluster):
    with local_cluster(2) as address:
        yield address


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_rpeg_run_of_a_synchronous_plan_reads_this_steps_weights(tmp_path, capsys, scheduler):
    """The reproduction: a colocated plan compiled synchronous ran with gen_version
    0,0,1,2 (one update old) and verified; now it runs 0,1,2,3."""
    _compiled(tmp_path, capsys)
    run_dir = tmp_path / "run"
    assert main(["run", str(tmp_path / "c.json"), "--spec", str(SPEC), "--steps", "4",
                 "--scheduler", scheduler, "--no-progress", "--run-dir", str(run_dir)]) == 0
    assert [m["gen_version"] for m in _metrics(run_dir)] == [0, 1, 2, 3]
    assert main(["verify", str(run_dir)]) == 0


@pytest.mark.slow          # two real runs and their diff; the rules have unit tests above
def test_a_run_under_a_staleness_cap_is_planned_and_diffed_as_such(tmp_path, capsys, scheduler):
    dirs = {}
    for name, flags in (("free", []), ("sync", ["--staleness", "0"])):
        dirs[name] = tmp_path / name
        assert main(["run", str(SPEC), "--cluster", str(LOCAL), "--steps", "3", "--scheduler",
                     scheduler, "--no-progress", "--run-dir", str(dirs[name]), *flags]) == 0
        assert main(["verify", str(dirs[name])]) == 0
    assert [m["gen_version"] for m in _metrics(dirs["sync"])] == [0, 1, 2]
    capsys.readouterr()
    assert main(["diff", str(dirs["free"]), str(dirs["sync"]), "--json"]) == 1
    diff = json.loads(capsys.readouterr().out)
    # the search spends the bound of 1 by reading older weights or by carrying responses
    free = Plan.load(dirs["free"] / "plan.json")
    lag, carry = dict(free.staleness).get("rollout", 0), free.placement("rollout").carry
    assert lag + carry == 1
    what = "staleness rollout" if lag else "carry rollout"
    assert {"what": what, "a": "1", "b": "0"} in diff["plan"]["structure"]
    predicted = diff["consequences"]["predicted step time"]
    assert predicted["a"] != predicted["b"]
    assert diff["predicted_cost"].startswith(f"{what} 1 -> 0")
    assert re.search(r": predicted step time [+-]\d", diff["predicted_cost"])


@pytest.mark.slow          # a real run with partial rollouts; the rule has unit tests above
def test_a_carry_run_verifies_within_the_spec_bound_and_a_doctored_trace_fails(
        ppo, tmp_path, capsys, scheduler):
    plan = _with_carry(attrs.evolve(split_plan(ppo, 2, staleness=0), staleness=()), 1)
    plan.save(tmp_path / "plan.json")
    run_dir = tmp_path / "run"
    assert main(["run", str(tmp_path / "plan.json"), "--spec", str(SPEC), "--steps", "4",
                 "--scheduler", scheduler, "--no-progress", "--run-dir", str(run_dir)]) == 0
    assert main(["verify", str(run_dir)]) == 0
    trace = json.loads((run_dir / "trace.json").read_text())
    gen = [e["args"] for e in trace["traceEvents"] if e.get("name") == "rollout"]
    assert {a["step"] - a["version_read"] for a in gen} <= {0, 1}      # within the bound
    for e in trace["traceEvents"]:
        if e.get("name") == "rollout" and e["args"]["step"] == 3:
            e["args"]["version_read"] = 1                               # 2 updates old
    (run_dir / "trace.json").write_text(json.dumps(trace))
    capsys.readouterr()
    assert main(["verify", str(run_dir)]) == 1
    assert "the spec's 'staleness rollout <= 1' allows 2..3" in capsys.readouterr().out
