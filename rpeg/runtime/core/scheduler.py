"""The scheduling core: events in, instructions out; no Dask, no clock, no I/O.

    >>> core = Core.create(calls, steps=3, window=2)                      # doctest: +SKIP
    >>> core.handle(Started())                                             # doctest: +SKIP
    [Submit(call=OpCall(id='rollout/s0/c0', ...)), ...]
    >>> core.handle(OpDone("rollout/s0/c0"))                               # doctest: +SKIP
    []

The core decides *what to submit when*; the adapter (``rpeg.runtime.dask.segments``, on Dask)
turns ``Submit`` into a Dask future whose arguments are the futures of the op's
dependencies, so *when it runs* is decided by completion events on the cluster,
never by predicted times. The core keeps at most ``window`` steps in flight
(staleness k needs k + 1: generation of step s + k overlaps training of step s),
submits an op only after everything it depends on was submitted, releases an
op's result once every consumer finished (but for the outputs read past the segment's
cut: those it keeps for the checkpoint, and ``Finish`` / ``CutShort`` name them), and
reports each finished step. The adapter packs its submissions into tasks by what the
core has heard (:meth:`Core.is_done`, :meth:`Core.task_of`), never by Dask's view.

It also makes every decision of a segment of a resilient run, from events the adapter
reports with the time they happened (``now``: the core reads no clock):

* the tasks the adapter packed its submissions into (``TaskSubmitted``) and how each
  ended (``TaskEnded``): done, failed (``Abort``; a collective op's failure first waits
  ``peer_grace_s`` for the cluster to report a lost peer, which then takes precedence),
  its worker lost (``Lost``), or given up by the scheduler (``GaveUp``); a device that made no progress for longer
  than its task's limit is stuck (``Stuck``, on a ``Tick``), but a rank blocked in a
  collective, or waiting to read another device's output, is blamed last: the core first
  asks whether its peers' and those devices' workers answer
  (``Ask``, answered by ``Answers``) and blames one that does not, or a peer that made no
  progress before joining (:func:`rpeg.runtime.core.flight.blame`); when to ask the cluster
  whether every worker is still there (``CheckAlive``); nothing in flight with work
  left is a scheduling bug (``Stalled``);
* Ctrl-C (``StopRequested``): the first cut that holds every op already submitted
  (``Stopping``), the ops past it held, and ``CutShort`` once every op inside is done.

What counts as a lost worker is decided here too (:func:`is_loss`, :func:`outcome_of`).
The run's decisions between segments are functions of ``rpeg.runtime.core.choices``:
where the next segment ends, how many steps it keeps in flight, whether its cut runs the
eval block, how long a worker may take before it is stuck (``Limits``), what to do with
the workers found at a (re)start and after a loss, and what a start, a resume and a cut
choose.

Every event carries an id and every instruction the id of the event that caused it
(``stimulus``, as Dask's ``stimulus_id``).

An op's state moves by :data:`TRANSITIONS` only: pending -> submitted (Submit) -> done
(OpDone) | failed (OpFailed -> Abort); pending -> held (past a Ctrl-C cut).
"""

from __future__ import annotations

import enum
import heapq
from collections import defaultdict

import attrs

from rpeg.errors import PlanError, RpegError
from rpeg.graph.order import Cycle, topological
from rpeg.runtime.core.flight import Flight, Task, blame
from rpeg.runtime.lowering.instances import OpCall
from rpeg.runtime.lowering.ordering import gangs_of


def _caused_by():
    """An instruction's ``stimulus``: the id of the event that caused it (kept out of its
    equality, so an instruction is the same whatever caused it)."""
    return attrs.field(default="", kw_only=True, eq=False)


# --- states ------------------------------------------------------------------------------
class OpState(enum.Enum):
    PENDING = "pending"
    HELD = "held"                 # past the cut a Ctrl-C stops at: never submitted
    SUBMITTED = "submitted"
    DONE = "done"
    FAILED = "failed"


# (state, what happens) -> the next state; any other move is a bug in the core
TRANSITIONS: dict[tuple[OpState, str], OpState] = {
    (OpState.PENDING, "submit"): OpState.SUBMITTED,
    (OpState.PENDING, "hold"): OpState.HELD,
    (OpState.SUBMITTED, "done"): OpState.DONE,
    (OpState.SUBMITTED, "fail"): OpState.FAILED,
}


