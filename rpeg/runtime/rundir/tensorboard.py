"""TensorBoard event files beside metrics.jsonl, when the ``tensorboard`` extra is installed.

    $ pip install 'rpeg[tensorboard]'
    $ rpeg run pipelines/tiny_ppo.rpeg            # runs/tiny_ppo-.../events.out.tfevents.*.rpeg
    $ tensorboard --logdir runs                    # every run a curve of its own

>>> write_events("runs/tiny_ppo-20261130-011500")             # doctest: +SKIP
PosixPath('runs/tiny_ppo-20261130-011500/events.out.tfevents.1796001649.rpeg')

Each step's row is appended as the step ends (:func:`append_event`, called by
``RunDir.append_metrics``), and the file is rewritten whole when the run ends
(:func:`write_events`, from the record), so a run that rolled back to a
checkpoint keeps only the steps that stand; writing it again gives the same
file. One scalar per numeric column of metrics.jsonl, tagged by its name
(TensorBoard groups ``grad_norm/actor_step`` under ``grad_norm``; a dotted name
is written with a slash), at the step of its row and the wall time the step
ended. Uses tensorboard's own record writer and protocol buffers: no torch, no
TensorFlow. Nothing is written when tensorboard is absent.
"""

from __future__ import annotations

import importlib.util
import math
import os
import time
from pathlib import Path


def available() -> bool:
    return importlib.util.find_spec("tensorboard") is not None


def chosen(run_dir: Path) -> bool:
    """Whether the run logs to TensorBoard: its trackers (run.json) name it, as by default."""
    trackers = _json(Path(run_dir) / "run.json").get("trackers", ["tensorboard"])
    return "tensorboard" in trackers


def event_file(run_dir: Path, started: float) -> Path:
    return Path(run_dir) / f"events.out.tfevents.{int(started)}.rpeg"


def write_events(run_dir: str | Path) -> Path | None:
    """(Re)write the run's event file from metrics.jsonl; None when tensorboard is absent or
    the run's trackers leave it out."""
    if not available() or not chosen(run_dir):
        return None
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.summary.writer.record_writer import RecordWriter

    run_dir = Path(run_dir)
    rows = _rows(run_dir / "metrics.jsonl")
    meta = _json(run_dir / "run.json")
    started = _number(meta.get("started"), time.time())
    wall = started + _number(meta.get("setup_s"), 0.0)
    for old in run_dir.glob("events.out.tfevents.*.rpeg"):
        old.unlink()
    path = event_file(run_dir, started)
    tmp = path.with_name(path.name + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644),
              "wb") as f:
        w = RecordWriter(f)
        w.write(Event(wall_time=started, file_version="brain.Event:2").SerializeToString())
        for row in rows:
            wall += _number(row.get("step_time_s"), 0.0)
            w.write(_event(row, wall).SerializeToString())
        for row in _rows(run_dir / "eval.jsonl"):        # evaluations: eval/reward, ...
            w.write(_event(eval_scalars(row), wall).SerializeToString())
        w.flush()
    tmp.replace(path)
    return path


def append_event(run_dir: str | Path, row: dict) -> Path | None:
    """Append one metrics row to the run's event file as the step ends, so TensorBoard
    shows a run while it goes; None (and nothing written) without tensorboard. Never
    raises: a metrics side channel must not stop a run."""
    if not available():
        return None
    try:
        if not chosen(run_dir):
            return None
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.summary.writer.record_writer import RecordWriter

        run_dir = Path(run_dir)
        existing = sorted(run_dir.glob("events.out.tfevents.*.rpeg"))
        started = _number(_json(run_dir / "run.json").get("started"), time.time())
        path = existing[0] if existing else event_file(run_dir, started)
        with open(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                          | os.O_NONBLOCK, 0o644), "ab") as f:
            w = RecordWriter(f)
            if f.tell() == 0:
                w.write(Event(wall_time=started, file_version="brain.Event:2").SerializeToString())
            w.write(_event(row, time.time()).SerializeToString())
            w.flush()
        return path
    except Exception:  # noqa: BLE001 — see the docstring; the run's end rewrites the file
        return None


def _event(row: dict, wall: float):
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    values = [Summary.Value(tag=tag(k), simple_value=float(v)) for k, v in sorted(row.items())
              if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)]
    return Event(wall_time=wall, step=int(row.get("step", 0)), summary=Summary(value=values))


def eval_scalars(row: dict) -> dict:
    """An eval.jsonl row as scalars ``eval.reward``, ``eval.accuracy``, ``eval.pass@k``."""
    keep = ("reward", "accuracy", "response_len")
    return {"step": row["step"], **{f"eval.{k}": v for k, v in row.items()
                                    if k in keep or k.startswith("pass@")}}


def _number(value: object, default: float) -> float:
    """A finite number from a record, or ``default`` (a damaged record still gets events)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(float(value)):
        return float(value)
    return default


def tag(name: str) -> str:
    """``actor_step.grad_norm`` -> ``actor_step/grad_norm``; plain names stay as they are."""
    return name.replace(".", "/")


def _rows(p: Path) -> list[dict]:
    from rpeg.runtime.rundir.files import read_metrics
    return read_metrics(p.parent, name=p.name)[0]      # damaged lines are left out


def _json(p: Path) -> dict:
    from rpeg.errors import RpegError
    from rpeg.runtime.rundir.files import read_json
    try:
        got = read_json(p, "run record", 1 << 20)
    except RpegError:
        return {}
    return got if isinstance(got, dict) else {}
