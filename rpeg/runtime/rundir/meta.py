"""run.json: a run's record of itself, as a typed value.

    >>> meta = RunMeta.new("tiny_ppo", steps=60, scheduler="local", started=0.0,
    ...                    spec=None, overrides=())
    >>> meta.status, sorted(meta.to_json())[:4]
    (<Status.RUNNING: 'running'>, ['overrides', 'pipeline', 'recoveries', 'replans'])
    >>> RunMeta.from_json(meta.to_json()) == meta
    True

The runner fills it in as the run goes (its workers and where each model lives once they
are set up, each loss and re-plan, the status it ended with) and writes it to run.json at
each of those points. The JSON keys are those every rpeg has written, so a run directory
made before still resumes: keys this version does not know (an older ``spec_dir``) are
kept as they were, and a field not yet known is left out, as it was (``tasks`` until the
first task, ``wall_s`` until the run first ends, ``cuda`` until the workers first start).
``rpeg verify`` and ``record.json`` read the file as JSON (``rpeg.runtime.rundir.check``).
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from rpeg.runtime.rundir.directory import NOT_STARTED


class Status(enum.Enum):
    """How the run stands (run.json's ``status``)."""

    RUNNING = "running"
    OK = "ok"
    INTERRUPTED = "interrupted"       # Ctrl-C: stopped at a checkpoint
    TERMINATED = "terminated"         # SIGTERM
    FAILED = "failed"
    NOT_STARTED = NOT_STARTED         # failed before its first step: the start can be retried
    UNKNOWN = "unknown"               # a record that says something else (read, never written)


def _entry(cls):
    """A record of one event of the run (a list entry of run.json): its fields, and the keys
    a record read back holds beyond them, kept as they were."""
    cls = attrs.frozen(cls)
    names = [f.name for f in attrs.fields(cls) if f.name != "extra"]

    def to_json(self) -> dict:
        out = dict(self.extra)
        out.update((n, getattr(self, n)) for n in names
                   if not (n in _OPTIONAL and getattr(self, n) is None))
        return out

    def from_json(value: dict):
        known = {n: value[n] for n in names if n in value}
        return cls(**known, extra={k: v for k, v in value.items() if k not in names})

    cls.to_json = to_json
    cls.from_json = staticmethod(from_json)
    return cls


_OPTIONAL = {"abandoned_ops"}         # entry fields left out until known


def _extra():
    return attrs.field(factory=dict, kw_only=True, eq=False, repr=False)


@_entry
class Recovery:
    """A worker lost (or stuck) and the rollback after it."""

    attempt: int = 0
    device: int = -1
    worker: str = "?"
    op: str = ""
    step: int = -1
    reason: str = ""
    stimulus: str = ""                # the core's event that found it ("": seen outside it)
    rolled_back_to: int = 0
    at: float = 0.0
    abandoned_ops: int | None = None  # ops the workers still there had finished, -1 unknown
    extra: dict = _extra()


@_entry
class Replan:
    """The plan re-made for the devices left; the new plan governs ``from_step`` on."""

    why: str = ""
    from_devices: int = 0
    to_devices: int = 0
    from_step: int = 0
    at: float = 0.0
    extra: dict = _extra()


@_entry
class Resume:
    """``rpeg run --resume``: where it continued from, and what it set aside."""

    from_step: int = 0
    at: float = 0.0
    checkpoint: str = ""
    set_aside: list = attrs.field(factory=list)
    damaged_checkpoints: list = attrs.field(factory=list)
    extra: dict = _extra()


@_entry
class Extension:
    """A finished run extended to more steps, restarted at ``from_step``."""

    from_step: int = 0
    from_steps: int = 0
    to_steps: int = 0
    at: float = 0.0
    extra: dict = _extra()


def _devices(value: dict) -> dict[int, Any]:
    return {int(d): v for d, v in value.items()}


@attrs.define
class RunMeta:
    """run.json, field by field (the JSON key is the field's name)."""

    pipeline: str
    steps: int
    status: Status = Status.RUNNING
    scheduler: str = "local"
    started: float | None = None
    spec: str | None = None                        # the spec's absolute path (written as null)
    overrides: list[str] = attrs.field(factory=list)      # KEY=VALUE the pipeline was checked with
    recoveries: list[Recovery] = attrs.field(factory=list)
    replans: list[Replan] = attrs.field(factory=list)
    resumes: list[Resume] = attrs.field(factory=list)
    extensions: list[Extension] = attrs.field(factory=list)   # written once there is one
    checkpoint_every: int | None = None
    trackers: list[str] | None = None              # TensorBoard reads it (tensorboard.py)
    # once the workers are set up
    setup_s: float | None = None
    workers: dict[int, str] = attrs.field(factory=dict)        # device -> its worker now
    worker_history: dict[int, list[str]] = attrs.field(factory=dict)   # every worker it had
    homes: dict[str, list[int]] | None = None      # model -> the devices of its replicas
    cuda: bool | None = None
    gpus: dict[int, str] = attrs.field(factory=dict)           # device -> "host:gpu"
    # as the run goes, and when it ends
    tasks: int = 0                                 # Dask tasks submitted
    host: dict | None = None                       # rpeg.runtime.rundir.directory.host_usage
    wall_s: float | None = None
    error: str | None = None                       # why a failed run stopped (its message)
    files: dict[str, str] = attrs.field(factory=dict)   # input file -> its content's hash
    extra: dict = attrs.field(factory=dict)        # keys of an older record, kept as they were

    @classmethod
    def new(cls, pipeline: str, *, steps: int, scheduler: str, started: float,
            spec: str | None, overrides) -> RunMeta:
        return cls(pipeline, steps, Status.RUNNING, scheduler, started, spec, list(overrides))

    def to_json(self) -> dict:
        out: dict = dict(self.extra)
        out.update(pipeline=self.pipeline, steps=self.steps, status=self.status.value,
                   scheduler=self.scheduler, spec=self.spec, overrides=list(self.overrides),
                   recoveries=[r.to_json() for r in self.recoveries],
                   replans=[r.to_json() for r in self.replans],
                   resumes=[r.to_json() for r in self.resumes])
        optional = {
            "started": self.started,
            "extensions": [x.to_json() for x in self.extensions] or None,
            "checkpoint_every": self.checkpoint_every,
            "trackers": self.trackers,
            "setup_s": self.setup_s,
            "workers": {str(d): a for d, a in self.workers.items()} if self.workers else None,
            "worker_history": {str(d): list(a) for d, a in self.worker_history.items()}
            if self.worker_history else None,
            "homes": self.homes,
            "cuda": self.cuda,
            "gpus": {str(d): g for d, g in self.gpus.items()} if self.gpus else None,
            "tasks": self.tasks or None,
            "host": self.host,
            "wall_s": self.wall_s,
            "error": self.error,
            "files": self.files or None,
        }
        out.update((k, v) for k, v in optional.items() if v is not None)
        return out

    @classmethod
    def from_json(cls, value: dict) -> RunMeta:
        """run.json as read back (checked first by ``rpeg.runtime.rundir.check.check_meta``)."""
        v = dict(value)
        try:
            status = Status(v.pop("status", "unknown"))
        except ValueError:
            status = Status.UNKNOWN
        out = cls(
            pipeline=v.pop("pipeline", ""), steps=int(v.pop("steps")), status=status,
            scheduler=v.pop("scheduler", "local"), started=v.pop("started", None),
            spec=v.pop("spec", None), overrides=list(v.pop("overrides", [])),
            recoveries=[Recovery.from_json(r) for r in v.pop("recoveries", [])],
            replans=[Replan.from_json(r) for r in v.pop("replans", [])],
            resumes=[Resume.from_json(r) for r in v.pop("resumes", [])],
            extensions=[Extension.from_json(r) for r in v.pop("extensions", [])],
            checkpoint_every=v.pop("checkpoint_every", None),
            trackers=v.pop("trackers", None), setup_s=v.pop("setup_s", None),
            workers=_devices(v.pop("workers", {})),
            worker_history={d: list(a) for d, a in _devices(v.pop("worker_history",
                                                                    {})).items()},
            homes=v.pop("homes", None), cuda=v.pop("cuda", None),
            gpus=_devices(v.pop("gpus", {})), tasks=int(v.pop("tasks", 0)),
            host=v.pop("host", None), wall_s=v.pop("wall_s", None),
            error=v.pop("error", None), files=dict(v.pop("files", None) or {}))
        out.extra = v
        return out

    def started_or(self, now: float) -> float:
        """When the run started, or ``now`` for a record that does not say."""
        return now if self.started is None else self.started

    def lost_workers(self) -> set[str]:
        """The workers of every loss so far (a replacement is never one of them)."""
        return {r.worker for r in self.recoveries}
