"""The cost model's formulas against hand-computed cases."""

from __future__ import annotations

import math

import attrs
import pytest

from rpeg.cost import (
    Collective,
    CostError,
    Topology,
    builtin_cluster,
    cluster_of,
    collective_time,
    estimate_stage,
    generation_chunks,
    resident_memory,
    stage_memory,
    weight_sync_time,
)
from rpeg.cost.examples import ppo_pipeline
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.spec.model import Cluster, GpuProfile, Level, Link, Model
from rpeg.spec.presets import PRESETS

LLAMA8B = PRESETS["llama3.1-8b"]


def _cluster(gpn=8, nodes=1, racks=1, gpu_bw=450e9, node_bw=50e9, rack_bw=25e9) -> Cluster:
    links = (Link(Level.GPU, gpu_bw, 1e-6), Link(Level.NODE, node_bw, 5e-6),
             Link(Level.RACK, rack_bw, 10e-6))
    gpu = GpuProfile("test", memory=80e9, matmul_flops=800e12, mem_bandwidth=3e12)
    return Cluster("t", "<test>", gpu, gpn, nodes, racks, links)


def test_llama31_8b_parameters_and_kv_bytes():
    # 32 x (q 4096^2 + k,v 2 x 4096 x 1024 + o 4096^2 + MLP 3 x 4096 x 14336 + 2 norms)
    #   + embedding and LM head 2 x 128256 x 4096 + final norm
    layer = 4096 * 4096 * 2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert LLAMA8B.param_count() == 32 * layer + 2 * 128256 * 4096 + 4096
    assert round(LLAMA8B.param_count() / 1e9, 2) == 8.03
    # K and V, 32 layers, 8 KV heads x 128, bf16: 2 x 32 x 1024 x 2 bytes
    assert LLAMA8B.kv_bytes_per_token(2) == 131072


def test_ring_all_reduce_on_a_known_link():
    topo = Topology.from_cluster(_cluster())
    t = collective_time(Collective.ALL_REDUCE, 1e9, tuple(range(8)), topo)
    assert t == pytest.approx(2 * 7 / 8 * 1e9 / 450e9 + 2 * 7 * 1e-6)
    rs = collective_time(Collective.REDUCE_SCATTER, 1e9, tuple(range(8)), topo)
    assert rs == pytest.approx(7 / 8 * 1e9 / 450e9 + 7 * 1e-6)
    assert collective_time(Collective.P2P, 1e6, (0, 1), topo) == pytest.approx(1e-6 + 1e6 / 450e9)
    assert collective_time(Collective.ALL_REDUCE, 1e9, (3,), topo) == 0.0


def test_levels_and_hierarchical_all_reduce():
    topo = Topology.from_cluster(_cluster(gpn=8, nodes=4, racks=2))
    assert topo.level_of((0, 7)) is Level.GPU
    assert topo.level_of((0, 8)) is Level.NODE
    assert topo.level_of((0, 32)) is Level.RACK
    devices = tuple(range(32))                      # 4 nodes of 8 in one rack
    flat = 2 * 31 / 32 * 1e9 / 50e9 + 62 * 5e-6
    t = collective_time(Collective.ALL_REDUCE, 1e9, devices, topo)
    # reduce-scatter in the node, all-reduce of 1/8 across 4 nodes, all-gather back
    hier = (7 / 8 * 1e9 / 450e9 + 7e-6) * 2 + 2 * 3 / 4 * (1e9 / 8) / 50e9 + 6 * 5e-6
    assert t == pytest.approx(min(flat, hier))
    assert t < flat


def test_adam_mixed_precision_is_16_bytes_per_parameter():
    gh = cluster_of("gh200", 4)
    actor = Model("actor", "llama3.1-8b", LLAMA8B)
    m = resident_memory(actor, Layout(), gh, trained=True)
    n = LLAMA8B.param_count()
    assert (m.weights, m.grads, m.optimizer) == (2 * n, 2 * n, 12 * n)
    fp32 = attrs.evolve(gh, gpu=attrs.evolve(gh.gpu, compute_bytes=4))
    m32 = resident_memory(actor, Layout(), fp32, trained=True)
    assert (m32.weights, m32.grads, m32.optimizer) == (4 * n, 4 * n, 8 * n)
    assert resident_memory(actor, Layout(), gh, trained=False).total == 2 * n


