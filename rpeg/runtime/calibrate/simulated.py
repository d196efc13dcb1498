"""The client's work on a simulated clock: the scheduling core and fused dispatch driven by
op times instead of a cluster, to measure what the client spends per step at any scale.

    >>> calls = build_calls(pipeline, plan, steps=6)                       # doctest: +SKIP
    >>> r = drive(calls, steps=6, window=2, op_time=seconds_from(plan, calls))  # doctest: +SKIP
    >>> r.tasks_per_step, r.client_cpu_per_step_s                          # doctest: +SKIP
    (1161.0, 0.021)

The loop is the segment loop's (``rpeg.runtime.dask.segments``) without Dask: the core
(``rpeg.runtime.core.scheduler``) says what to submit, ``rpeg.runtime.core.fusion`` packs it into
tasks, and a task runs on its device (one at a time, older steps first, as a worker of
one thread runs them) once every task it reads or waits for has ended; it takes the sum
of its calls' times. Each ending is reported to the core as the adapter reports a
finished future. What is timed (thread CPU time) is the client's part only — the core's
``handle`` and the fusion — not the simulated cluster's bookkeeping; what Dask's client
and scheduler add per task is measured apart (``benchmarks/control_plane.py``).
"""

from __future__ import annotations

import heapq
import time
from collections import Counter, defaultdict
from collections.abc import Callable

import attrs

from rpeg.runtime.core import fusion as F
from rpeg.runtime.core import scheduler as C
from rpeg.runtime.core.flight import Task
from rpeg.runtime.lowering.instances import OpCall


@attrs.frozen
class Driven:
    """What one simulated run took: counts of the steady steps, and the client's CPU."""

    devices: int
    steps: int
    calls_per_step: float
    tasks_per_step: float
    edges_per_step: float              # dependencies (data and ordering) of a step's calls
    task_args_per_step: float          # futures the tasks take as arguments, a step
    client_cpu_per_step_s: float       # the core's handle + fusion, thread CPU time
    simulated_step_s: float            # simulated time per steady step (op times only)
    client_cpu_s: float                # over the whole run


def _polls(start: float, end: float):
    """When the segment loop, last woken at ``start``, polls again before ``end``."""
    pause, t = 0.0005, start + 0.0005
    while t < end:
        yield t
        pause = min(pause * 2, 0.01)
        t += pause


def seconds_from(op_times: dict[str, float], calls) -> Callable[[OpCall], float]:
    """A call's time from its op's time per step (``Predicted.op_times``): the op's time
    shared by the calls of that op a device runs in a step (chunks stream one after another
    on one device; the ranks of a collective each take the whole time)."""
    share = Counter((c.op, c.step, c.device) for c in calls)
    return lambda c: op_times.get(c.op, 0.0) / share[(c.op, c.step, c.device)]


