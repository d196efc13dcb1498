"""A larger staleness bound never makes the searched plan slower.

Every plan allowed under bound k is allowed under k + 1, so for the same seed the plan
compiled under k + 1 must be at least as fast as the one compiled under k: the search
climbs the bounds 0, 1, ... k + 1 and each walk starts from the best of the tighter one.
"""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpeg.cost.profiles import cluster_of
from rpeg.errors import PlanError
from rpeg.plan import SearchOptions, compile_report
from rpeg.plan.baselines import BASELINES, Found, run_baselines
from rpeg.plan.edit import Context
from rpeg.plan.evaluate import Evaluator
from rpeg.plan.search import _accepts_below, capped, staleness_caps
from rpeg.spec import load

from .conftest import EVERY_ENGINE, ROOT

QUICK = SearchOptions(seed=0, iterations=200, patience=120, limits=EVERY_ENGINE)


def bounded(pipeline, k: int):
    """``pipeline`` with its generate stages' staleness bound set to ``k``."""
    gens = [s for s, _ in pipeline.staleness] or ["rollout"]
    return attrs.evolve(pipeline, staleness=tuple((s, k) for s in gens if k > 0))


def steps(pipeline, cluster, opts, bounds) -> list[float]:
    out = []
    for k in bounds:
        r = compile_report(bounded(pipeline, k), cluster, options=opts)
        assert all(c <= k for _, c in r.plan.staleness)
        out.append(r.plan.predicted.step_time_s)
    return out


def test_capped_and_caps():
    ppo = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    assert staleness_caps(ppo) == (0, 1) and staleness_caps(bounded(ppo, 3)) == (0, 1, 2, 3)
    assert capped(bounded(ppo, 3), 2) == bounded(ppo, 2)
    assert capped(ppo, 0).staleness == () and capped(ppo, 5) == ppo


@pytest.mark.parametrize("spec,gpus", [("tiny_ppo", (4, 2)), ("tiny_grpo", (8, 1)),
                                       ("grpo_qwen7b", (8, 2)), ("ppo_llama8b", (4, 4))])
def test_larger_bound_is_never_slower(spec, gpus):
    pipeline = load(ROOT / f"pipelines/{spec}.rpeg")
    cluster = cluster_of("a100", gpus_per_node=gpus[0], nodes=gpus[1])
    t = steps(pipeline, cluster, QUICK, (0, 1, 2))
    assert t[1] <= t[0] + 1e-9 and t[2] <= t[1] + 1e-9, t


@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=st.sampled_from(["tiny_ppo", "tiny_grpo"]), gpn=st.sampled_from([2, 4, 8]),
       nodes=st.sampled_from([1, 2]), k=st.integers(0, 2), seed=st.integers(0, 1000))
def test_larger_bound_is_never_slower_for_any_seed(spec, gpn, nodes, k, seed):
    pipeline = load(ROOT / f"pipelines/{spec}.rpeg")
    cluster = cluster_of("a100", gpus_per_node=gpn, nodes=nodes)
    try:
        t = steps(pipeline, cluster, attrs.evolve(QUICK, seed=seed, iterations=120), (k, k + 1))
    except PlanError:
        return
    assert t[1] <= t[0] + 1e-9, t


def test_ppo_8b_separate_critic_16_gh200():
    """The case that regressed: staleness 2 returned 40.3 s where staleness 1 found 37.0 s
    (at the default budget; the ladder makes it hold at any budget, a third of it here)."""
    ppo = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    ppo = attrs.evolve(ppo, name="ppo_separate", shares=())
    opts = SearchOptions(seed=0, iterations=1500, patience=700, limits=EVERY_ENGINE)
    t = steps(ppo, cluster_of("gh200", 4, 4), opts, (1, 2))
    assert t[1] <= t[0] + 1e-9, t


@pytest.mark.parametrize("carry", [False, True])
def test_no_cap_ends_slower_than_its_own_best_baseline(carry):
    """The case that ended at 0.84x of the best baseline without partial rollouts: each
    cap's walk started from the tighter cap's best only. It starts from the better of that
    and its own best baseline, so the search is never slower than a baseline it could
    start from, at any budget (a small one here)."""
    ppo = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    ppo = attrs.evolve(ppo, name="ppo_separate", shares=(), staleness=(("rollout", 1),))
    limits = EVERY_ENGINE if carry else attrs.evolve(EVERY_ENGINE, carry_engines=frozenset())
    opts = SearchOptions(seed=0, iterations=150, patience=80, limits=limits)
    r = compile_report(ppo, cluster_of("gh200", 4, 4), options=opts)
    best = min(e.step_time_s for _, e in r.baselines if e is not None)
    assert r.plan.predicted.step_time_s <= best + 1e-9, (r.plan.predicted.step_time_s, best)


def test_baselines_are_found_once_for_the_whole_ladder():
    """What no staleness bound changes (the colocated outcome, the split plans worth
    simulating, realloc from the same starts) is taken from the tighter cap: the same
    outcomes as finding every baseline again under each cap."""
    ppo = bounded(load(ROOT / "pipelines/ppo_llama8b.rpeg"), 1)
    cluster = cluster_of("gh200", 4, 4)
    ctx = Context.of(ppo, cluster, EVERY_ENGINE)
    found = Found()
    for cap in staleness_caps(ppo):
        here = attrs.evolve(ctx, pipeline=capped(ppo, cap))
        shared = run_baselines(tuple(BASELINES), here, Evaluator(ppo, cluster), found)
        fresh = run_baselines(tuple(BASELINES), here, Evaluator(ppo, cluster))
        assert [(o.strategy, o.best.plan, o.best.step_time_s, o.tried) for o in shared] \
            == [(o.strategy, o.best.plan, o.best.step_time_s, o.tried) for o in fresh]
    assert found.colocated is not None and found.splits and found.realloc


def test_a_draw_read_ahead_leaves_the_stream_as_it_was():
    rng = np.random.default_rng(7)
    below = _accepts_below(rng, 10.0, 0.5)
    u = rng.random()
    assert below == pytest.approx(10.0 - 0.5 * math.log(u))
    assert _accepts_below(rng, 10.0, 0.0) == 10.0
    assert rng.random() == np.random.default_rng(7).random(2)[1]
