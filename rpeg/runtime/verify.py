"""Checking a run's trace against its plan: placement, dependencies, parameter versions.

    >>> report = verify_run("runs/tiny_ppo-20261130-011500")                # doctest: +SKIP
    >>> report.ok, len(report.checked)                                      # doctest: +SKIP
    (True, 842)
    >>> print(report)                                                       # doctest: +SKIP
    verified 842 ops of 20 steps: placement, dependencies, versions - ok

The expected op calls are rebuilt from the run's own pipeline and plan (the
same unrolling the run used); the trace says what each worker observed. Checks:

* every expected op ran exactly once, and nothing else ran;
* placement: it ran on the device the plan gave its stage (weight-sync export or send
  on the model's home, load or receive where the reader is), on the worker mapped to
  that device;
* dependencies: everything it depends on (data and ordering) ended before it started;
* the placed graph (:func:`rpeg.plan.lower.lower`, the value the run's calls were laid out
  from): each op that ran is a share of one of its instances (but a weight sync loading a
  copy for a forward reader off its model's home, which the graph prices inside the
  reader), on the devices it gives that instance (a weight sync's load or receive: on its
  reader's), and each instance started
  after its dependency edges -- the last of its shares to start, after the first share of
  each instance it depends on ended (a reader on the trainer's device reads in place while
  a share elsewhere waits for its copy);
* versions: the parameter version it read is within ``[step - k, step]`` for the
  plan's staleness k of its stage (exactly ``step`` for training), and a train op wrote
  ``step + 1``; a generate op with partial rollouts (carry c) reports the oldest version
  any token of its chunk was sampled with, which must be within ``[step - k - c, step]``
  (:func:`rpeg.graph.versions.readable`, the rule the runtime ran by);
* staleness: that version is also within the spec's bound K (``staleness STAGE <= K``
  of the run's pipeline.json): ``[step - K, step]``, checked apart from the plan's window,
  so a run breaking the spec's contract fails whatever its plan says;
* per token: a generate op's event counts its output's tokens by the version that sampled
  each (``token_versions``; a conversation's observations have none), and every one of
  those versions is checked against both windows -- a conversation paused between turns
  and resumed under newer weights holds tokens of several.

A run re-planned mid-way (a worker gone for good, a resume onto another device
count) kept each old plan as ``plan.{i}.json``, and each entry of run.json's
``replans`` says from which step (``from_step``) the next plan applies. Each op
instance is checked against the plan that governed its step: its placement, its
dependencies on ops governed by the same plan, and that plan's staleness bounds.
A run directory whose replan records lack ``from_step`` is checked against
plan.json alone, as before.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from pathlib import Path

import attrs

from rpeg.errors import RuntimeFailure, Span
from rpeg.graph.versions import readable
from rpeg.plan.lower import Placed
from rpeg.plan.model import Plan
from rpeg.runtime.lowering.instances import (
    OpCall,
    build_calls,
    lookback,
    model_homes,
    placed_for,
)
from rpeg.runtime.lowering.joins import JOIN
from rpeg.runtime.rundir import files as rf
from rpeg.runtime.rundir.check import (
    check_event_fields,
    check_meta,
    check_metrics,
    check_plan_of_run,
)
from rpeg.runtime.rundir.directory import RunDir, events_from_trace
from rpeg.runtime.rundir.serial import loads, plan_from_json
from rpeg.spec.model import OpKind

SHOWN = 20           # violations a report lists by default; the rest are counted
MAX_SHOWN = 10_000   # the most it lists when asked

# Clock resolution between processes on one machine: ends and starts closer than
# this are treated as ordered (time.time() across processes, microsecond trace units).
SLACK_S = 2e-6


@attrs.frozen
class Violation:
    op: str
    step: int
    check: str           # missing | extra | identity | placement | dependency | version |
                         # staleness | metrics
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
        return self.text()

    def text(self, shown: int = SHOWN) -> str:
        """The report: a summary line (violations counted by check), the first ``shown``
        violations, and how many more there are -- bounded however many there are."""
        head = (f"verified {len(self.checked)} ops of {self.steps} steps: "
                "placement, dependencies, versions")
        if self.ok:
            return head + " - ok"
        n = len(self.violations)
        kinds = Counter(v.check for v in self.violations)
        lines = [head + f" - {n:,} violation(s): "
                 + ", ".join(f"{c:,} {k}" for k, c in sorted(kinds.items(),
                                                              key=lambda kc: (-kc[1], kc[0])))]
        lines += [f"  {v}" for v in self.violations[:shown]]
        if n > shown:
            lines.append(f"  ... and {n - shown:,} more (rpeg verify --violations N shows "
                         "more of them)")
        return "\n".join(lines)


def verify_run(path: str | Path) -> Report:
    rd = RunDir.open(path)
    pipeline = _read(rd, "pipeline.json", loads)
    plan = _read(rd, "plan.json", plan_from_json)
    meta = check_meta(_read(rd, "run.json", json.loads), rd.path / "run.json")
    events = _read(rd, "trace.json", lambda text: events_from_trace(json.loads(text)))
    check_event_fields(events, rd.path / "trace.json")
    check_plan_of_run(rd, pipeline, plan)
    counted, problems = check_metrics(rd, meta, events)
    try:
        steps = counted.checked                # steps whose every op is expected in the trace
        workers = {int(d): a for d, a in meta.get("workers", {}).items()}
        for d, addrs in meta.get("worker_history", {}).items():   # devices whose worker was replaced
            workers[int(d)] = tuple(addrs)
        segments = tuple(
            # built a little past the steps checked: their calls are as the run made them
            Segment(tuple(c for c in build_calls(pipeline, p, min(upto, steps + lookback(
                pipeline, p)), first=base) if first <= c.step < min(end, steps)),
                    p, model_homes(pipeline, p, _graph(pipeline, p)), placed_for(pipeline, p))
            for p, first, end, base, upto in governing_plans(rd, plan, meta, counted.recorded)
            if first < min(end, steps))
        report = check_segments(segments, events, workers, steps)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RuntimeFailure(f"run directory '{rd.path}' must hold the records rpeg run wrote; "
                             f"they are malformed ({type(e).__name__}: {e})",
                             Span(str(rd.path), 0, 0)) from None
    extra = tuple(Violation("metrics", step, "metrics", text) for step, text in problems)
    return attrs.evolve(report, steps=counted.recorded, violations=report.violations + extra)


def governing_plans(rd: RunDir, plan: Plan, meta: dict,
                    steps: int) -> list[tuple[Plan, int, int, int, int]]:
    """``(plan, first step, end step, base, built to)`` for each part of the run, in order:
    each plan it followed, and within one, each stretch between the points a resume
    extended it from. A stretch's calls are those of ``build_calls(first=base)`` up to
    ``built to``: an extended run restarted at ``base`` (run.json's ``extensions``), and
    the stretch before it ran as part of a run of ``built to`` steps.

    Replan ``i`` saved the plan it replaced as ``plan.{i}.json`` and records the first
    step the next plan governs; the last plan is plan.json. Without those records
    (an older run directory), plan.json governs every step.
    """
    replans = meta.get("replans") or []
    if not isinstance(replans, list) or not replans or not all(
            isinstance(r, dict) and isinstance(r.get("from_step"), int) for r in replans):
        parts = [(plan, 0, steps)]
    else:
        plans = [_read(rd, f"plan.{i}.json", plan_from_json) for i in range(len(replans))]
        for i, p in enumerate(plans):
            check_plan_of_run(rd, loads_pipeline(rd), p, f"plan.{i}.json")
        cuts = [0] + [min(max(int(r["from_step"]), 0), steps) for r in replans] + [steps]
        for i in range(1, len(cuts)):                     # a later cut never precedes an earlier
            cuts[i] = max(cuts[i], cuts[i - 1])
        parts = [(p, cuts[i], cuts[i + 1]) for i, p in enumerate([*plans, plan])]
    made = {}                                  # extension start -> steps the run had before
    for x in meta.get("extensions") or []:
        if isinstance(x.get("from_step"), int) and isinstance(x.get("from_steps"), int):
            made[min(max(x["from_step"], 0), steps)] = x["from_steps"]
    out = []
    for p, first, end in parts:
        bounds = [first] + sorted(b for b in made if first < b < end) + [end]
        for lo, hi in zip(bounds, bounds[1:], strict=False):
            base = max((b for b in made if b <= lo), default=0)
            # a run's calls near its end reach a few steps past them, never more
            upto = min(max(made[hi], hi), hi + 64) if hi in made else steps
            out.append((p, lo, hi, base, upto))
    return out


def loads_pipeline(rd: RunDir):
    return _read(rd, "pipeline.json", loads)


def _read(rd: RunDir, name: str, parse):
    """One record of the run directory, parsed; a damaged one is named in the error."""
    return rf.read_parsed(rd.path / name, name, parse)


def _graph(pipeline, plan):
    from rpeg.runtime.lowering.instances import graph_for
    return graph_for(pipeline, plan)


@attrs.frozen
class Segment:
    """The op instances one plan governed, with that plan and its models' homes."""

    calls: tuple[OpCall, ...]
    plan: Plan
    homes: dict[str, tuple[int, ...]]
    placed: Placed                     # the step graph the calls were laid out from


def check(calls: tuple[OpCall, ...], plan: Plan, events: list[dict], workers: dict[int, str],
          steps: int, homes: dict[str, tuple[int, ...]], placed: Placed) -> Report:
    """Pure: expected calls of one plan (laid out from ``placed``, the plan's step graph on
    its devices: :func:`rpeg.runtime.lowering.instances.placed_for`) + observed events ->
    violations."""
    return check_segments((Segment(calls, plan, homes, placed),), events, workers, steps)


def check_segments(segments: tuple[Segment, ...], events: list[dict],
                   workers: dict[int, str], steps: int) -> Report:
    """Pure: expected calls, each under the plan that governed its step, + observed
    events -> violations. Dependencies are checked within a segment: across a re-plan
    the run restarted from a checkpoint, so earlier ops had ended by construction."""
    out: list[Violation] = []
    seen: dict[str, dict] = {}
    for e in events:
        if e["id"] in seen:
            out.append(Violation(e["id"], e.get("step", -1), "extra", "ran more than once"))
        seen[e["id"]] = e
        start, end = e.get("start"), e.get("end")
        if not (isinstance(start, (int, float)) and isinstance(end, (int, float))
                and math.isfinite(start) and math.isfinite(end) and end >= start):
            out.append(Violation(e["id"], e.get("step", -1), "time",
                                 f"must end at or after it starts, at finite times, not "
                                 f"start {start} and end {end} (a damaged trace)"))
    expected = {c.id for seg in segments for c in seg.calls}
    for op_id, e in seen.items():
        if op_id not in expected:
            out.append(Violation(op_id, e.get("step", -1), "extra",
                                 "is not an op of this plan"))
    for seg in segments:
        own = {c.id for c in seg.calls}
        ends = dict(seen)
        for c in seg.calls:
            if c.role == JOIN:          # runs no op: it ends when the last it waits for does
                ends[c.id] = max((dict(seen[d], via=d) for d in c.all_deps
                                  if d in seen and d in own),
                                 key=lambda x: x["end"], default={"end": float("-inf")})
        for c in seg.calls:
            if c.role == JOIN:
                continue
            e = seen.get(c.id)
            if e is None:
                out.append(Violation(c.id, c.step, "missing", "never ran"))
                continue
            out += _identity(c, e)
            out += _placement(c, e, seg.plan, workers, seg.homes)
            out += _dependencies(c, e, ends, own)
            out += _versions(c, e)
        if seg.calls:
            out += _against_placed(seg.calls, seg.placed, seen)
    return Report(tuple(sorted(seen)), steps, tuple(out))


def _against_placed(calls: tuple[OpCall, ...], placed: Placed,
                    seen: dict[str, dict]) -> list[Violation]:
    """The traced calls against the placed graph they were laid out from (the module doc)."""
    out: list[Violation] = []
    edges = placed.edges(1 + max(c.step for c in calls))
    known = set(edges.instances)
    layouts = dict(placed.layouts)
    shares: dict = defaultdict(list)             # instance -> (call, event) of its shares
    for c in calls:
        e = seen.get(c.id)
        if e is None or c.role == JOIN:
            continue
        inst = c.instance
        if inst.op not in layouts:      # a copy for a forward reader off its model's home:
            continue                    # priced inside the reader, no instance of its own
        if inst not in known:
            out.append(Violation(c.id, c.step, "placement",
                                 f"is a share of {inst}, no instance of the placed graph"))
            continue
        shares[inst].append((c, e))
        lay = layouts[inst.op]
        devices = lay.devices if c.kind is OpKind.SYNC_WEIGHTS else lay.devices_of(inst.chunk)
        dev = int(e.get("device", -1))
        if devices and dev not in devices and not c.role.reads_at_reader:
            out.append(Violation(c.id, c.step, "placement",
                                 f"ran on device {dev}, and the placed graph runs {inst} on "
                                 f"{list(devices)}"))
    for d in edges.deps:
        if d.dst not in shares or d.src not in shares:
            continue
        c, last = max(shares[d.dst], key=lambda ce: ce[1]["start"])
        src, first = min(shares[d.src], key=lambda ce: ce[1]["end"])
        if first["end"] > last["start"] + SLACK_S:
            out.append(Violation(c.id, c.step, "dependency",
                                 f"{d.dst} started {1e3 * (first['end'] - last['start']):.3f} "
                                 f"ms before its {d.kind.value} dependency {d.src} ended "
                                 f"(its first share, {src.id})"))
    return out


def _identity(c: OpCall, e: dict) -> list[Violation]:
    """The event under an op's id is that op's: its name, kind, step and chunk (an event
    relabelled with another op's id would otherwise stand in for it)."""
    said = {k: e.get(k) for k in ("op", "kind", "step", "chunk")}
    want = {"op": c.op, "kind": c.kind.value, "step": c.step, "chunk": c.chunk}
    wrong = [k for k in want if said[k] is not None and said[k] != want[k]]
    if not wrong:
        return []
    return [Violation(c.id, c.step, "identity",
                      "its event is another op's: " + ", ".join(
                          f"{k} {said[k]!r}, must be {want[k]!r}" for k in wrong))]


def _placement(c: OpCall, e: dict, plan: Plan, workers, homes) -> list[Violation]:
    if c.kind is OpKind.SYNC_WEIGHTS:
        allowed = (c.device,) if c.role.reads_at_reader else homes.get(c.model, ())
        what = "the reader's device" if c.role.reads_at_reader else f"the home of {c.model}"
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


def _dependencies(c: OpCall, e: dict, seen: dict[str, dict], own: set[str]) -> list[Violation]:
    out = []
    for d in c.all_deps:
        src = seen.get(d)
        if src is None or d not in own:
            continue                      # missing: reported on its own; other plan: before the cut
        if src["end"] > e["start"] + SLACK_S:
            kind = "data" if d in c.deps else "order"
            through = f" (through {d})" if "via" in src else ""
            out.append(Violation(c.id, c.step, "dependency",
                                 f"started {1e3 * (src['end'] - e['start']):.3f} ms before "
                                 f"{kind} dependency {src.get('via', d)} ended{through}"))
    return out


def _token_versions(c: OpCall, e: dict, window: tuple[int, int],
                    oldest: int) -> list[Violation]:
    """Every token a generate op output, by the version that sampled it (its event's
    ``token_versions``: tokens per version): within the plan's window and the spec's bound,
    whatever the turn or step it was sampled in."""
    counts = (e.get("stats") or {}).get("token_versions")
    if c.kind is not OpKind.GENERATE or not isinstance(counts, dict):
        return []
    out = []
    lo, hi = window
    stage = c.stages[0] if c.stages else c.op
    for text, n in sorted(counts.items()):
        try:
            v = int(text)
        except ValueError:
            out.append(Violation(c.id, c.step, "version", f"token version {text!r} is not a "
                                 "version"))
            continue
        if not lo <= v <= hi:
            out.append(Violation(c.id, c.step, "version",
                                 f"{n} token(s) sampled with version {v}, must be {lo}..{hi}"))
        if v < oldest:
            out.append(Violation(c.id, c.step, "staleness",
                                 f"{n} token(s) sampled with version {v}, {c.step - v} updates "
                                 f"old: the spec's 'staleness {stage} <= {c.limit}' allows "
                                 f"{oldest}..{c.step}"))
    return out


def _versions(c: OpCall, e: dict) -> list[Violation]:
    """The version read against the plan's window (its staleness and carry) and the spec's
    (its bound): :func:`rpeg.graph.versions.readable` for both."""
    out = []
    read = int(e.get("version_read", -1))
    if c.version >= 0 and c.kind is not OpKind.SYNC_WEIGHTS:
        if c.kind is OpKind.TRAIN:
            if read != c.step:
                out.append(Violation(c.id, c.step, "version",
                                     f"trained from version {read}, must train from {c.step}"))
        else:
            lo, hi = readable(c.kind, c.step, c.bound, c.carry)
            if not lo <= read <= hi:
                why = f"staleness {c.bound}" + (f" + carry {c.carry}" if c.carry else "")
                out.append(Violation(c.id, c.step, "version",
                                     f"read version {read}, must read {lo}..{hi} ({why})"))
            oldest, _ = readable(c.kind, c.step, c.limit)
            if read < oldest:
                stage = c.stages[0] if c.stages else c.op
                out.append(Violation(c.id, c.step, "staleness",
                                     f"read version {read}, {c.step - read} updates old: the "
                                     f"spec's 'staleness {stage} <= {c.limit}' allows "
                                     f"{oldest}..{c.step}"))
            out += _token_versions(c, e, (lo, hi), oldest)
    if c.writes >= 0 and int(e.get("version_written", -1)) != c.writes:
        out.append(Violation(c.id, c.step, "version",
                             f"wrote version {e.get('version_written')}, must write {c.writes}"))
    return out
