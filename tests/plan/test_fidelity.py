"""The evaluator's generation waves and the optimizer-offload choice, on ppo_llama8b."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from rpeg.cost.memory import offloaded_bytes
from rpeg.cost.stages import generation_rows, stage_memory
from rpeg.graph.work import work_of
from rpeg.plan import Strategy
from rpeg.plan.oplayout import blocks_of
from rpeg.plan.search import Moves
from rpeg.spec import load_cluster

from .conftest import ROOT, colocated_start


@pytest.fixture(scope="module")
def gh8():
    return load_cluster(ROOT / "pipelines/clusters/gh200_8.rpeg")


@pytest.fixture(scope="module")
def coloc(ppo8b, gh8):
    return colocated_start(ppo8b, gh8)


def test_colocated_fits_on_8_gh200_with_generation_in_waves(ppo8b, gh8, coloc):
    _, ev, out = coloc
    assert out.best is not None and out.best.plan.strategy is Strategy.COLOCATED
    plan = out.best.plan
    graph = ev.graph(plan)
    resident, _ = ev.resident_bytes(plan, graph)
    gen = plan.placement("rollout")
    free = gh8.gpu.memory - resident[list(gen.devices)].max()
    rows = generation_rows(work_of(ppo8b, "rollout"), gen.layout, gh8, free, engine=gen.engine)
    assert ev.rows_of(plan, graph)["rollout"] == rows
    kv = stage_memory(work_of(ppo8b, "rollout"), gen.layout, gh8, rows=rows,
                      engine=gen.engine).total
    assert resident[list(gen.devices)].max() + kv <= gh8.gpu.memory
    again = ev.evaluate(attrs.evolve(plan, predicted=None))
    assert again.feasible and max(again.plan.predicted.peak_memory) <= gh8.gpu.memory


def test_offload_is_a_search_move_priced_by_the_evaluator(ppo8b, gh8, coloc):
    ctx, ev, out = coloc
    plan = attrs.evolve(out.best.plan, predicted=None)
    moves = Moves(ctx, np.random.default_rng(0))
    flipped = moves.offload(plan)
    (stage,) = [p.stage for p, q in zip(plan.placements, flipped.placements, strict=True)
                if p.offload != q.offload]
    before, after = plan.placement(stage), flipped.placement(stage)
    model = ppo8b.model(ppo8b.stage(stage).target)
    state = offloaded_bytes(model, before.layout, gh8.gpu)     # what moves
    on, off = (after, before) if after.offload else (before, after)
    r_on = ev.resident(model.name, on, trained=True)
    r_off = ev.resident(model.name, off, trained=True)
    assert r_off - r_on == pytest.approx(state)
    t_on, t_off = ev.stage_time(stage, on), ev.stage_time(stage, off)
    assert t_on - t_off == pytest.approx(2 * state / gh8.gpu.host_bandwidth)


def test_streamed_consumers_are_priced_chunk_by_chunk(ppo8b, gh8, coloc):
    """With the rollout in 4 rounds (4 chunks on each of its blocks), each per-sample
    consumer chunk is its own batch: its responses, padded to its longest (or packed, at
    their mean length); memory is the largest chunk's need."""
    from rpeg.cost.stages import estimate_stage
    _, ev, out = coloc
    blocks = blocks_of(out.best.plan.placement("rollout"))
    plan = attrs.evolve(out.best.plan, predicted=None, placements=tuple(
        attrs.evolve(p, chunks=4 * blocks) if p.stage == "rollout" else
        p.changed(packing=False) if p.stage == "ref_lp" else p     # padded, here
        for p in out.best.plan.placements))
    graph = ev.graph(plan)
    rows = ev.rows_of(plan, graph)
    ends = ev.chunk_ends("rollout", attrs.evolve(plan.placement("rollout"), chunks=4),
                         rows["rollout"])
    chunks = tuple((n, top, mean) for _, n, top, mean in ends)
    assert len(chunks) == 4 and sum(c[0] for c in chunks) == ppo8b.workload.batch
    assert all(mean <= top for _, top, mean in chunks)
    assert ev.streamed(plan, graph, rows)["ref_lp"] == chunks
    timings, _ = ev.timings(plan, graph)
    p = plan.placement("ref_lp")
    expect = [estimate_stage(work_of(ppo8b, "ref_lp"), p.layout, p.devices, gh8, batch=n,
                             padded_len=top, mean_len=mean).time_s for n, top, mean in chunks]
    assert timings["ref_lp"].chunk_times == pytest.approx(expect)
    assert expect[0] < expect[-1]                  # the shortest responses are the cheapest
    whole = ev.stage_time("ref_lp", p)
    assert sum(expect) < whole                     # no chunk is padded to the batch's longest
    r = ev.evaluate(plan)
    assert dict(r.plan.predicted.op_times)["ref_lp"] == pytest.approx(sum(expect), abs=1e-5)