class Outcome(enum.Enum):
    """How a task ended, as the adapter saw it."""

    DONE = "done"
    FAILED = "failed"             # an op raised: the run stops
    LOST = "lost"                 # its worker died under it
    CANCELLED = "cancelled"       # the scheduler gave it up (something it needs was lost)


# what a worker's death looks like to a task that ran there (by name: the core imports no Dask)
LOSSES = ("KilledWorker", "CommClosedError", "FutureCancelledError", "CancelledError")


def is_loss(error) -> bool:
    """Whether ``error``, raised by a call to a worker, means the worker went (killed, OOM, its
    connection closed) rather than that the op failed.

        >>> is_loss(ConnectionResetError()), is_loss(ValueError("bad reward"))
        (True, False)
    """
    return type(error).__name__ in LOSSES or isinstance(error, (ConnectionError, EOFError))


def outcome_of(status: str, error=None) -> Outcome:
    """How a task ended, from the status of its future ("finished", "error", "cancelled")
    and, when it raised, what: a loss is ``LOST``, anything else ``FAILED``; a task the
    scheduler cancelled (what it needs went with a worker) is ``CANCELLED``.

        >>> [outcome_of(s, e).value for s, e in (("finished", None), ("error", EOFError()),
        ...                                       ("error", KeyError()), ("cancelled", None))]
        ['done', 'lost', 'failed', 'cancelled']
    """
    if status == "finished":
        return Outcome.DONE
    if status == "error":
        return Outcome.LOST if is_loss(error) else Outcome.FAILED
    return Outcome.CANCELLED


# --- events -------------------------------------------------------------------------------
# Each event carries an id (its stimulus, as Dask's ``stimulus_id``): the adapter names what
# it saw (a task's end by its Dask key); an event without one is named by the core, by its
# kind and place in the segment's events (``tick-12``).
@attrs.frozen
class Started:
    now: float = 0.0
    id: str = attrs.field(default="", kw_only=True)


@attrs.frozen
class OpDone:
    op_id: str
    id: str = attrs.field(default="", kw_only=True)


@attrs.frozen
class OpFailed:
    op_id: str
    error: str
    id: str = attrs.field(default="", kw_only=True)


@attrs.frozen
class TaskSubmitted:
    key: object
    task: Task
    now: float
    id: str = attrs.field(default="", kw_only=True)


@attrs.frozen
class TaskEnded:
    key: object
    now: float
    outcome: Outcome = Outcome.DONE
    op_id: str = ""               # FAILED / LOST: the op that raised (default: the first)
    error: object = None          # FAILED / LOST: what it raised
    id: str = attrs.field(default="", kw_only=True)


@attrs.frozen
class Tick:
    now: float
    id: str = attrs.field(default="", kw_only=True)


@attrs.frozen
class StopRequested:
    id: str = attrs.field(default="", kw_only=True)


@attrs.frozen
class Answers:
    """The answer to ``Ask``: of the devices asked, those whose workers did not answer."""

    now: float
    silent: frozenset[int] = frozenset()
    id: str = attrs.field(default="", kw_only=True)


# --- instructions -------------------------------------------------------------------------
# Each instruction records the event that caused it (``stimulus``: that event's id), so a
# rollback or an abort names what the core saw when it decided; not part of its value.
@attrs.frozen
class Submit:
    call: OpCall
    stimulus: str = _caused_by()


@attrs.frozen
class Release:
    op_id: str
    stimulus: str = _caused_by()


@attrs.frozen
class StepDone:
    step: int
    stimulus: str = _caused_by()


@attrs.frozen
class Finish:
    """Every op of the segment is done: checkpoint at its end, keeping ``carried``."""

    carried: frozenset[str] = frozenset()    # outputs read past the cut (none without cuts)
    stimulus: str = _caused_by()


@attrs.frozen
class Abort:
    op_id: str
    error: str
    cause: object = attrs.field(default=None, eq=False)   # what the op raised, when known
    stimulus: str = _caused_by()


