"""The run's choices between segments: where a segment ends, how many steps it keeps in
flight, whether its cut runs the eval, how long a worker may take, what to do with the
workers at a start and after a loss, which workers a start takes, which saved replica
each model restores from, whether a resume restarts at its cut, where the eval runs,
which replicas a cut saves and which checkpoints it keeps, where a wait on the workers
outside a segment's tasks stands (running, stuck, lost) and whether a failed hand-over of
carried outputs lost its worker. Pure functions of what the adapter found; no Dask, no
files.

    >>> take_workers(["tcp://a", "tcp://b", "tcp://c"], lost={"tcp://a"}, n=2)
    {0: 'tcp://b', 1: 'tcp://c'}
    >>> pruned([2, 4, 6, 8], keep=2)
    [2, 4]
    >>> best_source({"actor@0": 4, "actor@1": 4, "critic@1": 3}, "actor", trained={"actor@1"})
    'actor@1'

The Dask adapter (``rpeg.runtime.dask``) asks the cluster and reads the checkpoint, then
carries out what these return; the scheduling core's own decisions (what to submit, when a
segment's work is done, what is stuck) are in ``rpeg.runtime.core.scheduler``.
"""

from __future__ import annotations

import enum

import attrs

from rpeg.graph.ids import ReplicaAt, ReplicaKey
from rpeg.runtime.core.scheduler import is_loss


def take_workers(alive, lost, n: int) -> dict[int, str] | None:
    """Device -> worker for a start needing ``n`` devices: the first ``n`` workers there (in
    the order given: sorted addresses) that were never lost (a worker blamed for a loss may
    be frozen, not gone); None when fewer are there."""
    have = [a for a in alive if a not in lost]
    return dict(enumerate(have[:n])) if len(have) >= n else None


FIRST_WORKERS_S = 30.0          # a start's first wait for the cluster's own workers


def workers_wait_s(attempt: int, replace_wait_s: float) -> float:
    """How long a start waits for enough workers: the cluster's own at the first attempt,
    a replacement for a lost one after it (the nanny restarts it; a spare may join)."""
    return replace_wait_s if attempt > 1 else FIRST_WORKERS_S



def pruned(steps, keep: int) -> list[int]:
    """The complete checkpoints (by step) a cut removes: all but the newest ``keep``
    (``keep`` = 0: all of them)."""
    done = sorted(steps)
    return done[:-keep] if keep else done


def rebuildable(versions: dict[str, tuple[int, bool, bool, bool]]) -> set[str]:
    """Replicas a cut does not save, as a resume rebuilds them without their files: a
    frozen model (made again from its weights or seed), and a copy whose version equals its
    trained replica's (loaded from that one's files) and that keeps no partial rollouts
    (only its own files hold them)."""
    trained = {ReplicaAt(k).key: v for k, (v, home, _, _) in versions.items() if home}
    return {k for k, (v, home, frozen, carries) in versions.items()
            if frozen or (not home and not carries and trained.get(ReplicaAt(k).key) == v)}


def best_source(saved: dict[str, int], model: str, trained) -> str:
    """The saved replica (``model@device`` -> version) a copy of ``model`` restores from on
    a device where it was not saved: its newest replica, of the same copy or, when the
    backbone it copies has a newer one, of the backbone; one with optimizer state
    (``trained``: the replicas saved with it) before one without.

        >>> best_source({"actor~vllm@0": 3, "actor@1": 4}, "actor~vllm", trained={"actor@1"})
        'actor@1'
    """
    key = ReplicaKey(model)
    cands = [k for k in saved if ReplicaAt(k).key == key]
    newest = max((saved[k] for k in saved if ReplicaAt(k).key.backbone == key.backbone),
                 default=None)
    if not cands or (newest is not None and max(saved[k] for k in cands) < newest):
        cands = [k for k in saved if ReplicaAt(k).key.backbone == key.backbone]
    with_opt = [k for k in cands if k in trained]
    return max(with_opt or cands, key=lambda k: saved[k])


def restore_sources(saved: dict[str, int], device: int, trained, *, restart: bool
                    ) -> dict[str, str]:
    """Copy -> the saved replica a worker of ``device`` restores it from: its own where it
    was saved on this device, else :func:`best_source` (a plan re-made for fewer devices
    maps state by model); ``restart`` (an extended run restarts at its cut, every replica at
    the newest version, as at step 0): always the best source.

        >>> restore_sources({"actor@0": 2, "actor@1": 2}, 1, set(), restart=False)
        {'actor': 'actor@1'}
    """
    out: dict[str, str] = {}
    for k in saved:
        if ReplicaAt(k).device == device:
            out[ReplicaAt(k).key] = k
    for k in saved:
        model = ReplicaAt(k).key
        if restart or model not in out:
            out[model] = best_source(saved, model, trained)
    return out


