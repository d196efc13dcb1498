"""The run's response lengths against the declared ones, and the plan priced at them."""

from __future__ import annotations

import json
from pathlib import Path

from rpeg.resources import clusters_dir
from rpeg.runtime.rundir.lengths import (
    at_lengths,
    histogram,
    measured_dist,
    response_tokens,
    steady_counts,
)
from rpeg.runtime.rundir.record import at_measured_lengths
from rpeg.spec import load, load_cluster

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def _trace(path: Path, ops: list[dict]) -> None:
    path.mkdir(parents=True, exist_ok=True)
    events = [{"ph": "X", "cat": "generate", "name": "rollout", "ts": 0, "dur": 1,
               "args": a} for a in ops]
    (path / "trace.json").write_text(json.dumps({"traceEvents": events}))


def test_histogram_and_its_distribution():
    h = histogram([3, 20, 20, 3, 7])
    assert h == {"3": 2, "7": 1, "20": 2}
    dist = measured_dist({int(k): v for k, v in h.items()})
    assert dist.max_len == 20 and abs(dist.mean() - 10.6) < 0.2
    assert measured_dist({0: 3}) is None


def test_steady_counts_from_the_trace_or_the_steps_means(tmp_path):
    pipeline = load(PIPELINES / "tiny_grpo.rpeg")
    _trace(tmp_path / "a", [{"step": 1, "stats": {"lengths": {"4": 2}}},
                            {"step": 2, "stats": {"lengths": {"4": 1, "20": 3}}},
                            {"step": 3, "stats": {"lengths": {"20": 5}}}])
    assert steady_counts(tmp_path / "a", {2, 3}) == {4: 1, 20: 8}
    # an older trace without histograms: the steps' mean, and nothing to price with
    rows = [{"step": 2, "response_len": 10.25}, {"step": 3, "response_len": 12.0}]
    summary, dist = response_tokens(tmp_path / "none", pipeline, rows)
    assert summary == {"mean": 11.125, "declared": 10.5, "steps": "2..3"} and dist is None


def test_longer_responses_than_declared_price_the_plan_slower(tmp_path):
    pipeline = load(PIPELINES / "tiny_grpo.rpeg")
    cluster = load_cluster(clusters_dir() / "local_cpu.rpeg")
    from rpeg.runtime.placement import split_plan
    plan = split_plan(pipeline, 2, cluster="local_cpu")
    _trace(tmp_path, [{"step": s, "stats": {"lengths": {"19": 8, "20": 56}}} for s in (2, 3)])
    rows = [{"step": s} for s in range(4)]
    summary, dist = response_tokens(tmp_path, pipeline, rows[2:])
    assert summary == {"mean": 19.875, "declared": 10.5, "longest": 20, "steps": "2..3"}
    declared = at_measured_lengths(pipeline, plan, cluster, pipeline.workload.gen_len)
    longer = at_measured_lengths(pipeline, plan, cluster, dist)
    shorter = at_measured_lengths(pipeline, plan, cluster, measured_dist({3: 1.0}))
    assert shorter < declared < longer
    # the workload's cap holds: lengths past it are priced at it
    capped = at_lengths(pipeline, measured_dist({25: 1.0}))
    assert capped.workload.gen_len.max_len == 20 == capped.workload.gen_len.mean()
