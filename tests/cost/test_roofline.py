"""Physics first: every figure a profile or an engine brings is within its physical range, and
no op the cost model prices runs faster than its device's roofline (MFU and MBU at most 1)."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.cost.compute import Roof, utilisation
from rpeg.cost.engines import BOUNDS, EFFICIENCY, KINDS, Efficiency, engine_terms, out_of_range
from rpeg.cost.examples import ppo_pipeline
from rpeg.cost.profiles import PROFILE_DIR, builtin_profile, cluster_of
from rpeg.cost.stages import estimate_stage
from rpeg.graph.layout import layout_of
from rpeg.graph.work import work_of
from rpeg.spec.model import Engine

GPUS = sorted(p.stem for p in PROFILE_DIR.glob("*.rpeg") if p.stem != "local_cpu")


@pytest.mark.parametrize("name", GPUS)
def test_a_profile_measures_no_more_than_its_datasheet(name):
    g = builtin_profile(name)
    assert 0 < g.matmul_flops <= g.peak_flops
    assert 0 < g.mem_bandwidth <= g.hbm_bandwidth
    assert (g.elem_bandwidth or g.mem_bandwidth) <= g.hbm_bandwidth
    assert (g.attn_flops or 0.6 * g.matmul_flops) <= g.peak_flops
    assert g.fp8_flops <= 2 * g.peak_flops          # the dense FP8 peak: twice bf16's
    assert g.backward_factor >= 2                   # the backward does twice the FLOPs
    assert 0 <= g.reserve < 1


def test_the_shared_terms_are_within_their_physical_ranges():
    assert out_of_range(EFFICIENCY) == []
    for term, (lo, hi) in BOUNDS.items():
        assert lo >= 0, term
        unit = attrs.fields_dict(Efficiency)[term].metadata["unit"]
        if unit == "":                          # a share
            assert hi <= 1, term
    # the check can fail: a share above one, a negative time
    assert out_of_range(attrs.evolve(EFFICIENCY, overlap=1.2, launch_s=-1e-6))


@pytest.mark.parametrize("name", GPUS)
def test_no_engine_runs_kernels_faster_than_the_device(name):
    g = builtin_profile(name)
    for engine in KINDS:
        t = engine_terms(engine, g)
        assert t.work == 1.0 and 0 < t.gemm <= 1, engine
        assert 0 <= t.overlap <= 1 and min(t.layer_s, t.step_s, t.hook_s, t.call_s) >= 0


def test_utilisation_is_the_share_of_peak():
    g = builtin_profile("h100")
    mfu, mbu = utilisation(Roof(g.peak_flops, g.hbm_bandwidth / 2), 2.0, 1, g)
    assert mfu == pytest.approx(0.5) and mbu == pytest.approx(0.25)
    # an FP8 model's compute against the FP8 peak
    assert utilisation(Roof(g.peak_flops, 0), 1.0, 1, g, fp8=True)[0] == pytest.approx(0.5)


PPO = ppo_pipeline("llama3.1-8b", prompts=256, prompt_len=512, gen_median=256, gen_max=2048)
STAGES = ("rollout", "ref_lp", "actor_step", "critic_step", "values")


@settings(max_examples=40, deadline=None)
@given(gpu=st.sampled_from(["h100", "a100", "gh200", "h20"]), stage=st.sampled_from(STAGES),
       tp=st.sampled_from([1, 2, 4, 8]), dp=st.sampled_from([1, 2]),
       mb=st.sampled_from([1, 4]), zero=st.sampled_from([0, 3]),
       engine=st.sampled_from([Engine.TORCH, Engine.VLLM, Engine.HF, Engine.DEEPSPEED,
                               Engine.MEGATRON]),
       recompute=st.booleans(), graph=st.booleans(), rows=st.sampled_from([None, 4, 64]))
def test_no_op_runs_above_its_roofline(gpu, stage, tp, dp, mb, zero, engine, recompute,
                                       graph, rows):
    work = work_of(PPO, stage)
    generate = stage == "rollout"
    if generate == (engine in (Engine.DEEPSPEED, Engine.MEGATRON)):
        engine = Engine.VLLM if generate else Engine.TORCH
    par = layout_of(dp=dp, tp=tp, microbatches=mb, zero=zero if dp > 1 else 0,
                   recompute=recompute and stage.endswith("_step"),
                   cuda_graph=graph and generate)
    cluster = cluster_of(gpu, 8)
    devices = tuple(range(par.size))
    cost = estimate_stage(work, par, devices, cluster, engine=engine,
                          rows=rows if generate else None)
    mfu, mbu = utilisation(cost.roof, cost.time_s, 1, cluster.gpu)
    assert cost.roof.flops > 0 and cost.roof.bytes > 0
    assert mfu <= 1 and mbu <= 1, (mfu, mbu)
