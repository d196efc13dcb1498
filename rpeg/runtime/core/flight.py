"""Tasks in flight: which (fused) Dask tasks run where, when each became ready, which is stuck.

    >>> fl = Flight()
    >>> fl.add("k1", Task(("rollout/s0/c0", "ref_lp/s0/c0"), device=0, step=0, limit_s=5.0,
    ...                   waits=()), now=0.0)
    >>> fl.add("k2", Task(("actor_step/s0/r0",), device=1, step=0, limit_s=5.0,
    ...                   waits=("ref_lp/s0/c0",)), now=0.0)
    >>> task, idle_s = fl.stuck({0: 0.0, 1: 0.0}, now=6.0)   # k2 is not ready: only k1 counts
    >>> task.ids, idle_s
    (('rollout/s0/c0', 'ref_lp/s0/c0'), 6.0)
    >>> fl.finish("k1", now=1.0).ids, fl.stuck({0: 1.0, 1: 0.0}, now=5.5)
    (('rollout/s0/c0', 'ref_lp/s0/c0'), None)
    >>> fl.running_on(1)
    ('actor_step/s0/r0', 0)

A task is one Dask future running one or more op calls of one device in order
(``rpeg.runtime.core.fusion``). It is *ready* once every op it waits for (its
dependencies inside the segment, outside the task) is done; a device makes no
progress when its earliest-ready task has not finished within its time limit
since it became ready or since the device last finished a task, whichever is
later. No Dask here: keys are whatever the caller uses to name its futures.
"""

from __future__ import annotations

from collections import defaultdict

import attrs


@attrs.frozen
class Task:
    ids: tuple[str, ...]              # op calls, in the order the worker runs them
    device: int
    step: int
    limit_s: float                    # no progress for this long after it is ready: stuck
    waits: tuple[str, ...]            # ops of other tasks it needs done before it can start
    # (device, op) of each other device whose output it reads (one op each): a worker that
    # froze after an op finished holds its output, and the reader waits for it in a fetch
    reads_from: tuple[tuple[int, str], ...] = ()


class Flight:
    """Tasks submitted and not yet finished, and the ops done so far."""

    def __init__(self) -> None:
        self.tasks: dict[object, Task] = {}
        self.ready_at: dict[object, float] = {}
        self.done: set[str] = set()
        self._missing: dict[object, set[str]] = {}
        self._waiters: dict[str, list[object]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self.tasks)

    def add(self, key, task: Task, now: float) -> None:
        self.tasks[key] = task
        missing = {d for d in task.waits if d not in self.done}
        if missing:
            self._missing[key] = missing
            for d in missing:
                self._waiters[d].append(key)
        else:
            self.ready_at[key] = now

    def finish(self, key, now: float, ok: bool = True) -> Task:
        """Forget the task of ``key``; when ``ok``, its ops are done (tasks waiting for
        them may become ready at ``now``)."""
        task = self.tasks.pop(key)
        self.ready_at.pop(key, None)
        self._missing.pop(key, None)
        if ok:
            for op_id in task.ids:
                self.done.add(op_id)
                for k in self._waiters.pop(op_id, ()):
                    left = self._missing.get(k)
                    if left is None:
                        continue
                    left.discard(op_id)
                    if not left:
                        del self._missing[k]
                        self.ready_at[k] = now
        return task

    def submitted(self) -> set[str]:
        """Ids of every op submitted: done or in a task in flight."""
        return self.done | {i for t in self.tasks.values() for i in t.ids}

    def running_on(self, device: int) -> tuple[str, int]:
        """(op, step) of the earliest op of ``device`` not done; ("(none)", -1) if none."""
        live = [(t.step, t.ids[0]) for t in self.tasks.values() if t.device == device]
        if not live:
            return "(none)", -1
        step, op = min(live)
        return op, step

    def first_ready(self, device: int) -> tuple[object, float] | None:
        """(key, when it became ready) of ``device``'s earliest-ready task; None if none."""
        ready = [(t, k) for k, t in self.ready_at.items() if self.tasks[k].device == device]
        if not ready:
            return None
        t, key = min(ready, key=lambda x: x[0])
        return key, t

    def idle(self, device: int, last_done: dict[int, float], now: float
             ) -> tuple[Task, float] | None:
        """``device``'s earliest-ready task and how long the device made no progress on it
        (since it became ready or the device last finished a task); None if none is ready."""
        first = self.first_ready(device)
        if first is None:
            return None
        key, t_ready = first
        return self.tasks[key], now - max(t_ready, last_done.get(device, t_ready))

    def overdue(self, last_done: dict[int, float], now: float) -> list[tuple[Task, float]]:
        """Every device that made no progress for longer than its earliest-ready task's
        limit: that task and the time, by device."""
        first: dict[int, tuple[float, object]] = {}      # one pass over the ready tasks
        for key, t_ready in self.ready_at.items():
            d = self.tasks[key].device
            if d not in first or t_ready < first[d][0]:
                first[d] = (t_ready, key)
        out = []
        for d, (t_ready, key) in sorted(first.items()):
            task = self.tasks[key]
            idle = now - max(t_ready, last_done.get(d, t_ready))
            if idle > task.limit_s:
                out.append((task, idle))
        return out

    def stuck(self, last_done: dict[int, float], now: float) -> tuple[Task, float] | None:
        """A task whose device made no progress for longer than its limit, if any (the first
        device's), and for how long its device made none."""
        over = self.overdue(last_done, now)
        return over[0] if over else None