def restarts_at_cut(cut: int, reach: int, made_for: int, steps: int) -> bool:
    """Whether a resume to ``steps`` (the run was made for ``made_for``) from the checkpoint
    at ``cut`` restarts there, every replica at the checkpoint's version: the cut was made
    for a run that ended within ``2 * reach`` steps of it (``reach``: how far back any
    dependency reaches), so what it carries is not what the longer run reads.

        >>> restarts_at_cut(59, 1, 60, 120), restarts_at_cut(40, 1, 60, 120)
        (True, False)
    """
    return steps != made_for and cut + 2 * reach > min(made_for, steps)


def eval_home(homes: dict[str, list[int]], generates) -> tuple[str, int] | None:
    """(replica, device) the eval block runs on: the first trained replica (``homes``:
    replica -> its devices, in the plan's order) whose backbone holds the generating model
    (``generates(replica)``), on its first device; None when the plan trains none.

        >>> eval_home({"critic": [1], "actor": [0, 1]}, lambda m: m == "actor")
        ('actor', 0)
    """
    for model, devices in homes.items():
        if generates(model) and devices:
            return model, devices[0]
    return None


# --- between segments: where one ends, its window, the eval, the limits, after a loss -------
def next_cut(start: int, steps: int, checkpoint_every: int, eval_every: int | None) -> int:
    """The step a segment starting at ``start`` ends at: the next checkpoint or eval step,
    or the run's end. ``checkpoint_every`` 0: no checkpoint between (only at evals and the
    end), as the workload key means.

        >>> next_cut(0, 25, 10, None), next_cut(10, 25, 10, 4), next_cut(20, 25, 10, None)
        (10, 12, 25)
        >>> next_cut(0, 25, 0, None), next_cut(0, 25, 0, 4)
        (25, 4)
    """
    every = eval_every or steps
    cadence = checkpoint_every or steps
    return min(steps, (start // cadence + 1) * cadence, (start // every + 1) * every)


class Workers(enum.Enum):
    """What a run does with the workers it finds at a (re)start."""

    RUN = "run"                   # as many as the plan's devices
    REFUSE = "refuse"             # too few for a run that never started: plan for these
    GIVE_UP = "give up"           # none left
    REPLAN = "replan"             # too few after a loss: re-plan for those left


def on_workers(needed: int, have: int, *, started: bool) -> Workers:
    """The decision of :class:`Workers` for ``have`` workers of the ``needed`` (``started``:
    the run has made a checkpoint, or this is a restart after a loss).

        >>> [on_workers(2, n, started=s).value for n, s in ((2, False), (1, False), (1, True),
        ...                                                  (0, True))]
        ['run', 'refuse', 'replan', 'give up']
    """
    if have >= needed:
        return Workers.RUN
    if not started:
        return Workers.REFUSE
    return Workers.GIVE_UP if have == 0 else Workers.REPLAN


def on_loss(losses: int, max_losses: int, stuck: bool) -> tuple[bool, bool]:
    """(give up, kill the worker first) after the run's ``losses``-th loss: past
    ``max_losses`` the run stops (resumable); a stuck worker (still there, not answering) is
    killed before the rollback, a lost one is gone already.

        >>> on_loss(1, 3, stuck=True), on_loss(4, 3, stuck=False)
        ((False, True), (True, False))
    """
    return losses > max_losses, stuck


def window_of(staleness) -> int:
    """Steps a segment keeps in flight for a plan of ``staleness`` ((stage, k) pairs): k + 1
    may run at once, and one more is submitted ahead, so the scheduler holds its ops and
    starts them the moment their inputs exist (no client round trip).

        >>> window_of(()), window_of((("rollout", 1), ("adv", 0)))
        (2, 3)
    """
    return max((k for _, k in staleness), default=0) + 2


def eval_due(step: int, steps: int, every: int | None) -> bool:
    """Whether the cut at ``step`` runs the eval block: every ``every`` steps (the untrained
    model at 0 among them) and the run's last step; never without one.

        >>> [s for s in range(11) if eval_due(s, 10, 4)], eval_due(3, 10, None)
        ([0, 4, 8, 10], False)
    """
    return every is not None and (step % every == 0 or step == steps)


SETUP_LIMIT_S = 600.0        # a worker's set-up imports torch and builds models: minutes
QUICK_S = 30.0               # a call answered at once, but for a loaded machine
REPORT_S = 120.0             # a worker's first import of torch, on a loaded machine


@attrs.frozen
class Limits:
    """How long the run waits on its workers before one counts as stuck (then it is killed
    and the run rolls back): a task, ``factor`` x the plan's predicted time of its ops and
    never less than ``floor_s``; any other call to a worker, from the floor.

        >>> Limits(10.0, 120.0).task([("gen",), ("gen", "ref")], {"gen": 20.0, "ref": 30.0})
        500.0
        >>> Limits(10.0, 1.0).task([("gen",)], {}), Limits(10.0, 1.0).gather_s
        (1.0, 2.0)
    """

    factor: float = 10.0
    floor_s: float = 120.0

    def task(self, stages_of_calls, op_times: dict[str, float]) -> float:
        """A task running calls of these stages (each call's stages, as ``OpCall.stages``)
        in turn: the slowest stage of each call, summed (once per task: a frozen worker
        is found as fast whatever the task holds)."""
        t = sum(max((op_times.get(s, 0.0) for s in stages), default=0.0)
                for stages in stages_of_calls)
        return max(self.floor_s, self.factor * t)

    @property
    def gather_s(self) -> float:
        """Results of a call to every worker (a checkpoint's saves, an eval)."""
        return 2 * self.floor_s

    @property
    def setup_s(self) -> float:
        """The workers' set-up: importing torch and building models."""
        return max(SETUP_LIMIT_S, 2 * self.floor_s)

    @property
    def drain_s(self) -> float:
        """Trace events from every worker at once (then each is asked on its own)."""
        return min(10.0, self.floor_s)

    @property
    def quick_s(self) -> float:
        """A call a worker or the scheduler answers at once: a teardown, a free port, its
        pid, a restart, the scheduler going idle after a loss."""
        return QUICK_S

    @property
    def report_s(self) -> float:
        """A worker's report of its devices (it looks at its GPUs, importing torch)."""
        return REPORT_S

    @property
    def answer_s(self) -> float:
        """Whether a worker answers at all (``Ask``): its event loop replies at once, even
        while its task blocks in a collective; a frozen one never does."""
        return min(5.0, self.floor_s)


# --- waits on the workers outside a segment's tasks (set-ups, a cut's saves, an eval) -----
ENDED = frozenset(("finished", "error", "cancelled"))   # a future's end states ("lost" is not
# one: its result went with a worker and waits to be made again, pinned there, never)


class Wait(enum.Enum):
    """Where a wait on calls to the workers stands (each call a Dask future; a segment's
    tasks are not waited on so: the scheduling core hears their ends one by one)."""

    RUNNING = "running"           # some still run, within the limit: wait on
    STUCK = "stuck"               # some still run past the limit: the run recovers
    ENDED = "ended"               # every one ended: see :func:`lost_in`


def waiting(statuses, waited_s: float, limit_s: float) -> Wait:
    """Where a wait stands after ``waited_s`` seconds, from the statuses of the futures still
    waited on (a future that ended once is not asked again), ``limit_s`` the wait's limit
    (:class:`Limits`).

        >>> [waiting(s, t, 10.0).value for s, t in ((["pending", "finished"], 3.0),
        ...      (["lost"], 11.0), (["finished", "error", "cancelled"], 11.0))]
        ['running', 'stuck', 'ended']
    """
    if all(s in ENDED for s in statuses):
        return Wait.ENDED
    return Wait.STUCK if waited_s > limit_s else Wait.RUNNING


def lost_in(ended) -> bool:
    """Whether a wait whose calls all ended lost a worker: ``ended`` yields each call's
    (status, the error it raised or None), and one the scheduler cancelled (what it needed
    went with a worker) or one that raised a loss
    (:func:`~rpeg.runtime.core.scheduler.is_loss`) lost it (not one whose result went with
    a worker since, "lost": the adapter's loss check finds that worker gone); any other
    error is the call's own, raised when the results are gathered.

        >>> lost_in([("finished", None), ("cancelled", None)])
        True
        >>> lost_in([("error", KeyError("x")), ("error", EOFError())])
        True
        >>> lost_in([("error", KeyError("x")), ("finished", None)])
        False
    """
    return any(status == "cancelled" or (status == "error" and is_loss(error))
               for status, error in ended)


def carry_lost(error: BaseException) -> bool:
    """Whether putting the outputs carried over a cut on a worker failed because the worker
    went (a loss, or its connection timed out) rather than by an error of its own.

        >>> carry_lost(OSError("Timed out trying to connect")), carry_lost(TypeError("x"))
        (True, False)
    """
    return is_loss(error) or "timed out" in str(error).lower()
