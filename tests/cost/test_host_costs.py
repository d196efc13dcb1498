"""The host-op terms of a calibrated profile price the reward and advantage stages."""

from __future__ import annotations

import attrs
import pytest

from rpeg.cost.calibrate import cpu_cluster
from rpeg.cost.examples import ppo_pipeline
from rpeg.cost.stages import estimate_stage
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.spec.model import Engine, GpuProfile, Level, Link
from rpeg.spec.presets import PRESETS

HOST = {"reward_sample_overhead": 3e-6, "reward_token_time": 1e-7,
        "compute_sample_time": 2e-6, "compute_token_time": 4e-7}
PROFILE = GpuProfile("cpu", sample_overhead=5e-5, **HOST)
CLUSTER = cpu_cluster(PROFILE, Link(Level.GPU, 1e9, 1e-4))


def _pipeline(**kw):
    return ppo_pipeline(dims=PRESETS["tiny"], prompts=64, prompt_len=8, gen_median=10,
                        gen_max=10, **kw)


def test_a_python_reward_costs_per_response_and_per_token():
    p = _pipeline()
    mean = p.workload.gen_len.mean()
    t = estimate_stage(work_of(p, "scores"), Layout(), (0,), CLUSTER).time_s
    assert t == pytest.approx(64 * 3e-6 + 64 * mean * 1e-7)


def test_gae_costs_per_response_and_per_response_token():
    p = _pipeline()
    mean = p.workload.gen_len.mean()
    t = estimate_stage(work_of(p, "adv"), Layout(), (0,), CLUSTER).time_s
    assert t == pytest.approx(64 * 2e-6 + 64 * mean * 4e-7)


def test_a_group_estimator_costs_per_response_only():
    p = _pipeline()
    adv = p.stage("adv")
    p = attrs.evolve(p, stages=tuple(attrs.evolve(s, function="group_norm") if s is adv else s
                                     for s in p.stages))
    t = estimate_stage(work_of(p, "adv"), Layout(), (0,), CLUSTER).time_s
    assert t == pytest.approx(64 * 2e-6)


def test_profiles_without_host_terms_fall_back_to_the_sample_overhead():
    plain = cpu_cluster(GpuProfile("cpu", sample_overhead=5e-5), Link(Level.GPU, 1e9, 1e-4))
    p = _pipeline()
    assert estimate_stage(work_of(p, "scores"), Layout(), (0,), plain).time_s == pytest.approx(64 * 5e-5)
    assert estimate_stage(work_of(p, "adv"), Layout(), (0,), plain).time_s > 64 * 5e-5


def test_each_call_of_a_host_op_pays_its_call_overhead():
    prof = attrs.evolve(PROFILE, reward_call_overhead=3e-4, compute_call_overhead=2e-4)
    cluster = cpu_cluster(prof, Link(Level.GPU, 1e9, 1e-4))
    p = _pipeline()
    for stage, call in (("scores", 3e-4), ("adv", 2e-4)):
        base = estimate_stage(work_of(p, stage), Layout(), (0,), CLUSTER).time_s
        assert estimate_stage(work_of(p, stage), Layout(), (0,), cluster).time_s == \
            pytest.approx(base + call)
        half = estimate_stage(work_of(p, stage), Layout(), (0,), cluster, batch=32).time_s
        assert half > (base + call) / 2             # a chunk of half the batch: same call cost


