"""Experiment trackers beside TensorBoard: Weights & Biases and MLflow, as optional extras.

    log { trackers = [tensorboard, wandb, mlflow]; project = "gsm" }    # in the spec
    $ rpeg run spec.rpeg --tracker wandb --tracker mlflow                # or for one run

    >>> t = Trackers.open(pipeline, run_dir, chosen=("wandb",))      # doctest: +SKIP
    >>> t.log({"step": 0, "reward": 0.2}); t.close()                 # doctest: +SKIP

Each step's metrics row and each evaluation (as ``eval/reward``, ``eval/accuracy``,
``eval/pass@k``) go to every chosen tracker as the run goes. TensorBoard needs nothing
here (``rpeg.runtime.rundir.tensorboard`` writes beside metrics.jsonl whenever it is installed).
W&B writes into the run directory (``wandb/``) and runs in its offline mode unless
``WANDB_MODE`` says otherwise (``wandb sync`` uploads it later); MLflow logs to a SQLite
store in the run directory (``mlflow.db``; ``mlflow ui --backend-store-uri
sqlite:///RUN/mlflow.db``) unless ``MLFLOW_TRACKING_URI`` names another.
A chosen tracker that is not installed stops the run before it starts, naming the extra
to install; one that fails mid-run is dropped with a warning, never the run.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from rpeg.errors import RuntimeFailure
from rpeg.spec.training import Tracker

EXTRAS = {Tracker.WANDB: "wandb", Tracker.MLFLOW: "mlflow", Tracker.TENSORBOARD: "tensorboard"}


def chosen(pipeline, names: tuple[str, ...] = ()) -> tuple[Tracker, ...]:
    """The spec's trackers, or the command line's when it names any."""
    if not names:
        return pipeline.log.trackers
    out = []
    for n in names:
        try:
            out.append(Tracker(n))
        except ValueError:
            raise RuntimeFailure(f"--tracker must be one of "
                                 f"{', '.join(t.value for t in Tracker)}, not {n!r}") from None
    return tuple(dict.fromkeys(out))


def check_installed(trackers: tuple[Tracker, ...]) -> None:
    """W&B and MLflow must be installed when chosen; TensorBoard, chosen by default, is
    written whenever it is installed (as before there were trackers to choose)."""
    for t in trackers:
        if t is not Tracker.TENSORBOARD and importlib.util.find_spec(EXTRAS[t]) is None:
            raise RuntimeFailure(f"tracker {t.value} must be installed to log to it, and it is "
                                 "not", hint=f"pip install 'rpeg[{EXTRAS[t]}]', or leave "
                                             f"{t.value} out of log {{ trackers = [...] }}")


class Trackers:
    """The run's open trackers (W&B and MLflow; TensorBoard is written elsewhere)."""

    def __init__(self, sinks: list) -> None:
        self.sinks = sinks

    @classmethod
    def open(cls, pipeline, run_dir: Path, trackers: tuple[Tracker, ...], *,
             config: dict | None = None, resume: bool = False) -> Trackers:
        check_installed(trackers)
        sinks = []
        name = Path(run_dir).name
        for t in trackers:
            if t is Tracker.WANDB:
                sinks.append(_Wandb(pipeline.log.project, name, Path(run_dir), config, resume))
            elif t is Tracker.MLFLOW:
                sinks.append(_Mlflow(pipeline.log.project, name, Path(run_dir), config, resume))
        return cls(sinks)

    def log(self, row: dict) -> None:
        self._each("log", _scalars(row), int(row.get("step", 0)))

    def log_eval(self, row: dict) -> None:
        keep = {k: v for k, v in row.items() if k in ("reward", "accuracy", "response_len")
                or k.startswith("pass@")}
        self._each("log", {f"eval/{k}": v for k, v in keep.items()}, int(row["step"]))

    def close(self) -> None:
        self._each("close")
        self.sinks = []

    def _each(self, method: str, *args) -> None:
        for s in list(self.sinks):
            try:
                getattr(s, method)(*args)
            except Exception as e:  # noqa: BLE001 — a tracker must never stop a run
                print(f"rpeg: warning: tracker {s.name} dropped: {type(e).__name__}: {e}",
                      file=sys.stderr)
                self.sinks.remove(s)


def _scalars(row: dict) -> dict:
    return {k.replace(".", "/"): float(v) for k, v in row.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class _Wandb:
    name = "wandb"

    def __init__(self, project: str, run_name: str, run_dir: Path, config, resume) -> None:
        import wandb
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        self.wandb = wandb
        self.run = wandb.init(project=project, name=run_name, id=_run_id(run_name),
                              dir=str(run_dir), config=config or {},
                              resume="allow" if resume else None, reinit="finish_previous")

    def log(self, values: dict, step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    name = "mlflow"

    def __init__(self, project: str, run_name: str, run_dir: Path, config, resume) -> None:
        import mlflow
        self.mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(project)
        existing = None
        if resume:
            found = mlflow.search_runs(filter_string=f"tags.mlflow.runName = '{run_name}'",
                                       output_format="list")
            existing = found[0].info.run_id if found else None
        self.run = mlflow.start_run(run_id=existing, run_name=None if existing else run_name)
        if config and not existing:
            mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, values: dict, step: int) -> None:
        self.mlflow.log_metrics({k.replace("@", "_at_"): v for k, v in values.items()},
                                step=step)

    def close(self) -> None:
        self.mlflow.end_run()


def _run_id(name: str) -> str:
    """A W&B run id from the run directory's name (letters, digits, -, _ only)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:64]
