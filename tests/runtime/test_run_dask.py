"""Real runs on a real local Dask cluster (2 worker processes, resource GPU=1, 127.0.0.1):
PPO and GRPO, synchronous and asynchronous, shared actor-critic, data parallel."""

from __future__ import annotations

import json
import math
import multiprocessing
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.runtime import RunOptions, run_pipeline, verify_run
from rpeg.runtime.placement import split_plan

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
STEPS = 3


@pytest.fixture(scope="module")
def scheduler(local_cluster):
    """One cluster for the module's runs (each run attaches with --scheduler)."""
    with local_cluster(2) as address:
        yield address


def _run(pipeline, plan, tmp_path, scheduler, steps=STEPS):
    result = run_pipeline(pipeline, plan, RunOptions(steps=steps, scheduler=scheduler,
                                                     root=str(tmp_path), progress=False),
                          spec_path=pipeline.path)
    report = verify_run(result.path)
    assert report.ok, str(report)
    assert len(result.metrics) == steps
    for row in result.metrics:
        for key in ("reward", "entropy", "step_time_s", "tokens_per_s"):
            assert math.isfinite(row[key]), (key, row)
    return result, report


def _events(path):
    trace = json.loads((path / "trace.json").read_text())
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def test_ppo_async_on_two_workers(ppo, tmp_path, scheduler):
    plan = split_plan(ppo, 2, staleness=1)
    result, _ = _run(ppo, plan, tmp_path, scheduler)
    events = _events(result.path)
    gen = {e["args"]["step"]: e["args"]["version_read"] for e in events if e["name"] == "rollout"}
    assert gen == {0: 0, 1: 0, 2: 1}                 # exactly s - 1: one update old
    assert {e["tid"] for e in events} == {0, 1}      # one track per worker
    assert any(e["name"] == "sync_actor.load" for e in events)
    row = result.metrics[-1]
    assert math.isfinite(row["value_loss"]) and math.isfinite(row["clip_frac"])
    # one checkpoint, at the end: every replica (the actor on both workers: it generates on
    # one and trains on the other)
    (ck,) = (result.path / "checkpoints").iterdir()
    assert ck.name == f"step-{STEPS:06d}" and (ck / "COMPLETE").exists()
    names = {p.name for p in ck.iterdir()}
    assert {"actor@0", "actor@1"} <= names and any(n.startswith("critic@") for n in names)


def test_grpo_sync_on_two_workers(grpo, tmp_path, scheduler):
    result, _ = _run(grpo, split_plan(grpo, 2, staleness=0), tmp_path, scheduler)
    gen = {e["args"]["step"]: e["args"]["version_read"] for e in _events(result.path)
           if e["name"] == "rollout"}
    assert gen == {0: 0, 1: 1, 2: 2}
    assert math.isfinite(result.metrics[-1]["kl"])


def test_shared_actor_critic_one_backbone(ppo, tmp_path, scheduler):
    plan = split_plan(ppo, 2, staleness=1, share=True)
    result, _ = _run(ppo, plan, tmp_path, scheduler)
    trains = {e["name"] for e in _events(result.path) if e["cat"] == "train"}
    assert trains == {"actor_step+critic_step"}
    row = result.metrics[-1]
    assert math.isfinite(row["value_loss"]) and math.isfinite(row["policy_loss"])


def test_data_parallel_training_over_both_workers(ppo, tmp_path, scheduler):
    plan = split_plan(ppo, 2, staleness=0, dp=2)
    result, _ = _run(ppo, plan, tmp_path, scheduler, steps=2)
    ranks = {(e["name"], e["args"]["rank"], e["tid"]) for e in _events(result.path)
             if e["cat"] == "train"}
    assert ("actor_step", 0, 0) in ranks and ("actor_step", 1, 1) in ranks


def test_embedded_cluster_leaves_no_processes_and_verify_fails_on_tampering(tmp_path, capsys):
    run_dir = tmp_path / "run"
    before = {p.pid for p in multiprocessing.active_children()}       # the module's cluster
    assert main(["run", str(PIPELINES / "tiny_grpo.rpeg"), "--steps", "2", "--no-progress",
                 "--run-dir", str(run_dir)]) == 0
    assert {p.pid for p in multiprocessing.active_children()} <= before
    assert main(["verify", str(run_dir)]) == 0
    trace = json.loads((run_dir / "trace.json").read_text())
    for e in trace["traceEvents"]:
        if e.get("name") == "rollout" and e["args"]["step"] == 1:
            e["args"]["version_read"] = 7                       # a version from the future
    (run_dir / "trace.json").write_text(json.dumps(trace))
    capsys.readouterr()
    assert main(["verify", str(run_dir)]) == 1
    assert "rollout/s1/c0 (step 1)" in capsys.readouterr().out
