"""Hand-checked cases for generation waves, resharding between layouts, optimizer offload."""

import math

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.cost import compute as C
from rpeg.cost.examples import ppo_pipeline
from rpeg.cost.memory import local_params, model_params, resident_memory
from rpeg.cost.passes import cpu_adam_step, offload_time
from rpeg.cost.profiles import cluster_of
from rpeg.cost.stages import (
    estimate_stage,
    generation_chunks,
    generation_rows,
    host_bandwidth,
    stage_memory,
    weight_sync_time,
)
from rpeg.cost.topology import Collective, Topology, collective_time
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.spec.model import Engine, Model, Zero
from rpeg.spec.presets import PRESETS

GH = cluster_of("gh200", 8)
R8 = tuple(range(8))
ACTOR = Model("actor", "llama3.1-8b", PRESETS["llama3.1-8b"])


@pytest.fixture(scope="module")
def ppo():
    return ppo_pipeline("llama3.1-8b", prompts=512, prompt_len=512, gen_median=256,
                        gen_max=1024)


def test_generation_rows_is_free_memory_over_bytes_per_sequence(ppo):
    d, par = ACTOR.dims, Layout(dp=8)
    seq = 512 + 1024
    kv = seq * 2 * d.kv_dim * 2 * (d.layers + 1)            # bf16 K and V, + a layer growing
    other = max(512 * (3 * d.ffn + 4 * d.hidden) * 2, d.vocab * 4 * 3)
    free = 18e9
    expect = int((free - GH.gpu.runtime_memory) // (kv + other))
    assert 1 <= expect < 64
    assert generation_rows(work_of(ppo, "rollout"), par, GH, free) == expect
    assert generation_rows(work_of(ppo, "rollout"), par, GH, 1e13) == 64          # all of the batch
    assert generation_rows(work_of(ppo, "rollout"), par, GH, 0.0) == 1            # shortfall reported
    m = stage_memory(work_of(ppo, "rollout"), par, GH, rows=expect)
    assert m.kv_cache == pytest.approx(expect * kv)
    assert stage_memory(work_of(ppo, "rollout"), par, GH).kv_cache == pytest.approx(64 * kv)


def test_waves_cost_one_wave_each(ppo):
    par = Layout(dp=8)
    one_wave = estimate_stage(work_of(ppo, "rollout"), par, R8, GH, batch=128).time_s   # 16 per replica
    four = estimate_stage(work_of(ppo, "rollout"), par, R8, GH, rows=16).time_s         # 64 in 4 waves
    # Each wave waits for its longest response; of a 512 batch that is longer than of 128.
    assert 4 * one_wave < four < 4 * 1.5 * one_wave
    whole = estimate_stage(work_of(ppo, "rollout"), par, R8, GH).time_s
    assert whole < four                       # one wave of 64 shares each weight read
    ends = generation_chunks(work_of(ppo, "rollout"), par, R8, GH, 4, rows=16)
    assert [round(4 * t / four, 6) for t, _ in ends] == [1, 2, 3, 4]
    assert sum(n for _, n in ends) == 512


def test_generation_ends_with_the_batch_longest_whatever_the_dp(ppo):
    """The stage ends when the replica holding the batch's longest response does: more
    replicas with fewer responses each do not shorten the tail."""
    from rpeg.cost.stages import _slowest_lengths
    dist = ppo.workload.gen_len
    top = dist.quantiles(512).max()
    for dp in (1, 8, 64):
        lengths = _slowest_lengths(dist, 512 // dp, dp)
        assert len(lengths) == 512 // dp and lengths.max() == top
    # the slowest replica's others are the longest of each stratum: never shorter than
    # the replica's own stratified draws
    assert (_slowest_lengths(dist, 64, 8) >= dist.quantiles(64)).all()


def test_identical_layout_shares_its_weights():
    assert weight_sync_time(ACTOR, R8, Layout(dp=8), R8, Layout(dp=8), GH) == 0.0


def test_tp1_to_tp2_on_same_gpus_copies_a_slice_locally():
    wbytes = model_params(ACTOR) * 2
    expect = 2 * (wbytes / 2) / GH.gpu.mem_bandwidth \
        + C.param_tensors(ACTOR.dims) * GH.gpu.launch_overhead
    t = weight_sync_time(ACTOR, R8, Layout(dp=8), R8, Layout(dp=4, tp=2), GH)
    assert t == pytest.approx(expect)
    assert 1e-3 < t < 0.1                        # 8 GB read and written at 3.67 TB/s


def test_tp2_to_tp1_on_same_gpus_gathers_over_the_link():
    t = weight_sync_time(ACTOR, R8, Layout(dp=4, tp=2), R8, Layout(dp=8), GH)
    link = Topology.from_cluster(GH).link(Topology.from_cluster(GH).level_of(R8))
    assert t >= model_params(ACTOR) * 2 / link.bandwidth


def test_zero3_gathers_weights_before_generation():
    z3 = Layout(dp=8, zero=3)
    shard = model_params(ACTOR) * 2
    gather = collective_time(Collective.ALL_GATHER, shard, R8, Topology.from_cluster(GH))
    assert gather > 0
    assert weight_sync_time(ACTOR, R8, z3, R8, Layout(dp=8), GH) == pytest.approx(gather)


def test_offload_moves_adam_state_off_the_device_between_steps(ppo):
    par = Layout(dp=8, microbatches=4)
    off = attrs.evolve(par, offload=True)
    state = local_params(ACTOR, par) * 12                # fp32 master + 2 moments
    keep = resident_memory(ACTOR, par, GH, trained=True)
    gone = resident_memory(ACTOR, off, GH, trained=True)
    assert keep.optimizer == pytest.approx(state) and gone.optimizer == 0.0
    assert keep.total - gone.total == pytest.approx(state)
    # ... but the train step brings it back: the step's own peak is unchanged
    assert stage_memory(work_of(ppo, "actor_step"), off, GH).optimizer == pytest.approx(state)
    dt = estimate_stage(work_of(ppo, "actor_step"), off, R8, GH).time_s \
        - estimate_stage(work_of(ppo, "actor_step"), par, R8, GH).time_s
    assert dt == pytest.approx(2 * state / 450e9)
    assert host_bandwidth(GH.gpu) == 450e9
    assert math.isclose(host_bandwidth(cluster_of("a100", 8).gpu), 25e9)


def test_deepspeed_offload_streams_the_step_zero_offload_runs_on_the_host():
    """DeepSpeed's ZeRO-Offload step per rank: float32 gradients out, unscaled and clipped in
    place, CPU Adam, the float32 weights narrowed to 16 bits on the host and sent back; every
    optimizer step of a DeepSpeed train stage pays it."""
    a100 = cluster_of("a100", 8).gpu
    par = Layout(dp=4, zero=Zero.GRADIENTS, offload=True)
    n = local_params(ACTOR, par) / 4                  # the rank's share of the optimizer
    host = n * (8 + 28 + 6) / a100.host_memory_bandwidth
    pcie = n * (4 + 2) / a100.host_bandwidth
    assert cpu_adam_step(ACTOR, par, a100) == pytest.approx(host + pcie)
    # more than Adam's own streaming, the rest of the step is the host's too
    assert cpu_adam_step(ACTOR, par, a100) > n * 28 / a100.host_memory_bandwidth
    assert offload_time(ACTOR, par, a100, Engine.DEEPSPEED, opt_steps=4) == \
        pytest.approx(4 * cpu_adam_step(ACTOR, par, a100))
    # a float32 model converts nothing: its weights go back as they are
    f32 = attrs.evolve(ACTOR, dtype="fp32")
    assert cpu_adam_step(f32, par, a100) == pytest.approx(
        n * 36 / a100.host_memory_bandwidth + n * 8 / a100.host_bandwidth)


def test_chunks_report_their_longest_and_mean_response(ppo):
    par = Layout(dp=8)
    ends = generation_chunks(work_of(ppo, "rollout"), par, R8, GH, 4, with_lengths=True)
    tops = [top for _, _, top, _ in ends]
    means = [mean for _, _, _, mean in ends]
    assert tops == sorted(tops) and tops[-1] == ppo.workload.gen_len.quantiles(512).max()
    assert means == sorted(means) and all(m <= t for m, t in zip(means, tops, strict=True))
    assert [(t, n) for t, n, _, _ in ends] == list(generation_chunks(work_of(ppo, "rollout"), par, R8,
                                                                     GH, 4))


def test_a_packed_batch_costs_its_real_lengths_not_the_longest(ppo):
    """Packed, a forward or train op computes each response at its own length: the same
    op padded to the batch's longest costs more, in time and memory; a packed chunk costs
    its own mean length."""
    for stage in ("ref_lp", "actor_step"):
        padded, packed = Layout(dp=8), Layout(dp=8, packing=True)
        assert estimate_stage(work_of(ppo, stage), packed, R8, GH).time_s \
            < estimate_stage(work_of(ppo, stage), padded, R8, GH).time_s
        assert stage_memory(work_of(ppo, stage), packed, GH).total \
            < stage_memory(work_of(ppo, stage), padded, GH).total
    short = estimate_stage(work_of(ppo, "ref_lp"), Layout(dp=8, packing=True), R8, GH, batch=128,
                           padded_len=4096, mean_len=100).time_s
    long = estimate_stage(work_of(ppo, "ref_lp"), Layout(dp=8, packing=True), R8, GH, batch=128,
                          padded_len=4096, mean_len=1000).time_s
    assert short < long


def test_a_batch_padded_shorter_costs_less(ppo):
    par = Layout(dp=8, microbatches=2)
    whole = estimate_stage(work_of(ppo, "ref_lp"), par, R8, GH, batch=128).time_s
    short = estimate_stage(work_of(ppo, "ref_lp"), par, R8, GH, batch=128, padded_len=128).time_s
    assert short < 0.8 * whole              # 512 + 128 tokens a row, not 512 + ~600
    m_whole = stage_memory(work_of(ppo, "ref_lp"), par, GH, batch=128).total
    m_short = stage_memory(work_of(ppo, "ref_lp"), par, GH, batch=128, padded_len=128).total
    assert m_short < m_whole


def test_continuous_batching_admits_into_the_first_free_slot():
    import numpy as np

    from rpeg.cost.stages import _admissions
    first, last = _admissions(np.array([1.0, 2.0, 3.0, 4.0]), 2)
    # arrivals 0, 2, 1, 3 (a fixed order unrelated to length), two slots
    assert first.tolist() == [0.0, 1.0, 0.0, 3.0] and last.tolist() == [1.0, 3.0, 3.0, 7.0]
    first, last = _admissions(np.array([1.0, 2.0]), None)
    assert first.tolist() == [0.0, 0.0] and last.tolist() == [1.0, 2.0]


def test_vllm_refills_freed_slots_instead_of_waiting_for_each_wave(ppo):
    from rpeg.spec.model import Engine
    par, vllm = Layout(dp=8), Engine.VLLM
    whole = estimate_stage(work_of(ppo, "rollout"), par, R8, GH, engine=vllm).time_s
    assert estimate_stage(work_of(ppo, "rollout"), par, R8, GH, engine=vllm, rows=64).time_s == whole
    refill = estimate_stage(work_of(ppo, "rollout"), par, R8, GH, engine=vllm, rows=16).time_s
    one_wave = estimate_stage(work_of(ppo, "rollout"), par, R8, GH, engine=vllm, batch=128).time_s
    assert whole < refill < 4 * one_wave        # 16 at once, but one tail, not four
    ends = generation_chunks(work_of(ppo, "rollout"), par, R8, GH, 4, engine=vllm, rows=16)
    assert [t for t, _ in ends] == sorted(t for t, _ in ends)
    assert ends[-1][0] == pytest.approx(refill) and sum(n for _, n in ends) == 512


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 500), min_size=1, max_size=60),
       slots=st.integers(1, 70))
def test_continuous_batching_keeps_at_most_slots_busy(lengths, slots):
    import numpy as np

    from rpeg.cost.stages import _admissions
    ls = np.sort(np.array(lengths, dtype=float))
    first, last = _admissions(ls, slots)
    assert (first >= 0).all() and np.allclose(last - first, ls)
    for t in np.unique(first):                      # at each admission, slots not exceeded
        assert ((first <= t) & (last > t)).sum() <= slots
    makespan = last.max()
    assert makespan >= max(ls.max(), ls.sum() / slots) - 1e-9
    # list scheduling: never worse than the bound of Graham's greedy
    assert makespan <= ls.sum() / min(slots, len(ls)) + ls.max() + 1e-9
