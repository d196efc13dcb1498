"""Planner fixtures: the shipped specs and clusters, and small clusters built in code."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.plan.space import Limits
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Engine

ROOT = Path(__file__).resolve().parents[2]
EVERY_ENGINE = Limits(engines=frozenset({Engine.TORCH, Engine.VLLM}))


@pytest.fixture(scope="session")
def tiny():
    return load(ROOT / "pipelines/tiny_ppo.rpeg")


@pytest.fixture(scope="session")
def local_cpu():
    return load_cluster(ROOT / "pipelines/clusters/local_cpu.rpeg")


@pytest.fixture(scope="session")
def ppo8b():
    return load(ROOT / "pipelines/ppo_llama8b.rpeg")


@pytest.fixture(scope="session")
def grpo():
    return load(ROOT / "pipelines/grpo_qwen7b.rpeg")


@pytest.fixture(scope="session")
def a100_16():
    return load_cluster(ROOT / "pipelines/clusters/a100_16.rpeg")


def colocated_start(pipeline, cluster):
    """(context, evaluator, the colocated baseline's outcome) for ``pipeline`` on ``cluster``:
    a feasible plan to edit in tests of the evaluator and the search's moves."""
    from rpeg.plan import Evaluator
    from rpeg.plan.baselines import colocated
    from rpeg.plan.edit import Context
    ctx, ev = Context.of(pipeline, cluster, EVERY_ENGINE), Evaluator(pipeline, cluster)
    return ctx, ev, colocated(ctx, ev)


def counted_and_fused(pipeline, plan):
    """(the count's (calls, tasks) of a steady step of ``plan`` on GH200s, the runtime's
    fusion's, and the runtime's calls of that step): what tests of a rule both sides call
    compare."""
    from rpeg.cost.profiles import builtin_cluster
    from rpeg.plan import Evaluator
    from rpeg.runtime.core import fusion
    from rpeg.runtime.lowering.instances import build_calls
    ev = Evaluator(pipeline, builtin_cluster("gh200_8"))
    graph = ev.graph(plan)
    d = ev.dispatch(plan, graph, ev.timings(plan, graph)[0])
    calls = build_calls(pipeline, plan, 10)
    step = [c for c in calls if c.step == 6]
    groups = fusion.fuse(step, fusion.consumers_of(calls), lambda _: False,
                         together=plan.fusion)
    return (d.calls, d.tasks), (len(step), len(groups)), step
