"""A generate stage is priced for the batch as the runtime deals it out to its data-parallel
ranks: responses r, r + dp, ... to rank r, or, under dynamic sampling, whole groups (a
prompt with all its samples), so the busiest rank holds ceil(prompts / dp) groups. The
dealing is one function both sides call (``rpeg.graph.deal.dealt``): the runtime's
generate calls take their responses by it (``backends.torch_backend.sampling.positions``)
and the cost model prices the busiest rank's share by it (``dealt_batch``)."""

from __future__ import annotations

import doctest
import importlib
import math
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpeg.cost import generation
from rpeg.cost.generation import dealt_batch
from rpeg.cost.memory import Parallel
from rpeg.cost.stages import estimate_stage, stage_memory
from rpeg.graph import deal
from rpeg.graph.work import Work, work_of
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Engine, LengthDist, OpKind, Workload

sampling = pytest.importorskip("backends.torch_backend.sampling")

ROOT = Path(__file__).resolve().parents[2]


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 80), st.booleans())
def test_the_priced_busiest_rank_is_the_runtimes(prompts, samples, dp, refills):
    """``ceil(dealt / dp)``, the responses the cost model gives each rank, is the most the
    runtime's dealing (``backends.torch_backend``'s generate) gives any rank."""
    w = Workload(steps=1, prompts=prompts, samples=samples, prompt_len=8,
                 gen_len=LengthDist.fixed(8))
    work = Work("rollout", OpKind.GENERATE, w, refill_rounds=2 if refills else 0)
    batch = prompts * samples
    busiest = max(len(sampling.positions(r, dp, w, refills)) for r in range(dp))
    assert math.ceil(dealt_batch(work, batch, dp) / dp) == busiest
    assert dealt_batch(work, batch, dp) >= batch


def test_a_rank_past_the_prompts_does_not_speed_dynamic_sampling_up():
    """DAPO's rollout (128 prompts x 16) on 64 and on 68 GPUs: at 68, 60 ranks still hold two
    whole groups, so the step takes no less than at 64, and holds as much (a rank's
    responses; the expected longest of more responses in the refill rounds may add a
    little). Priced as an even split, 68 ranks were faster."""
    pipeline = load(ROOT / "pipelines" / "dapo_qwen7b.rpeg")
    cluster = load_cluster(ROOT / "pipelines" / "clusters" / "gh200_256.rpeg")
    work = work_of(pipeline, "rollout")
    assert work.refill_rounds and pipeline.workload.prompts == 128

    def priced(dp):
        par = Parallel(dp=dp)
        t = estimate_stage(work, par, range(dp), cluster, engine=Engine.VLLM).time_s
        m = stage_memory(work, par, cluster, engine=Engine.VLLM)
        return t, m

    (t64, m64), (t68, m68) = priced(64), priced(68)
    assert t64 <= t68 < t64 * 1.01 and m68 == m64
    even = attrs.evolve(work, refill_rounds=0)           # without it, more ranks: faster
    assert estimate_stage(even, Parallel(dp=68), range(68), cluster,
                          engine=Engine.VLLM).time_s < t68


@pytest.fixture
def _forget():
    """The cost model's memo of the busiest share, which a patched rule must not find filled."""
    generation.busiest_share.cache_clear()
    yield
    generation.busiest_share.cache_clear()


@pytest.mark.parametrize("name", ["rpeg.graph.deal", "rpeg.cost.generation"])
def test_module_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0


def test_one_dealing_rule_for_the_runtime_and_the_cost_model():
    assert sampling.dealt is generation.dealt is deal.dealt


@pytest.mark.parametrize("refills", [0, 2])
def test_one_edit_of_the_dealing_changes_both_sides(refills, monkeypatch, _forget):
    """Every response to the first rank, edited in the one function: the runtime's generate
    calls deal by it (rank 0 generates the step's batch, the others nothing), and the cost
    model prices the busiest rank for it: the whole batch on one of the dp ranks, slower
    than the usual dealing."""
    pipeline = load(ROOT / "pipelines" / "grpo_qwen7b.rpeg")
    cluster = load_cluster(ROOT / "pipelines" / "clusters" / "gh200_8.rpeg")
    w = pipeline.workload
    work = attrs.evolve(work_of(pipeline, "rollout"), refill_rounds=refills)
    batch, dp = w.prompts * w.samples, 4

    def priced():
        return estimate_stage(work, Parallel(dp=dp), range(dp), cluster).time_s

    usual = priced()
    assert [len(sampling.positions(r, dp, w, bool(refills))) for r in range(dp)] == \
        [batch // dp] * dp

    def first(rank, ranks, responses, group=1):
        return tuple(range(responses)) if rank == 0 else ()

    for side in (sampling, generation):
        monkeypatch.setattr(side, "dealt", first)
    generation.busiest_share.cache_clear()
    assert sampling.positions(0, dp, w, bool(refills)).tolist() == list(range(batch))
    assert not any(len(sampling.positions(r, dp, w, bool(refills))) for r in range(1, dp))
    assert dealt_batch(work, batch, dp) == batch * dp
    assert priced() > usual
