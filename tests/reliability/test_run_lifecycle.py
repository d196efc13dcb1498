"""A run directory over a run's life, with real runs: two runs into one directory, SIGTERM,
a run extended past its end, and a run that fails. Every wait is a hang guard (minutes),
never a speed target."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rpeg.cli import main
from tests.reliability.test_faults import micro_spec
from tests.reliability.test_hostile_input import no_hang

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 600.0


def _rows(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.endswith("}")]


def _wait(cond, what: str) -> None:
    end = time.time() + WAIT_S
    while not cond():
        if time.time() > end:
            raise AssertionError(f"still waiting for {what} after {WAIT_S:.0f} s: a hang")
        time.sleep(0.2)


def _start(spec: Path, run_dir: Path, steps: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rpeg", "run", str(spec), "--steps", str(steps), "--no-progress",
         "--strategy", "runtime-split", "--checkpoint-every", "2", "--run-dir", str(run_dir),
         *extra], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture
def spec(tmp_path) -> Path:
    return micro_spec(tmp_path / "micro")


def test_a_second_run_into_a_running_directory_is_refused_naming_the_holder(spec, tmp_path,
                                                                            capsys):
    run_dir = tmp_path / "run"
    first = _start(spec, run_dir, 6)
    try:
        _wait(lambda: (run_dir / "run.lock").exists()
              and (run_dir / "run.lock").read_text().strip(), "the first run's lock")
        with no_hang():
            rc = main(["run", str(spec), "--steps", "6", "--no-progress", "--strategy",
                       "runtime-split", "--run-dir", str(run_dir)])
        err = capsys.readouterr().err
        assert rc == 1 and f"pid {first.pid}" in err, err
        _, first_err = first.communicate(timeout=WAIT_S)
    finally:
        first.kill()
    assert first.returncode == 0, first_err
    assert [r["step"] for r in _rows(run_dir)] == list(range(6))
    assert main(["verify", str(run_dir)]) == 0


def test_sigterm_closes_the_record_and_the_run_resumes(spec, tmp_path, capsys):
    run_dir = tmp_path / "run"
    proc = _start(spec, run_dir, 12)
    try:
        _wait(lambda: len(_rows(run_dir)) >= 3, "step 2")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        proc.kill()
    assert proc.returncode == 1 and "terminated (SIGTERM)" in err, err
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["status"] == "terminated"
    trace = json.loads((run_dir / "trace.json").read_text())
    traced = {e["args"]["step"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    done = [r["step"] for r in _rows(run_dir)]
    assert set(done) <= traced, "a finished step's ops are missing from the trace"
    with no_hang():
        assert main(["show", str(run_dir)]) == 1          # shown; verify: steps never ran
    assert "never ran" in capsys.readouterr().out
    with no_hang(WAIT_S):
        assert main(["run", "--resume", str(run_dir), "--no-progress"]) == 0
    assert [r["step"] for r in _rows(run_dir)] == list(range(12))
    assert main(["verify", str(run_dir)]) == 0


def test_resume_with_more_steps_extends_a_finished_run(spec, tmp_path, capsys):
    run_dir = tmp_path / "run"
    with no_hang(WAIT_S):
        assert main(["run", str(spec), "--steps", "3", "--no-progress", "--strategy",
                     "runtime-split", "--checkpoint-every", "2", "--run-dir", str(run_dir)]) == 0
        assert main(["run", "--resume", str(run_dir), "--steps", "5", "--no-progress"]) == 0
    assert "resuming" in capsys.readouterr().err
    meta = json.loads((run_dir / "run.json").read_text())
    assert meta["steps"] == 5 and meta["status"] == "ok"
    assert meta["extensions"][0]["from_step"] == 3
    assert [r["step"] for r in _rows(run_dir)] == list(range(5))
    assert main(["verify", str(run_dir)]) == 0
    # step 3 restarted from version 3, as step 0 starts from version 0
    assert _rows(run_dir)[3]["gen_version"] == 3


def test_a_failed_run_leaves_the_ops_that_ran_in_its_trace(tmp_path, capsys):
    spec = micro_spec(tmp_path / "micro")
    (spec.parent / "rewards_fail.py").write_text(
        "def fail(*args, **kwargs):\n    raise ValueError('no score today')\n")
    spec.write_text(spec.read_text().replace('python("rewards:toy_reward")',
                                             'python("rewards_fail:fail")'))
    run_dir = tmp_path / "run"
    with no_hang(WAIT_S):
        rc = main(["run", str(spec), "--steps", "2", "--no-progress", "--strategy",
                   "runtime-split", "--run-dir", str(run_dir)])
    assert rc == 1 and "no score today" in capsys.readouterr().err
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    trace = json.loads((run_dir / "trace.json").read_text())
    ran = {e["args"]["id"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert any(i.startswith("rollout/s0/") for i in ran), ran
    assert main(["verify", str(run_dir)]) == 1
    report = capsys.readouterr().out
    assert "rollout/s0/c0 (step 0): never ran" not in report
    assert "scores/s0" in report


def test_a_checkpoint_whose_state_names_an_earlier_step_is_passed_over(spec, tmp_path, capsys):
    """The damaged latest checkpoint is skipped with a warning; the resume goes on from the
    one before, and the metrics past it are cut only then, once every check has passed."""
    run_dir = tmp_path / "run"
    with no_hang(WAIT_S):
        assert main(["run", str(spec), "--steps", "4", "--no-progress", "--strategy",
                     "runtime-split", "--checkpoint-every", "2", "--run-dir", str(run_dir)]) == 0
    latest = run_dir / "checkpoints" / "step-000004"
    state = json.loads((latest / "state.json").read_text())
    state["step"] = 2
    (latest / "state.json").write_text(json.dumps(state))
    meta = json.loads((run_dir / "run.json").read_text())
    meta["status"] = "interrupted"
    (run_dir / "run.json").write_text(json.dumps(meta))
    capsys.readouterr()
    with no_hang(WAIT_S):
        assert main(["run", "--resume", str(run_dir), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "skipping a damaged checkpoint" in err and "from step-000002" in err, err
    assert [r["step"] for r in _rows(run_dir)] == list(range(4))
    assert main(["verify", str(run_dir)]) == 0
    shutil.rmtree(run_dir)