@attrs.frozen
class Lost:
    """A worker died under a task: roll back to the last cut."""

    device: int
    op_id: str
    step: int
    reason: str
    stimulus: str = _caused_by()


@attrs.frozen
class GaveUp:
    """The scheduler gave a task up: find the worker that left, else roll back anyway."""

    task: Task
    status: str
    stimulus: str = _caused_by()


@attrs.frozen
class Stuck:
    """A device made no progress for longer than its task's limit: kill it, roll back.
    ``blocked``: devices blocked in a collective with it, the first found overdue;
    ``reading``: devices waiting to read an output its worker holds."""

    task: Task
    idle_s: float
    blocked: tuple[int, ...] = ()
    reading: tuple[int, ...] = ()
    stimulus: str = _caused_by()


@attrs.frozen
class Ask:
    """A rank blocked in a collective, or a task reading another device's output, is
    overdue: ask whether the workers of ``devices`` (it, its peers in the collective, the
    devices holding its inputs) answer, and report it (``Answers``), so the core blames
    the one that does not, not the rank waiting for it."""

    devices: tuple[int, ...]
    stimulus: str = _caused_by()


@attrs.frozen
class CheckAlive:
    """Ask the cluster whether every worker is still there (a loss not seen otherwise)."""

    stimulus: str = _caused_by()


@attrs.frozen
class Stalled:
    """Nothing in flight and work left: a bug in the scheduling."""

    stimulus: str = _caused_by()


@attrs.frozen
class Stopping:
    """Ctrl-C: the segment now ends at the cut at ``end``, holding ``inside``."""

    end: int
    inside: frozenset[str]
    stimulus: str = _caused_by()


@attrs.frozen
class CutShort:
    """Every op inside the Ctrl-C cut is done: checkpoint there and stop."""

    end: int
    inside: frozenset[str]
    carried: frozenset[str] = frozenset()    # outputs read past the cut
    stimulus: str = _caused_by()


