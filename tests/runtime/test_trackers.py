"""Trackers: W&B (offline) and MLflow (a file store in the run directory) receive each
step's metrics and each evaluation; chosen in the spec or on the command line."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rpeg.errors import RuntimeFailure
from rpeg.runtime.rundir import trackers as T
from rpeg.spec import load
from rpeg.spec.overrides import parse_overrides
from rpeg.spec.training import Tracker

SPEC = Path(__file__).resolve().parents[2] / "pipelines" / "tiny_grpo.rpeg"
ROWS = [{"step": 0, "reward": 0.2, "grad_norm.actor_step": 1.5, "note": "x"},
        {"step": 1, "reward": 0.4, "grad_norm.actor_step": 1.1}]
EVAL = {"step": 2, "reward": 0.5, "accuracy": 0.5, "pass@4": 0.75, "prompts": 8}


def _pipeline(trackers: str = "[tensorboard]"):
    return load(SPEC, parse_overrides([f"log.trackers={trackers}"]))


def test_the_command_line_replaces_the_specs_choice():
    p = _pipeline("[wandb]")
    assert T.chosen(p) == (Tracker.WANDB,)
    assert T.chosen(p, ("mlflow", "mlflow")) == (Tracker.MLFLOW,)
    with pytest.raises(RuntimeFailure, match="--tracker must be one of tensorboard, wandb, "
                                             "mlflow, not 'neptune'"):
        T.chosen(p, ("neptune",))


def test_a_missing_tracker_stops_the_run_before_it_starts(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RuntimeFailure, match="tracker wandb must be installed") as info:
        T.check_installed((Tracker.WANDB,))
    assert "pip install 'rpeg[wandb]'" in info.value.hint


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb is not installed (pip install 'rpeg[wandb]')")
def test_wandb_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    # on a loaded machine W&B's service starts slowly; past its waits the tracker is dropped
    # (as a failing tracker is, mid-run) and the log stays empty: wait as long as a hang guard
    monkeypatch.setenv("WANDB__SERVICE_WAIT", "600")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "600")
    t = T.Trackers.open(_pipeline("[wandb]"), tmp_path, (Tracker.WANDB,), config={"a": 1})
    for row in ROWS:
        t.log(row)
    t.log_eval(EVAL)
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb")), list((tmp_path / "wandb").iterdir())
    # the offline log (protocol buffers) names every metric logged, to be synced later
    keys = (b"reward", b"grad_norm/actor_step", b"eval/accuracy", b"eval/pass@4")
    log = _written(next(runs[0].glob("*.wandb")), keys)
    for key in keys:
        assert key in log, key
    assert b"note" not in log                      # text columns are not metrics


def _written(path, keys, guard_s: float = 120.0) -> bytes:
    """The file once it holds every key: W&B's service process writes it and may still be
    flushing when ``finish`` returns on a loaded machine (a hang guard, not a speed target)."""
    import time
    deadline = time.monotonic() + guard_s
    while True:
        data = path.read_bytes()
        if all(k in data for k in keys) or time.monotonic() > deadline:
            return data
        time.sleep(0.5)


@pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                    reason="mlflow is not installed (pip install 'rpeg[mlflow]')")
def test_mlflow_file_store(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    import mlflow
    t = T.Trackers.open(_pipeline("[mlflow]"), tmp_path, (Tracker.MLFLOW,), config={"a": 1})
    for row in ROWS:
        t.log(row)
    t.log_eval(EVAL)
    t.close()
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = mlflow.search_runs(experiment_names=["rpeg"], output_format="list")
    history = mlflow.tracking.MlflowClient().get_metric_history(run.info.run_id, "reward")
    assert [(m.step, m.value) for m in history] == [(0, 0.2), (1, 0.4)]
    assert run.data.metrics["eval/pass_at_4"] == 0.75
    assert run.data.metrics["grad_norm/actor_step"] == 1.1


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None,
                    reason="tensorboard is not installed (pip install 'rpeg[tensorboard]')")
def test_tensorboard_is_written_only_when_chosen(tmp_path):
    import json

    from rpeg.runtime.rundir.tensorboard import append_event, write_events
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS[:1]))
    (tmp_path / "run.json").write_text(json.dumps({"started": 1.0, "trackers": ["wandb"]}))
    assert append_event(tmp_path, ROWS[0]) is None and write_events(tmp_path) is None
    assert not list(tmp_path.glob("events.out.tfevents.*"))
    (tmp_path / "run.json").write_text(json.dumps({"started": 1.0}))     # as by default
    assert write_events(tmp_path) is not None