def drive(calls, steps: int, window: int, op_time: Callable[[OpCall], float], *,
          fuse: bool = True, measure_from: int = 1, ticks: bool = True,
          together=()) -> Driven:
    """Run ``steps`` steps of ``calls`` through the core and the fusion on a simulated
    clock (see the module doc); the per-step figures are over steps ``measure_from`` on.
    ``ticks``: the core also hears the segment loop's clock ticks, as often as the loop
    polls while nothing ends (every 0.5 ms at first, the pause doubling to 10 ms).
    ``together``: the plan's fused stages (``Plan.fusion``), as the runtime packs them."""
    table = {c.id: c for c in calls}
    consumers = F.consumers_of(calls)
    devices = sorted({c.device for c in calls})
    core = C.Core.create(calls, steps, window, devices=devices)
    key_of: dict[str, int] = {}                 # op id -> its task (while referenced)
    ended: set[int] = set()
    tasks: list[tuple[F.Group, float]] = []
    waiting: dict[int, int] = {}                # task -> tasks it still waits for
    waiters: dict[int, list[int]] = defaultdict(list)
    ready: dict[int, list] = defaultdict(list)  # device -> heap of (step, task)
    free_at = dict.fromkeys(devices, 0.0)
    running: set[int] = set()
    finishing: list[tuple[float, int]] = []     # (when, task)
    cpu = 0.0
    step_cpu: dict[int, float] = {}
    step_end: dict[int, float] = {}
    tasks_of_step: Counter = Counter()
    args_of_step: Counter = Counter()
    now = 0.0

    def timed(fn, *args):
        nonlocal cpu
        t = time.thread_time()
        out = fn(*args)
        cpu += time.thread_time() - t
        return out

    def submit(instructions) -> None:
        batch = [table[i.call.id] for i in instructions if isinstance(i, C.Submit)]
        # packed by what the core has heard, as the runtime packs them
        for g in (timed(F.fuse, batch, consumers, core.is_done, fuse, core.task_of, together)
                  if batch else ()):
            k = len(tasks)
            tasks.append((g, sum(op_time(c) for c in g.calls)))
            own = set(g.ids)
            needs = {key_of[d] for d in g.external if d in key_of and d not in own}
            args_of_step[g.calls[0].step] += len(needs)
            tasks_of_step[g.calls[0].step] += 1
            for op_id in g.ids:
                key_of[op_id] = k
            timed(core.handle, C.TaskSubmitted(k, Task(g.ids, g.device, g.calls[0].step, 1e9,
                                                       ()), now))
            left = [t for t in needs if t not in ended]
            if left:
                waiting[k] = len(left)
                for t in left:
                    waiters[t].append(k)
            else:
                heapq.heappush(ready[g.device], (g.calls[0].step, k))
        for i in instructions:
            if isinstance(i, C.Release):
                key_of.pop(i.op_id, None)
            elif isinstance(i, C.StepDone):
                step_cpu[i.step] = cpu
                step_end[i.step] = now

    def start_ready() -> None:
        for d in devices:
            if d in running or not ready[d]:
                continue
            _, k = heapq.heappop(ready[d])
            running.add(d)
            free_at[d] = max(now, free_at[d]) + tasks[k][1]
            heapq.heappush(finishing, (free_at[d], k))

    submit(timed(core.handle, C.Started(now)))
    start_ready()
    while finishing and not core.finished:
        if ticks:
            for t in _polls(now, finishing[0][0]):
                timed(core.handle, C.Tick(t))
        now, k = heapq.heappop(finishing)
        g = tasks[k][0]
        running.discard(g.device)
        ended.add(k)
        for w in waiters.pop(k, ()):
            waiting[w] -= 1
            if not waiting[w]:
                del waiting[w]
                heapq.heappush(ready[tasks[w][0].device], (tasks[w][0].calls[0].step, w))
        submit(timed(core.handle, C.TaskEnded(k, now)))
        start_ready()
    if not core.finished:
        raise RuntimeError(f"the simulated run stalled after step {core.steps_done}")
    first, last = measure_from, steps - 1
    span = max(last - first + 1, 1)
    per = lambda counter: sum(counter[s] for s in range(first, steps)) / (steps - first)  # noqa: E731
    calls_per_step = Counter(c.step for c in calls)
    edges = Counter()
    for c in calls:
        edges[c.step] += len(c.all_deps)
    return Driven(devices=len(devices), steps=steps,
                  calls_per_step=per(calls_per_step), tasks_per_step=per(tasks_of_step),
                  edges_per_step=per(edges), task_args_per_step=per(args_of_step),
                  client_cpu_per_step_s=(step_cpu[last] - step_cpu[first - 1]) / span
                  if first > 0 else step_cpu[last] / steps,
                  simulated_step_s=(step_end[last] - step_end[first - 1]) / span
                  if first > 0 else step_end[last] / steps,
                  client_cpu_s=cpu)


def scaled(plan, factor: int):
    """``plan`` on ``factor`` times its devices: each device becomes ``factor`` consecutive
    ones, each stage's data-parallel degree, chunks and model homes grow with them (tensor
    parallel blocks stay as wide). A plan's shape at another size, for measuring how the
    control plane grows; not a plan anyone priced."""
    def grow(devices):
        return tuple(d * factor + j for d in devices for j in range(factor))
    places = tuple(p.changed(devices=grow(p.devices), dp=p.dp * factor,
                                chunks=p.chunks * factor) for p in plan.placements)
    return attrs.evolve(plan, num_devices=plan.num_devices * factor, placements=places,
                        model_homes=tuple((m, grow(d)) for m, d in plan.model_homes),
                        predicted=plan.predicted)


def measure_core(devices: int = 64, steps: int = 6) -> dict:
    """The client's CPU per op call on a simulated clock: the shipped PPO pipeline split over
    two devices (generation on one, the trained models on the other, data parallel) and
    :func:`scaled` to ``devices``, its ops taking 1 s each."""
    import os

    from rpeg.resources import shipped
    from rpeg.runtime.lowering.instances import build_calls
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load

    pipeline = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    plan = scaled(split_plan(pipeline, 2, chunks=2, dp=2, staleness=1), max(1, devices // 2))
    calls = build_calls(pipeline, plan, steps)
    r = drive(calls, steps, 2, lambda c: 1.0)
    return {"devices": r.devices, "calls_per_step": r.calls_per_step,
            "client_cpu_per_step_s": r.client_cpu_per_step_s,
            "call_s": r.client_cpu_per_step_s / max(r.calls_per_step, 1),
            "loadavg": os.getloadavg()[0]}
