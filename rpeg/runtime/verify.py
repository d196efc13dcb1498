"""Checking a run's trace against its plan: placement, dependencies, parameter versions.

    >>> report = verify_run("runs/tiny_ppo-20261130-011500")                # doctest: +SKIP
    >>> report.ok, len(report.checked)                                      # doctest: +SKIP
    (True, 842)
    >>> print(report)                                                       # doctest: +SKIP
    verified 842 ops of 20 steps: placement, dependencies, versions - ok

The expected op calls are rebuilt from the run's own pipeline and plan (the
same unrolling the run used); the trace says what each worker observed. Checks:

* every expected op ran exactly once, and nothing else ran;
* placement: it ran on the device the plan gave its stage (weight-sync export on
  the model's home, load where the reader is), on the worker mapped to that device;
* dependencies: everything it depends on (data and ordering) ended before it started;
* versions: the parameter version it read is within ``[step - k, step]`` for its
  staleness bound k (exactly ``step`` for training), and a train op wrote ``step + 1``.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from rpeg.errors import RpegError, RuntimeFailure, Span
from rpeg.plan.model import Plan
from rpeg.runtime.instances import LOAD, OpCall, build_calls, model_homes
from rpeg.runtime.rundir import RunDir, events_from_trace
from rpeg.runtime.serial import loads, plan_from_json
from rpeg.spec.model import OpKind

# Clock resolution between processes on one machine: ends and starts closer than
# this are treated as ordered (time.time() across processes, microsecond trace units).
SLACK_S = 2e-6
MAX_RECORD_BYTES = 1 << 30         # a trace of a long run is large; beyond this it is not one


@attrs.frozen
class Violation:
    op: str
    step: int
    check: str           # missing | extra | placement | dependency | version
    message: str

    def __str__(self) -> str:
        return f"{self.check}: op {self.op} (step {self.step}): {self.message}"


@attrs.frozen
class Report:
    checked: tuple[str, ...]
    steps: int
    violations: tuple[Violation, ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    def __str__(self) -> str:
        head = (f"verified {len(self.checked)} ops of {self.steps} steps: "
                "placement, dependencies, versions")
        if self.ok:
            return head + " - ok"
        lines = [head + f" - {len(self.violations)} violation(s)"]
        lines += [f"  {v}" for v in self.violations]
        return "\n".join(lines)


def verify_run(path: str | Path) -> Report:
    rd = RunDir.open(path)
    pipeline = _read(rd, "pipeline.json", loads)
    plan = _read(rd, "plan.json", plan_from_json)
    meta = _read(rd, "run.json", json.loads)
    events = _read(rd, "trace.json", lambda text: events_from_trace(json.loads(text)))
    try:
        steps = int(meta["steps"])
        workers = {int(d): a for d, a in meta.get("workers", {}).items()}
        for d, addrs in meta.get("worker_history", {}).items():   # devices whose worker was replaced
            workers[int(d)] = tuple(addrs)
        return check(build_calls(pipeline, plan, steps), plan, events, workers, steps,
                     model_homes(pipeline, plan, _graph(pipeline, plan)))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RuntimeFailure(f"run directory '{rd.path}' must hold the records rpeg run wrote; "
                             f"they are malformed ({type(e).__name__}: {e})",
                             Span(str(rd.path), 0, 0)) from None


def _read(rd: RunDir, name: str, parse):
    """One record of the run directory, parsed; a damaged one is named in the error."""
    path = rd.path / name
    try:
        if path.stat().st_size > MAX_RECORD_BYTES:
            raise RuntimeFailure(f"'{path}' must be at most {MAX_RECORD_BYTES:,} bytes",
                                 Span(str(path), 0, 0))
        return parse(path.read_text(encoding="utf-8"))
    except RpegError as e:
        if e.span is not None and e.span.path and not e.span.path.startswith("<"):
            raise
        raise RuntimeFailure(f"'{path}' is unusable: {e.message}", Span(str(path), 0, 0),
                             hint=e.hint) from None
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise RuntimeFailure(f"'{path}' must be the {name} rpeg run wrote, and it is not "
                             f"({type(e).__name__}: {e})", Span(str(path), 0, 0)) from None


def _graph(pipeline, plan):
    from rpeg.runtime.instances import graph_for
    return graph_for(pipeline, plan)


def check(calls: tuple[OpCall, ...], plan: Plan, events: list[dict], workers: dict[int, str],
          steps: int, homes: dict[str, tuple[int, ...]]) -> Report:
    """Pure: expected calls + observed events -> violations."""
    out: list[Violation] = []
    seen: dict[str, dict] = {}
    for e in events:
        if e["id"] in seen:
            out.append(Violation(e["id"], e.get("step", -1), "extra", "ran more than once"))
        seen[e["id"]] = e
    expected = {c.id: c for c in calls}
    for op_id, e in seen.items():
        if op_id not in expected:
            out.append(Violation(op_id, e.get("step", -1), "extra",
                                 "is not an op of this plan"))
    for c in calls:
        e = seen.get(c.id)
        if e is None:
            out.append(Violation(c.id, c.step, "missing", "never ran"))
            continue
        out += _placement(c, e, plan, workers, homes)
        out += _dependencies(c, e, seen)
        out += _versions(c, e)
    return Report(tuple(sorted(seen)), steps, tuple(out))


def _placement(c: OpCall, e: dict, plan: Plan, workers, homes) -> list[Violation]:
    if c.kind is OpKind.SYNC_WEIGHTS:
        allowed = (homes.get(c.model, ()) if c.role != LOAD else (c.device,))
        what = f"the home of {c.model}" if c.role != LOAD else "the reader's device"
    else:
        allowed = plan.placement(c.stages[0]).devices
        what = f"stage {c.stages[0]}'s devices"
    out = []
    dev = int(e.get("device", -1))
    if dev not in allowed or dev != c.device:
        out.append(Violation(c.id, c.step, "placement",
                             f"ran on device {dev}, must run on device {c.device} "
                             f"({what}: {list(allowed)})"))
    want = workers.get(dev)
    wants = want if isinstance(want, tuple) else (want,)
    if want is not None and e.get("worker") not in (*wants, None):
        out.append(Violation(c.id, c.step, "placement",
                             f"ran on worker {e.get('worker')}, device {dev} is {want}"))
    return out


def _dependencies(c: OpCall, e: dict, seen: dict[str, dict]) -> list[Violation]:
    out = []
    for d in c.all_deps:
        src = seen.get(d)
        if src is None:
            continue                                  # reported as missing on its own
        if src["end"] > e["start"] + SLACK_S:
            kind = "data" if d in c.deps else "order"
            out.append(Violation(c.id, c.step, "dependency",
                                 f"started {1e3 * (src['end'] - e['start']):.3f} ms before "
                                 f"{kind} dependency {d} ended"))
    return out


def _versions(c: OpCall, e: dict) -> list[Violation]:
    out = []
    read = int(e.get("version_read", -1))
    if c.version >= 0 and c.kind is not OpKind.SYNC_WEIGHTS:
        if c.kind is OpKind.TRAIN:
            if read != c.step:
                out.append(Violation(c.id, c.step, "version",
                                     f"trained from version {read}, must train from {c.step}"))
        elif read < c.step - c.bound or read > c.step:
            out.append(Violation(c.id, c.step, "version",
                                 f"read version {read}, must read {max(0, c.step - c.bound)}"
                                 f"..{c.step} (staleness {c.bound})"))
    if c.writes >= 0 and int(e.get("version_written", -1)) != c.writes:
        out.append(Violation(c.id, c.step, "version",
                             f"wrote version {e.get('version_written')}, must write {c.writes}"))
    return out
