"""Hypothesis invariants of the cost model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.cost import (
    Collective,
    Topology,
    cluster_of,
    collective_time,
    estimate_stage,
    resident_memory,
    stage_memory,
)
from rpeg.cost.examples import ppo_pipeline
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.spec.model import Model
from rpeg.spec.presets import PRESETS

GH = cluster_of("gh200", 4, 4)
STAGES = ("rollout", "ref_lp", "actor_step", "critic_step", "scores", "adv")


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(STAGES), st.integers(1, 256), st.integers(1, 256),
       st.sampled_from([1, 2, 4]))
def test_time_and_memory_never_fall_as_the_batch_grows(stage, b1, b2, tp):
    p = ppo_pipeline("llama3.1-8b", prompt_len=256, gen_median=128, gen_max=512)
    lo, hi = sorted((b1, b2))
    devs = tuple(range(tp))
    par = Layout(tp=tp)
    t_lo = estimate_stage(work_of(p, stage), par, devs, GH, batch=lo).time_s
    t_hi = estimate_stage(work_of(p, stage), par, devs, GH, batch=hi).time_s
    assert t_hi >= t_lo * (1 - 1e-9)
    m_lo = stage_memory(work_of(p, stage), par, GH, batch=lo).total
    m_hi = stage_memory(work_of(p, stage), par, GH, batch=hi).total
    assert m_hi >= m_lo


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(sorted(k for k in PRESETS if k.startswith(("llama", "qwen")))),
       st.booleans())
def test_more_tp_never_increases_per_gpu_weight_memory(preset, trained):
    dims = PRESETS[preset]
    model = Model("m", preset, dims)
    last = None
    for tp in (1, 2, 4, 8):
        if dims.heads % tp or (tp > dims.kv_heads and tp % dims.kv_heads):
            continue
        w = resident_memory(model, Layout(tp=tp), GH, trained=trained).total
        assert last is None or w <= last
        last = w


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(list(Collective)), st.floats(1.0, 1e10), st.floats(1.0, 1e10),
       st.lists(st.integers(0, 15), min_size=2, max_size=16, unique=True))
def test_collectives_cost_more_for_more_bytes(kind, a, b, devices):
    topo = Topology.from_cluster(GH)
    lo, hi = sorted((a, b))
    devs = tuple(devices[:2]) if kind is Collective.P2P else tuple(devices)
    assert collective_time(kind, hi, devs, topo) >= collective_time(kind, lo, devs, topo)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 8))
def test_more_dp_replicas_never_slow_a_forward_within_a_node(dp_a, mb):
    p = ppo_pipeline("llama3.1-8b", prompts=64)
    t1 = estimate_stage(work_of(p, "ref_lp"), Layout(microbatches=mb), (0,), GH).time_s
    tn = estimate_stage(work_of(p, "ref_lp"), Layout(dp=dp_a, microbatches=mb), tuple(range(dp_a)),
                        GH).time_s
    assert tn <= t1 * (1 + 1e-9)
