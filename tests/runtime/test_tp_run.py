"""Tensor parallelism for real: tiny PPO on a local Dask cluster with actor, critic and
reference split over two workers (tp = 2, gloo), against the same run unsplit (tp = 1)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.runtime import RunOptions, run_pipeline, verify_run

STEPS = 3
MODELS = ("actor", "critic", "ref")
COMPARED = ("reward", "policy_loss", "value_loss", "entropy", "clip_frac",
            "grad_norm.actor_step", "grad_norm.critic_step")


def plan_with(pipeline, devs: tuple[int, ...], tp: int, gen: tuple[int, ...] | None = None,
              devices: int = 2, staleness: int = 0) -> Plan:
    """Model stages on ``devs`` at ``tp``; generation and the reference on ``gen`` (tp = 1)
    when given; scores and advantages on device 0."""
    places = []
    for s in pipeline.stages:
        kind = s.kind.value
        if s.target in MODELS and kind in ("generate", "forward", "train"):
            d, t = devs, tp
            if gen is not None and (kind == "generate" or s.target == "ref"):
                d, t = gen, 1
            places.append(StagePlacement.of(s.name, d, dp=len(d) // t, tp=t,
                                         chunks=2 if kind == "generate" else 1))
        else:
            places.append(StagePlacement.of(s.name, (0,)))
    return Plan(pipeline.name, "test", devices, tuple(places),
                model_homes=(("actor", devs), ("critic", devs)),
                staleness=tuple((st, min(k, staleness)) for st, k in pipeline.staleness),
                strategy=Strategy.MANUAL)


@pytest.fixture(scope="module")
def cluster3(local_cluster):
    with local_cluster(3) as address:
        yield address


def _run(pipeline, plan, root: Path, scheduler):
    result = run_pipeline(pipeline, plan, RunOptions(steps=STEPS, scheduler=scheduler,
                                                     root=str(root), progress=False),
                          spec_path=pipeline.path)
    report = verify_run(result.path)
    assert report.ok, str(report)
    for row in result.metrics:
        for key in COMPARED:
            assert math.isfinite(row[key]), (key, row)
    return result


def _same(a, b, rel=1e-3, abs_=1e-4):
    for ra, rb in zip(a.metrics, b.metrics, strict=True):
        for key in COMPARED:
            assert ra[key] == pytest.approx(rb[key], rel=rel, abs=abs_), (key, ra, rb)


def _final(run: Path) -> Path:
    return max((run / "checkpoints").glob("step-*"))


def _weights(path: Path):
    from backends.torch_backend.dcp import weights_of
    return {k: v.numpy() for k, v in weights_of(path).items()}


@pytest.mark.slow
def test_tp2_train_forward_generate_match_tp1(ppo, tmp_path, cluster3):
    whole = _run(ppo, plan_with(ppo, (0,), 1), tmp_path / "tp1", cluster3)
    split = _run(ppo, plan_with(ppo, (0, 1), 2), tmp_path / "tp2", cluster3)
    _same(split, whole)
    import json
    trace = json.loads((split.path / "trace.json").read_text())
    ran = {(e["name"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    for stage in ("rollout", "ref_lp", "values", "actor_step", "critic_step"):
        assert (stage, 0) in ran and (stage, 1) in ran, stage      # both ranks ran it
    # the final checkpoint holds the tensors (whole, read from each rank's shards), equal to
    # the unsplit run's
    b = _weights(_final(whole.path) / "actor@0")
    for rank in (0, 1):
        a = _weights(_final(split.path) / f"actor@{rank}")
        assert a.keys() == b.keys()
        assert a["backbone.layers.0.self_attn.q_proj.weight"].shape == (64, 64)
        assert max(float(abs(a[k] - b[k]).max()) for k in a) < 1e-3


@pytest.mark.slow
def test_a_tp2_trainer_syncs_whole_weights_to_a_tp1_generator(ppo, tmp_path, cluster3):
    """Asynchronous PPO: trained split over devices 0-1, generated unsplit on device 2."""
    split = _run(ppo, plan_with(ppo, (0, 1), 2, gen=(2,), devices=3, staleness=1),
                 tmp_path / "tp2", cluster3)
    whole = _run(ppo, plan_with(ppo, (0,), 1, gen=(2,), devices=3, staleness=1),
                 tmp_path / "tp1", cluster3)
    _same(split, whole)
    import json
    trace = json.loads((split.path / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"sync_actor.export", "sync_actor.load"} <= names


@pytest.mark.slow
def test_generation_resharded_from_an_unsplit_trainer_on_the_same_device(ppo, tmp_path,
                                                                          cluster3):
    """Trained unsplit on device 0, generated at tp = 2 on devices 0-1: the generator's
    copy (``actor~tp0-1``) is loaded by weight sync each step, and the run matches tp = 1."""
    import attrs
    base = plan_with(ppo, (0,), 1)
    plan = attrs.evolve(base, placements=tuple(
        p.changed(devices=(0, 1), tp=2) if p.stage == "rollout" else p
        for p in base.placements))
    split = _run(ppo, plan, tmp_path / "reshard", cluster3)
    whole = _run(ppo, base, tmp_path / "tp1", cluster3)
    _same(split, whole)
    import json
    trace = json.loads((split.path / "trace.json").read_text())
    loads = {(e["args"]["step"], e["tid"]) for e in trace["traceEvents"]
             if e["ph"] == "X" and e["name"] == "sync_actor.load"}
    assert loads == {(s, d) for s in range(STEPS - 1) for d in (0, 1)}


@pytest.mark.slow
def test_dp2_x_tp2_on_four_workers_matches_dp2(ppo, tmp_path, local_cluster):
    """Two data-parallel replicas, each split over two workers: gradients of each shard are
    averaged over the ranks holding it; the run matches plain dp = 2 step for step."""
    with local_cluster(4) as address:
        dp = _run(ppo, plan_with(ppo, (0, 1), 1, devices=4), tmp_path / "dp2", address)
        dptp = _run(ppo, plan_with(ppo, (0, 1, 2, 3), 2, devices=4), tmp_path / "dp2tp2",
                    address)
    _same(dptp, dp)
