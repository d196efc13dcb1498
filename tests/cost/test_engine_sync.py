"""The collective weight sync into vLLM engines' own copies, and a generate stage's
batching (max_num_seqs, kv_fraction) as a plan records it, priced and settled."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.cost.engine_sync import SYNC_BUCKET_BYTES, collective_sync_time, engine_copy
from rpeg.cost.examples import ppo_pipeline
from rpeg.cost.generation import sync_bytes
from rpeg.cost.profiles import cluster_of
from rpeg.cost.stages import estimate_stage
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.plan.model import StagePlacement
from rpeg.spec.model import Engine, Zero

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ppo():
    return ppo_pipeline("llama3.1-8b", prompts=512, prompt_len=1024, gen_median=1024,
                        gen_max=4096)


@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.TORCH])
def test_fewer_rows_decode_longer(ppo, engine):
    h200, par = cluster_of("h200", 8), Layout(dp=8)
    times = [estimate_stage(work_of(ppo, "rollout"), par, tuple(range(8)), h200, engine=engine,
                            rows=r).time_s for r in (64, 16, 4)]
    assert times[0] < times[1] < times[2]


def test_the_sync_is_priced_by_bytes_in_the_dtype_per_bucket_over_the_links():
    ppo = ppo_pipeline("llama3.1-8b")
    actor = ppo.model("actor")
    two = cluster_of("h200", 8, 2)
    r8 = tuple(range(8))
    same_node = collective_sync_time(actor, r8[:4], Layout(dp=4), ((4, 5), (6, 7)), two)
    other_node = collective_sync_time(actor, r8, Layout(dp=8), ((8, 9), (10, 11)), two)
    assert other_node > same_node > 0                     # the slower link the sets span
    fp32 = collective_sync_time(attrs.evolve(actor, dtype="fp32"), r8, Layout(dp=8),
                                ((8, 9),), two)
    bf16 = collective_sync_time(actor, r8, Layout(dp=8), ((8, 9),), two)
    assert fp32 == pytest.approx(2 * bf16, rel=0.05)      # bytes in the parameter dtype
    assert sync_bytes(attrs.evolve(actor, dtype="fp32"), two.gpu) == 2 * sync_bytes(actor, two.gpu)
    small = collective_sync_time(actor, r8, Layout(dp=8), ((8, 9),), two, bucket_bytes=1 << 20)
    assert small > bf16                                    # a latency per bucket
    # a trainer split tp-ways gathers whole tensors first
    assert collective_sync_time(actor, r8, Layout(dp=4, tp=2), ((8, 9),), two) > bf16


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.integers(1, 3))
def test_more_engines_never_sync_faster(engines, tp):
    actor = ppo_pipeline("llama3.1-8b").model("actor")
    big = cluster_of("h200", 8, 4)
    blocks = tuple(tuple(range(8 + i * tp, 8 + (i + 1) * tp)) for i in range(engines))
    more = blocks + (tuple(range(8 + engines * tp, 8 + (engines + 1) * tp)),)
    src = tuple(range(8))
    assert collective_sync_time(actor, src, Layout(dp=8), more, big) >= \
        collective_sync_time(actor, src, Layout(dp=8), blocks, big)


def test_which_engines_get_a_copy():
    trainer = StagePlacement.of("train", (0, 1), dp=2)
    assert not engine_copy(trainer, StagePlacement.of("g", (0,), engine=Engine.VLLM))
    assert engine_copy(trainer, StagePlacement.of("g", (2,), engine=Engine.VLLM))
    assert engine_copy(trainer, StagePlacement.of("g", (0, 1), tp=2, engine=Engine.VLLM))
    assert not engine_copy(trainer, StagePlacement.of("g", (2,), engine=Engine.TORCH))
    split = StagePlacement.of("train", (0, 1), tp=2)
    assert engine_copy(split, StagePlacement.of("g", (0,), engine=Engine.VLLM))
    for zero in (2, 3):             # FSDP2's parameters: the engine gets a copy of its own
        fsdp = StagePlacement.of("train", (0, 1), dp=2, zero=zero)
        assert engine_copy(fsdp, StagePlacement.of("g", (0,), engine=Engine.VLLM))


def test_the_backend_sends_the_bucket_priced():
    """One value, not two kept equal: the vLLM backend's bucket is the cost model's (the
    same object; an int this large written again elsewhere would be another)."""
    from backends.vllm_backend.weights import DEFAULT_BUCKET_BYTES
    assert DEFAULT_BUCKET_BYTES is SYNC_BUCKET_BYTES


def _vllm_beside(trainer: tuple[int, ...]):
    """grpo_qwen7b on 8 H200s: the rollout on vLLM at dp 2 x tp 2 on GPUs 0-3, the train
    stages (and the actor's home) at dp 4 on ``trainer``: (pipeline, cluster, train stage
    names, plan)."""
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    pipeline = load(ROOT / "pipelines/grpo_qwen7b.rpeg")
    cluster = cluster_of("h200", 8, 1)
    trains = {s.name for s in pipeline.stages if s.kind.value == "train"}

    def placed(p):
        if p.stage == "rollout":
            return p.changed(devices=(0, 1, 2, 3), dp=2, tp=2, engine=Engine.VLLM)
        if p.stage in trains or p.devices != (0,):
            return p.changed(devices=trainer, dp=4)
        return p
    base = split_plan(pipeline, 8)
    return pipeline, cluster, trains, attrs.evolve(
        base, placements=tuple(placed(p) for p in base.placements),
        model_homes=(("actor", trainer),))


def test_the_planner_prices_a_disaggregated_engine_with_the_collective_sync():
    """A plan's sync op into a vLLM engine's own copy costs what collective_sync_time
    says, and the devices taking part are busy for it: the trainer's first rank, which
    broadcasts (its other ranks hold the same weights), and the engines' workers."""
    from rpeg.plan.evaluate import Evaluator
    pipeline, cluster, trains, plan = _vllm_beside((4, 5, 6, 7))
    ev = Evaluator(pipeline, cluster)
    timings, _ = ev.timings(plan, ev.graph(plan))
    sync = next(t for name, t in timings.items() if name.startswith("sync_"))
    src = plan.placement(next(iter(trains)))
    want = collective_sync_time(pipeline.model("actor"), src.devices, Layout(dp=4),
                                ((0, 1), (2, 3)), cluster)
    assert sync.time_s == pytest.approx(want)
    assert set(sync.devices) == {0, 1, 2, 3, 4}    # the engines and the trainer's first rank
    capped = attrs.evolve(plan, placements=tuple(
        p.changed(max_num_seqs=2) if p.stage == "rollout" else p for p in plan.placements))
    def step(p):            # memory aside (the trainer here is not laid out to fit)
        return ev.evaluate(p, simulate_infeasible=True).plan.predicted.step_time_s
    assert step(capped) > step(plan) > 0                        # the knob is priced


