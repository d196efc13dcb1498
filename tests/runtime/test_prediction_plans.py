"""The plans benchmarks/runtime.py's prediction table runs (``--only prediction``): for
tiny_ppo and tiny_grpo, ``rpeg run``'s plan and five others, each one the runtime accepts
and the cost model prices on the local 2-worker cluster, each different from the others."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks import runtime  # noqa: E402

LABELS = {"default", "split", "chunked", "async", "colocated", "fused"}


@pytest.mark.parametrize("name", ("tiny_ppo", "tiny_grpo"))
def test_the_table_runs_six_distinct_plans_each_priced(name):
    variants = runtime.plan_variants(name)
    assert set(variants) == LABELS
    plans = {label: plan for label, (_, plan) in variants.items()}
    others = [plans[k] for k in sorted(LABELS - {"default"})]
    assert len({(p.placements, p.staleness, p.fusion) for p in others}) == 5
    assert plans["fused"].fusion and plans["async"].staleness != plans["split"].staleness
    for label, (pipeline, plan) in variants.items():
        pr = runtime.Evaluator(pipeline, runtime.load_cluster(runtime.CLUSTER)) \
            .evaluate(plan).plan.predicted
        assert 0 < pr.step_time_s < float("inf"), label
        assert pr.tasks_per_step > 0, label


def test_the_results_name_the_profile_the_predictions_price_with():
    assert runtime.shown(runtime.CLUSTER) == "pipelines/clusters/local_cpu.rpeg"
    assert runtime.shown(runtime.Path.home() / ".cache" / "x").startswith("~/")


def test_the_table_says_which_runs_are_within_their_target():
    pred = {"tiny_ppo default": {"ratio_measured_over_predicted": 1.16,
                                 "ratio_at_measured_lengths": 1.14},
            "tiny_ppo split": {"ratio_measured_over_predicted": 1.19,
                               "ratio_at_measured_lengths": 0.79}}
    declared, measured, _ = runtime.within_targets(pred)
    # 15% for the default plan, 20% for the others
    assert "1 of 2" in declared and "tiny_ppo default 1.16" in declared
    assert "1 of 2" in measured and "tiny_ppo split 0.79" in measured
    assert runtime.within_targets({}) == []
