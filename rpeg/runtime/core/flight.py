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

    def stuck(self, last_done: dict[int, float], now: float) -> tuple[Task, float] | None:
        """A task whose device made no progress for longer than its limit, if any, and for
        how long its device made none."""
        first: dict[int, tuple[float, object]] = {}
        for key, t_ready in self.ready_at.items():
            d = self.tasks[key].device
            if d not in first or t_ready < first[d][0]:
                first[d] = (t_ready, key)
        for d, (t_ready, key) in sorted(first.items()):
            task = self.tasks[key]
            idle = now - max(t_ready, last_done.get(d, t_ready))
            if idle > task.limit_s:
                return task, idle
        return None
