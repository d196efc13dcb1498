"""Unrolling a plan into op calls: chunks, ranks, weight sync, exact versions, ordering."""

from __future__ import annotations

import pytest

from rpeg.errors import PlanError
from rpeg.runtime.lowering.instances import build_calls, by_id
from rpeg.runtime.placement import split_plan
from rpeg.spec.model import OpKind


def test_colocated_sync_plan_has_no_weight_sync(ppo, plan_by_hand):
    calls = build_calls(ppo, plan_by_hand(ppo, {}, devices=1), steps=3)
    assert not [c for c in calls if c.kind is OpKind.SYNC_WEIGHTS]
    t = by_id(calls)
    # generation of step 2 reads exactly version 2, made by the train op of step 1
    assert t["rollout/s2/c0"].version == 2
    assert "actor_step/s1" in t["rollout/s2/c0"].after
    assert t["actor_step/s1"].version == 1 and t["actor_step/s1"].writes == 2


def test_split_plan_syncs_only_versions_that_are_read(ppo):
    plan = split_plan(ppo, 2, staleness=1)
    calls = build_calls(ppo, plan, steps=4)
    t = by_id(calls)
    loads = sorted(c.id for c in calls if c.role == "load")
    # staleness 1: steps 2 and 3 read versions 1 and 2; step 0 and 1 read the initial weights
    assert loads == ["sync_actor/s0/load@0", "sync_actor/s1/load@0"]
    load, export = t["sync_actor/s0/load@0"], t["sync_actor/s0/export"]
    assert export.device == plan.home("actor")[0]
    # one collective transfer: no data through Dask; both wait for the trainer's version
    assert load.deps == () and load.gang == export.gang == tuple(sorted({0, export.device}))
    assert export.sources == (export.device,) and load.fills == ("actor",)
    assert "actor_step/s0" in load.after and "actor_step/s0" in export.after
    assert t["rollout/s1/c0"].version == 0 and t["rollout/s3/c0"].version == 2
    # write after read: the load of version 1 waits for every chunk that reads version 0
    assert {"rollout/s1/c0", "rollout/s1/c1"} <= set(t["sync_actor/s0/load@0"].after)


def test_chunked_consumers_follow_their_chunk_and_train_waits_for_all(ppo):
    calls = by_id(build_calls(ppo, split_plan(ppo, 2), steps=1))
    assert calls["ref_lp/s0/c1"].deps == ("rollout/s0/c1",)
    assert "rollout/s0/c0" in calls["rollout/s0/c1"].after
    train = calls["actor_step/s0"]
    assert {"adv/s0/c0", "adv/s0/c1", "rollout/s0/c0", "rollout/s0/c1"} <= set(train.deps)


def test_group_ops_wait_for_the_whole_step(grpo):
    calls = by_id(build_calls(grpo, split_plan(grpo, 2), steps=1))
    adv = calls["adv/s0"]
    assert set(adv.deps) == {"scores/s0/c0", "scores/s0/c1", "rollout/s0/c0", "rollout/s0/c1"}
    assert dict(adv.inputs) == {"scores": 2, "responses": 2}


def test_shared_actor_critic_is_one_train_op(ppo):
    plan = split_plan(ppo, 2, share=True)
    calls = build_calls(ppo, plan, steps=2)
    trains = [c for c in calls if c.kind is OpKind.TRAIN]
    assert {c.op for c in trains} == {"actor_step+critic_step"}
    assert all(c.model == "actor+critic" for c in trains)


def test_data_parallel_ranks_share_dependencies_and_collective_order(ppo):
    plan = split_plan(ppo, 2, dp=2, staleness=0)
    calls = by_id(build_calls(ppo, plan, steps=2))
    r0, r1 = calls["actor_step/s1/r0"], calls["actor_step/s1/r1"]
    assert (r0.device, r1.device, r0.world) == (0, 1, 2)
    assert set(r0.deps) | set(r0.after) >= set(r1.deps) - {r0.id}
    # on each device, the critic's collective of a step follows the actor's
    assert "actor_step/s1/r0" in calls["critic_step/s1/r0"].after
    assert "actor_step/s1/r1" in calls["critic_step/s1/r1"].after


