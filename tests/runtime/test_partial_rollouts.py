"""Partial rollouts in the runtime: the instance graph orders a carrying generate op step
after step on its device, verify allows a chunk's tokens carry steps older and no more,
and real runs on a local Dask cluster verify with finite losses."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest

from rpeg.cli import main
from rpeg.errors import PlanError
from rpeg.runtime import RunOptions, run_pipeline, verify_run
from rpeg.runtime.lowering.instances import (
    build_calls,
    by_id,
    graph_for,
    model_homes,
    placed_for,
)
from rpeg.runtime.placement import split_plan
from rpeg.runtime.verify import check
from rpeg.spec import load

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def with_carry(plan, carry: int, stage: str = "rollout"):
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, carry=carry) if p.stage == stage else p for p in plan.placements))


def _chunks(calls, step, op="rollout"):
    return [c for c in calls if c.op == op and c.step == step]


def test_a_carrying_generate_op_runs_step_after_step_on_its_device(ppo, run_through_core):
    plan = with_carry(split_plan(ppo, 2, staleness=0), 1)
    calls = build_calls(ppo, plan, steps=3)
    for s in (1, 2):
        first, *_ = _chunks(calls, s)
        *_, last = _chunks(calls, s - 1)
        assert first.carry == 1 and last.id in first.after
    # without carry, steps of a generate op are not chained (they may overlap)
    plain = build_calls(ppo, split_plan(ppo, 2, staleness=1), steps=3)
    assert not any(c.id.startswith("rollout/s0") for c in _chunks(plain, 1)[0].after)
    # the scheduling core runs it through
    run_through_core(calls, 3)


def test_each_generating_device_keeps_its_own_order(ppo, plan_by_hand):
    """Two data-parallel generators: each chains its own chunks from step to step."""
    base = plan_by_hand(ppo, {"rollout": (0, 1)}, chunks=4)
    plan = with_carry(attrs.evolve(base, placements=tuple(
        p.changed(dp=2) if p.stage == "rollout" else p for p in base.placements)), 1)
    calls = build_calls(ppo, plan, steps=2)
    for dev in (0, 1):
        mine = [c for c in calls if c.op == "rollout" and c.device == dev]
        assert [c.step for c in mine] == [0, 0, 1, 1]
        for prev, nxt in zip(mine, mine[1:], strict=False):
            assert prev.id in nxt.after
            assert not any(a.startswith("rollout/") and table_device(calls, a) != dev
                           for a in nxt.after)


def table_device(calls, op_id):
    return by_id(calls)[op_id].device


def test_a_carry_beyond_the_staleness_bound_is_refused(ppo):
    with pytest.raises(PlanError, match=r"not 2 \(staleness 1 \+ carry 1"):
        build_calls(ppo, with_carry(split_plan(ppo, 2, staleness=1), 1), steps=2)
    with pytest.raises(PlanError, match="generate stage, not 'ref_lp'"):
        build_calls(ppo, with_carry(split_plan(ppo, 2, staleness=0), 1, "ref_lp"), steps=2)


def test_a_staleness_cap_caps_the_carry_too(ppo, tmp_path):
    from rpeg.runtime.plans import plan_for_run
    plan_file = tmp_path / "plan.json"
    with_carry(split_plan(ppo, 2, staleness=0), 1).save(plan_file)
    for cap, carry in ((None, 1), (1, 1), (0, 0)):           # --staleness 0: synchronous
        _, plan, _ = plan_for_run(plan_file, spec=ppo.path, staleness=cap)
        assert plan.placement("rollout").carry == carry


def test_verify_allows_tokens_carry_steps_older_and_no_more(ppo, trace_of):
    plan = with_carry(split_plan(ppo, 2, staleness=0), 1)
    calls = build_calls(ppo, plan, steps=4)
    workers, homes = {0: "tcp://a", 1: "tcp://b"}, model_homes(ppo, plan, graph_for(ppo, plan))

    def oldest(c):                       # a chunk's tokens started one step early
        return max(0, c.step - 1) if c.op == "rollout" else c.version
    placed = placed_for(ppo, plan)
    assert check(calls, plan, trace_of(calls, workers, oldest), workers, 4, homes, placed).ok

    def too_old(c):
        return c.step - 2 if c.id == "rollout/s3/c1" else oldest(c)
    report = check(calls, plan, trace_of(calls, workers, too_old), workers, 4, homes, placed)
    assert [(v.check, v.op) for v in report.violations] == [("version", "rollout/s3/c1"),
                                                            ("staleness", "rollout/s3/c1")]
    assert "must read 2..3 (staleness 0 + carry 1)" in str(report)
    assert "2 updates old: the spec's 'staleness rollout <= 1' allows 2..3" in str(report)


# --- real runs -------------------------------------------------------------------------------

def test_both_engines_carry_and_an_executor_without_it_refuses():
    from rpeg.plan.compile import check_executable
    from rpeg.plan.space import Limits
    from rpeg.spec.model import Engine
    limits = Limits.runtime()
    assert limits.carry_engines == {Engine.TORCH, Engine.VLLM}
    plan = with_carry(split_plan(load(PIPELINES / "tiny_ppo.rpeg"), 2, staleness=0), 1)
    vllm = attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, engine=Engine.VLLM) if p.stage == "rollout" else p
        for p in plan.placements))
    check_executable(plan, limits)
    check_executable(vllm, limits)
    with pytest.raises(PlanError, match="whole responses each step with the vllm engine"):
        check_executable(vllm, attrs.evolve(limits, carry_engines=frozenset({Engine.TORCH})))


def _run_plan_file(pipeline, plan, tmp_path, scheduler, steps, capsys, every: int = 2):
    """``rpeg run plan.json`` (a hand-written plan with carry) then ``rpeg verify``."""
    plan_file, run_dir = tmp_path / "plan.json", tmp_path / "run"
    plan.save(plan_file)
    assert main(["run", str(plan_file), "--spec", str(pipeline.path), "--scheduler", scheduler,
                 "--steps", str(steps), "--no-progress", "--run-dir", str(run_dir),
                 "--checkpoint-every", str(every)]) == 0
    assert main(["verify", str(run_dir)]) == 0
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps
    for row in rows:
        for key in ("reward", "entropy", "policy_loss", "step_time_s"):
            assert math.isfinite(row[key]), (key, row)
    capsys.readouterr()
    return run_dir, rows


def _rollouts(path):
    trace = json.loads((path / "trace.json").read_text())
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "rollout"]


def _lags(path):
    return [e["args"]["step"] - e["args"]["version_read"] for e in _rollouts(path)]


@pytest.mark.slow           # a cluster of its own; the verify rule has a unit test above
def test_ppo_with_carry_on_two_workers_verifies_and_verify_catches_a_stale_chunk(
        ppo, tmp_path, local_cluster, capsys):
    plan = with_carry(split_plan(ppo, 2, staleness=0), 1)
    with local_cluster(2) as scheduler:
        run_dir, rows = _run_plan_file(ppo, plan, tmp_path, scheduler, 4, capsys)
    assert all(math.isfinite(r["value_loss"]) for r in rows)
    assert set(_lags(run_dir)) <= {0, 1} and 1 in _lags(run_dir)   # some started a step early
    # a chunk whose tokens are older than staleness + carry allows
    trace = json.loads((run_dir / "trace.json").read_text())
    for e in trace["traceEvents"]:
        if e.get("name") == "rollout" and e["args"]["step"] == 3:
            e["args"]["version_read"] = 1
    (run_dir / "trace.json").write_text(json.dumps(trace))
    assert main(["verify", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert "rollout/s3/c0 (step 3): read version 1, must read 2..3 (staleness 0 + carry 1)" \
        in out
    assert "staleness: op rollout/s3/c0 (step 3): read version 1, 2 updates old: the spec's " \
           "'staleness rollout <= 1' allows 2..3" in out


@pytest.mark.slow
def test_grpo_with_carry_verifies_and_a_resumed_run_continues_the_same_responses(
        grpo, tmp_path, local_cluster, capsys):
    """The checkpoint holds the engines' buffers: resumed from the cut at step 3, step 3
    continues the responses started in step 2 and steps 3..5 give the same numbers."""
    import shutil

    from rpeg.runtime.dask.resume import resume_run
    from rpeg.runtime.dask.runner import Resilience
    plan = with_carry(split_plan(grpo, 2, staleness=0), 1)
    with local_cluster(2) as scheduler:
        run_dir, rows = _run_plan_file(grpo, plan, tmp_path, scheduler, 6, capsys, every=3)
        assert all(math.isfinite(r["kl"]) for r in rows)
        assert set(_lags(run_dir)) <= {0, 1} and 1 in _lags(run_dir)
        read = {e["args"]["id"]: e["args"]["version_read"] for e in _rollouts(run_dir)}
        # the scenario: step 3's responses were started in step 2, before the cut
        assert 2 in {v for k, v in read.items() if k.startswith("rollout/s3/")}
        assert list((run_dir / "checkpoints" / "step-000003").glob("actor@*/carried.json"))
        # as if killed after the checkpoint at step 3: that one is the latest
        shutil.rmtree(run_dir / "checkpoints" / "step-000006")
        meta = json.loads((run_dir / "run.json").read_text())
        (run_dir / "run.json").write_text(json.dumps({**meta, "status": "interrupted"}))
        result = resume_run(run_dir, RunOptions(progress=False, scheduler=scheduler),
                            Resilience(checkpoint_every=3))
    assert len(result.metrics) == 6
    report = verify_run(run_dir)
    assert report.ok, str(report)
    assert {e["args"]["id"]: e["args"]["version_read"] for e in _rollouts(run_dir)} == read
    for before, after in zip(rows[3:], result.metrics[3:], strict=True):
        for key in ("reward", "response_len", "kl", "policy_loss"):
            assert after[key] == before[key], key


@pytest.mark.slow
def test_a_tensor_parallel_generator_carries_like_an_unsplit_one(ppo, tmp_path, local_cluster,
                                                                 plan_by_hand):
    """Both ranks of a tp = 2 group keep the same buffer: the run matches tp = 1."""
    def on(devs):
        base = plan_by_hand(ppo, {}, devices=2, homes={"actor": devs, "critic": devs})
        return with_carry(attrs.evolve(base, placements=tuple(
            p.changed(devices=devs, tp=len(devs)) if p.stage in (
                "rollout", "ref_lp", "values", "actor_step", "critic_step") else p
            for p in base.placements)), 1)
    runs = []
    with local_cluster(2) as scheduler:
        for devs in ((0,), (0, 1)):
            result = run_pipeline(ppo, on(devs), RunOptions(
                steps=3, scheduler=scheduler, root=str(tmp_path / str(len(devs))),
                progress=False), spec_path=ppo.path)
            assert verify_run(result.path).ok
            runs.append(result.metrics)
    for a, b in zip(*runs, strict=True):
        for key in ("reward", "policy_loss", "value_loss", "response_len"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), key
