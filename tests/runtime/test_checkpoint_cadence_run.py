"""A real run cuts at its spec's ``checkpoint_every`` and records it, so that a resume keeps
it (``rpeg.runtime.dask.resume.recorded_cadence``); ``--checkpoint-every`` replaces it."""

from __future__ import annotations

import json

import pytest

from rpeg.cli import main
from rpeg.runtime.dask.resume import recorded_cadence
from rpeg.runtime.rundir.serial import loads
from tests.reliability.test_faults import micro_spec
from tests.reliability.test_hostile_input import no_hang


def _checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.slow      # two real runs; the choice of cadence alone: tests/cli/test_checkpoint_cadence.py
def test_a_run_cuts_at_the_specs_cadence_or_the_flags_and_records_it(tmp_path):
    spec = micro_spec(tmp_path / "micro")
    spec.write_text(spec.read_text().replace("seed = 0", "seed = 0; checkpoint_every = 2"))
    run_dir = tmp_path / "run"
    with no_hang(900):
        assert main(["run", str(spec), "--steps", "3", "--no-progress", "--strategy",
                     "runtime-split", "--run-dir", str(run_dir)]) == 0
    assert _checkpoints(run_dir) == ["step-000002", "step-000003"]
    assert json.loads((run_dir / "run.json").read_text())["checkpoint_every"] == 2
    assert recorded_cadence(run_dir) == 2
    assert loads((run_dir / "pipeline.json").read_text()).workload.checkpoint_every == 2
    flagged = tmp_path / "flagged"
    with no_hang(900):
        assert main(["run", str(spec), "--steps", "3", "--no-progress", "--strategy",
                     "runtime-split", "--run-dir", str(flagged), "--checkpoint-every", "0"]) == 0
    assert _checkpoints(flagged) == ["step-000003"]          # 0: one segment, cut at the end
    assert loads((flagged / "pipeline.json").read_text()).workload.checkpoint_every == 0
    assert recorded_cadence(flagged) == 0                     # a resume keeps it: none between
    with no_hang(900):              # resumed further: still no checkpoint between
        assert main(["run", "--resume", str(flagged), "--steps", "5", "--no-progress"]) == 0
    assert _checkpoints(flagged) == ["step-000003", "step-000005"]


@pytest.mark.slow      # a real run
def test_a_run_keeps_the_checkpoints_its_spec_says(tmp_path):
    """keep_checkpoints: the newest N complete ones (2 unless set), 0 every one (the best
    eval's checkpoint was deleted, and export --step could not reach it)."""
    spec = micro_spec(tmp_path / "micro")
    spec.write_text(spec.read_text().replace("seed = 0", "seed = 0; checkpoint_every = 1; "
                                                         "keep_checkpoints = 0"))
    run_dir = tmp_path / "run"
    with no_hang(900):
        assert main(["run", str(spec), "--steps", "4", "--no-progress", "--strategy",
                     "runtime-split", "--run-dir", str(run_dir)]) == 0
    assert _checkpoints(run_dir) == [f"step-00000{k}" for k in (1, 2, 3, 4)]
    three = tmp_path / "three"
    spec.write_text(spec.read_text().replace("keep_checkpoints = 0", "keep_checkpoints = 3"))
    with no_hang(900):
        assert main(["run", str(spec), "--steps", "4", "--no-progress", "--strategy",
                     "runtime-split", "--run-dir", str(three)]) == 0
    assert _checkpoints(three) == [f"step-00000{k}" for k in (2, 3, 4)]
