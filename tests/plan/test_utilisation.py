"""Every shipped GPU pipeline's plan on every shipped cluster: no op above the roofline (MFU
and MBU at most 1, in ``predicted.ops``), every GPU within its memory less the reserve, and
the peak by kind for every GPU in the prediction. The default suite checks every pipeline
on one cluster and one pipeline on other GPU kinds; the slow suite, the searched plan of
every pipeline on every cluster."""

from __future__ import annotations

import pytest

from rpeg.cost.memory import usable_memory
from rpeg.plan.compile import compile_report
from rpeg.plan.model import Strategy
from rpeg.plan.options import SearchOptions
from rpeg.plan.space import Limits
from rpeg.spec import load, load_cluster
from tests.conftest import ROOT

PIPELINES = ("dapo_qwen7b", "grpo_qwen7b", "gspo_qwen7b", "ppo_async", "ppo_llama8b",
             "ppo_shared")
CLUSTERS = ("a100_16", "a100_64", "gh200_8", "gh200_64", "gh200_256", "gh200_2048",
            "h100_64")


def plan_of(pipeline: str, cluster: str, strategy: Strategy, budget: int = 60):
    c = load_cluster(ROOT / "pipelines" / "clusters" / f"{cluster}.rpeg")
    report = compile_report(load(ROOT / "pipelines" / f"{pipeline}.rpeg"), c, strategy,
                            SearchOptions(seed=0, iterations=budget, limits=Limits()))
    return report.plan, c


def check(plan, cluster) -> None:
    pr = plan.predicted
    assert pr.ops and {u.stage for u in pr.ops} >= {o for o, _ in pr.op_times if o != "eval"}
    for u in pr.ops:
        assert 0 <= u.mfu <= 1 and 0 <= u.mbu <= 1, u
        assert u.flops >= 0 and u.bytes >= 0 and u.time_s > 0, u
    assert any(u.flops > 0 for u in pr.ops)
    usable = usable_memory(cluster.gpu)
    assert pr.memory_reserve == pytest.approx(cluster.gpu.memory - usable)
    assert max(pr.peak_memory) <= usable
    covered = sorted(d for m in pr.memory for d in m.devices)
    assert covered == list(range(plan.num_devices))
    for m in pr.memory:
        assert m.total <= usable
        assert m.total == pytest.approx(max(pr.peak_memory[d] for d in m.devices), rel=1e-6)


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_every_pipeline_on_a100(pipeline):
    check(*plan_of(pipeline, "a100_16", Strategy.COLOCATED))


@pytest.mark.parametrize("cluster", ("gh200_8", "h100_64"))
def test_other_gpus_with_grpo(cluster):
    check(*plan_of("grpo_qwen7b", cluster, Strategy.SPLIT))


@pytest.mark.slow
@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("pipeline", PIPELINES)
def test_every_pipeline_on_every_cluster_searched(pipeline, cluster):
    check(*plan_of(pipeline, cluster, Strategy.SEARCH))
