"""``rpeg run`` with ``engine = vllm`` on a generate stage: real runs that verify.

tiny_ppo and tiny_grpo on the tiny-vllm preset, disaggregated: the rollout's vLLM engine
alone on device 0 serving its own copy of the actor, the actor trained on device 1, every
version reaching the engine through collectives (a send on the trainer, a receive in the
engine: no weights through Dask), for 5 steps. The trace must verify against the plan
(placement, dependencies, parameter versions), and the versions generation read must
follow the staleness bound. With partial rollouts (carry 1) a run resumed from a
checkpoint continues the responses the engine had started before the cut. No Dask
setting is given by hand: the runtime starts non-daemon workers because the plan uses
vLLM, and shuts the engines down before the cluster.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from backends.vllm_backend import available
from rpeg.graph.ids import OpId

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not available()[0], reason="vllm is not installed")]

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
RPEG = [sys.executable, "-m", "rpeg"]


def _env() -> dict:
    # rpeg run itself makes the workers non-daemon for a plan that uses vLLM
    return {k: v for k, v in os.environ.items() if k != "DASK_DISTRIBUTED__WORKER__DAEMON"}


def _vllm_spec(name: str, tmp_path: Path) -> Path:
    text = (PIPELINES / f"{name}.rpeg").read_text()
    text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", text)
    text = re.sub(r"(stage rollout\s*=\s*generate\([^)]*)\)", r"\1, engine = vllm)", text)
    assert "engine = vllm" in text and "tiny-vllm" in text
    path = tmp_path / f"{name}_vllm.rpeg"
    path.write_text(text)
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    if not (tmp_path / "data").exists():
        (tmp_path / "data").symlink_to(PIPELINES / "data")
    return path


def _rpeg(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    done = subprocess.run([*RPEG, *args], env=_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def _verified(run_dir: Path) -> None:
    verify = _rpeg("verify", str(run_dir), timeout=300)
    assert "ok" in verify.stdout, verify.stdout + verify.stderr


def _events(run_dir: Path) -> list[dict]:
    trace = json.loads((run_dir / "trace.json").read_text())
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.parametrize("name", ["tiny_ppo", "tiny_grpo"])
def test_a_disaggregated_vllm_engine_runs_five_steps_that_verify(name, tmp_path):
    spec = _vllm_spec(name, tmp_path)
    run_dir = tmp_path / "run"
    _rpeg("run", str(spec), "--steps", "5", "--run-dir", str(run_dir),
          "--strategy", "runtime-split")
    plan = json.loads((run_dir / "plan.json").read_text())
    rollout = next(p for p in plan["placements"] if p["stage"] == "rollout")
    assert rollout["engine"] == "vllm" and rollout["devices"] == [0]
    assert dict(map(tuple, plan["model_homes"]))["actor"] == [1]         # trained elsewhere
    _verified(run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    versions = [m["gen_version"] for m in metrics]
    assert len(metrics) == 5 and versions[0] == 0 and versions[-1] >= 3  # pushed weights served
    assert all(s - 1 <= v <= s for s, v in enumerate(versions))         # staleness <= 1
    syncs = [e for e in _events(run_dir) if e["name"].startswith("sync_actor")]
    assert {e["name"] for e in syncs} == {"sync_actor.send", "sync_actor.recv"}  # collectives
    sent = [e["args"]["stats"]["bytes"] for e in syncs if e["name"] == "sync_actor.send"]
    received = [e["args"]["stats"]["bytes"] for e in syncs if e["name"] == "sync_actor.recv"]
    assert sent == received and min(sent) > 0 and len(sent) >= 3


def test_vllm_partial_rollouts_verify_and_a_resumed_run_continues_them(tmp_path):
    """Carry 1 on the vLLM engine: the run verifies with tokens one step older than the
    staleness allows alone, and resumed from the checkpoint at step 3 (the engine's
    buffer there holds responses started in step 2) it reads the same versions and
    computes the same numbers as the run that went through."""
    import attrs

    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load

    spec = _vllm_spec("tiny_grpo", tmp_path)
    plan = split_plan(load(spec), 2, staleness=0)
    plan = attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, carry=1) if p.stage == "rollout" else p for p in plan.placements))
    plan_file, run_dir = tmp_path / "plan.json", tmp_path / "run"
    plan.save(plan_file)
    _rpeg("run", str(plan_file), "--spec", str(spec), "--steps", "6", "--run-dir",
          str(run_dir), "--checkpoint-every", "3", "--no-progress")
    _verified(run_dir)
    read = {e["args"]["id"]: e["args"]["version_read"] for e in _events(run_dir)
            if e["name"] == "rollout"}
    lags = [OpId(k).step - v for k, v in read.items()]
    assert set(lags) <= {0, 1} and 1 in lags
    assert list((run_dir / "checkpoints" / "step-000003").glob("actor~vllm@*/carried.json"))
    before = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(run_dir / "checkpoints" / "step-000006")      # as if killed after step 3
    meta = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    _rpeg("run", "--resume", str(run_dir), "--checkpoint-every", "3", "--no-progress")
    _verified(run_dir)
    after = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {e["args"]["id"]: e["args"]["version_read"] for e in _events(run_dir)
            if e["name"] == "rollout"} == read
    carried = [k for k, v in read.items() if OpId(k).step in (3, 4, 5)
               and OpId(k).step - v == 1]
    assert carried                                       # some continued across the cut
    for b, a in zip(before[3:], after[3:], strict=True):
        assert (a["reward"], a["response_len"]) == (b["reward"], b["response_len"])


def test_auto_engine_plans_and_runs_either_engine_for_wide_heads(tmp_path):
    # engine = auto: for tiny-vllm (head_dim 64) the planner may pick vLLM or torch, as the
    # profile prices them; the run uses the one it picked, and it verifies
    text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", (PIPELINES / "tiny_grpo.rpeg").read_text())
    assert "engine" not in text
    (tmp_path / "g.rpeg").write_text(text)
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    (tmp_path / "data").symlink_to(PIPELINES / "data")
    env = _env()
    run_dir = tmp_path / "run"
    done = subprocess.run([*RPEG, "run", str(tmp_path / "g.rpeg"), "--steps", "2",
                           "--run-dir", str(run_dir)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    engine = next(p for p in plan["placements"] if p["stage"] == "rollout")["engine"]
    assert engine in ("vllm", "torch")
    # vLLM's own loader reads the policy; the torch engine never loads a checkpoint here
    loaded = "Loading safetensors checkpoint shards" in done.stdout + done.stderr
    assert loaded == (engine == "vllm")
    _verified(run_dir)
