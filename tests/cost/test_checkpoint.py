"""Checkpoint saves priced as ``rpeg run`` writes them (``rpeg.cost.checkpoint``): each
trained model's state once a cut, the cuts of the runtime's own rule, a step's share of
them in the predicted step and the whole save among the ops."""

from __future__ import annotations

import attrs
import pytest

from rpeg.cost.checkpoint import CHECKPOINT_EVERY, checkpoint_bytes, cuts, per_step, save_time
from rpeg.cost.memory import model_params
from rpeg.cost.profiles import builtin_cluster
from rpeg.plan.evaluate import Evaluator
from rpeg.resources import shipped
from rpeg.runtime.core.choices import next_cut
from rpeg.runtime.placement import split_plan
from rpeg.spec import load


def _runtime_cuts(steps, every, eval_every):
    at, start = [], 0
    while start < steps:
        start = next_cut(start, steps, every, eval_every)
        at.append(start)
    return len(at)


@pytest.mark.parametrize("steps", [1, 7, 10, 25, 80, 300])
@pytest.mark.parametrize("every", [0, 1, 3, 10, 50])
@pytest.mark.parametrize("eval_every", [None, 4, 10])
def test_the_cuts_priced_are_the_runtimes(steps, every, eval_every):
    assert cuts(steps, every, eval_every) == _runtime_cuts(steps, every, eval_every)


def test_a_trained_models_bytes_are_what_its_checkpoint_holds():
    """16-bit weights with float32 masters write the masters and Adam's two moments; a
    frozen model writes nothing (it is not among the trained ones)."""
    p = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    gpu = builtin_cluster("gh200_8").gpu
    actor = p.model("actor")
    assert checkpoint_bytes(actor, gpu) == pytest.approx(12 * model_params(actor))


def test_the_predicted_step_carries_the_saves():
    p = load(shipped("pipelines", "tiny_ppo.rpeg"))
    cluster = builtin_cluster("gh200_8")
    plan = split_plan(p, 2, staleness=0)
    ev = Evaluator(p, cluster)
    got = ev.evaluate(plan).plan.predicted
    one = dict(got.op_times)["checkpoint"]
    trained = [(p.model(s.target), plan.placement(s.name).devices) for s in p.stages
               if s.kind.value == "train"]
    want = save_time(tuple((checkpoint_bytes(m, cluster.gpu), tuple(devs))
                           for m, devs in trained), cluster.gpu, cluster.gpus_per_node)
    assert one == pytest.approx(want, abs=1e-6) and one > 0
    # the same plan on a disk twice as fast and writers hashing twice as fast: half
    fast = attrs.evolve(cluster, gpu=attrs.evolve(cluster.gpu,
                                                  disk_bandwidth=2 * cluster.gpu.disk_bandwidth,
                                                  hash_bandwidth=2 * cluster.gpu.hash_bandwidth))
    quick = Evaluator(p, fast).evaluate(plan).plan.predicted
    share = per_step(want, p.workload.steps, CHECKPOINT_EVERY, None)
    assert got.step_time_s - quick.step_time_s == pytest.approx(share / 2, rel=1e-3)


def test_each_writer_hashes_its_own_shard():
    """A node writes its ranks' bytes at its disk's speed, then every rank hashes its own
    shard at once: more ranks a node, the same disk time and less hashing; the slowest
    node decides; no trained model, no save."""
    gpu = builtin_cluster("gh200_8").gpu
    b, disk, sha = 8e9, gpu.disk_bandwidth, gpu.hash_bandwidth
    assert save_time(((b, (0,)),), gpu, 4) == pytest.approx(b / disk + b / sha)
    assert save_time(((b, (0, 1, 2, 3)),), gpu, 4) == pytest.approx(b / disk + b / 4 / sha)
    assert save_time(((b, tuple(range(8))),), gpu, 4) == pytest.approx(
        b / 2 / disk + b / 8 / sha)
    # two models: node 0 holds half of one and all of the other, its largest rank 1/2 of b
    both = save_time(((b, (0, 1, 4, 5)), (b, (2, 3))), gpu, 4)
    assert both == pytest.approx(1.5 * b / disk + b / 2 / sha)
    assert save_time((), gpu, 4) == 0.0


@pytest.mark.parametrize("steps", [1, 7, 25, 100])
@pytest.mark.parametrize("eval_every", [None, 4])
def test_no_cadence_cuts_at_the_evals_and_the_end_as_the_runtime(steps, eval_every):
    """checkpoint_every = 0: ``rpeg run`` runs one segment to the end (``runner.run``, every
    ``steps``), cut at the eval steps."""
    assert cuts(steps, 0, eval_every) == _runtime_cuts(steps, steps, eval_every)


def test_the_predicted_step_prices_the_workloads_cadence():
    """tests/fixtures/checkpoint/every_*.rpeg: the same pipeline, 100 steps, a checkpoint every
    50 steps (2 cuts), every 10 (the default: 10) or only at the end (1)."""
    from pathlib import Path
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint"
    cluster = builtin_cluster("gh200_8")
    got = {}
    for name in ("every_50", "every_default", "every_0"):
        p = load(fixtures / f"{name}.rpeg")
        got[name] = Evaluator(p, cluster).evaluate(split_plan(p, 2, staleness=0)).plan.predicted
    one = dict(got["every_50"].op_times)["checkpoint"]
    assert one > 0 and all(dict(g.op_times)["checkpoint"] == one for g in got.values())   # rounded
    step = {k: g.step_time_s for k, g in got.items()}
    assert step["every_default"] - step["every_50"] == pytest.approx(one * (10 - 2) / 100, rel=1e-3)
    assert step["every_50"] - step["every_0"] == pytest.approx(one * (2 - 1) / 100, rel=1e-3)
