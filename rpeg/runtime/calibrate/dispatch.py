"""What one Dask task costs on this machine, measured: the dispatch term of the cost model.

    >>> m = measure_dispatch(tasks=60)                                    # doctest: +SKIP
    >>> m["dispatch_s"], m["same_worker_s"], m["cross_worker_s"]          # doctest: +SKIP
    (0.0034, 0.0030, 0.0039)

A local cluster like the one ``rpeg run`` starts (worker processes of one thread,
resource ``GPU=1``, 127.0.0.1) runs chains of tasks, each holding its worker for
``hold_s`` (a small op: 10 ms) and passing a small result on to the next. The whole
chain is submitted up front, as the runtime submits a window of steps, and held
back by its first task until every task is in, so what separates one task's end
from the next one's start is dispatch alone: worker -> scheduler -> worker, and the
result's transfer when the next task runs on the other worker. ``same_worker_s``
and ``cross_worker_s`` are the median gaps of chains on one worker and of chains
alternating between the two; ``dispatch_s`` the median of all gaps, which
``rpeg.cost.calibrate.fit_dispatch`` writes into the profile. ``round_trip_s`` is
one task submitted by the client and waited for.
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from collections.abc import Iterator

import attrs


@contextlib.contextmanager
def environ_kept() -> Iterator[None]:
    """Restore this process's environment as it was on entry. A Dask nanny writes its
    pre-spawn settings into ``os.environ`` before it starts a worker (Dask's defaults:
    ``MALLOC_TRIM_THRESHOLD_=65536``, one thread for OpenMP, MKL and OpenBLAS,
    ``PYTHONHASHSEED``) and leaves them there, so every process this one starts later
    would inherit them: a measurement must leave the process as it found it."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update({k: v for k, v in before.items() if os.environ.get(k) != v})


def _stamp(prev, hold_s: float = 0.0) -> dict:
    """A task that holds its worker for ``hold_s`` and passes a small payload on; says when
    it started and ended."""
    start = time.time()
    time.sleep(hold_s)
    return {"start": start, "end": time.time(), "values": prev["values"]}


