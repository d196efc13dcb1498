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
from collections import defaultdict

import attrs

from rpeg.runtime import checkpoint_io as ckio
from rpeg.runtime.rundir import EVENTS, RunDir


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

    def write_trace(self, rd: RunDir, workers: dict[int, str], t0: float,
                    force: bool = False) -> None:
        """trace.json from the events so far: whenever they have doubled since it was last
        written (so a long run rewrites it O(log n) times, not at every checkpoint), and
        when the run ends (``force``)."""
        if force and self.traced != len(self.events) or len(self.events) >= 2 * self.traced:
            rd.write_trace(self.events, workers, t0)
            self.traced = len(self.events)


def state_at(rd: RunDir, ck: ckio.Checkpoint | None) -> RunState:
    """The state at checkpoint ``ck`` (None: the start), the run directory's
    metrics and event log cut back to it."""
    if ck is None:
        rd.write_text("metrics.jsonl", "")
        rd.write_text(EVENTS, "")
        return RunState(0, [], [], defaultdict(list), {})
    rows = [m for m in rd.metrics() if m["step"] < ck.step]
    rd.write_text("metrics.jsonl", "".join(_line(m) for m in rows))
    if "events_bytes" in ck.state:
        events = rd.cut_events(int(ck.state["events_bytes"]))
    else:                                   # a checkpoint that held its events itself
        events = list(ck.state.get("events", []))
        rd.write_text(EVENTS, "".join(_line(e) for e in events))
    pending: dict[int, list[dict]] = defaultdict(list)
    for e in ck.state.get("pending", []):
        pending[int(e["step"])].append(e)
    carry = ckio.load_tree(ck.path, "carry") if (ck.path / "carry.json").exists() else {}
    return RunState(ck.step, rows, events, pending, carry, ck, appended=len(events))


def _line(row: dict) -> str:
    return json.dumps(row, sort_keys=True) + "\n"