@attrs.define
class Core:
    calls: dict[str, OpCall]
    order: tuple[str, ...]                    # submission order (dependencies first)
    steps: int
    window: int
    status: dict[str, OpState]
    consumers: dict[str, set[str]]
    left_in_step: dict[int, int]
    by_step: dict[int, list[str]]             # submission order, per step
    steps_done: int = 0                       # steps 0..steps_done-1 are complete
    finished: bool = False
    # a segment of a resilient run (rpeg.runtime.dask.segments)
    cuts: object = None                       # rpeg.runtime.core.cuts.Cuts of the run, if any
    start: int = 0                            # the segment's first step (its cut)
    before: frozenset[str] = frozenset()      # ops done before the segment's cut
    flight: Flight = attrs.field(factory=Flight)
    last_done: dict[int, float] = attrs.field(factory=dict)   # device -> its last finish
    alive_every_s: float = 0.5
    last_alive: float = 0.0
    stuck_every_s: float = 0.5                # how often the tasks in flight are looked at
    last_stuck: float = 0.0
    keep: frozenset[str] = frozenset()        # outputs read past the cut: never released
    stop_cut: frozenset[str] | None = None    # Ctrl-C: the ops inside the cut it stops at
    stop_end: int = 0
    submitted: int = 0                        # ops in the submitted state (in flight)
    peer_grace_s: float = 10.0                # a collective's failure waits this for a loss
    suspect: tuple | None = None              # (op, error, cause, when) of such a failure
    # what the core counts as it goes, so each event costs what it touches (not the
    # whole window): a step's ops are found ready by their dependencies being submitted
    unmet: dict[str, int] = attrs.field(factory=dict)      # op -> dependencies not submitted
    undone: dict[str, int] = attrs.field(factory=dict)     # op -> consumers not done
    ready: dict[int, list[int]] = attrs.field(factory=dict)  # step -> ready ops (positions)
    position: dict[str, int] = attrs.field(factory=dict)   # op -> its place in ``order``
    done_ids: set[str] = attrs.field(factory=set)
    limit: int = 0                            # steps below it may submit (the window's end)
    task_key: dict[str, object] = attrs.field(factory=dict)   # op -> the task it runs in
    events: int = 0                           # events handled (an unnamed one's number)
    stimulus: str = ""                        # the id of the event being handled
    asking: tuple | None = None   # ((overdue task, idle), its gang, its holders) awaiting Answers
    gangs: dict[str, tuple[str, ...]] | None = None   # op -> the calls of its collective

    @classmethod
    def create(cls, calls, steps: int, window: int, *, start: int = 0, cuts=None,
               before=frozenset(), devices=()) -> Core:
        table = {c.id: c for c in calls}
        consumers: dict[str, set[str]] = defaultdict(set)
        unmet: dict[str, int] = {}
        for c in calls:
            deps = set(c.all_deps)
            for d in deps:
                consumers[d].add(c.id)
            # a dependency outside the table never gets submitted: the op waits for ever
            unmet[c.id] = len(deps)
        left: dict[int, int] = defaultdict(int)
        for c in calls:
            left[c.step] += 1
        order = submission_order(calls)
        by_step: dict[int, list[str]] = defaultdict(list)
        for op_id in order:
            by_step[table[op_id].step].append(op_id)
        position = {op_id: k for k, op_id in enumerate(order)}
        ready: dict[int, list[int]] = defaultdict(list)
        for op_id in order:
            if not unmet[op_id]:
                ready[table[op_id].step].append(position[op_id])
        return cls(table, order, steps, max(1, window), {c.id: OpState.PENDING for c in calls},
                   dict(consumers), dict(left), dict(by_step), steps_done=start, cuts=cuts,
                   start=start, before=frozenset(before),
                   keep=frozenset(cuts.carried(steps)) if cuts is not None else frozenset(),
                   last_done=dict.fromkeys(devices, 0.0), unmet=unmet,
                   undone={d: len(cs) for d, cs in consumers.items()}, ready=ready,
                   position=position)

    @property
    def stopping(self) -> bool:
        return self.stop_cut is not None

    def handle(self, event) -> list:
        self.events += 1
        self.stimulus = (getattr(event, "id", "")
                         or f"{_KINDS.get(type(event), 'event')}-{self.events}")
        if isinstance(event, Started):
            self.last_done = dict.fromkeys(self.last_done, event.now)
            self.last_alive = self.last_stuck = event.now
            return self._submit_ready()
        if isinstance(event, OpDone):
            return self._done(event.op_id) + self._stop_reached()
        if isinstance(event, OpFailed):
            return self._fail(event.op_id, event.error)
        if isinstance(event, TaskSubmitted):
            self.flight.add(event.key, event.task, event.now)
            for op_id in event.task.ids:
                self.task_key[op_id] = event.key
            return []
        if isinstance(event, TaskEnded):
            return self._task_ended(event)
        if isinstance(event, Tick):
            return self._tick(event.now)
        if isinstance(event, StopRequested):
            return self._stop()
        if isinstance(event, Answers):
            return self._answers(event)
        raise TypeError(f"unknown event {event!r}")

    def is_done(self, op_id: str) -> bool:
        """Whether the core has heard that ``op_id`` finished (an op of no call of the
        segment finished before its cut). The fusion packs by it: a call joins a task
        without waiting for what is done."""
        state = self.status.get(op_id)
        return state is None or state is OpState.DONE

    def task_of(self, op_id: str) -> object:
        """The key of the task ``op_id`` was submitted in (None: before the segment)."""
        return self.task_key.get(op_id)

    def _move(self, op_id: str, what: str) -> None:
        old = self.status[op_id]
        new = self.status[op_id] = TRANSITIONS[(old, what)]
        self.submitted += (new is OpState.SUBMITTED) - (old is OpState.SUBMITTED)
        if new is OpState.SUBMITTED:              # its consumers wait for one fewer
            for c in self.consumers.get(op_id, ()):
                self.unmet[c] -= 1
                if not self.unmet[c]:
                    call = self.calls[c]
                    self.ready.setdefault(call.step, []).append(self.position[c])
        elif new is OpState.DONE:
            self.done_ids.add(op_id)

    def _fail(self, op_id: str, error: str, cause=None) -> list:
        if self.status.get(op_id) is OpState.SUBMITTED:
            self._move(op_id, "fail")
        self.finished = True
        return [Abort(op_id, error, cause, stimulus=self.stimulus)]

    def running(self, task: Task) -> str:
        """The op of ``task`` its worker is on: the first of its ops not done (those before
        it reported done as they finished), not the task's first op."""
        return next((i for i in task.ids if self.status.get(i) is not OpState.DONE),
                    task.ids[0])

    def _done(self, op_id: str) -> list:
        if self.status.get(op_id) is not OpState.SUBMITTED:
            return []
        self._move(op_id, "done")
        out: list = []
        call = self.calls[op_id]
        for d in dict.fromkeys(call.all_deps):
            self.undone[d] -= 1
            if not self.undone[d]:                 # every consumer of d is done
                if d not in self.keep:
                    out.append(Release(d, stimulus=self.stimulus))
        if not self.consumers.get(op_id):
            if op_id not in self.keep:
                out.append(Release(op_id, stimulus=self.stimulus))
        self.left_in_step[call.step] -= 1
        while self.steps_done < self.steps and self.left_in_step.get(self.steps_done, 0) == 0:
            out.append(StepDone(self.steps_done, stimulus=self.stimulus))
            self.steps_done += 1
        out += self._submit_ready()
        if self.steps_done == self.steps and not self.finished:
            self.finished = True
            out.append(Finish(self.keep, stimulus=self.stimulus))
        return out

    def _submit_ready(self) -> list:
        """Submit every pending op of the window whose dependencies are all submitted, in
        passes over the window's steps in submission order (write-after-read edges point
        forward, so an op made ready by one after it waits for the next pass), as a scan of
        the whole window would; only the ops made ready are visited."""
        limit = min(self.steps_done + self.window, self.steps)
        out = []
        now = self._take_ready(limit)
        while now:
            heapq.heapify(now)
            later: list[tuple[int, int]] = []
            while now:
                key = heapq.heappop(now)
                op_id = self.order[key[1]]
                if self.status[op_id] is not OpState.PENDING:
                    continue
                if self.stop_cut is not None and op_id not in self.stop_cut:
                    self._move(op_id, "hold")
                    continue
                self._move(op_id, "submit")
                out.append(Submit(self.calls[op_id], stimulus=self.stimulus))
                for k in self._take_ready(limit):                # made ready by this one
                    if k > key:
                        heapq.heappush(now, k)
                    else:
                        later.append(k)
            now = later
        return out

    def _take_ready(self, limit: int) -> list[tuple[int, int]]:
        """(step, position) of the ops found ready in the window's steps since last asked."""
        return [(step, p) for step in range(self.steps_done, limit)
                for p in self.ready.pop(step, ())]

    # --- a segment's tasks ----------------------------------------------------------------
    def _task_ended(self, e: TaskEnded) -> list:
        task = self.flight.finish(e.key, e.now, e.outcome is Outcome.DONE)
        if e.outcome is Outcome.DONE:
            self.last_done[task.device] = e.now
            out: list = []
            for op_id in task.ids:
                out += self._done(op_id)
            return out + self._stop_reached()
        op_id = e.op_id or task.ids[0]
        if e.outcome is Outcome.FAILED:
            error = f"{type(e.error).__name__}: {e.error}"
            if (self.calls[op_id].collective and self.suspect is None
                    and not isinstance(e.error, RpegError)):
                # a collective fails when a peer dies (gloo: "connection closed by peer"):
                # the loss, once the cluster sees it, rolls back; only without one it aborts
                self.suspect = (op_id, error, e.error, e.now)
                self.last_alive = e.now
                return [CheckAlive(stimulus=self.stimulus)]
            return self._fail(op_id, error, e.error)
        if e.outcome is Outcome.LOST:
            call = self.calls[op_id]
            return [Lost(call.device, op_id, call.step,
                         f"worker lost ({type(e.error).__name__})", stimulus=self.stimulus)]
        # cancelled: its ops never ran; forgetting it would leave the core waiting for them
        # with nothing in flight (the run "stalled"): it is a loss
        return [GaveUp(task, e.outcome.value, stimulus=self.stimulus)]

    def _tick(self, now: float) -> list:
        out: list = []
        if self.suspect is not None and not self.finished:
            op_id, error, cause, when = self.suspect
            if now - when >= self.peer_grace_s:       # no worker was lost: the op failed
                return self._fail(op_id, error, cause)
        if not self.finished and not self.submitted:
            return [CheckAlive(stimulus=self.stimulus), Stalled(stimulus=self.stimulus)]    # a loss not seen yet is a loss, not a stall
        if now - self.last_alive > self.alive_every_s:
            self.last_alive = now
            out.append(CheckAlive(stimulus=self.stimulus))
        if now - self.last_stuck >= self.stuck_every_s and self.asking is None:
            self.last_stuck = now                    # every task in flight: not each tick
            hit = self.flight.stuck(self.last_done, now)
            gang = self._gang_of(hit[0]) if hit is not None else {}
            holders = {d: op for d, op in hit[0].reads_from
                       if d != hit[0].device} if hit is not None else {}
            if gang or holders:              # blocked in a collective, or a fetch: who answers?
                self.asking = (hit, gang, holders)
                out.append(Ask(tuple(sorted({hit[0].device, *gang, *holders})),
                               stimulus=self.stimulus))
            elif hit is not None:
                out.append(Stuck(*hit, stimulus=self.stimulus))
        return out

    def _answers(self, e: Answers) -> list:
        """Blame, for the overdue rank of a collective asked about, the device that does not
        answer or made no progress before joining (:func:`blame`), else the rank itself."""
        if self.asking is None or self.finished:
            return []
        hit, gang, holders = self.asking
        self.asking = None
        task, idle = blame(self.flight, hit, gang, e.silent, self.last_done, e.now, holders)
        if task == hit[0]:
            return [Stuck(task, idle, stimulus=self.stimulus)]
        if task.device in gang:
            return [Stuck(task, idle, (hit[0].device,), stimulus=self.stimulus)]
        return [Stuck(task, idle, reading=(hit[0].device,), stimulus=self.stimulus)]

    def _gang_of(self, task: Task) -> dict[int, str]:
        """Device -> the call of each peer (on another device) in the collective of the
        first collective call of ``task``; empty when it runs none."""
        if self.gangs is None:
            calls = tuple(self.calls.values())
            self.gangs = {calls[i].id: tuple(calls[j].id for j in at)
                          for at in gangs_of(calls).values() for i in at}
        for op_id in task.ids:
            if op_id in self.gangs:
                return {self.calls[o].device: o for o in self.gangs[op_id]
                        if self.calls[o].device != task.device}
        return {}

    def _stop(self) -> list:
        """Ctrl-C: stop at the first cut after the segment's start that holds every op
        already submitted (or the segment's own end)."""
        if self.stop_cut is not None or self.cuts is None:
            return []
        started = {i for i, st in self.status.items() if st in (OpState.SUBMITTED,
                                                                   OpState.DONE)}
        end = self.steps
        inside = None
        for b in range(self.start + 1, self.steps + 1):
            inside = self.cuts.closure(b)
            if started <= inside:
                end = b
                break
        else:
            inside = self.cuts.closure(self.steps)
        self.stop_cut, self.stop_end = frozenset(inside), end
        self.keep = frozenset(self.cuts.carried(end))
        return [Stopping(end, self.stop_cut, stimulus=self.stimulus)] + self._stop_reached()

    def _stop_reached(self) -> list:
        if self.stop_cut is None or self.finished:
            return []
        if all(i in self.done_ids or i in self.before for i in self.stop_cut):
            self.finished = True
            return [CutShort(self.stop_end, self.stop_cut, self.keep, stimulus=self.stimulus)]
        return []


_KINDS = {Started: "started", OpDone: "op-done", OpFailed: "op-failed",
          TaskSubmitted: "task-submitted", TaskEnded: "task-ended", Tick: "tick",
          StopRequested: "stop-requested", Answers: "answers"}


def submission_order(calls) -> tuple[str, ...]:
    """Dependencies before dependents (stable in build order); write-after-read edges may
    point forward, so this is a real topological sort, not the build order."""
    table = {c.id: c for c in calls}
    try:
        return topological(list(table), lambda i: table[i].all_deps)
    except Cycle as e:
        raise PlanError(f"the op dependencies must be acyclic, and these wait on each other: "
                        f"{', '.join(e.stuck[:5])}") from None
