"""The run directory: one record per experiment tying spec, plan, trace and metrics together.

    runs/tiny_ppo-20261130-011500/
        spec.rpeg          the spec as written (and its extends, resolved into pipeline.json)
        pipeline.json      the resolved pipeline value
        plan.json          the plan that ran
        run.json           steps, devices -> workers, timings, status
        trace.json         Chrome trace (Perfetto): one track per worker; each op with
                           step, chunk, version read and written, CPU seconds
        events.jsonl       the same op events, appended at each checkpoint (trace.json is
                           rewritten whenever they have doubled, and at the end of a run)
        metrics.jsonl      one line per step: reward (the estimators' weighted sum of
                           scores) and each score stage's own, KL, clip fraction, value
                           loss, entropy, learning rate and gradient norm per train op,
                           step time, tokens/s, dynamic sampling's filtered share
        checkpoints/       safetensors + JSON per trained model

    >>> rd = RunDir.create("runs", "tiny_ppo")                 # doctest: +SKIP
    >>> rd.write_trace(events, devices)                         # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import attrs

from rpeg.errors import RuntimeFailure, Span
from rpeg.runtime.rundir import files as rf
from rpeg.runtime.rundir.tensorboard import append_event

EVENTS = "events.jsonl"      # every committed op event, appended at each checkpoint
NOT_STARTED = "failed-before-start"   # run.json's status when no step finished


@attrs.frozen
class RunDir:
    path: Path

    @classmethod
    def target(cls, root: str | Path, pipeline: str, path: str | Path | None = None) -> Path:
        """Where a new run will write, checked and not yet made: ``path``, else a fresh
        ``ROOT/PIPELINE-TIME``; RuntimeFailure when it is a file, lies inside another run's
        directory, or holds a run (one whose start failed before its first step does not)."""
        if path is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = Path(root) / f"{pipeline}-{stamp}"
            n = 1
            while path.exists():
                n += 1
                path = Path(root) / f"{pipeline}-{stamp}-{n}"
        path = Path(path)
        if os.path.lexists(path) and not path.is_dir():
            raise RuntimeFailure(f"run directory '{path}' must be a directory, and it is not",
                                 Span(str(path), 0, 0), hint="choose another --run-dir")
        from rpeg.destinations import run_dir_around
        around = run_dir_around(path.parent)
        if around is not None:
            raise RuntimeFailure(f"run directory '{path}' must not lie inside another run's "
                                 f"directory, and it is inside '{around}'",
                                 Span(str(path), 0, 0), hint="choose another --run-dir")
        if path.is_dir():
            rf.check_entries(path)
        return path

    @classmethod
    def create(cls, root: str | Path, pipeline: str, path: str | Path | None = None) -> RunDir:
        path = cls.target(root, pipeline, path)
        path.mkdir(parents=True, exist_ok=True)
        rf.check_entries(path)
        (path / "checkpoints").mkdir(exist_ok=True)
        return cls(path.resolve())

    @classmethod
    def open(cls, path: str | Path) -> RunDir:
        path = Path(path)
        if not os.path.lexists(path):
            raise RuntimeFailure(f"run directory '{path}' must exist, and it does not",
                                 Span(str(path), 0, 0),
                                 hint="runs are written under runs/ by rpeg run")
        if not path.is_dir():
            raise RuntimeFailure(f"run directory '{path}' must be a directory made by `rpeg "
                                 "run`, and it is not", Span(str(path), 0, 0),
                                 hint="pass a directory made by `rpeg run`")
        missing = [f for f in ("plan.json", "trace.json", "run.json", "pipeline.json")
                   if not os.path.lexists(path / f)]
        if missing:
            raise RuntimeFailure(f"run directory '{path}' must hold {', '.join(missing)}, "
                                 "and it does not", hint="pass a directory made by `rpeg run`")
        rf.check_entries(path)
        return cls(path)

    def holds_run(self) -> bool:
        """Whether a run has written here (its record, plan, metrics or events); a start
        that failed before its first step (:data:`NOT_STARTED`) holds none."""
        if self.failed_start():
            return False
        return any(os.path.lexists(self.path / f) for f in
                   ("run.json", "plan.json", "metrics.jsonl", EVENTS, "trace.json"))

    def failed_start(self) -> bool:
        """Whether this directory holds only a start that failed before its first step."""
        try:
            meta = rf.read_json(self.path / "run.json", "run record")
        except RuntimeFailure:
            return False
        return isinstance(meta, dict) and meta.get("status") == NOT_STARTED \
            and not any(p.name.startswith("step-") for p in self.checkpoints())

    def checkpoints(self) -> list[Path]:
        root = self.path / "checkpoints"
        return list(root.iterdir()) if root.is_dir() and not root.is_symlink() else []

    def clear_failed_start(self) -> None:
        """Remove what a start that failed before its first step wrote (its record files),
        so that the same command can start the run here."""
        if not self.failed_start():
            return
        for name in rf.FILES:
            if name != rf.LOCK and os.path.lexists(self.path / name):
                os.unlink(self.path / name)

    def write_text(self, name: str, text: str) -> Path:
        """Write atomically: a fresh temporary name, then rename (never through a symlink)."""
        return rf.write_atomic(self.path / name, text)

    def write_json(self, name: str, value) -> Path:
        return self.write_text(name, json.dumps(value, indent=1, sort_keys=True) + "\n")

    def read_json(self, name: str):
        return rf.read_json(self.path / name, name)

    def append_metrics(self, row: dict) -> None:
        with rf.open_append(self.path / "metrics.jsonl", "metrics file") as f:
            f.write(json.dumps(row, sort_keys=True) + "\n")
        append_event(self.path, row)

    def metrics(self) -> list[dict]:
        """The rows of metrics.jsonl; RuntimeFailure naming the first damaged line."""
        rows, damaged = rf.read_metrics(self.path)
        if damaged:
            n, why = damaged[0]
            path = self.path / "metrics.jsonl"
            raise RuntimeFailure(f"metrics file '{path}' line {n} must be a row rpeg wrote, "
                                 f"and it is {why}"
                                 + (f" ({len(damaged) - 1} more such lines)"
                                    if len(damaged) > 1 else ""), Span(str(path), n, 1),
                                 hint="a run killed while writing leaves its last line cut "
                                      "short; remove the damaged lines to use the rest")
        return rows

    def write_trace(self, events: list[dict], workers: dict[int, str], t0: float) -> Path:
        return self.write_json("trace.json", chrome_trace(events, workers, t0))

    def append_events(self, events: list[dict]) -> int:
        """Append op events to ``events.jsonl`` (on disk when this returns); its size in
        bytes, which a checkpoint records: what is past it belongs to later steps."""
        path = self.path / EVENTS
        with rf.open_append(path, "event log") as f:
            for e in events:
                f.write(json.dumps(e, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
            return os.fstat(f.fileno()).st_size

    def read_events(self, size: int) -> list[dict]:
        """The events of ``events.jsonl``'s first ``size`` bytes (what a checkpoint recorded);
        RuntimeFailure when the log is shorter or damaged there. Changes nothing."""
        path = self.path / EVENTS
        if not os.path.lexists(path):
            if size:
                raise RuntimeFailure(f"run directory '{self.path}' must hold {EVENTS} "
                                     f"({size} bytes recorded by its checkpoint), and it "
                                     "does not")
            return []
        data = rf.read_bytes(path, "event log")[:size]
        if len(data) < size:
            raise RuntimeFailure(f"'{path}' must hold the {size} bytes its checkpoint "
                                 f"recorded, and it holds {len(data)}", Span(str(path), 0, 0))
        out = []
        for n, line in enumerate(data.decode("utf-8", errors="replace").split("\n"), 1):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
            except ValueError:
                e = None
            if not isinstance(e, dict) or not isinstance(e.get("id"), str) \
                    or not isinstance(e.get("step"), int):
                raise RuntimeFailure(f"event log '{path}' line {n} must be an op event rpeg "
                                     "wrote, and it is damaged", Span(str(path), n, 1))
            out.append(e)
        return out

    def set_aside_events(self, size: int, aside: str) -> None:
        """Copy what ``events.jsonl`` holds past its first ``size`` bytes to
        ``events.<aside>.jsonl`` (before a resume cuts it)."""
        path = self.path / EVENTS
        if os.path.lexists(path):
            tail = rf.read_bytes(path, "event log")[size:]
            if tail:
                rf.write_atomic(self.path / f"events.{aside}.jsonl", tail)

    def cut_events(self, size: int) -> list[dict]:
        """The events of ``events.jsonl``'s first ``size`` bytes, the rest cut off (a run
        rolled back or resumed from a checkpoint runs those steps again)."""
        events = self.read_events(size)
        path = self.path / EVENTS
        if os.path.lexists(path):
            with rf.open_update(path, "event log") as f:
                f.truncate(size)
        return events


def chrome_trace(events: list[dict], workers: dict[int, str], t0: float) -> dict:
    """Chrome trace JSON: process = the run, one thread (track) per worker/device."""
    out = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "rpeg run"}}]
    for dev, addr in sorted(workers.items()):
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": dev,
                    "args": {"name": f"device {dev} ({addr})"}})
    for e in sorted(events, key=lambda e: e["start"]):
        label = e["op"] if not e.get("role") else f"{e['op']}.{e['role']}"
        out.append({"ph": "X", "name": label, "cat": e["kind"], "pid": 1, "tid": e["device"],
                    "ts": round((e["start"] - t0) * 1e6, 1),
                    "dur": round((e["end"] - e["start"]) * 1e6, 1),
                    "args": {k: e[k] for k in ("id", "step", "chunk", "rank", "device", "worker",
                                               "version_read", "version_written", "stats",
                                               "cpu_s", "proc_cpu_s") if k in e}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def events_from_trace(trace: dict) -> list[dict]:
    """The op events of a Chrome trace written by :func:`chrome_trace` (times in seconds)."""
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X":
            continue
        a = e.get("args", {})
        out.append({**a, "op": e["name"].split(".")[0], "kind": e.get("cat"),
                    "start": e["ts"] / 1e6, "end": (e["ts"] + e["dur"]) / 1e6})
    return out


def step_metrics(step: int, events: list[dict], step_time: float) -> dict:
    """One metrics.jsonl row from the events of one step."""
    row: dict = {"step": step, "step_time_s": round(step_time, 4)}
    reward_sum = sum(e["stats"].get("reward_sum", 0.0) for e in events)
    reward_n = sum(e["stats"].get("reward_n", 0) for e in events)
    if reward_n:
        row["reward"] = reward_sum / reward_n
    for key in sorted({k for e in events for k in e["stats"] if k.startswith("reward_sum.")}):
        name = key.split(".", 1)[1]            # one score stage's own mean (unweighted)
        n = sum(e["stats"].get(f"reward_n.{name}", 0) for e in events)
        if n:
            row[f"reward.{name}"] = sum(e["stats"].get(key, 0.0) for e in events) / n
    for key in sorted({k for e in events for k in e["stats"] if k.startswith("reward_errors.")}):
        row[key] = sum(e["stats"].get(key, 0) for e in events)   # scored 0 (on_error = zero)
    gen = [e for e in events if e["kind"] == "generate"]
    tokens = sum(e["stats"].get("tokens", 0) for e in gen)
    responses = sum(e["stats"].get("responses", 0) for e in gen)
    if responses:
        row["response_len"] = tokens / responses
        row["tokens_per_s"] = tokens / step_time if step_time > 0 else 0.0
    row.update(conversation_metrics(gen))
    groups = sum(e["stats"].get("groups_checked", 0) for e in gen)
    if groups:                                # dynamic sampling: the measured filter rate
        row["filtered"] = sum(e["stats"].get("groups_filtered", 0) for e in gen) / groups
        row["refill_rounds"] = max(e["stats"].get("refill_rounds", 0) for e in gen)
    kl_n = sum(e["stats"].get("kl_n", 0) for e in events)
    if kl_n:                                  # KL to the reference, as the advantages saw it
        row["kl"] = sum(e["stats"].get("kl_sum", 0.0) for e in events) / kl_n
    for e in events:
        if e["kind"] != "train" or e.get("rank", 0) != 0:
            continue
        for k in ("kl", "clip_frac", "value_loss", "entropy", "policy_loss", "is_weight"):
            if k in e["stats"] and k not in row:
                row[k] = e["stats"][k]
        for k in ("grad_norm", "lr", "kl_coef"):
            if k in e["stats"]:
                row[f"{k}.{e['op']}"] = e["stats"][k]
    versions = [e["version_read"] for e in gen if e.get("version_read", -1) >= 0]
    if versions:
        row["gen_version"] = min(versions)
    # strict JSON (no bare NaN): a value that is not a finite number is named, not written
    bad = sorted(k for k, v in row.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        row = {k: v for k, v in row.items() if k not in bad} | {"nonfinite": bad}
    return row


def conversation_metrics(gen: list[dict]) -> dict:
    """What a step's conversations did, from its generate events: turns per sample, the
    share of samples with two or more, tool calls, their errors and timeouts, their mean
    seconds and observation tokens ({} where no stage holds conversations)."""
    total = {k: sum(e["stats"].get(k, 0) for e in gen)
             for k in ("conversations", "turns", "multi_turn", "tool_calls", "tool_errors",
                       "tool_timeouts", "tool_s", "obs_tokens", "obs_truncated")}
    if not total["conversations"]:
        return {}
    out = {"turns": total["turns"] / total["conversations"],
           "multi_turn": total["multi_turn"] / total["conversations"],
           "tool_calls": total["tool_calls"], "tool_errors": total["tool_errors"],
           "tool_timeouts": total["tool_timeouts"], "obs_truncated": total["obs_truncated"]}
    if total["tool_calls"]:
        out["tool_s"] = total["tool_s"] / total["tool_calls"]
        out["obs_len"] = total["obs_tokens"] / total["tool_calls"]
    return out


def host_usage(events: list[dict], marks: list[tuple[int, float, float, int]],
               warmup: int = 5, task_steps: dict[int, int] | None = None) -> dict | None:
    """Where a run's CPU went per step, once past ``warmup`` steps: the ops' own CPU, the
    device workers' CPU outside ops (Dask's event loop, transfers) and the client's (the
    driver, and on a local cluster the scheduler and nannies, which share its process).

    ``marks``: ``(step, wall time, client CPU seconds, tasks submitted)`` taken as each
    step finished (a run of under ``2 * warmup`` steps is measured over its second half);
    ``task_steps``: the Dask tasks submitted for each step, what the tasks a step counts
    (tasks go out ahead of their step, in a window, so a count by when they were submitted
    drifts, down to 0 where the window holds the steps measured); ``events``: op events
    with ``proc_cpu_s`` (the worker process's CPU at the op's end). None when there is too
    little to measure.

        >>> ev = [{"device": 0, "end": t, "cpu_s": 0.1, "proc_cpu_s": 0.15 * t}
        ...       for t in range(1, 6)]
        >>> u = host_usage(ev, [(1, 1.5, 1.0, 2), (3, 4.5, 1.2, 6)], warmup=0)
        >>> u["steps"], u["tasks_per_step"], u["client_cpu_per_step_s"]
        (2, 2.0, 0.1)
        >>> u["op_cpu_per_step_s"], u["worker_cpu_per_step_s"]
        (0.15, 0.075)

    All of a short run's tasks submitted by its first step's end still count for their
    steps (7 a step here), not as none:

        >>> marks = [(1, 1.0, 1.0, 28), (3, 3.0, 1.2, 28)]
        >>> host_usage(ev, marks, warmup=0, task_steps={0: 7, 1: 7, 2: 7, 3: 7})["tasks_per_step"]
        7.0
        >>> host_usage(ev, marks, warmup=0)["tasks_per_step"]
        0.0
    """
    marks = sorted(marks)
    if not marks:
        return None
    warmup = min(warmup, marks[-1][0] // 2)             # a short run: its second half
    first = next((m for m in marks if m[0] >= warmup), None)
    if first is None or marks[-1][0] <= first[0] \
            or not all("proc_cpu_s" in e for e in events):
        return None
    last = marks[-1]
    steps = last[0] - first[0]
    t0, t1 = first[1], last[1]
    ops = other = 0.0
    by_device: dict[int, list[dict]] = {}
    for e in events:
        by_device.setdefault(e["device"], []).append(e)
    for evs in by_device.values():
        evs.sort(key=lambda e: e["end"])
        before = [e for e in evs if e["end"] <= t0]
        inside = [e for e in evs if t0 < e["end"] <= t1]
        if not before or not inside:
            continue
        spent = inside[-1]["proc_cpu_s"] - before[-1]["proc_cpu_s"]
        own = sum(e["cpu_s"] for e in inside)
        ops += own
        other += max(spent - own, 0.0)
    return {"steps": steps, "from_step": first[0],
            "wall_per_step_s": round((t1 - t0) / steps, 6),
            "tasks_per_step": round((sum(n for s, n in task_steps.items()
                                         if first[0] < s <= last[0]) if task_steps
                                     else last[3] - first[3]) / steps, 3),
            "client_cpu_per_step_s": round((last[2] - first[2]) / steps, 6),
            "op_cpu_per_step_s": round(ops / steps, 6),
            "worker_cpu_per_step_s": round(other / steps, 6)}
