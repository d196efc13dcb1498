"""A generate stage is priced for the batch as the runtime deals it out to its data-parallel
ranks: responses r, r + dp, ... to rank r, or, under dynamic sampling, whole groups (a
prompt with all its samples), so the busiest rank holds ceil(prompts / dp) groups. The
dealing is one function both sides call (``rpeg.graph.deal.dealt``): the runtime's
generate calls take their responses by it (``backends.torch_backend.sampling.positions``)
and the cost model prices the busiest rank's share by it (``dealt_batch``). A plan asks
each block for no more chunks than the emptiest rank's share by it
(``rpeg.plan.oplayout.stream_chunks``, by ``deal.emptiest_share``): a rank makes at most
a chunk a response it holds, and whole groups leave some ranks fewer than an even split
would."""

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
from rpeg.cost.stages import estimate_stage, stage_memory
from rpeg.graph import build, deal
from rpeg.graph.layout import Layout
from rpeg.graph.work import Work, work_of
from rpeg.plan.model import StagePlacement
from rpeg.plan.oplayout import chunks_per_step, stream_chunks
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Engine, LengthDist, OpKind, Workload

sampling = pytest.importorskip("backends.torch_backend.sampling")
chunk_bounds = pytest.importorskip("backends.api").chunk_bounds

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
        par = Layout(dp=dp)
        t = estimate_stage(work, par, range(dp), cluster, engine=Engine.VLLM).time_s
        m = stage_memory(work, par, cluster, engine=Engine.VLLM)
        return t, m

    (t64, m64), (t68, m68) = priced(64), priced(68)
    assert t64 <= t68 < t64 * 1.01 and m68 == m64
    even = attrs.evolve(work, refill_rounds=0)           # without it, more ranks: faster
    assert estimate_stage(even, Layout(dp=68), range(68), cluster,
                          engine=Engine.VLLM).time_s < t68


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 80), st.integers(1, 600),
       st.booleans())
def test_every_rank_makes_the_chunks_the_plan_asks_of_it(prompts, samples, blocks, chunks,
                                                          refills):
    """The chunks a step streams (``stream_chunks``) are as many on every block, and each
    block's rank makes that many of the responses dealt to it (``chunk_bounds``: at most
    one a response, at least one), whole groups or not."""
    w = Workload(steps=1, prompts=prompts, samples=samples, prompt_len=8,
                 gen_len=LengthDist.fixed(8))
    group = samples if refills else 1
    asked = stream_chunks(chunks, blocks, prompts * samples, group)
    assert asked % blocks == 0
    for r in range(blocks):
        held = len(sampling.positions(r, blocks, w, refills))
        assert len(chunk_bounds(held, asked // blocks)) == asked // blocks


def _dapo_chunks(chunks: int, blocks: int) -> int:
    """Chunks a step of DAPO's rollout asked for ``chunks`` on ``blocks`` blocks streams."""
    pipeline = load(ROOT / "pipelines" / "dapo_qwen7b.rpeg")
    w = pipeline.workload
    place = StagePlacement.of("rollout", tuple(range(blocks)), chunks=chunks)
    return chunks_per_step(build(pipeline), lambda op: place, w.prompts * w.samples)


def test_dynamic_sampling_asks_no_rank_for_more_chunks_than_it_holds_responses():
    """DAPO's 128 prompts x 16 on 100 blocks: ranks 28 to 99 hold one group, 16 responses
    (an even split's 20), and make 16 chunks; asked for 2000 chunks, 20 a block, the step
    streams 1600, 16 a block (it streamed 2000, and the 17th chunk of rank 99 found none)."""
    w = load(ROOT / "pipelines" / "dapo_qwen7b.rpeg").workload
    held = [len(sampling.positions(r, 100, w, True)) for r in range(100)]
    assert min(held) == 16 == deal.emptiest_share(2048, 100, 16) and max(held) == 32
    assert _dapo_chunks(2000, 100) == 1600
    assert _dapo_chunks(1000, 100) == 1000                  # 10 a block: every rank makes them


@pytest.fixture
def _forget():
    """The memos of the busiest and the emptiest share, which a patched rule must not find
    filled."""
    deal.busiest_share.cache_clear()
    deal.emptiest_share.cache_clear()
    yield
    deal.busiest_share.cache_clear()
    deal.emptiest_share.cache_clear()


@pytest.mark.parametrize("name", ["rpeg.graph.deal", "rpeg.cost.generation"])
def test_module_examples(name):
    result = doctest.testmod(importlib.import_module(name))
    assert result.failed == 0 and result.attempted > 0


def test_one_dealing_rule_for_the_runtime_and_the_cost_model():
    # the runtime deals by the rule, the cost model prices the busiest share it deals
    assert sampling.dealt is deal.dealt
    assert generation.busiest_share is deal.busiest_share


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
        return estimate_stage(work, Layout(dp=dp), range(dp), cluster).time_s

    usual = priced()
    assert [len(sampling.positions(r, dp, w, bool(refills))) for r in range(dp)] == \
        [batch // dp] * dp

    def first(rank, ranks, responses, group=1):
        return tuple(range(responses)) if rank == 0 else ()

    asked = stream_chunks(8 * dp, dp, batch, deal.deal_group(work))
    for side in (sampling, deal):
        monkeypatch.setattr(side, "dealt", first)
    deal.busiest_share.cache_clear()
    deal.emptiest_share.cache_clear()
    assert sampling.positions(0, dp, w, bool(refills)).tolist() == list(range(batch))
    assert not any(len(sampling.positions(r, dp, w, bool(refills))) for r in range(1, dp))
    assert dealt_batch(work, batch, dp) == batch * dp
    assert priced() > usual
    # the ranks left nothing make one (empty) chunk each: the plan asks one a block
    assert asked == 8 * dp and stream_chunks(8 * dp, dp, batch, deal.deal_group(work)) == dp
