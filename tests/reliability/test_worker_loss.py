"""A lost worker never stalls the run. One Dask worker of tiny_ppo (split over two devices,
so a weight sync moves the actor between them every step, on a real local cluster whose
nannies replace a dead worker) is SIGKILLed at many points of a
step — as each op starts, in its middle (half the op's time in a run without faults, from
that run's trace), and as its trace event is recorded — chosen by the op, not by the
runtime's step callback; every run must finish with each step once and pass
``rpeg verify``. And a task the scheduler cancels (what it needs was lost with a worker, or
another client cancelled it) is rolled back like a loss, never forgotten: forgetting it
left the core waiting with nothing in flight ("the run stalled")."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from pathlib import Path

import attrs
import cloudpickle
import pytest

from rpeg.runtime import RunOptions, verify_run
from rpeg.runtime.dask.runner import Resilience, run_resilient
from rpeg.runtime.lowering.instances import build_calls

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "pipelines" / "tiny_ppo.rpeg"
STEPS = 6
STEP = 2                   # the step whose ops the kills hit: the first after the cut at 2
RESILIENCE = Resilience(checkpoint_every=2, timeout_floor_s=60.0, replace_wait_s=120.0)

cloudpickle.register_pickle_by_value(sys.modules[__name__])   # _arm runs in the workers


def _split():
    """tiny_ppo on two devices with a weight sync each step, one chunk an op: a plan pinned
    here, not the planner's choice of the day (which may fuse ops or need no sync)."""
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    pipeline = load(SPEC)
    plan = split_plan(pipeline, 2)
    return pipeline, attrs.evolve(plan, placements=tuple(attrs.evolve(p, chunks=1)
                                                         for p in plan.placements))


PLANNED = _split()


@pytest.fixture(scope="module")
def planned():
    return PLANNED


@pytest.fixture(scope="module")
def cluster():
    from distributed import Client, LocalCluster
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
                      host="127.0.0.1", dashboard_address="127.0.0.1:0",
                      silence_logs=logging.ERROR) as c, Client(c.scheduler_address) as client:
        yield c.scheduler_address, client


def _arm(target: str, phase: str, mid_s: float, marker: str) -> None:
    """In a worker: SIGKILL this process at ``phase`` of op call ``target`` — "start" (before
    it runs), "mid" (``mid_s`` after it started) or "end" (its trace event recorded, its
    outputs not yet returned) — once in the whole cluster (``marker`` is created first)."""
    import os
    import signal

    from rpeg.runtime.dask import worker as W

    def fire() -> None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    run_op = W.run_op

    def armed(call, *args):
        if call.id == target and not os.path.exists(marker):
            if phase == "start":
                fire()
            elif phase == "mid":
                threading.Timer(mid_s, fire).start()
        out = run_op(call, *args)
        if call.id == target and phase == "end":
            fire()
        return out

    W.run_op = armed


def _run(planned, address, run_dir: Path):
    pipeline, plan = planned
    result = run_resilient(pipeline, plan, RunOptions(steps=STEPS, run_dir=str(run_dir),
                                                      progress=False, scheduler=address),
                           spec_path=str(SPEC), resilience=RESILIENCE)
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(STEPS)), "a step lost or counted twice"
    report = verify_run(run_dir)
    assert report.ok, str(report)
    return result, json.loads((run_dir / "run.json").read_text())


@pytest.fixture(scope="module")
def op_times(planned, cluster, tmp_path_factory) -> dict[str, float]:
    """Op call -> seconds it took in a run without faults (its trace)."""
    address, _ = cluster
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    _, meta = _run(planned, address, run_dir)
    assert not meta["recoveries"]
    trace = json.loads((run_dir / "trace.json").read_text())
    return {e["args"]["id"]: e["dur"] / 1e6 for e in trace["traceEvents"]
            if e.get("ph") == "X" and "id" in e.get("args", {})}


def _points(planned) -> list[tuple[str, str]]:
    pipeline, plan = planned
    ops = [c.id for c in build_calls(pipeline, plan, STEPS) if c.step == STEP]
    return [(op, phase) for op in ops for phase in ("start", "mid", "end")]


def _kill_at(planned, cluster, tmp_path, op: str, phase: str, mid_s: float = 0.0) -> dict:
    address, client = cluster
    marker = tmp_path / "killed"
    client.run(_arm, op, phase, mid_s, str(marker))
    _, meta = _run(planned, address, tmp_path / "run")
    assert marker.exists(), f"the kill at {phase} of {op} never fired"
    assert meta["recoveries"] and all("worker lost" in r["reason"]
                                      for r in meta["recoveries"]), meta["recoveries"]
    return meta


@pytest.mark.slow          # a worker killed and replaced: minutes on a busy machine
def test_a_kill_as_the_weight_sync_export_ends_is_recovered(planned, cluster, tmp_path):
    export = next(op for op, _ in _points(planned) if op.endswith("/export"))
    _kill_at(planned, cluster, tmp_path, export, "end")


@pytest.mark.slow          # 27 runs (9 op calls a step, 3 points each), each with a kill
@pytest.mark.parametrize("op, phase", _points(PLANNED))
def test_a_kill_at_any_point_of_a_step_is_recovered(planned, cluster, op_times, tmp_path,
                                                    op, phase):
    _kill_at(planned, cluster, tmp_path, op, phase, op_times.get(op, 0.0) / 2)


def test_a_task_the_scheduler_cancels_is_rolled_back_not_forgotten(planned, cluster,
                                                                   tmp_path):
    """Another client cancels every task of the run once, as step 3's are submitted: the
    run rolls back to its last cut and finishes (before, the cancelled tasks were dropped
    and the run ended with "the run stalled")."""
    address, _ = cluster
    done = threading.Event()

    def cancel_once() -> None:
        from distributed import Client, Future
        with Client(address) as other:
            deadline = time.time() + 600
            while time.time() < deadline:
                keys = other.run_on_scheduler(_run_keys)
                if any(re.search(rf"/s{STEP + 1}[/+]", k) for k in keys):
                    other.cancel([Future(k, other) for k in keys], force=True)
                    done.set()
                    return
                time.sleep(0.005)

    t = threading.Thread(target=cancel_once, daemon=True)
    t.start()
    _, meta = _run(planned, address, tmp_path / "run")
    t.join(60)
    assert done.is_set()
    assert [r["reason"] for r in meta["recoveries"]][:1] == [
        "task cancelled by the scheduler (an input of it was lost, or another client "
        "cancelled it)"]
    # the rollback names the event the core found it in: the cancelled task's end
    assert meta["recoveries"][0]["stimulus"].startswith("task-ended-"), meta["recoveries"]


def _run_keys(dask_scheduler=None) -> list[str]:
    """Keys of the op tasks the scheduler holds that have not run yet."""
    return [k for k, ts in dask_scheduler.tasks.items()
            if isinstance(k, str) and "/s" in k and "+" in k
            and ts.state in ("waiting", "processing", "no-worker", "queued")]
