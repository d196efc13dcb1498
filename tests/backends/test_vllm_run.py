"""``rpeg run`` with ``engine = vllm`` on a generate stage: a real run that verifies.

tiny_grpo on the tiny-vllm preset, rollout on its own device (vLLM there), the
trainer on the other, weights synced after every step, for 3 steps. The
trace must verify against the plan (placement, dependencies, parameter
versions), and the versions generation read must follow the staleness bound.
No Dask setting is given by hand: the runtime starts non-daemon workers
because the plan uses vLLM, and shuts the engines down before the cluster.
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

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not available()[0], reason="vllm is not installed")]

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def test_tiny_grpo_generates_with_vllm_and_verifies(tmp_path):
    text = (PIPELINES / "tiny_grpo.rpeg").read_text()
    text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", text)
    text = re.sub(r"(stage rollout\s*=\s*generate\([^)]*)\)", r"\1, engine = vllm)", text)
    assert "engine = vllm" in text and "tiny-vllm" in text
    (tmp_path / "tiny_grpo_vllm.rpeg").write_text(text)
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    (tmp_path / "data").symlink_to(PIPELINES / "data")
    # rpeg run itself makes the workers non-daemon for a plan that uses vLLM
    env = {k: v for k, v in os.environ.items() if k != "DASK_DISTRIBUTED__WORKER__DAEMON"}
    run_dir = tmp_path / "run"
    rpeg = [sys.executable, "-m", "rpeg"]
    done = subprocess.run([*rpeg, "run", str(tmp_path / "tiny_grpo_vllm.rpeg"), "--steps", "3",
                           "--run-dir", str(run_dir), "--strategy", "runtime-split"],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    rollout = next(p for p in plan["placements"] if p["stage"] == "rollout")
    assert rollout["engine"] == "vllm"
    verify = subprocess.run([*rpeg, "verify", str(run_dir)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert verify.returncode == 0 and "ok" in verify.stdout, verify.stdout + verify.stderr
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    versions = [m["gen_version"] for m in metrics]
    assert versions[0] == 0 and versions[-1] >= 1          # pushed weights were served
    assert all(s - 1 <= v <= s for s, v in enumerate(versions))   # staleness <= 1



def test_auto_engine_plans_and_runs_either_engine_for_wide_heads(tmp_path):
    # engine = auto: for tiny-vllm (head_dim 64) the planner may pick vLLM or torch, as the
    # profile prices them; the run uses the one it picked, and it verifies
    text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", (PIPELINES / "tiny_grpo.rpeg").read_text())
    assert "engine" not in text
    (tmp_path / "g.rpeg").write_text(text)
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    (tmp_path / "data").symlink_to(PIPELINES / "data")
    env = {k: v for k, v in os.environ.items() if k != "DASK_DISTRIBUTED__WORKER__DAEMON"}
    run_dir = tmp_path / "run"
    rpeg = [sys.executable, "-m", "rpeg"]
    done = subprocess.run([*rpeg, "run", str(tmp_path / "g.rpeg"), "--steps", "2",
                           "--run-dir", str(run_dir)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    engine = next(p for p in plan["placements"] if p["stage"] == "rollout")["engine"]
    assert engine in ("vllm", "torch")
    # vLLM's own loader reads the policy; the torch engine never loads a checkpoint here
    loaded = "Loading safetensors checkpoint shards" in done.stdout + done.stderr
    assert loaded == (engine == "vllm")
    verify = subprocess.run([*rpeg, "verify", str(run_dir)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert verify.returncode == 0 and "ok" in verify.stdout, verify.stdout + verify.stderr
