"""The records of a run directory checked before its trace is: run.json's fields, the plan
against the run's own pipeline, and metrics.jsonl against the steps the trace shows.

    >>> meta = check_meta(rd.read_json("run.json"), rd.path / "run.json")      # doctest: +SKIP
    >>> steps, problems = check_metrics(rd, meta, events)                      # doctest: +SKIP
    >>> steps.checked, [str(v) for v in problems]                              # doctest: +SKIP
    (60, [])

``rpeg verify`` builds the op calls of every step it checks, so how many steps it
checks comes from what the run left, not from a number in ``run.json`` alone: the
steps recorded in metrics.jsonl and the trace. A run.json that claims more steps than
ran (a failed run, or one edited to say 10^12) is one violation naming the steps that
never ran, not a hang while their calls are built.
"""

from __future__ import annotations

import attrs

from rpeg.errors import RuntimeFailure, Span
from rpeg.runtime.rundir import files as rf
from rpeg.spec.lower import MAX_STEPS


@attrs.frozen
class Steps:
    """How many steps a run recorded, and how many to check op by op."""

    recorded: int            # run.json's steps
    done: int                # steps with a metrics row (0..done-1 each once when intact)
    checked: int             # steps whose op calls verify builds and checks


def check_meta(meta: object, path) -> dict:
    """run.json as rpeg writes it, or a RuntimeFailure naming the file and the field."""
    where = Span(str(path), 0, 0)

    def bad(field: str, want: str, got: object) -> RuntimeFailure:
        text = repr(got)
        return RuntimeFailure(f"run record '{path}' field '{field}' must be {want}, not "
                              f"{text if len(text) <= 40 else text[:40] + '...'}", where,
                              hint="this is not a run.json rpeg run wrote")

    if not isinstance(meta, dict):
        raise RuntimeFailure(f"run record '{path}' must be a JSON object, not "
                             f"{type(meta).__name__}", where)
    steps = meta.get("steps")
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise bad("steps", f"an integer 1..{MAX_STEPS:,}", steps)
    for field in ("recoveries", "replans", "resumes", "extensions"):
        value = meta.get(field, [])
        if not isinstance(value, list) or not all(isinstance(x, dict) for x in value):
            raise bad(field, "a list of JSON objects", value)
    for field in ("workers", "worker_history", "homes", "gpus"):
        value = meta.get(field, {})
        if not isinstance(value, dict):
            raise bad(field, "a JSON object", value)
        for k in value:
            if not k.isdigit() and field != "homes":
                raise bad(f"{field}.{k}", "keyed by device number", k)
    for d, addrs in meta.get("worker_history", {}).items():
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise bad(f"worker_history.{d}", "a list of worker addresses", addrs)
    for d, a in meta.get("workers", {}).items():
        if not isinstance(a, str):
            raise bad(f"workers.{d}", "a worker address", a)
    status = meta.get("status", "unknown")
    if not isinstance(status, str):
        raise bad("status", "a string", status)
    return meta


def check_metrics(rd, meta: dict, events: list[dict]) -> tuple[Steps, list[tuple[int, str]]]:
    """The steps to check, and what is wrong with metrics.jsonl as ``(step, message)``:
    damaged lines, a step recorded twice, out of order or missing, rows for steps the
    trace did not finish, and a finished run with fewer rows than its steps."""
    path = rd.path / "metrics.jsonl"
    rows, damaged = rf.read_metrics(rd.path, required=True)
    problems = [(-1, f"metrics.jsonl line {n} is {why}") for n, why in damaged]
    steps = [r["step"] for r in rows]
    seen: set[int] = set()
    in_order = True
    for n, s in enumerate(steps):
        if s in seen:
            problems.append((s, f"step {s} is recorded twice in {path.name}"))
        elif s != len(seen) and in_order:
            in_order = False
            problems.append((s, f"step {s} is recorded out of order in {path.name} "
                                f"(row {n + 1})"))
        seen.add(s)
    done = 0
    while done in seen:
        done += 1
    beyond = sorted(s for s in seen if s >= done)
    if beyond:
        problems.append((beyond[0], f"{path.name} records step {beyond[0]} but not step {done}"))
    recorded = int(meta["steps"])
    if done > recorded:
        problems.append((recorded, f"{path.name} records {done} steps, run.json says the run "
                                   f"has {recorded}"))
    traced = max((e["step"] for e in events if isinstance(e.get("step"), int)), default=-1) + 1
    checked = min(recorded, max(done, traced))
    if meta.get("status") == "ok" and done < recorded:
        problems.append((done, f"the run says it finished {recorded} steps, and "
                               f"{path.name} records {done}"))
    if checked < recorded:
        began = (f"; step{'s' if checked - done > 1 else ''} {done}"
                 + (f"..{checked - 1}" if checked - done > 1 else "")
                 + " began and did not finish") if done < checked else ""
        problems.append((checked, f"steps {checked}..{recorded - 1} never ran (the run "
                                  f"ended '{meta.get('status', 'unknown')}'{began})"))
    return Steps(recorded, done, checked), problems


def check_plan_of_run(rd, pipeline, plan, name: str = "plan.json") -> None:
    """The plan checked against the run's own pipeline, as every command checks a plan;
    its spec hash against the spec the run copied (spec.rpeg), where that is the whole
    spec (the run copies no base a spec extends: its hash is then not checked here)."""
    from rpeg.plan.validate import check_plan, spec_hash_of_file
    spec = rd.path / "spec.rpeg"
    digest = ""
    if spec.is_file() and not spec.is_symlink() and not pipeline.extends:
        digest = spec_hash_of_file(spec)
    check_plan(plan, pipeline, path=str(rd.path / name), spec_hash=digest)


def check_event_fields(events: list[dict], path) -> None:
    """Each op event of a trace has the fields verify reads, of the right types."""
    for i, e in enumerate(events):
        for key, kinds in (("id", str), ("step", int), ("start", (int, float)),
                           ("end", (int, float))):
            v = e.get(key)
            if isinstance(v, bool) or not isinstance(v, kinds):
                raise RuntimeFailure(f"trace '{path}' event {i} ({e.get('op', '?')}) must "
                                     f"have a{'n' if key == 'id' else ''} '{key}' as rpeg "
                                     f"writes it, not {v!r}"[:300], Span(str(path), 0, 0))