def test_a_stages_batching_is_recorded_in_the_plan_and_the_runtimes_kv_share_priced():
    """A generate stage's max_num_seqs and kv_fraction (the stage's, where the placement
    leaves them) are written into the placement the cost model prices and the runtime
    passes to its engine; a vLLM stage that leaves kv_fraction at 0 is priced with the
    share rpeg's vLLM takes (half a GPU), an executor that declares none with free memory."""
    from rpeg.plan.evaluate import settle_batching
    from rpeg.plan.space import Limits
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    pipeline = load(ROOT / "pipelines/grpo_qwen7b.rpeg")
    cluster = cluster_of("h200", 8, 1)
    plan = split_plan(pipeline, 8)
    plan = attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, engine=Engine.VLLM) if p.stage == "rollout" else p
        for p in plan.placements))
    runtime = Limits.runtime().engine_kv
    settled = settle_batching(pipeline, plan, cluster, runtime).placement("rollout")
    assert settled.kv_fraction == 0.5 and settled.max_num_seqs == 0
    assert settle_batching(pipeline, plan, cluster, ()).placement("rollout").kv_fraction == 0
    from rpeg.spec import load_cluster
    local = load_cluster(ROOT / "pipelines/clusters/local_cpu.rpeg")     # a CPU: 1 GiB of KV
    small = attrs.evolve(split_plan(pipeline, 2), placements=tuple(
        attrs.evolve(p, engine=Engine.VLLM) if p.stage == "rollout" else p
        for p in split_plan(pipeline, 2).placements))
    on_cpu = settle_batching(pipeline, small, local, runtime).placement("rollout")
    assert on_cpu.kv_fraction == pytest.approx((1 << 30) / local.gpu.memory)
    pinned = attrs.evolve(plan, placements=tuple(
        p.changed(max_num_seqs=8, kv_fraction=0.3) if p.stage == "rollout" else p
        for p in plan.placements))
    got = settle_batching(pipeline, pinned, cluster, runtime).placement("rollout")
    assert (got.max_num_seqs, got.kv_fraction) == (8, 0.3)


