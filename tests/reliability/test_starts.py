"""Starts are atomic: nothing is written to --run-dir until the inputs are checked and the
cluster is reached, so a start refused there leaves nothing; a start that fails after that,
before its first step, leaves the directory marked failed-before-start, and the same
command runs into it once the cause is gone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.errors import RuntimeFailure
from tests.backends.ranks import free_port
from tests.reliability.test_faults import micro_spec
from tests.reliability.test_hostile_input import no_hang
from tests.reliability.test_run_dirs import _refused


@pytest.fixture
def spec(tmp_path) -> Path:
    return micro_spec(tmp_path / "micro")


def _argv(spec: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["run", str(spec), "--steps", "2", "--no-progress", "--strategy", "runtime-split",
            "--run-dir", str(run_dir), *extra]


def test_an_unknown_tracker_is_refused_before_anything_is_written(spec, tmp_path, capsys):
    run_dir = tmp_path / "run"
    _refused(_argv(spec, run_dir, "--tracker", "neptune"), capsys, "--tracker", "neptune")
    assert not run_dir.exists()


def test_an_unreachable_scheduler_is_refused_before_anything_is_written(spec, tmp_path,
                                                                          capsys):
    run_dir = tmp_path / "run"
    _refused(_argv(spec, run_dir, "--scheduler", f"tcp://127.0.0.1:{free_port()}"), capsys,
             "must be reachable")
    assert not run_dir.exists()


def test_a_missing_dataset_is_refused_before_anything_is_written(spec, tmp_path, capsys):
    (spec.parent / "data" / "toy.jsonl").unlink()
    run_dir = tmp_path / "run"
    _refused(_argv(spec, run_dir), capsys, "toy.jsonl", "must exist")
    assert not run_dir.exists()


def _failing_set_up(monkeypatch):
    from rpeg.runtime.dask.checkpointing import Starter

    def fail(self, number, plan):
        raise RuntimeFailure("worker set-up must succeed, and it failed: (a test's failure)")
    monkeypatch.setattr(Starter, "start", fail)


def test_a_start_failing_before_its_first_step_is_marked_and_not_resumable(spec, tmp_path,
                                                                            capsys, monkeypatch):
    run_dir = tmp_path / "run"
    _failing_set_up(monkeypatch)
    with no_hang(600):
        _refused(_argv(spec, run_dir), capsys, "a test's failure")
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "failed-before-start"
    _refused(["run", "--resume", str(run_dir), "--no-progress"], capsys,
             "must hold a complete checkpoint", "--run-dir")


@pytest.mark.slow          # real runs on a local Dask cluster
def test_the_same_command_runs_into_a_start_that_failed(spec, tmp_path, capsys, monkeypatch):
    run_dir = tmp_path / "run"
    with monkeypatch.context() as m:
        _failing_set_up(m)
        with no_hang(600):
            assert main(_argv(spec, run_dir)) == 1
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed-before-start"
    with no_hang(900):
        assert main(_argv(spec, run_dir)) == 0
    assert json.loads((run_dir / "run.json").read_text())["status"] == "ok"
    assert main(["verify", str(run_dir)]) == 0


@pytest.mark.slow          # a scheduler started by the test, and a real run on it
def test_a_scheduler_reached_on_the_second_try_runs_the_same_command(spec, tmp_path, capsys):
    import logging

    from distributed import LocalCluster
    port = free_port()
    run_dir = tmp_path / "run"
    argv = _argv(spec, run_dir, "--scheduler", f"tcp://127.0.0.1:{port}")
    assert main(argv) == 1 and not run_dir.exists()
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
                      host="127.0.0.1", scheduler_port=port, dashboard_address=None,
                      silence_logs=logging.ERROR), no_hang(900):
        assert main(argv) == 0
    assert main(["verify", str(run_dir)]) == 0


def test_a_run_dir_holding_what_the_run_reads_is_refused_before_anything(spec, capsys):
    before = sorted(p.name for p in spec.parent.rglob("*"))
    _refused(_argv(spec, spec.parent), capsys, "--run-dir must not name a folder holding",
             "toy.jsonl")
    _refused(_argv(spec, spec.parent / "data"), capsys, "which this command reads")
    assert sorted(p.name for p in spec.parent.rglob("*")) == before


def test_a_folder_holding_a_file_a_run_writes_is_refused_naming_it(spec, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "plan.json").write_text("{}")
    _refused(_argv(spec, mine), capsys, "it holds plan.json, which a run writes")
    assert (mine / "plan.json").read_text() == "{}" and len(list(mine.iterdir())) == 1


def test_a_resume_keeps_the_runs_steps_between_checkpoints(micro_run, tmp_path, capsys,
                                                           monkeypatch):
    import rpeg.runtime.dask.resume as resume
    from rpeg.runtime.rundir.directory import RunDir
    made = json.loads((micro_run / "run.json").read_text())["checkpoint_every"]
    assert made == 2
    used = []
    monkeypatch.setattr(resume, "resume_run", lambda path, options, resilience, **kw:
                        used.append(resilience.checkpoint_every) or
                        type("R", (), {"path": RunDir(Path(path)).path, "steps": 4})())
    for extra, want in (((), made), (("--checkpoint-every", "3"), 3)):
        assert main(["run", "--resume", str(micro_run), "--no-progress", *extra]) == 0
        assert used.pop() == want