def test_a_tensor_parallel_op_pays_its_host_work_per_layer_per_pass():
    """An op split over two CPU devices pays ``tp_layer_overhead`` per layer per pass: a
    forward once per layer, a train op's backward ``backward_factor`` times more, a
    generate op once per layer per decode step (and its prefill); at tp = 1 nothing, nor
    in an engine that splits layers its own way (vLLM)."""
    from rpeg.cost.profiles import PROFILE_DIR, load_profile
    base = attrs.evolve(load_profile(PROFILE_DIR / "local_cpu.rpeg"), concurrency_slowdown=1.0)
    link = Link(Level.GPU, 1e9, 1e-4)
    p = _pipeline()
    layers = PRESETS["tiny"].layers

    def extra(stage: str, par: Layout, devices: tuple[int, ...],
              engine: Engine = Engine.TORCH) -> float:
        def t(x):
            c = cpu_cluster(attrs.evolve(base, tp_layer_overhead=x), link)
            return estimate_stage(work_of(p, stage), par, devices, c, engine=engine).time_s
        return t(1e-3) - t(0.0)
    tp2 = Layout(tp=2)
    assert extra("ref_lp", tp2, (0, 1)) == pytest.approx(layers * 1e-3)
    assert extra("actor_step", tp2, (0, 1)) == pytest.approx(
        layers * 1e-3 * (1 + base.backward_factor))
    gen = extra("rollout", tp2, (0, 1))
    assert gen > layers * 1e-3 * p.workload.gen_len.median        # a pass per decode step
    for stage in ("ref_lp", "actor_step", "rollout"):
        assert extra(stage, Layout(), (0,)) == 0.0
    # vLLM splits its layers its own way: the term measures the runtime's DTensor layers
    assert extra("rollout", tp2, (0, 1), Engine.VLLM) == 0.0


def test_data_parallel_training_pays_its_host_work_per_tensor_per_step():
    """A train op over two CPU devices pays ``dp_tensor_overhead`` per parameter tensor per
    optimizer step (DDP), and ``shard_tensor_overhead`` more under FSDP2 (ZeRO 2-3); on one
    device neither."""
    from rpeg.cost.compute import param_tensors
    from rpeg.cost.profiles import PROFILE_DIR, load_profile
    base = attrs.evolve(load_profile(PROFILE_DIR / "local_cpu.rpeg"), concurrency_slowdown=1.0)
    priced = attrs.evolve(base, dp_tensor_overhead=1e-4, shard_tensor_overhead=5e-4)
    plain = attrs.evolve(base, dp_tensor_overhead=0.0, shard_tensor_overhead=0.0)
    work = work_of(_pipeline(minibatches=2), "actor_step")

    def extra(par: Layout, devices: tuple[int, ...]) -> float:
        link = Link(Level.GPU, 1e9, 1e-4)
        return (estimate_stage(work, par, devices, cpu_cluster(priced, link)).time_s
                - estimate_stage(work, par, devices, cpu_cluster(plain, link)).time_s)
    tensors_steps = param_tensors(PRESETS["tiny"]) * 2            # two optimizer steps
    assert extra(Layout(dp=2), (0, 1)) == pytest.approx(tensors_steps * 1e-4)
    for zero in (2, 3):
        assert extra(Layout(dp=2, zero=zero), (0, 1)) == pytest.approx(tensors_steps * 6e-4)
    assert extra(Layout(), (0,)) == 0.0


def test_fsdp2_training_pays_its_calls_per_layer_per_micro_batch():
    """Under FSDP2 (ZeRO 2-3) over two CPU devices a train op pays ``shard_layer_overhead``
    per layer per micro-batch of each optimizer step; under DDP and on one device not."""
    from rpeg.cost.profiles import PROFILE_DIR, load_profile
    base = attrs.evolve(load_profile(PROFILE_DIR / "local_cpu.rpeg"), concurrency_slowdown=1.0)
    link = Link(Level.GPU, 1e9, 1e-4)
    work = work_of(_pipeline(minibatches=2), "actor_step")     # two optimizer steps

    def extra(par: Layout, devices: tuple[int, ...]) -> float:
        def t(x):
            c = cpu_cluster(attrs.evolve(base, shard_layer_overhead=x), link)
            return estimate_stage(work, par, devices, c).time_s
        return t(1e-3) - t(0.0)
    layers = PRESETS["tiny"].layers
    for zero in (2, 3):
        for mb in (1, 2):
            assert extra(Layout(dp=2, zero=zero, microbatches=mb), (0, 1)) == \
                pytest.approx(2 * mb * layers * 1e-3)
    assert extra(Layout(dp=2, microbatches=2), (0, 1)) == 0.0
    assert extra(Layout(zero=3), (0,)) == 0.0
