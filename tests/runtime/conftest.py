"""Hand-built plans for runtime tests (the planner is not needed to test the runtime)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import pytest

from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.spec import load

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


@pytest.fixture(scope="session")
def ppo():
    return load(PIPELINES / "tiny_ppo.rpeg")


@pytest.fixture(scope="session")
def grpo():
    return load(PIPELINES / "tiny_grpo.rpeg")


def manual_plan(pipeline, where: dict[str, tuple[int, ...]], *, devices: int = 2,
                homes: dict[str, tuple[int, ...]] | None = None, staleness: int = 0,
                chunks: int = 2, shared: tuple[tuple[str, ...], ...] = ()) -> Plan:
    """Every stage on ``where[stage]`` (default device 0)."""
    places = tuple(StagePlacement.of(s.name, where.get(s.name, (0,)),
                                  dp=len(where.get(s.name, (0,))) if s.kind.value == "train" else 1,
                                  chunks=chunks if s.kind.value == "generate" else 1)
                   for s in pipeline.stages)
    return Plan(pipeline.name, "test", devices, places,
                model_homes=tuple(sorted((homes or {}).items())),
                staleness=tuple((st, min(k, staleness)) for st, k in pipeline.staleness),
                shared=shared, strategy=Strategy.MANUAL)


@pytest.fixture(scope="session")
def plan_by_hand():
    return manual_plan


def synthetic_trace(calls, workers: dict[int, str], read=lambda c: c.version) -> list[dict]:
    """Trace events of ``calls`` back to back in dependency order, on the planned devices
    and ``workers``; ``read(call)`` is the parameter version each reports."""
    from rpeg.runtime.core.scheduler import submission_order
    table = {c.id: c for c in calls}
    events, t = [], 0.0
    for op in submission_order(calls):
        c = table[op]
        events.append({"id": c.id, "step": c.step, "device": c.device, "worker": workers[c.device],
                       "start": t, "end": t + 1.0, "version_read": read(c),
                       "version_written": c.writes})
        t += 1.0
    return events


def through_core(calls, steps: int, window: int = 2) -> None:
    """Run ``calls`` through the scheduling core in dependency order: no cycle, none left."""
    from rpeg.runtime.core import scheduler as C
    from rpeg.runtime.lowering.instances import by_id
    table = by_id(calls)
    core = C.Core.create(calls, steps=steps, window=window)
    pending = [i.call.id for i in core.handle(C.Started()) if isinstance(i, C.Submit)]
    done = []
    while pending:
        op = pending.pop(0)
        assert all(d in done for d in table[op].all_deps)
        done.append(op)
        pending += [i.call.id for i in core.handle(C.OpDone(op)) if isinstance(i, C.Submit)]
    assert core.finished and len(done) == len(calls)


@pytest.fixture(scope="session")
def run_through_core():
    """:func:`through_core`."""
    return through_core


@pytest.fixture(scope="session")
def trace_of():
    """:func:`synthetic_trace`."""
    return synthetic_trace


@pytest.fixture(scope="session")
def local_cluster():
    """``with local_cluster(n) as address``: see :func:`_local_cluster`."""
    return _local_cluster


@contextlib.contextmanager
def _local_cluster(workers: int):
    """A loopback Dask cluster of ``workers`` single-threaded processes with GPU=1 each, as
    `rpeg run --scheduler` expects; yields its scheduler address."""
    from distributed import LocalCluster
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      resources={"GPU": 1}, host="127.0.0.1", dashboard_address="127.0.0.1:0",
                      silence_logs=logging.ERROR) as cluster:
        yield cluster.scheduler_address