def test_tp_pp_zero_divide_memory():
    gh = cluster_of("gh200", 4)
    actor = Model("actor", "llama3.1-8b", LLAMA8B)
    one = resident_memory(actor, Layout(), gh, trained=True).total
    assert resident_memory(actor, Layout(tp=4), gh, trained=True).total == pytest.approx(one / 4)
    pp2 = resident_memory(actor, Layout(pp=2), gh, trained=True).total
    assert one / 2 < pp2 < one * 0.6            # the busier stage also holds an embedding
    z1 = resident_memory(actor, Layout(dp=4, zero=1), gh, trained=True)
    assert z1.optimizer == pytest.approx(12 * LLAMA8B.param_count() / 4)


def test_zero_levels_as_the_torch_backend_runs_them():
    """ZeRO-2 is FSDP2 keeping its gathered weights whole between ops, beside the float32
    shards it updates; ZeRO-3 holds a shard of everything (16 B/parameter over dp)."""
    gh = cluster_of("gh200", 4)
    fp32 = attrs.evolve(gh, gpu=attrs.evolve(gh.gpu, compute_bytes=4))
    actor = Model("actor", "llama3.1-8b", LLAMA8B)
    n, dp = LLAMA8B.param_count(), 4
    z2 = resident_memory(actor, Layout(dp=dp, zero=2), fp32, trained=True)
    assert (z2.weights, z2.grads, z2.optimizer) == pytest.approx(
        (4 * n + 4 * n / dp, 4 * n / dp, 8 * n / dp))          # a second, sharded copy
    z2 = resident_memory(actor, Layout(dp=dp, zero=2), gh, trained=True)
    assert (z2.weights, z2.grads, z2.optimizer) == pytest.approx(
        (2 * n, 4 * n / dp, 12 * n / dp))                      # the masters are the shards
    for cluster in (gh, fp32):
        z3 = resident_memory(actor, Layout(dp=dp, zero=3), cluster, trained=True)
        assert z3.total == pytest.approx(16 * n / dp)


def test_fsdp_gathers_and_scatters_in_every_micro_batch():
    """ZeRO-3's data-parallel traffic grows with the micro-batches (each gathers the weights
    for its forward and backward and reduce-scatters its gradients); DDP's does not."""
    gh = cluster_of("gh200", 4, 2)
    p = ppo_pipeline("llama3.1-8b", prompts=512)
    devs = tuple(range(8))

    def reduce(zero, m):
        c = estimate_stage(work_of(p, "actor_step"), Layout(dp=8, zero=zero, microbatches=m), devs, gh)
        parts = dict(c.breakdown)
        return sum(parts.get(k, 0.0) for k in ("dp_grad_reduce", "zero2_gather",
                                                "zero3_gather"))
    # the engine hides part of each micro-batch's traffic behind its compute, never all of it
    assert reduce(3, 4) > 2 * reduce(3, 1)
    assert reduce(2, 4) > 2 * reduce(2, 1)
    assert reduce(0, 4) == pytest.approx(reduce(0, 1))
    assert reduce(2, 4) < reduce(3, 4)             # ZeRO-2 keeps the gathered weights


def test_master_weights_false_keeps_16_bit_moments_and_no_master_copy():
    from rpeg.spec.model import Optimizer
    gh = cluster_of("gh200", 4)
    plain = Model("actor", "llama3.1-8b", LLAMA8B, optimizer=Optimizer("adam", master=False))
    m = resident_memory(plain, Layout(), gh, trained=True)
    n = LLAMA8B.param_count()
    assert (m.weights, m.grads, m.optimizer) == (2 * n, 2 * n, 4 * n)


def test_offload_frees_device_memory_only_where_it_is_not_the_hosts():
    """A GPU's optimizer state leaves it between train steps; a CPU device's host memory is
    its own memory, so offloading there frees none (it is still counted)."""
    from rpeg.cost.memory import devices_are_host, offloaded_bytes
    gh = cluster_of("gh200", 4)
    cpu = attrs.evolve(gh, gpu=attrs.evolve(gh.gpu, compute_bytes=4,
                                            host_cores=2.0))
    actor = Model("actor", "llama3.1-8b", LLAMA8B)
    on, off = Layout(dp=4, zero=3, offload=True), Layout(dp=4, zero=3)
    assert not devices_are_host(gh.gpu) and devices_are_host(cpu.gpu)
    gpu_saved = resident_memory(actor, off, gh, trained=True).total \
        - resident_memory(actor, on, gh, trained=True).total
    assert gpu_saved == pytest.approx(offloaded_bytes(actor, on, gh.gpu))
    assert gpu_saved == pytest.approx(8 * LLAMA8B.param_count() / 4)   # moments, not masters
    assert resident_memory(actor, on, cpu, trained=True).total == \
        resident_memory(actor, off, cpu, trained=True).total


