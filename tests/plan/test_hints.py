"""Hints that converge: each hint rpeg gives when nothing fits, applied, makes the stage it
names fit (a cluster of the GPUs it names, the executor it names, the reserve it names, the
layout it pins); where none helps, the message names the limit that binds."""

from __future__ import annotations

import attrs
import pytest

from rpeg.cost.memory import with_reserve
from rpeg.errors import PlanError
from rpeg.plan.compile import compile_report
from rpeg.plan.edit import Context
from rpeg.plan.hints import bigger, binding
from rpeg.plan.model import Strategy
from rpeg.plan.options import SearchOptions
from rpeg.plan.space import Limits
from rpeg.spec import load, load_cluster
from tests.conftest import ROOT

FIX = ROOT / "tests" / "fixtures" / "hints"
CASES = (("grpo_qwen72b.rpeg", FIX / "h100_16.rpeg"),
         ("grpo_llama405b.rpeg", ROOT / "pipelines" / "clusters" / "h100_64.rpeg"))


def no_fit(pipeline, cluster, limits) -> PlanError:
    with pytest.raises(PlanError) as e:
        compile_report(pipeline, cluster, Strategy.SEARCH,
                       SearchOptions(seed=0, iterations=20, limits=limits))
    return e.value


def fits_alone(pipeline, cluster, limits, stage: str) -> bool:
    """The search's own check: the stage has a layout that fits a device on this cluster."""
    table = Context.of(pipeline, cluster, limits).table
    return any(table.options(stage, size) for size in table.sizes)


def with_gpus(cluster, gpus: int):
    k = gpus // cluster.num_gpus
    out = bigger(cluster, k)
    assert out.num_gpus == gpus
    return out


@pytest.mark.parametrize("spec,cluster_file", CASES, ids=("72b", "405b"))
def test_every_hint_makes_its_stage_fit(spec, cluster_file):
    pipeline, cluster, limits = load(FIX / spec), load_cluster(cluster_file), Limits.runtime()
    err = no_fit(pipeline, cluster, limits)
    assert err.hints or err.hint.startswith("nothing this executor runs"), err.hint
    for h in err.hints:
        assert h.stage and not fits_alone(pipeline, cluster, limits, h.stage)
        if h.gpus:
            assert fits_alone(pipeline, with_gpus(cluster, h.gpus), limits, h.stage), h.text
        if h.any_executor:
            assert fits_alone(pipeline, cluster, Limits(), h.stage), h.text
        if h.reserve is not None:
            assert fits_alone(pipeline, with_reserve(cluster, h.reserve), limits, h.stage)


def test_offload_is_not_offered_where_the_train_step_brings_the_state_back():
    pipeline, cluster = load(FIX / "grpo_qwen72b.rpeg"), load_cluster(FIX / "h100_16.rpeg")
    err = no_fit(pipeline, cluster, Limits.runtime())
    assert "offload" not in err.hint          # the peak is the train step's, state and all
    assert "raise tp" not in err.hint         # 16 GPUs shard the state alike at any tp


def test_more_gpus_are_not_offered_where_each_replica_holds_the_model():
    pipeline = load(FIX / "grpo_llama405b.rpeg")
    cluster = load_cluster(ROOT / "pipelines" / "clusters" / "h100_64.rpeg")
    limits = attrs.evolve(Limits.runtime(), max_pp=1)     # generation cannot be split further
    err = no_fit(pipeline, cluster, limits)
    assert not any(h.gpus for h in err.hints), err.hint
    if not err.hints:
        assert "more GPUs add replicas, not room" in err.hint
        assert err.hint == binding(pipeline, cluster, limits, "rollout")


def test_every_stage_that_fits_nowhere_is_said_at_once():
    """405B on 64 H100 at rpeg's executor: generation, the reference and training each fit
    no layout; the error names all three (each with its own hint), so applying the first
    hint does not lead into an error about the next."""
    pipeline = load(FIX / "grpo_llama405b.rpeg")
    cluster = load_cluster(ROOT / "pipelines" / "clusters" / "h100_64.rpeg")
    err = no_fit(pipeline, cluster, Limits.runtime())
    said = [err.message] + [text for text, _ in err.notes]
    unfit = [s for s in ("rollout", "ref_lp", "actor_step")
             if not fits_alone(pipeline, cluster, Limits.runtime(), s)]
    assert len(unfit) > 1
    for stage in unfit:
        assert any(f"({stage}) alone, in its smallest layout" in t for t in said), said
