"""Two real runs of tiny_ppo (3 steps each) on one local Dask cluster, shared by the session:
A with the spec's staleness bound (rollout <= 1) by the plain runner, B synchronous
(staleness 0) by the resilient runner that `rpeg run` uses; both write their record."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rpeg.runtime import RunOptions, run_pipeline
from rpeg.runtime.dask.runner import run_resilient
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
STEPS = 3


@pytest.fixture(scope="session")
def two_runs(tmp_path_factory):
    from distributed import LocalCluster

    root = tmp_path_factory.mktemp("runs")
    pipeline = load(PIPELINES / "tiny_ppo.rpeg")
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           resources={"GPU": 1}, host="127.0.0.1",
                           dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR)
    try:
        out = []
        for name, staleness, runner in (("a", None, run_pipeline), ("b", 0, run_resilient)):
            plan = split_plan(pipeline, 2, staleness=staleness, cluster="local_cpu")
            result = runner(pipeline, plan, RunOptions(
                steps=STEPS, scheduler=cluster.scheduler_address, root=str(root),
                run_dir=str(root / f"tiny_ppo-{name}"), progress=False),
                spec_path=str(PIPELINES / "tiny_ppo.rpeg"))
            out.append(result.path)
    finally:
        cluster.close()
    return tuple(out)


@pytest.fixture(scope="session")
def run_a(two_runs):
    return two_runs[0]


@pytest.fixture(scope="session")
def run_b(two_runs):
    return two_runs[1]
