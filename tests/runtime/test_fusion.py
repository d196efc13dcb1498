"""Fused dispatch: the same numbers as one task per op, each op still traced and verified."""

from __future__ import annotations

import json
import logging

import attrs
import pytest

from rpeg.runtime import RunOptions, run_pipeline, verify_run
from rpeg.runtime.fusion import consumers_of, fuse
from rpeg.runtime.instances import build_calls
from rpeg.runtime.placement import split_plan

TIMING = ("step_time_s", "tokens_per_s")


def _same(a: dict, b: dict) -> bool:
    return {k: v for k, v in a.items() if k not in TIMING and "time" not in k} == \
        {k: v for k, v in b.items() if k not in TIMING and "time" not in k}


def test_groups_keep_cross_device_outputs_apart(ppo):
    calls = build_calls(ppo, split_plan(ppo, 2, staleness=1), 2)
    cons = consumers_of(calls)
    groups = fuse(calls, cons, lambda d: False)
    assert sorted(i for g in groups for i in g.ids) == sorted(c.id for c in calls)
    assert len(groups) < len(calls)
    for g in groups:
        assert len({c.device for c in g.calls}) == 1 and len({c.step for c in g.calls}) == 1
        for c in g.calls[:-1]:                       # only the last may feed another device
            assert all(r.device == g.device for r in cons.get(c.id, ()))
    seen: set[str] = set()
    for g in groups:                                 # groups only wait on earlier groups
        assert set(g.external) <= seen
        seen |= set(g.ids)
    assert len(fuse(calls, cons, lambda d: False, enabled=False)) == len(calls)


@pytest.mark.parametrize("devices,k", [(1, 0), (2, 1)])
def test_fused_run_matches_unfused(ppo, tmp_path, devices, k):
    from distributed import LocalCluster
    plan = split_plan(ppo, devices, staleness=k)
    with LocalCluster(n_workers=devices, threads_per_worker=1, processes=True,
                      resources={"GPU": 1}, host="127.0.0.1", dashboard_address="127.0.0.1:0",
                      silence_logs=logging.ERROR) as cluster:
        opts = RunOptions(steps=3, scheduler=cluster.scheduler_address, root=str(tmp_path),
                          progress=False)
        fused = run_pipeline(ppo, plan, opts, spec_path=ppo.path)
        plain = run_pipeline(ppo, plan, attrs.evolve(opts, fuse=False), spec_path=ppo.path)
    for r in (fused, plain):
        report = verify_run(r.path)
        assert report.ok, str(report)
    tasks = [json.loads((r.path / "run.json").read_text())["tasks"] for r in (fused, plain)]
    assert tasks[1] == len(build_calls(ppo, plan, 3)) and tasks[0] < tasks[1]
    assert all(_same(a, b) for a, b in zip(fused.metrics, plain.metrics, strict=True)), \
        (fused.metrics, plain.metrics)