def blame(fl: Flight, hit: tuple[Task, float], gang: dict[int, str],
          silent: frozenset[int], last_done: dict[int, float], now: float,
          holders: dict[int, str] | None = None) -> tuple[Task, float]:
    """Whom a stuck task blames: ``hit`` is the overdue task of a device blocked in a
    collective or reading another device's output, ``gang`` its peers' calls of that
    collective (device -> op id), ``holders`` the other devices whose outputs it reads
    (device -> an op whose output it reads there), ``silent`` the devices whose workers did
    not answer when asked. A rank blocked in a collective waits for a peer that never
    joined, and a reader waits for the worker that holds its input, so it is the last to
    blame: first a device that does not answer (frozen: the task in hand if it is its own;
    a silent peer before a silent holder), then an overdue peer busy with a task that holds
    no call of the collective (it made no progress before joining), and only then the rank
    in hand.

        >>> fl = Flight()
        >>> fl.add("a", Task(("load",), 0, 2, 5.0, ()), now=0.0)
        >>> fl.add("b", Task(("export",), 1, 2, 5.0, ()), now=0.0)
        >>> hit = fl.stuck({0: 0.0, 1: 0.0}, now=6.0)
        >>> hit[0].device, blame(fl, hit, {1: "export"}, frozenset({1}), {}, 6.0)[0].device
        (0, 1)
        >>> fl = Flight()                  # device 1 froze after its rollout finished
        >>> fl.add("c", Task(("train",), 0, 2, 5.0, (), ((1, "rollout"),)), now=0.0)
        >>> hit = fl.stuck({0: 0.0, 1: 0.0}, now=6.0)
        >>> task, idle = blame(fl, hit, {}, frozenset({1}), {}, 6.0, {1: "rollout"})
        >>> task.ids, task.device, idle
        (('rollout',), 1, 6.0)
    """
    task, idle_s = hit
    if task.device in silent:
        return hit
    for device in sorted(gang):
        if device in silent:
            found = fl.idle(device, last_done, now) or _holding(fl, gang[device], last_done,
                                                                 now)
            if found is not None:
                return found
    for device, op_id in sorted((holders or {}).items()):
        if device in silent and device not in gang:
            # its own task if it has one ready; else the op whose output it holds
            return fl.idle(device, last_done, now) \
                or (Task((op_id,), device, task.step, task.limit_s, ()), idle_s)
    for device in sorted(gang):
        found = fl.idle(device, last_done, now)
        if found is not None and gang[device] not in found[0].ids \
                and found[1] > found[0].limit_s:
            return found
    return hit


def first_silent(devices, silent) -> int:
    """Whom a call to several workers that timed out blames: the first of ``devices`` (those
    whose results are missing, in order) whose worker does not answer, else the first (the
    others may only be waiting for it, in a collective).

        >>> first_silent([0, 1], frozenset({1})), first_silent([0, 1], frozenset())
        (1, 0)
    """
    devices = list(devices)
    return next((d for d in devices if d in silent), devices[0] if devices else -1)


def _holding(fl: Flight, op_id: str, last_done: dict[int, float], now: float
             ) -> tuple[Task, float] | None:
    """The task in flight that holds ``op_id`` (not yet ready), with its device's idle time
    since it last finished a task."""
    for t in fl.tasks.values():
        if op_id in t.ids:
            return t, now - last_done.get(t.device, now)
    return None
