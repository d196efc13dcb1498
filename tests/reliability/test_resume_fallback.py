"""Resume never throws away what was done: a damaged latest checkpoint falls back to the
latest complete one, the metrics up to it stay in metrics.jsonl and the rows after it move
to a file of their own, the damaged checkpoint is kept under its own name (never
overwritten), and the run goes on to verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpeg.cli import main
from tests.reliability.test_hostile_input import no_hang
from tests.reliability.test_run_dirs import _tree
from tests.reliability.test_tensors import _damage


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line]


@pytest.mark.slow          # a real resume (2 steps on a local Dask cluster); refusals are fast
@pytest.mark.parametrize("case", ["nan", "truncated"])
def test_a_damaged_latest_checkpoint_resumes_from_the_one_before(run, capsys, case):
    rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    latest = run / "checkpoints" / "step-000004"
    _damage(latest, case)
    damaged = _tree(latest)
    meta = json.loads((run / "run.json").read_text())
    meta["status"] = "interrupted"
    (run / "run.json").write_text(json.dumps(meta))
    capsys.readouterr()
    with no_hang(900):
        assert main(["run", "--resume", str(run), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "skipping a damaged checkpoint" in err and "from step-000002" in err, err
    assert "metrics.set-aside-1.jsonl" in err and "step-000004.damaged-1" in err
    # the steps before the checkpoint kept, those after it moved aside as they were
    assert _steps(run / "metrics.jsonl") == [0, 1, 2, 3]
    assert (run / "metrics.set-aside-1.jsonl").read_text() == "".join(rows[2:])
    assert (run / "metrics.jsonl").read_text().splitlines(keepends=True)[:2] == rows[:2]
    # the damaged checkpoint kept as it was; a new one made beside it
    assert _tree(run / "checkpoints" / "step-000004.damaged-1") == damaged
    assert (run / "checkpoints" / "step-000004" / "COMPLETE").is_file()
    resumed = json.loads((run / "run.json").read_text())["resumes"][-1]
    assert resumed["from_step"] == 2 and "metrics.set-aside-1.jsonl" in resumed["set_aside"]
    assert resumed["damaged_checkpoints"] == ["step-000004.damaged-1"]
    assert main(["verify", str(run)]) == 0
