"""A run's state at a checkpoint cut: what the next segment starts from, and how it is
read back from the run directory for a rollback or a resume.

    >>> state = state_at(RunDir(path), ckio.latest(path))             # doctest: +SKIP
    >>> state.start, len(state.events)                                # doctest: +SKIP
    (40, 320)

The op events of committed steps are appended to ``events.jsonl`` at each checkpoint,
which records the log's size: reading a checkpoint back cuts the log (and
``metrics.jsonl``) to what it held, so the steps after it run again.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import attrs

from rpeg.errors import RuntimeFailure, Span
from rpeg.runtime.rundir import checkpoints as ckio
from rpeg.runtime.rundir import files as rf
from rpeg.runtime.rundir.directory import EVENTS, RunDir


@attrs.define
class RunState:
    start: int                                   # the cut the next segment starts from
    metrics: list[dict]
    events: list[dict]                           # trace events of committed steps
    pending: dict[int, list[dict]]               # events of steps not yet complete
    carry: dict[str, object]                     # outputs made before the cut, read after
    checkpoint: ckio.Checkpoint | None = None
    appended: int = 0                            # events already in events.jsonl
    traced: int = 0                              # events in trace.json when last written
    base: int = 0                                # the step the run (re)started from with
                                                 # every replica at that version (extended)

    def unfinished(self) -> list[dict]:
        """Events of ops that finished in steps not yet complete (a run that stops early
        records them in its trace: what did run)."""
        return [e for s in sorted(self.pending) for e in self.pending[s]]

    def write_trace(self, rd: RunDir, workers: dict[int, str], t0: float,
                    force: bool = False) -> None:
        """trace.json from the events so far: whenever they have doubled since it was last
        written (so a long run rewrites it O(log n) times, not at every checkpoint), and
        when the run ends (``force``)."""
        if force and self.traced != len(self.events) or len(self.events) >= 2 * self.traced:
            rd.write_trace(self.events, workers, t0)
            self.traced = len(self.events)


def state_at(rd: RunDir, ck: ckio.Checkpoint | None, aside: str | None = None) -> RunState:
    """The state at checkpoint ``ck`` (None: the start), the run directory's
    metrics and event log cut back to it. Everything is read and checked before anything
    is cut: a damaged record refuses the resume and leaves the directory as it was. With
    ``aside`` (a resume), what is cut is moved to files of its own rather than dropped:
    ``metrics.<aside>.jsonl``, ``events.<aside>.jsonl`` (and the samples' and
    evaluations', ``rpeg.runtime.rundir.outputs.cut_back``)."""
    if ck is None:
        rd.write_text("metrics.jsonl", "")
        rd.write_text(EVENTS, "")
        return RunState(0, [], [], defaultdict(list), {})
    rows = metrics_before(rd, ck.step)
    if "events_bytes" in ck.state:
        events = rd.read_events(int(ck.state["events_bytes"]))
    else:                                   # a checkpoint that held its events itself
        events = list(ck.state.get("events", []))
    pending: dict[int, list[dict]] = defaultdict(list)
    for e in ck.state.get("pending", []):
        pending[int(e["step"])].append(e)
    carry = ckio.load_tree(ck.path, "carry") if (ck.path / "carry.json").exists() else {}
    if aside is not None:
        from rpeg.runtime.rundir.outputs import keep_rows
        keep_rows(rd.path, "metrics.jsonl", lambda r: r["step"] < ck.step, aside)
        if "events_bytes" in ck.state:
            rd.set_aside_events(int(ck.state["events_bytes"]), aside)
    rd.write_text("metrics.jsonl", "".join(_line(m) for m in rows))
    if "events_bytes" in ck.state:
        rd.cut_events(int(ck.state["events_bytes"]))
    else:
        rd.write_text(EVENTS, "".join(_line(e) for e in events))
    return RunState(ck.step, rows, events, pending, carry, ck, appended=len(events),
                    base=int(ck.state.get("base", 0)))


def metrics_before(rd: RunDir, step: int) -> list[dict]:
    """The rows of metrics.jsonl for steps 0..step-1, each once and in order, as a
    checkpoint at ``step`` needs them; RuntimeFailure naming the file and the line when
    one is missing, damaged or doubled. Damaged lines after them (a row cut short by a
    kill) are left behind with the rows past the checkpoint."""
    path = rd.path / "metrics.jsonl"
    rows, damaged = rf.read_metrics(rd.path, required=step > 0)
    wanted = [r for r in rows if r["step"] < step]
    steps = [r["step"] for r in wanted]
    if steps != list(range(step)):
        counts = Counter(steps)
        doubled = next((s for s in steps if counts[s] > 1), None)
        missing = next((s for s in range(step) if s not in counts), None)
        what = (f"step {doubled} twice" if doubled is not None else
                f"no row for step {missing}" if missing is not None else "its steps out of order")
        if damaged:
            what += f" (line {damaged[0][0]} is {damaged[0][1]})"
        raise RuntimeFailure(f"metrics file '{path}' must record steps 0..{step - 1} once each "
                             f"for the checkpoint at step {step}, and it holds {what}",
                             Span(str(path), 0, 0),
                             hint="the metrics of those steps are lost; start the run afresh "
                                  "in another directory")
    if damaged and wanted:
        last_needed = _line_of(rd, wanted[-1])
        early = [(n, why) for n, why in damaged if n < last_needed]
        if early:
            n, why = early[0]
            raise RuntimeFailure(f"metrics file '{path}' line {n} must be a row rpeg wrote, "
                                 f"and it is {why}", Span(str(path), n, 1),
                                 hint="the run's metrics were damaged before its checkpoint")
    return wanted


def _line_of(rd: RunDir, row: dict) -> int:
    """The line number of ``row`` in metrics.jsonl (the last line holding its step)."""
    text = rf.read_bytes(rd.path / "metrics.jsonl", "metrics file").decode("utf-8", "replace")
    target = row["step"]
    last = 0
    for n, line in enumerate(text.split("\n"), start=1):
        try:
            got = json.loads(line)
        except ValueError:
            continue
        if isinstance(got, dict) and got.get("step") == target:
            last = n
    return last


def _line(row: dict) -> str:
    return json.dumps(row, sort_keys=True) + "\n"