def test_tensor_parallel_is_refused_with_a_reason(ppo):
    plan = split_plan(ppo, 2)
    import attrs
    bad = attrs.evolve(plan, placements=tuple(p.changed(tp=2) if p.stage == "ref_lp" else p
                                              for p in plan.placements))
    with pytest.raises(PlanError, match="tp = 1"):
        build_calls(ppo, bad, steps=1)


def test_chunks_are_capped_by_the_responses_of_a_step(ppo):
    """A plan asking for 8 chunks of a step that generates 4 responses streams 4, one each
    (an empty chunk has nothing to stream); 2 generating devices stream 2 each."""
    import attrs
    small = attrs.evolve(ppo, workload=attrs.evolve(ppo.workload, prompts=2, samples=2))
    for devices, want in ((1, 4), (2, 4)):
        plan = split_plan(small, devices, dp=devices, staleness=0) if devices > 1 \
            else split_plan(small, 1, staleness=0)
        plan = attrs.evolve(plan, placements=tuple(
            attrs.evolve(p, chunks=8) if p.stage == "rollout" else p for p in plan.placements))
        rollouts = [c for c in build_calls(small, plan, steps=1) if c.op == "rollout"]
        assert len(rollouts) == want and {c.chunks for c in rollouts} == {want}


def test_a_pass_split_into_more_parts_than_sequences_is_refused(ppo, plan_by_hand):
    """A written plan splitting the reference pass over two blocks when a step has one
    response: no call of an empty part is laid out, the plan is refused naming the stage;
    with two responses each block's call gets one."""
    import attrs
    plan = plan_by_hand(ppo, {"ref_lp": (0, 1)}, chunks=1)
    plan = attrs.evolve(plan, placements=tuple(
        p.changed(dp=2) if p.stage == "ref_lp" else p for p in plan.placements))
    one = attrs.evolve(ppo, workload=attrs.evolve(ppo.workload, prompts=1, samples=1))
    with pytest.raises(PlanError, match="stage 'ref_lp' must split a step's 1 sequences"):
        build_calls(one, plan, steps=1)
    two = attrs.evolve(one, workload=attrs.evolve(one.workload, prompts=2))
    refs = [c for c in build_calls(two, plan, steps=1) if c.op == "ref_lp"]
    assert [(c.device, c.chunk, c.parts) for c in refs] == [(0, 0, 2), (1, 1, 2)]


@pytest.mark.parametrize("zero", [0, 3])
def test_every_call_id_names_the_call(ppo, zero):
    """An op call's id is its op, step and what tells it apart (chunk, rank, tp rank, a
    weight sync's role and loading device), read back as fields (``OpId``)."""
    import attrs

    from rpeg.graph.ids import OpId
    base = split_plan(ppo, 4, dp=4, chunks=4, staleness=1)    # trainers on 0-3
    plan = attrs.evolve(base, placements=tuple(
        p.changed(tp=2, dp=2, zero=zero) if p.stage.endswith("_step") else p
        for p in base.placements))
    calls = build_calls(ppo, plan, steps=3)
    assert {"export", "load"} <= {c.role for c in calls}
    assert any(c.id.tp_rank for c in calls if c.role == "export")
    for c in calls:
        i = c.id
        assert type(i) is OpId and OpId(str(i)) == i and i.step == c.step
        assert i.role == ("" if c.role == "join" else c.role) and i.join == (c.role == "join")
        if i.chunk is not None:
            assert i.chunk == c.chunk and c.kind is not OpKind.TRAIN
        if i.rank is not None:
            assert c.kind is OpKind.TRAIN and c.world > 1
        if not c.role:
            assert i.op == c.op
            assert i.tp_rank == (c.tp_group.index(c.device) if c.tp_group
                                 and c.kind is not OpKind.TRAIN else 0)
        if c.role in ("load", "recv"):
            assert i.device == c.device and i.op == f"sync_{c.model}"