def test_weight_sync_holds_the_trainers_senders_and_the_generator(ppo8b, gh8, coloc):
    """A weight transfer is one collective, as the runtime runs it: the trainer's GPUs that
    hold its weights (its first tensor-parallel block; every GPU under ZeRO-3, which gathers
    them first) send, the generating GPUs receive, and the trainer goes on after it. The
    same holds for the broadcast into a vLLM engine's own copy."""
    from rpeg.plan.choices import model_stages
    from rpeg.plan.edit import empty_plan, options, put, repair
    from rpeg.plan.space import Block
    from rpeg.spec.model import Engine
    ctx, ev, out = coloc
    for sharded in (False, True):
        plan = empty_plan(ctx)
        for s in model_stages(ppo8b):
            block = Block(0, 4) if s == "rollout" else Block(4, 4)
            pick = [c for c in options(ctx, s, 4) if c.par.zero.shards_params == sharded
                    or ppo8b.stage(s).kind.value != "train"]
            plan = put(ctx, plan, s, block, pick[0])
        plan = repair(ctx, plan)
        timings, _ = ev.timings(plan, ev.graph(plan))
        actor = plan.placement("actor_step")
        senders = actor.devices if actor.zero.shards_params else actor.devices[:actor.tp]
        assert timings["sync_actor"].devices == tuple(sorted((0, 1, 2, 3) + senders))
        assert timings["actor_step"].time_s == pytest.approx(ev.stage_time("actor_step", actor))
    vllm = attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, engine=Engine.VLLM if p.stage == "rollout" else p.engine)
        for p in plan.placements))
    assert ev.timings(vllm, ev.graph(vllm))[0]["sync_actor"].devices == \
        tuple(sorted((0, 1, 2, 3) + senders))
    shared, _ = ev.timings(out.best.plan, ev.graph(out.best.plan))     # colocated
    assert set(shared["sync_actor"].devices) <= set(range(8))


def test_stale_or_carried_responses_cost_the_trainer_a_forward(ppo8b, gh8, coloc):
    """The off-policy correction runs a forward before a PPO update on responses sampled
    with older weights (staleness or a carry), not on synchronous ones; the critic's value
    loss needs none. Host ops occupy their devices' workers."""
    _, ev, out = coloc
    plan = out.best.plan
    times = {}
    for name, edit in (("sync", {}), ("stale", {"staleness": (("rollout", 1),)}),
                       ("carry", {"placements": tuple(attrs.evolve(p, carry=1)
                                                     if p.stage == "rollout" else p
                                                     for p in plan.placements)})):
        e = ev.evaluate(attrs.evolve(plan, predicted=None, **edit))
        times[name] = dict(e.plan.predicted.op_times)
    assert times["stale"]["actor_step"] > times["sync"]["actor_step"]
    assert times["carry"]["actor_step"] == pytest.approx(times["stale"]["actor_step"])
    assert times["stale"]["critic_step"] == pytest.approx(times["sync"]["critic_step"])
    graph = ev.graph(plan)
    timings, _ = ev.timings(plan, graph)
    assert timings["scores"].devices == plan.placement("scores").devices


def test_chunks_are_priced_as_the_rounds_the_runtime_streams(coloc):
    """The runtime streams a step's chunks in rounds, a chunk on each block of the rollout
    side by side, as many on each: fewer chunks asked than blocks stream one round (each
    block its whole share), as one chunk does, and are priced so; ``m`` rounds are priced
    as ``m`` chunks of the step's responses."""
    _, ev, out = coloc
    blocks = blocks_of(out.best.plan.placement("rollout"))
    assert blocks > 2                         # the rollout on several blocks

    def priced(chunks):
        plan = attrs.evolve(out.best.plan, predicted=None, placements=tuple(
            attrs.evolve(p, chunks=chunks) if p.stage == "rollout" else p
            for p in out.best.plan.placements))
        graph = ev.graph(plan)
        return plan, graph, ev.timings(plan, graph)[0]["rollout"]

    one, graph, whole = priced(1)
    assert whole.chunk_ends == () and ev.placed(one).fused().by_round().chunks == 1
    for asked in (2, blocks - 1):
        plan, graph, timing = priced(asked)
        assert timing == whole and ev.placed(plan).fused().chunks == blocks
        assert ev.evaluate(plan).plan.predicted.step_time_s == \
            pytest.approx(ev.evaluate(one).plan.predicted.step_time_s)
    plan, graph, timing = priced(2 * blocks)
    assert len(timing.chunk_ends) == ev.placed(plan).fused().by_round().chunks == 2