def test_infeasible_degrees_raise_with_the_reason():
    p, gh = ppo_pipeline("llama3.1-8b"), cluster_of("gh200", 4, 2)
    with pytest.raises(CostError, match="tp must divide the 32 attention heads"):
        estimate_stage(work_of(p, "ref_lp"), Layout(tp=3), (0, 1, 2), gh)
    with pytest.raises(CostError, match="pp must be at most the 32 layers"):
        estimate_stage(work_of(p, "ref_lp"), Layout(pp=64), tuple(range(64)), cluster_of("gh200", 4, 16))
    with pytest.raises(CostError, match="must run on dp x tp x pp = 4 devices, not 2"):
        estimate_stage(work_of(p, "ref_lp"), Layout(tp=4), (0, 1), gh)


def test_tp_speeds_up_and_communicates():
    p, gh = ppo_pipeline("llama3.1-8b", prompts=64), cluster_of("gh200", 4, 2)
    one = estimate_stage(work_of(p, "ref_lp"), Layout(), (0,), gh)
    four = estimate_stage(work_of(p, "ref_lp"), Layout(tp=4), (0, 1, 2, 3), gh)
    assert one.comm_s == 0 and four.comm_s > 0
    assert four.compute_s < one.compute_s / 3


def test_pipeline_bubble_shrinks_with_microbatches():
    p, gh = ppo_pipeline("llama3.1-8b", prompts=64), cluster_of("gh200", 4, 2)
    fb = dict(estimate_stage(work_of(p, "actor_step"), Layout(pp=4), (0, 1, 2, 3), gh).breakdown)
    fb8 = dict(estimate_stage(work_of(p, "actor_step"), Layout(pp=4, microbatches=8), (0, 1, 2, 3),
                              gh).breakdown)
    # (m + p - 1) stage passes: 4 passes of the whole batch vs 11 passes of an eighth
    assert fb8["forward+backward"] < 0.5 * fb["forward+backward"]


def test_dp_gradient_reduction_crosses_nodes():
    p, gh = ppo_pipeline("llama3.1-8b", prompts=64), cluster_of("gh200", 4, 2)
    inside = dict(estimate_stage(work_of(p, "actor_step"), Layout(dp=2, tp=2), (0, 1, 2, 3), gh)
                  .breakdown)["dp_grad_reduce"]
    across = dict(estimate_stage(work_of(p, "actor_step"), Layout(dp=2, tp=2), (0, 1, 4, 5), gh)
                  .breakdown)["dp_grad_reduce"]
    assert across > 2 * inside


def test_generation_chunks_follow_the_length_tail():
    p = ppo_pipeline("llama3.1-8b", prompts=256, gen_median=512, gen_max=4096)
    gh = cluster_of("gh200", 4, 2)
    chunks = generation_chunks(work_of(p, "rollout"), Layout(dp=2, tp=4), tuple(range(8)), gh, 4)
    times = [t for t, _ in chunks]
    assert sum(n for _, n in chunks) == 256
    assert times == sorted(times)
    total = estimate_stage(work_of(p, "rollout"), Layout(dp=2, tp=4), tuple(range(8)), gh).time_s
    assert times[-1] == pytest.approx(total)
    assert times[0] < 0.5 * total                   # short responses are done long before


def test_cheap_host_ops_cost_per_sample():
    p, gh = ppo_pipeline("llama3.1-8b", prompts=512), cluster_of("gh200", 4)
    score = estimate_stage(work_of(p, "scores"), Layout(), (0,), gh)
    adv = estimate_stage(work_of(p, "adv"), Layout(), (0,), gh)
    assert score.time_s == pytest.approx(512 * gh.gpu.sample_overhead)
    assert adv.time_s > 512 * gh.gpu.sample_overhead


def test_weight_sync():
    c = builtin_cluster("gh200_64")
    actor = Model("actor", "llama3.1-8b", LLAMA8B)
    same = weight_sync_time(actor, (0, 1, 2, 3), Layout(tp=4), (0, 1, 2, 3), Layout(tp=4), c)
    assert same == 0.0
    node = weight_sync_time(actor, (0, 1, 2, 3), Layout(tp=4), (4, 5, 6, 7), Layout(tp=4), c)
    rack = weight_sync_time(actor, (0, 1, 2, 3), Layout(tp=4), (32, 33, 34, 35),
                            Layout(tp=4), c)
    # 16 GB in 4 shards of 4 GB, each over a 25 GB/s node link
    assert node == pytest.approx(2 * LLAMA8B.param_count() / 4 / 25e9, rel=0.01)
    assert rack > node


