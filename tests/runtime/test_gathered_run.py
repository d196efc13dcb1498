"""A forward pass reading its ZeRO-3 trainer's shards in place, run for real: tiny_ppo with
its critic trained by FSDP2 at ZeRO-3 on two Dask workers and its values pass pinned to the
same two ranks, the rollout on one device (a step streams one chunk), run by ``rpeg run`` and
checked by ``rpeg verify``. Every step the values pass runs on both ranks with the trained
critic itself (each layer gathered as it runs): no second copy of the critic anywhere, no
weight sync into one, and each rank reads the version its trainer has just written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.runtime import verify_run

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
STEPS = 3
PINS = ("place rollout on gpus 0..0 { chunks = 1 }",
        "place values on gpus 0..1 { dp = 2; zero = 3 }",
        "place actor_step on gpus 0..1 { dp = 2; zero = 3 }",
        "place critic_step on gpus 0..1 { dp = 2; zero = 3 }")

pytestmark = pytest.mark.slow


def _spec(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(PIPELINES / "rewards.py", folder / "rewards.py")
    (folder / "data").mkdir(exist_ok=True)
    shutil.copy(PIPELINES / "data" / "toy.jsonl", folder / "data" / "toy.jsonl")
    text = (PIPELINES / "tiny_ppo.rpeg").read_text().replace("share actor, critic", "")
    path = folder / "pinned.rpeg"
    path.write_text(text + "".join(p + "\n" for p in PINS))
    return path


def test_the_values_pass_reads_the_zero3_critic_in_place(tmp_path, local_cluster):
    spec, run_dir = _spec(tmp_path / "spec"), tmp_path / "run"
    with local_cluster(2) as address:
        rc = main(["run", str(spec), "--cluster", str(PIPELINES / "clusters" / "local_cpu.rpeg"),
                   "--scheduler", address, "--steps", str(STEPS), "--run-dir", str(run_dir),
                   "--no-progress"])
    assert rc == 0
    report = verify_run(run_dir)
    assert report.ok, str(report)
    calls = [e["args"] for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"]
             if e.get("ph") == "X"]
    values = [c for c in calls if c["id"].startswith("values/")]
    assert sorted((c["step"], c["device"], c["rank"]) for c in values) == \
        [(s, d, d) for s in range(STEPS) for d in (0, 1)]
    # each rank reads the version critic_step wrote the step before, on that rank
    assert all(c["version_read"] == c["step"] for c in values)
    assert not any(c["id"].startswith("sync_critic") for c in calls)
    # the replicas a run keeps (its checkpoint): the trained critic on each rank, no copy
    last = sorted((run_dir / "checkpoints").iterdir())[-1]
    held = {p.name for p in last.iterdir() if "@" in p.name}
    assert {"critic@0", "critic@1"} <= held
    assert not any(h.startswith("critic~") for h in held), held
