"""Sharded checkpoints in real runs: tiny_ppo with both trainers at ZeRO-3 over two workers
writes a checkpoint at most 1.3x the size of the same pipeline's at dp 1 (each rank its
shard, once; it wrote 2.6x before: every rank's whole state and ``~whole`` copies), a run
resumed from it continues exactly as the uninterrupted run, and it resumes on one device
(dp 1) from the dp 2 checkpoint, verified."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.runtime import verify_run
from tests.runtime.test_sharded_syncs import CLUSTER, PROFILE

pytestmark = pytest.mark.slow

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
TIMING = ("step_time_s", "tokens_per_s", "client_cpu_s")


def _run(folder: Path, dp: int, steps: int = 4) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(PIPELINES / "rewards.py", folder / "rewards.py")
    if not (folder / "data").exists():
        (folder / "data").symlink_to(PIPELINES / "data")
    last = dp - 1
    pins = "".join(f"place {s} on gpus 0..{last} {{ dp = {dp}; zero = 3 }}\n"
                   for s in ("actor_step", "critic_step"))
    pins += f"place rollout on gpus 0..{last} {{ dp = {dp} }}\n"
    pins += "".join(f"place {s} on gpus 0..0\n" for s in ("ref_lp", "values", "scores", "adv"))
    (folder / "ppo.rpeg").write_text((PIPELINES / "tiny_ppo.rpeg").read_text() + pins)
    (folder / "cluster.rpeg").write_text(CLUSTER.format(n=dp, profile=PROFILE))
    assert main(["compile", str(folder / "ppo.rpeg"), "--cluster", str(folder / "cluster.rpeg"),
                 "--strategy", "pinned", "-o", str(folder / "plan.json")]) == 0
    run_dir = folder / "run"
    assert main(["run", str(folder / "plan.json"), "--steps", str(steps), "--run-dir",
                 str(run_dir), "--checkpoint-every", "2", "--no-progress"]) == 0
    return run_dir


def _rows(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k not in TIMING}
            for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _replica_bytes(step_dir: Path) -> int:
    """Bytes of the replicas' state in a checkpoint (not the carried outputs or the state)."""
    return sum(f.stat().st_size for d in step_dir.iterdir() if d.is_dir()
               for f in d.rglob("*") if f.is_file())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("ckpt")
    return _run(base / "dp2", 2), _run(base / "dp1", 1)


def test_a_zero3_dp2_checkpoint_is_about_the_dp1_size(runs):
    dp2, dp1 = runs
    a = _replica_bytes(dp2 / "checkpoints" / "step-000004")
    b = _replica_bytes(dp1 / "checkpoints" / "step-000004")
    assert a <= 1.3 * b, (a, b)
    assert list((dp2 / "checkpoints" / "step-000004").glob("actor.dcp/*.safetensors"))


def test_a_run_resumed_from_a_sharded_checkpoint_continues_exactly(runs, tmp_path):
    dp2, _ = runs
    run_dir = tmp_path / "run"
    shutil.copytree(dp2, run_dir)
    before = _rows(run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-000004")       # as if killed after step 2
    meta = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    assert main(["run", "--resume", str(run_dir), "--no-progress"]) == 0
    assert _rows(run_dir) == before
    assert verify_run(run_dir).ok


def test_a_dp2_checkpoint_resumes_at_dp1(runs, tmp_path):
    dp2, _ = runs
    run_dir = tmp_path / "run"
    shutil.copytree(dp2, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-000004")
    meta = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    assert main(["run", "--resume", str(run_dir), "--devices", "1", "--steps", "6",
                 "--no-progress"]) == 0
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["replans"][-1]["to_devices"] == 1 and meta["replans"][-1]["from_step"] == 2
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == list(range(6))
    assert all(math.isfinite(r["reward"]) for r in rows)
    assert verify_run(run_dir).ok