def test_kv_cache_memory_of_generation():
    p = ppo_pipeline("llama3.1-8b", prompts=64, prompt_len=1024, gen_median=1024, gen_max=1024)
    gh = cluster_of("gh200", 4)
    m = stage_memory(work_of(p, "rollout"), Layout(), gh)
    # 64 sequences x 2048 tokens x 128 KiB, plus one layer being grown (33/32)
    assert m.kv_cache == pytest.approx(64 * 2048 * 131072 * 33 / 32)
    m4 = stage_memory(work_of(p, "rollout"), Layout(tp=4), gh)
    assert m4.kv_cache == pytest.approx(m.kv_cache / 4)


def test_every_shipped_cluster_loads_and_prices_a_step():
    for name in ("local_cpu", "gh200_8", "gh200_64", "gh200_256", "gh200_2048", "a100_16",
                 "a100_64", "h100_64"):
        c = builtin_cluster(name)
        p = ppo_pipeline("tiny" if name == "local_cpu" else "llama3.1-8b")
        for s in p.stages:
            cost = estimate_stage(work_of(p, s.name), Layout(), (0,), c)
            assert cost.time_s > 0 and math.isfinite(cost.time_s), (name, s.name)


@pytest.mark.parametrize("dp,cp,tp,pp", [(1, 1, 1, 1), (4, 1, 2, 1), (2, 1, 2, 2), (3, 1, 1, 2),
                                         (2, 2, 2, 1), (2, 2, 1, 2)])
def test_shard_group_is_each_data_and_context_rank(dp, cp, tp, pp):
    from rpeg.cost.passes import shard_group
    par = Layout(dp=dp, cp=cp, tp=tp, pp=pp)
    devices = tuple(range(100, 100 + dp * cp * tp * pp))
    step = cp * tp
    assert shard_group(devices, par) == tuple(devices[d * pp * step + c * tp]
                                              for d in range(dp) for c in range(cp))


def test_a_cluster_topology_is_built_once_per_cluster_value():
    gh = cluster_of("h100", gpus_per_node=8, nodes=2)
    assert Topology.from_cluster(gh) is Topology.from_cluster(gh)
    other = attrs.evolve(gh, links=gh.links[:1])
    with pytest.raises(CostError):       # a new value is built (and checked) afresh
        Topology.from_cluster(other)


def test_a_tensor_parallel_engine_samples_from_the_whole_vocabularys_logits():
    """A sequence's next-token logits are gathered whole to sample from at any tp (vLLM's
    logits processor, the torch engine), so its sampling buffer does not shrink with tp:
    fp32 logits and two copies the sampler makes, 12 bytes a vocabulary entry."""
    from types import SimpleNamespace

    from rpeg.cost.generation import row_buffer, step_buffer
    model = Model("m", "llama3.1-8b", LLAMA8B)
    gpu = _cluster().gpu
    one_token = SimpleNamespace(prompt_len=1)   # a prefill layer's work below the logits'
    for tp in (1, 2, 4):
        par = Layout(tp=tp)
        assert row_buffer(model, par, one_token, gpu) == LLAMA8B.vocab * 12
        assert step_buffer(model, par, gpu, 4096) == 4096 * LLAMA8B.vocab * 12


def test_a_decode_step_of_a_mixture_of_experts_reads_the_experts_its_tokens_reach():
    """One token reaches its active experts alone, so a decode step of a few sequences reads
    a few experts' weights; a long prefill reaches them all (and the grouped kernel runs them
    in one launch, not one small GEMM's shortfall per expert)."""
    from rpeg.cost.compute import experts_touched, moe_time
    from rpeg.cost.profiles import builtin_profile
    dims, h100 = PRESETS["qwen3-30b-a3b"], builtin_profile("h100")
    assert experts_touched(dims, 1, 1) == pytest.approx(dims.active_experts)
    assert experts_touched(dims, 4096, 1) == pytest.approx(dims.experts)
    # 8 of 128 experts' weights against all of them: memory-bound, so far under a tenth
    assert moe_time(dims, h100, 1, 2, 1, 1) < moe_time(dims, h100, 512, 2, 1, 1) / 8


def test_a_grouped_gemm_pays_a_small_gemms_shortfall_once():
    from rpeg.cost.compute import Gemm, gemm_time
    from rpeg.cost.profiles import builtin_profile
    h100 = builtin_profile("h100")
    small = Gemm(64, 512, 512)                  # compute-bound, far below the saturating rate
    one = gemm_time(small, h100, 2) - h100.launch_overhead
    group = gemm_time(small, h100, 2, count=128) - h100.launch_overhead
    assert one < group < 128 * one / 4
