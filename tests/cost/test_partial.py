"""Partial rollouts in the cost model: segments of responses, generation capped per step."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.cost.partial import Partial, max_carries, smallest_cap
from rpeg.cost.profiles import cluster_of
from rpeg.cost.stages import decoded_batch, estimate_stage, generation_chunks, stage_memory
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.spec import load
from rpeg.spec.model import LengthDist, LengthKind

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ppo8b():
    return load(ROOT / "pipelines/ppo_llama8b.rpeg")


def test_segments_by_hand():
    """Lengths 1..4000 uniformly, 1,000 tokens a step: a response of length l is cut into
    ceil(l / 1000) pieces, so 2.5 sequences per response started, the longest 1,000."""
    p = Partial(LengthDist(LengthKind.UNIFORM, max_len=4000, low=0), 1000)
    assert p.carries == 3 and p.max_len == 1000
    assert p.rows == pytest.approx(2.5, abs=0.01)
    # earlier tokens: pieces 0,1,2,3 have 0, 1000, 2000, 3000 before them, in 4:3:2:1
    assert p.context == pytest.approx((0 * 4 + 1000 * 3 + 2000 * 2 + 3000 * 1) / 10, rel=0.01)
    assert p.longest_context == 3000
    q = p.quantiles(100)
    assert q.max() <= 1000 and np.all(np.diff(q) >= 0)
    assert p.finished_top(10) == 3010 and p.finished_top(999) == 3999


@given(cap=st.integers(1, 5000), median=st.integers(16, 2000))
@settings(max_examples=60, deadline=None)
def test_tokens_are_conserved(cap, median):
    """Every token of a response is decoded in exactly one step: segments per response
    times their mean length is the mean response length."""
    d = LengthDist(LengthKind.LOGNORMAL, max_len=4096, median=median, sigma=0.6)
    p = Partial(d, cap)
    assert p.rows * p.mean() == pytest.approx(float(d.quantiles(4096).mean()), rel=1e-6)
    assert p.carries == max(math.ceil(4096 / cap) - 1, 0)


def test_the_smallest_cap_of_a_carry_keeps_every_response_within_it():
    d = LengthDist(LengthKind.LOGNORMAL, max_len=4096, median=1024, sigma=0.45)
    for c in (1, 2, 3, 7):
        assert Partial(d, smallest_cap(4096, c)).carries == c
    assert smallest_cap(4096, 1) == 2048 and smallest_cap(4096, 0) == 0
    assert max_carries(2, 1) == 1 and max_carries(1, 1) == 0


def test_a_capped_step_ends_sooner_and_decodes_more_sequences(ppo8b):
    gh = cluster_of("gh200", 4, 16)
    par, devs = Layout(dp=32), tuple(range(32))
    whole = estimate_stage(work_of(ppo8b, "rollout"), par, devs, gh)
    half = estimate_stage(work_of(ppo8b, "rollout"), par, devs, gh, partial=2048)
    assert half.time_s < 0.75 * whole.time_s         # the tail past 2,048 tokens is gone
    assert estimate_stage(work_of(ppo8b, "rollout"), par, devs, gh, partial=4096).time_s \
        == pytest.approx(whole.time_s)                # a cap at the longest cuts nothing
    # the KV cache holds the carried sequences too
    batch = ppo8b.workload.batch
    assert decoded_batch(batch, ppo8b.workload.gen_len, 2048) > batch
    assert stage_memory(work_of(ppo8b, "rollout"), par, gh, partial=2048).kv_cache \
        > stage_memory(work_of(ppo8b, "rollout"), par, gh).kv_cache


def test_capped_chunks_hold_the_batch_and_end_with_the_step(ppo8b):
    gh = cluster_of("gh200", 4, 16)
    par, devs = Layout(dp=32), tuple(range(32))
    for cap in (1366, 2048, 2467):
        ch = generation_chunks(work_of(ppo8b, "rollout"), par, devs, gh, 4, partial=cap,
                               with_lengths=True)
        assert sum(c[1] for c in ch) == ppo8b.workload.batch
        ends = [c[0] for c in ch]
        assert ends == sorted(ends)
        total = estimate_stage(work_of(ppo8b, "rollout"), par, devs, gh, partial=cap).time_s
        assert ends[-1] == pytest.approx(total, rel=1e-6)
        # a consumer pads a chunk to its longest whole response, carried ones included
        assert all(cap < top <= ppo8b.workload.gen_len.max_len for _, _, top, _ in ch)


def test_an_off_policy_train_step_pays_the_correction_forward(ppo8b):
    gh = cluster_of("gh200", 4, 4)
    par, devs = Layout(dp=16), tuple(range(16))
    on = estimate_stage(work_of(ppo8b, "actor_step"), par, devs, gh)
    off = estimate_stage(work_of(ppo8b, "actor_step"), par, devs, gh, off_policy=True)
    fb = dict(on.breakdown)["forward+backward"]
    extra = dict(off.breakdown)["proximal_forward"]
    # one forward of the batch: a fraction of the forward + backward passes
    assert 0 < extra < fb / 2 and off.time_s == pytest.approx(on.time_s + extra, rel=1e-9)


def test_a_padded_engine_reprefills_every_carried_row_to_the_longest_context(monkeypatch):
    """rpeg's torch loop pads a step's sequences to the longest context (a carried
    response's prompt and tokens so far) and prefills them all: its prefill is priced at
    the longest, not the mean, earlier tokens; a paged cache (vLLM) holds each its own."""
    import rpeg.cost.generation as G
    from rpeg.spec.model import Engine
    tiny = load(ROOT / "pipelines/tiny_ppo.rpeg")
    cpu = cluster_of("local_cpu", 2)
    work = work_of(tiny, "rollout")
    prefill = lambda engine: dict(estimate_stage(  # noqa: E731
        work, Layout(), (0,), cpu, partial=10, engine=engine).breakdown)["prefill"]
    padded = prefill(Engine.TORCH)
    G._cached.cache_clear()
    monkeypatch.setattr(Partial, "longest_context", property(lambda p: p.context))
    assert padded > prefill(Engine.TORCH)
    G._cached.cache_clear()