def test_the_layouts_offered_are_priced_with_the_share_the_engine_takes():
    """The planner's layouts for a vLLM stage carry the KV share rpeg's vLLM takes, so a
    baseline never picks a vLLM layout that fits only at free memory (colocated beside an
    8B actor's Adam state, half of a 96 GB GPU does not fit: the torch engine does)."""
    from rpeg.plan.compile import compile_plan
    from rpeg.plan.model import Strategy
    from rpeg.plan.search import SearchOptions
    from rpeg.plan.space import Limits
    from rpeg.spec import load, load_cluster
    pipeline = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    cluster = load_cluster(ROOT / "pipelines/clusters/gh200_64.rpeg")
    plan = compile_plan(pipeline, cluster, Strategy.COLOCATED,
                        SearchOptions(limits=Limits.runtime()))
    assert max(plan.predicted.peak_memory) <= cluster.gpu.memory
    for p in plan.placements:
        if p.engine is Engine.VLLM:
            assert p.kv_fraction == 0.5


# --- who takes part in a sync (the runtime's rule, priced as it runs) -----------------------

def test_every_device_holding_a_piece_sends():
    from rpeg.cost.engine_sync import sync_senders
    devices = (4, 5, 6, 7)
    assert sync_senders(devices, tp=1, zero=Zero(0)) == (4,)           # whole on each rank
    assert sync_senders(devices, tp=1, zero=Zero(2)) == (4,)           # ZeRO-2: whole between ops
    assert sync_senders(devices, tp=2, zero=Zero(2)) == (4, 5)         # the first tp block gathers
    assert sync_senders(devices, tp=1, zero=Zero(3)) == devices        # shards: every rank gathers
    assert sync_senders(devices, tp=2, zero=Zero(3)) == devices


@given(st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
       st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True),
                min_size=1, max_size=4))
def test_no_sync_group_holds_two_ranks_on_one_device(senders, blocks):
    from rpeg.cost.engine_sync import sync_layout, sync_refusal
    taken = set()
    disjoint = []
    for b in blocks:                       # one engine per device, as placements give them
        if not taken & set(b):
            disjoint.append(tuple(b))
            taken |= set(b)
    lay = sync_layout(tuple(senders), disjoint)
    if sync_refusal(lay) is None:
        assert len(set(lay.members)) == len(lay.members)
        assert all(b[0] in senders for b in lay.local)
    assert sorted(lay.group + lay.local) == sorted(disjoint)
    for b in lay.group:
        assert not set(b) & set(senders)


def test_an_engine_on_a_sending_device_is_loaded_in_process_and_priced_so():
    from rpeg.cost.engine_sync import sync_layout, sync_refusal
    lay = sync_layout((0, 1), ((0,), (2,)))
    assert lay.local == ((0,),) and lay.group == ((2,),) and lay.members == (0, 2)
    assert sync_refusal(sync_layout((0,), ((1, 0),))) is not None     # hosted off a sender
    cluster = cluster_of("h200", 8)
    m = ppo_pipeline("llama3.1-8b", prompts=8).model("actor")
    apart = collective_sync_time(m, (0, 1), Layout(dp=2, zero=3), ((2,),), cluster)
    beside = collective_sync_time(m, (0, 1), Layout(dp=2, zero=3), ((0,),), cluster)
    assert beside < apart                               # no broadcast: a copy in process


def test_an_engine_sleeps_beside_a_trainer_on_gpus_only():
    from rpeg.cost.engine_sync import engine_sleeps, sleep_wake_time
    assert engine_sleeps((0, 1), (1, 2), devices_are_host=False)
    assert not engine_sleeps((0,), (1, 2), devices_are_host=False)
    assert not engine_sleeps((1,), (1, 2), devices_are_host=True)     # CPU memory is the host's
    h200 = cluster_of("h200", 8).gpu
    m = ppo_pipeline("llama3.1-8b", prompts=8).model("actor")
    assert sleep_wake_time(m, 1, h200) == pytest.approx(2 * sync_bytes(m, h200)
                                                        / h200.host_bandwidth)


@pytest.mark.parametrize("trainer, sleeps", [((4, 5, 6, 7), False), ((2, 3, 4, 5), True)])
def test_the_planner_prices_an_engine_asleep_while_its_gpus_train(trainer, sleeps):
    """A plan's generate op on vLLM beside a trainer on GPUs costs its decode plus one sleep
    and wake (``sleep_wake_time``); on devices of its own, its decode alone."""
    from rpeg.cost.engine_sync import sleep_wake_time
    from rpeg.plan.evaluate import Evaluator
    pipeline, cluster, _, plan = _vllm_beside(trainer)
    ev = Evaluator(pipeline, cluster)
    graph = ev.graph(plan)
    timings, _ = ev.timings(plan, graph)
    gen = next(o for o in graph.ops if o.kind.value == "generate")
    p = plan.placement(gen.stages[0])
    decode = ev.stage_time(gen.stages[0], p, ev.walk(plan, graph).rows.get(gen.stages[0]))
    rest = sleep_wake_time(pipeline.model("actor"), 2, cluster.gpu) if sleeps else 0.0
    assert timings[gen.name].time_s == pytest.approx(decode + rest)
    assert (rest > 0) == sleeps
