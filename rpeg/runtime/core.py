"""The scheduling core: events in, instructions out; no Dask, no clock, no I/O.

    >>> core = Core.create(calls, steps=3, window=2)                      # doctest: +SKIP
    >>> core.handle(Started())                                             # doctest: +SKIP
    [Submit(call=OpCall(id='rollout/s0/c0', ...)), ...]
    >>> core.handle(OpDone("rollout/s0/c0"))                               # doctest: +SKIP
    []

The core decides *what to submit when*; the adapter (``rpeg.runtime.recovery``)
turns ``Submit`` into a Dask future whose arguments are the futures of the op's
dependencies, so *when it runs* is decided by completion events on the cluster,
never by predicted times. The core keeps at most ``window`` steps in flight
(staleness k needs k + 1: generation of step s + k overlaps training of step s),
submits an op only after everything it depends on was submitted, releases an
op's result once every consumer finished, and reports each finished step.

Transitions: pending -> submitted (Submit) -> done (OpDone) | failed (OpFailed -> Abort).
"""

from __future__ import annotations

from collections import defaultdict

import attrs

from rpeg.errors import PlanError
from rpeg.graph.order import Cycle, topological
from rpeg.runtime.instances import OpCall


# --- events -------------------------------------------------------------------------------
@attrs.frozen
class Started:
    pass


@attrs.frozen
class OpDone:
    op_id: str


@attrs.frozen
class OpFailed:
    op_id: str
    error: str


# --- instructions -------------------------------------------------------------------------
@attrs.frozen
class Submit:
    call: OpCall


@attrs.frozen
class Release:
    op_id: str


@attrs.frozen
class StepDone:
    step: int


@attrs.frozen
class Finish:
    pass


@attrs.frozen
class Abort:
    op_id: str
    error: str


@attrs.define
class Core:
    calls: dict[str, OpCall]
    order: tuple[str, ...]                    # submission order (dependencies first)
    steps: int
    window: int
    status: dict[str, str]                    # id -> pending | submitted | done
    consumers: dict[str, set[str]]
    left_in_step: dict[int, int]
    by_step: dict[int, list[str]]             # submission order, per step
    steps_done: int = 0                       # steps 0..steps_done-1 are complete
    finished: bool = False

    @classmethod
    def create(cls, calls, steps: int, window: int) -> Core:
        table = {c.id: c for c in calls}
        consumers: dict[str, set[str]] = defaultdict(set)
        for c in calls:
            for d in c.all_deps:
                consumers[d].add(c.id)
        left: dict[int, int] = defaultdict(int)
        for c in calls:
            left[c.step] += 1
        order = _submission_order(calls)
        by_step: dict[int, list[str]] = defaultdict(list)
        for op_id in order:
            by_step[table[op_id].step].append(op_id)
        return cls(table, order, steps, max(1, window), {c.id: "pending" for c in calls},
                   dict(consumers), dict(left), dict(by_step))

    def handle(self, event) -> list:
        if isinstance(event, Started):
            return self._submit_ready()
        if isinstance(event, OpDone):
            return self._done(event.op_id)
        if isinstance(event, OpFailed):
            self.finished = True
            return [Abort(event.op_id, event.error)]
        raise TypeError(f"unknown event {event!r}")

    def _done(self, op_id: str) -> list:
        if self.status.get(op_id) != "submitted":
            return []
        self.status[op_id] = "done"
        out: list = []
        call = self.calls[op_id]
        for d in call.all_deps:
            if all(self.status[c] == "done" for c in self.consumers.get(d, ())):
                out.append(Release(d))
        if not self.consumers.get(op_id):
            out.append(Release(op_id))
        self.left_in_step[call.step] -= 1
        while self.steps_done < self.steps and self.left_in_step.get(self.steps_done, 0) == 0:
            out.append(StepDone(self.steps_done))
            self.steps_done += 1
        out += self._submit_ready()
        if self.steps_done == self.steps and not self.finished:
            self.finished = True
            out.append(Finish())
        return out

    def _submit_ready(self) -> list:
        limit = min(self.steps_done + self.window, self.steps)
        out = []
        progress = True
        while progress:                      # forward (write-after-read) edges need a rescan
            progress = False
            for step in range(self.steps_done, limit):
                for op_id in self.by_step.get(step, ()):
                    if self.status[op_id] != "pending":
                        continue
                    call = self.calls[op_id]
                    if all(self.status.get(d, "pending") != "pending" for d in call.all_deps):
                        self.status[op_id] = "submitted"
                        out.append(Submit(call))
                        progress = True
        return out


def _submission_order(calls) -> tuple[str, ...]:
    """Dependencies before dependents (stable in build order); write-after-read edges may
    point forward, so this is a real topological sort, not the build order."""
    table = {c.id: c for c in calls}
    try:
        return topological(list(table), lambda i: table[i].all_deps)
    except Cycle as e:
        raise PlanError(f"the op dependencies must be acyclic, and these wait on each other: "
                        f"{', '.join(e.stuck[:5])}") from None
