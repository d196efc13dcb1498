"""A run resumed onto another number of devices from a checkpoint that carries outputs
over its cut (a staleness-1 rollout of the step after it): the new plan's ops and chunks
are not the old one's, so the run restarts at the cut with every replica at the
checkpoint's version, and finishes, verified (it stopped with KeyError on the carried
chunk, and the plan it had swapped in refused every later resume)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.runtime import verify_run

pytestmark = pytest.mark.slow

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def test_a_carrying_checkpoint_resumes_on_fewer_devices(tmp_path, capsys):
    (tmp_path / "data").symlink_to(PIPELINES / "data")
    shutil.copy(PIPELINES / "rewards.py", tmp_path / "rewards.py")
    spec = tmp_path / "grpo.rpeg"
    spec.write_text((PIPELINES / "tiny_grpo.rpeg").read_text())
    run_dir = tmp_path / "run"
    assert main(["run", str(spec), "--steps", "8", "--checkpoint-every", "4", "--strategy",
                 "runtime-split", "--run-dir", str(run_dir), "--no-progress"]) == 0
    assert "dask dashboard" not in capsys.readouterr().out    # stdout: what a command outputs
    carried = run_dir / "checkpoints" / "step-000004"
    state = json.loads((carried / "state.json").read_text())
    assert state["carry"], state                     # the next step's rollout, made before
    shutil.rmtree(run_dir / "checkpoints" / "step-000008")      # as if killed after step 6
    meta = json.loads((run_dir / "run.json").read_text())
    (run_dir / "run.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    assert main(["run", "--resume", str(run_dir), "--devices", "1", "--no-progress"]) == 0
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["replans"][-1]["to_devices"] == 1 and meta["replans"][-1]["from_step"] == 4
    assert meta["extensions"][-1]["from_step"] == 4            # restarted at the cut
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(8))
    assert all(math.isfinite(r["reward"]) for r in rows)
    assert verify_run(run_dir).ok
    capsys.readouterr()
    assert main(["show", str(run_dir), "--no-verify"]) == 0       # show says how it went on
    out = capsys.readouterr().out
    assert "resumed at step 4 from step-000004" in out
    assert "re-planned from step 4: 2 to 1 device(s)" in out
    # a damaged run.json is said, not passed over for record.json's status
    (run_dir / "run.json").write_text('{"x": ')
    main(["show", str(run_dir), "--no-verify"])
    assert "warning: run.json is not JSON" in capsys.readouterr().out