def measure_dispatch(tasks: int = 60, repeats: int = 3, hold_s: float = 0.01) -> dict:
    """Per-task dispatch seconds of a fresh local 2-worker cluster (see the module doc)."""
    from distributed import Client, LocalCluster, wait

    payload = {"values": list(range(64))}
    with environ_kept(), LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                      resources={"GPU": 1}, host="127.0.0.1", dashboard_address=None,
                      silence_logs=logging.CRITICAL) as cluster, Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])

        def chain(alternate: bool, n: int) -> list[float]:
            # the first task holds the chain until every task is submitted: the gaps are
            # then the scheduler's and the workers', not the client's submitting
            futs = [client.submit(_stamp, payload, 0.3 + 0.01 * n, workers=[workers[0]],
                                  pure=False)]
            for i in range(n):
                w = workers[(i + 1) % 2] if alternate else workers[0]
                futs.append(client.submit(_stamp, futs[-1], hold_s, workers=[w],
                                          allow_other_workers=False, pure=False))
            wait(futs)
            got = [f.result() for f in futs[1:]]
            return [b["start"] - a["end"] for a, b in zip(got, got[1:], strict=False)]

        def round_trip(n: int) -> float:
            t = time.perf_counter()
            for _ in range(n):
                client.submit(_stamp, payload, workers=[workers[0]], pure=False).result()
            return (time.perf_counter() - t) / n

        chain(False, 10)                                     # warm up both paths
        chain(True, 10)
        same = [g for _ in range(repeats) for g in chain(False, tasks)]
        cross = [g for _ in range(repeats) for g in chain(True, tasks)]
        trip = [round_trip(max(tasks // 4, 10)) for _ in range(repeats)]
    return {"dispatch_s": statistics.median(same + cross),
            "same_worker_s": statistics.median(same), "cross_worker_s": statistics.median(cross),
            "round_trip_s": statistics.median(trip), "tasks": tasks, "repeats": repeats,
            "hold_s": hold_s, "loadavg": os.getloadavg()[0]}


def measure_control(steps: int = 40, root: str | None = None, rounds: int = 2) -> dict:
    """The control plane's CPU per step of real runs (``rpeg.runtime.rundir.directory.host_usage``:
    the client's process — on a local cluster also the scheduler's — and the device
    workers' CPU outside ops), with the Dask tasks per step they took.

    Three runs of the shipped tiny PPO pipeline on hand-built split placements (not what
    the planner picks): two devices with 1 and with 3 generation chunks (7 and ~15 tasks a
    step), and one device (1 task a step); ``rpeg.cost.calibrate.fit_control`` fits the
    per-device and per-task terms from them.

    Each run cuts a checkpoint only at its end, after the steps measured: a cut saves every
    model's weights and optimizer state, in the workers and the client, once every
    ``checkpoint_every`` steps (10 for ``rpeg run``), and what it costs grows with the
    models' state, not with the devices or the tasks. A step a cut ends is one of ten, not
    the median step the prediction is compared with (``rpeg show``); measured into these
    runs it would be priced into every step, and most into a plan on one device (these
    runs' models are not shared, the planner's plan for tiny_ppo shares one backbone).

    The three runs are made ``rounds`` times, in alternating order (the second round
    backwards, so a load that drifts over the calibration weighs on every run alike), and
    each run's figures are the medians over its rounds: from one round, a run's control CPU
    a step moved by +-10% from one calibration to the next (load 9-11), and the per-device
    term fitted from their differences by up to 60%.
    """
    import json
    import os
    import tempfile

    from rpeg.resources import shipped
    from rpeg.runtime.calibrate.runs import generate_rows
    from rpeg.runtime.dask.driver import RunOptions
    from rpeg.runtime.dask.runner import Resilience, run_resilient
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load

    idle = measure_idle()
    spec = shipped("pipelines", "tiny_ppo.rpeg")
    pipeline = load(spec)
    configs = ((2, 1), (2, 3), (1, 1))
    seen: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    rollouts: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="rpeg-calibrate-") as tmp:
        for r in range(max(rounds, 1)):
            for devices, chunks in (configs if r % 2 == 0 else configs[::-1]):
                plan = split_plan(pipeline, devices, staleness=1 if devices > 1 else 0,
                                  chunks=chunks)
                result = run_resilient(pipeline, plan,
                                       RunOptions(steps=steps, root=root or tmp,
                                                  progress=False),
                                       spec_path=str(spec),
                                       resilience=Resilience(checkpoint_every=steps))
                host = json.loads((result.path / "run.json").read_text()).get("host")
                if chunks == 1:       # the rollout whole, one call a step: its CPU and lengths
                    rollouts.setdefault(f"{devices}x{chunks}", []).extend(
                        generate_rows(result.path))
                if host is None:
                    continue
                seen[(devices, chunks)].append(
                    {"tasks_per_step": host["tasks_per_step"],
                     "control_cpu_per_step_s": round(host["client_cpu_per_step_s"]
                                                     + host["worker_cpu_per_step_s"], 6),
                     **{k: host[k] for k in ("wall_per_step_s", "op_cpu_per_step_s")}})
    runs = [{"devices": d, "chunks": c, "rounds": len(got),
             **{k: round(statistics.median(g[k] for g in got), 6) for k in got[0]}}
            for (d, c), got in seen.items() if got]
    w = pipeline.workload
    generate = {"stage": "rollout", "model": pipeline.model("actor").preset,
                "prompt_len": w.prompt_len, "max_len": w.gen_len.max_len,
                "runs": [{"run": k, "rows": v} for k, v in rollouts.items()]}
    return {"runs": runs, "samples": {f"{d}x{c}": got for (d, c), got in seen.items()},
            "idle": idle, "host_cores": os.cpu_count() or 1, "steps": steps,
            "rounds": rounds, "loadavg": os.getloadavg()[0], "generate": generate}


def measure_idle(devices: int = 2, wait_s: float = 3.0) -> dict:
    """The CPU a local cluster like ``rpeg run``'s burns doing nothing, per second and per
    process (the client's — with the scheduler and the nannies — and each device worker's):
    heartbeats, the workers' system and memory monitors, the dashboard's periodic callbacks.
    A run pays it for as long as its steps take, whatever it dispatches."""
    from rpeg.runtime.dask.driver import WORKER_BYTES, DaskCluster

    with DaskCluster(devices, None, False, False, WORKER_BYTES) as cl:
        client = cl.client
        time.sleep(1.0)                               # past the start's own traffic
        before = time.process_time(), sum(client.run(time.process_time).values())
        t = time.perf_counter()
        time.sleep(wait_s)
        wall = time.perf_counter() - t
        after = time.process_time(), sum(client.run(time.process_time).values())
    cpu = (after[0] - before[0]) + (after[1] - before[1])
    return {"processes": devices + 1, "wall_s": round(wall, 4), "cpu_s": round(cpu, 6),
            "cpu_per_process_s": round(cpu / (wall * (devices + 1)), 6)}


def measure_scheduler(workers=(8, 32), tasks: int = 400, deps: int = 4,
                      idle_s: float = 3.0, broadcasts: int = 10, cross: bool = True) -> dict:
    """What Dask's scheduler and client spend per task, per task argument and per worker,
    with ``workers`` lightweight workers at a time (``rpeg.runtime.calibrate.fleet``): CPU
    seconds of each process over

    * ``idle_s`` of nothing (the workers' heartbeats),
    * ``broadcasts`` calls of ``client.run`` on every worker (the trace drain each step),
    * ``tasks`` no-op tasks pinned round-robin to the workers as rpeg pins them, with no
      arguments and with ``deps`` futures each of earlier tasks on the same worker (and,
      on the smallest fleet, with ``cross``, on other workers, which the worker fetches).

    ``rpeg.cost.calibrate.fit_scheduler`` turns the rows into the profile's terms.
    """
    from rpeg.runtime.calibrate.fleet import Fleet
    from rpeg.runtime.dask import worker as W

    rows = []
    for i, n in enumerate(sorted(workers)):
        with Fleet(n) as f:
            row: dict = {"workers": n, "tasks": tasks, "deps": deps, "memory": f.memory()}
            time.sleep(1.0)                          # past the start's own traffic
            a = f.cpu()
            time.sleep(idle_s)
            row["idle"] = attrs.asdict(f.cpu() - a)
            a = f.cpu()
            for _ in range(broadcasts):
                f.client.run(W.drain)
            row["broadcast"] = dict(attrs.asdict(f.cpu() - a), calls=broadcasts)
            parts = [("tasks_0", 0, False), (f"tasks_{deps}", deps, False)]
            if i == 0 and cross:
                parts.append((f"tasks_{deps}_cross", deps, True))
            for name, k, cross in parts:
                _tasks(f, min(tasks, 100), k, cross)           # warm up
                a = f.cpu()
                _tasks(f, tasks, k, cross)
                row[name] = attrs.asdict(f.cpu() - a)
            row["memory_after"] = f.memory()
        rows.append(row)
    return {"rows": rows, "loadavg": os.getloadavg()[0]}


def _tasks(fleet, n: int, k: int, cross: bool = True) -> list:
    """``n`` no-op tasks pinned round-robin, each taking the futures of ``k`` tasks before
    it — on other workers (``cross``: the worker fetches them) or on its own — submitted
    one by one as the runtime submits them."""
    from distributed import wait

    from rpeg.runtime.calibrate.fleet import noop
    futs: list = []
    w = fleet.workers
    stride = 1 if cross else len(w)
    for i in range(n):
        args = [futs[j] for j in range(i - stride, max(-1, i - stride * (k + 1)), -stride)
                if j >= 0][:k]
        futs.append(fleet.client.submit(noop, *args, key=f"t{k}-{i}-{time.time_ns()}",
                                        workers=[w[i % len(w)]], allow_other_workers=False,
                                        pure=False, priority=0))
    wait(futs)
    return futs
