"""vLLM engines in the instance graph: their own copies of the model (disaggregated, or at
tp > 1), one instance per tensor-parallel block, and the weight sync into them as one gang
of send and receive calls (no export/load pair through Dask). No vLLM is needed here."""

from __future__ import annotations

import re
from pathlib import Path

import attrs
import pytest

from rpeg.runtime.core.choices import rebuildable
from rpeg.runtime.lowering.context import RunContext, WeightSync
from rpeg.runtime.lowering.instances import (
    EXPORT,
    LOAD,
    RECV,
    SEND,
    build_calls,
    by_id,
    graph_for,
    model_homes,
    placed_for,
)
from rpeg.runtime.placement import split_plan
from rpeg.runtime.verify import check
from rpeg.spec import load
from rpeg.spec.model import Engine

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


@pytest.fixture(scope="module")
def vgrpo(tmp_path_factory):
    """tiny_grpo on the tiny-vllm preset, generating with vLLM."""
    text = (PIPELINES / "tiny_grpo.rpeg").read_text()
    text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", text)
    text = re.sub(r"(stage rollout\s*=\s*generate\([^)]*)\)", r"\1, engine = vllm)", text)
    folder = tmp_path_factory.mktemp("spec")
    (folder / "g.rpeg").write_text(text)
    (folder / "rewards.py").write_text((PIPELINES / "rewards.py").read_text())
    return load(folder / "g.rpeg")


def _place(plan, stage, **changes):
    return attrs.evolve(plan, placements=tuple(
        p.changed(**changes) if p.stage == stage else p for p in plan.placements))


def test_a_disaggregated_engine_serves_its_own_copy_synced_by_collectives(vgrpo, run_through_core):
    plan = split_plan(vgrpo, 2, staleness=1)        # rollout on 0 (vLLM), actor trained on 1
    calls = build_calls(vgrpo, plan, steps=4)
    rollouts = [c for c in calls if c.op == "rollout"]
    assert {(c.model, c.device) for c in rollouts} == {("actor~vllm", 0)}
    assert [max(0, c.step - 1) for c in rollouts] == [c.version for c in rollouts]
    assert not [c for c in calls if c.role in (EXPORT, LOAD)]     # nothing through Dask
    table = by_id(calls)
    assert not [c for c in calls if c.op == "sync_actor" and c.step >= 2]   # v3: nobody reads
    for v in (1, 2):
        recv, send = table[f"sync_actor~vllm/s{v - 1}/recv@0"], table[f"sync_actor/s{v - 1}/send"]
        assert (recv.device, recv.model, recv.writes) == (0, "actor~vllm", v)
        assert (send.device, send.model, send.version) == (1, "actor", v)
        assert recv.tp_group == send.tp_group == (0, 1) and recv.collective
        # a gang: both wait for everything either waits for
        assert set(recv.all_deps) == set(send.all_deps)
        readers = [c.id for c in rollouts if c.version == v]
        assert readers and all(recv.id in table[r].after for r in readers)
    ctx = RunContext.create(vgrpo, plan, calls, run_dir=".")
    engine = next(r for r in ctx.replicas if r.model == "actor~vllm")
    assert engine.engine == (0,) and not engine.trainable
    assert ctx.syncs == (WeightSync("actor", (1,), ((0, 1),)),)
    assert ctx.syncs[0].world == 2 and ctx.syncs[0].first_rank(0) == 1
    run_through_core(calls, 4)


def test_a_tensor_parallel_engine_runs_one_instance_per_block(vgrpo, run_through_core):
    base = split_plan(vgrpo, 5, staleness=0)          # actor trained on 4
    plan = _place(base, "rollout", devices=(0, 1, 2, 3), dp=2, tp=2, chunks=4)
    calls = build_calls(vgrpo, plan, steps=2)
    rollouts = [c for c in calls if c.op == "rollout" and c.step == 0]
    assert [(c.chunk, c.device, c.tp_group, c.world) for c in rollouts] == [
        (0, 0, (), 2), (1, 2, (), 2), (2, 0, (), 2), (3, 2, (), 2)]
    ctx = RunContext.create(vgrpo, plan, calls, run_dir=".")
    blocks = {r.device: r.engine for r in ctx.replicas if r.model == "actor~vllm"}
    assert blocks == {0: (0, 1), 2: (2, 3)}
    sync = ctx.syncs[0]
    assert sync.engines == ((0, 2), (2, 2)) and sync.world == 5
    assert [sync.first_rank(h) for h in (0, 2)] == [1, 3]
    gang = [c for c in calls if c.op == "sync_actor" and c.step == 0]
    assert sorted((c.role, c.device) for c in gang) == [(RECV, 0), (RECV, 2), (SEND, 4)]
    run_through_core(calls, 2)


def test_an_engine_beside_its_unsplit_trainer_is_updated_in_memory(vgrpo):
    plan = _place(split_plan(vgrpo, 2, staleness=0), "rollout", devices=(1,))   # home: 1
    calls = build_calls(vgrpo, plan, steps=3)
    assert {c.model for c in calls if c.op == "rollout"} == {"actor"}
    assert not [c for c in calls if c.kind.value == "sync_weights"]
    assert RunContext.create(vgrpo, plan, calls, run_dir=".").syncs == ()


def test_an_engine_on_a_sending_device_is_loaded_in_process_never_through_the_group(
        vgrpo, run_through_core):
    # the trainer's device hosts a tp = 2 engine: its worker on device 0 and the trainer's
    # rank there would be two ranks of one process group on one GPU, which NCCL refuses;
    # the send loads it in process (CUDA IPC on a GPU) and its receive only follows
    plan = _place(split_plan(vgrpo, 2, staleness=0), "rollout", devices=(0, 1), tp=2)
    plan = _place(plan, "actor_step", devices=(0,))
    plan = attrs.evolve(plan, model_homes=(("actor", (0,)),))
    calls = build_calls(vgrpo, plan, steps=3)
    table = by_id(calls)
    recv, send = table["sync_actor~vllm/s0/recv@0"], table["sync_actor/s0/send"]
    assert recv.device == send.device == 0 and send.id in recv.after
    later = [c for c in calls if c.collective and c.device == 0 and c.step == 1
             and c.op == "sync_actor"]
    assert all(recv.id in c.after for c in later)         # the next gang waits for it
    ctx = RunContext.create(vgrpo, plan, calls, run_dir=".")
    assert ctx.syncs == (WeightSync("actor", (0,), (), local=(0,)),)
    assert ctx.syncs[0].world == 1                        # nobody else in the group
    run_through_core(calls, 3)


@pytest.mark.parametrize("zero", [2, 3])
def test_a_sharded_trainers_senders_are_every_device_holding_a_piece(vgrpo, zero):
    """ZeRO-2 keeps each tensor whole on every rank between ops: the first rank alone
    reads and sends. ZeRO-3 keeps shards: every rank enters each gather, so every rank
    sends (the first broadcasts); an engine on a sending device is loaded in process."""
    split = split_plan(vgrpo, 3, staleness=1)
    plan = _place(split, "actor_step", devices=(1, 2), dp=2, zero=zero)
    plan = _place(plan, "rollout", devices=(0,))
    plan = attrs.evolve(plan, model_homes=tuple(
        (m, (1, 2) if m == "actor" else d) for m, d in split.model_homes))
    calls = build_calls(vgrpo, plan, steps=4)
    sends = sorted({c.device for c in calls if c.role == SEND})
    assert sends == ([1] if zero == 2 else [1, 2])
    sync = RunContext.create(vgrpo, plan, calls, run_dir=".").syncs[0]
    assert sync.senders == tuple(sends) and sync.engines == ((0, 1),) and not sync.local
    shared = _place(plan, "rollout", devices=(2,))
    calls = build_calls(vgrpo, shared, steps=4)
    sync = RunContext.create(vgrpo, shared, calls, run_dir=".").syncs[0]
    if zero == 3:                                          # device 2 sends: in process
        assert (sync.engines, sync.local) == ((), (2,))
    else:                                                  # its own rank in the group
        assert (sync.engines, sync.local) == (((2, 1),), ())


def test_verify_places_a_receive_on_its_engine_and_checks_the_version_it_wrote(vgrpo):
    from rpeg.runtime.core.scheduler import submission_order
    plan = split_plan(vgrpo, 2, staleness=1)
    calls = build_calls(vgrpo, plan, steps=3)
    workers = {0: "tcp://a", 1: "tcp://b"}
    homes = model_homes(vgrpo, plan, graph_for(vgrpo, plan))
    table = by_id(calls)

    def trace(wrote):
        events, t = [], 0.0
        for op in submission_order(calls):
            c = table[op]
            events.append({"id": c.id, "step": c.step, "device": c.device,
                           "worker": workers[c.device], "start": t, "end": t + 1.0,
                           "version_read": c.version, "version_written": wrote(c)})
            t += 1.0
        return events
    placed = placed_for(vgrpo, plan)
    assert check(calls, plan, trace(lambda c: c.writes), workers, 3, homes, placed).ok
    bad = check(calls, plan, trace(lambda c: c.writes - (c.role == RECV)), workers, 3, homes,
                placed)
    assert {v.check for v in bad.violations} == {"version"}
    assert all(RECV in v.op for v in bad.violations)


def test_the_engine_copy_keeps_the_plans_engine(vgrpo):
    plan = split_plan(vgrpo, 2, staleness=1)
    assert plan.placement("rollout").engine is Engine.VLLM


def test_an_engine_beside_an_fsdp2_trainer_serves_its_own_copy(vgrpo):
    """vLLM at tp 1 on a home device of its model: updated in memory beside a DDP trainer
    (ZeRO 0), given a copy of its own beside an FSDP2 one (ZeRO 2 or 3), as the cost model's
    engine_copy says."""
    from rpeg.cost.engine_sync import engine_copy
    split = split_plan(vgrpo, 2, staleness=0)
    base = attrs.evolve(_place(split, "actor_step", devices=(0, 1), dp=2), model_homes=tuple(
        (m, (0, 1) if m == "actor" else d) for m, d in split.model_homes))
    for zero in (0, 2, 3):
        plan = _place(base, "actor_step", zero=zero)
        rollouts = {c.model for c in build_calls(vgrpo, plan, steps=2) if c.op == "rollout"}
        copy = engine_copy(plan.placement("actor_step"), plan.placement("rollout"))
        assert rollouts == ({"actor~vllm"} if zero else {"actor"}) and copy == bool(zero)


def test_an_in_process_run_syncs_the_generation_copy_from_its_trainer(ppo):
    """Generation on device 0, the actor trained on device 1: the in-process reference run
    copies each new version into the generator, so it learns step for step as the run on
    one device does (it generated from the initial weights, with KL 0, before)."""
    from rpeg.runtime.calibrate.inline import run_inline
    split = run_inline(ppo, split_plan(ppo, 2, staleness=0), steps=3)
    alone = run_inline(ppo, split_plan(ppo, 1, staleness=0), steps=3)
    keys = ("reward", "kl", "policy_loss", "value_loss")
    assert [[r[k] for k in keys] for r in split] == [[r[k] for k in keys] for r in alone]
    assert split[-1]["kl"] != 0.0


def test_an_in_process_run_refuses_a_collective_sync(vgrpo):
    from rpeg.errors import RuntimeFailure
    from rpeg.runtime.calibrate.inline import run_inline
    with pytest.raises(RuntimeFailure, match="vLLM engine's own copy"):
        run_inline(vgrpo, split_plan(vgrpo, 2, staleness=1), steps=3)


def test_a_checkpoint_asks_an_engine_copy_its_version_and_keeps_its_files(monkeypatch):
    """A vLLM engine's own copy holds no optimizer: the checkpoint reads it as a replica
    trained elsewhere and writes its files (its version and carried responses), never
    treating it as one rebuilt from the trained replica."""
    from types import SimpleNamespace

    from rpeg.runtime.dask import worker as W
    from rpeg.runtime.rundir import checkpoints as ckio
    from rpeg.spec import load
    pipeline = load(PIPELINES / "tiny_ppo.rpeg")
    trained = SimpleNamespace(version=3, optimizer=object())
    copy = SimpleNamespace(version=3)                         # an EngineReplica: no optimizer
    ex = SimpleNamespace(ctx=SimpleNamespace(pipeline=pipeline),
                         replicas={"actor": trained, "actor~vllm": copy},
                         carries=lambda model: False)
    monkeypatch.setitem(W._STATE, "executor", ex)
    monkeypatch.setitem(W._STATE, "device", 1)
    versions = ckio.replica_versions()
    assert versions["actor~vllm@1"] == (3, False, False, False)
    assert "actor~vllm@1" not in rebuildable(versions)


def test_a_copy_that_keeps_partial_rollouts_is_written_though_its_version_is_current():
    """A generator's copy at its trainer's version is rebuilt from the trainer's files,
    unless it keeps partial rollouts: only its own files hold those."""
    versions = {"actor@1": (3, True, False, False), "actor@0": (3, False, False, True),
                "critic@0": (3, False, False, False), "ref@1": (0, False, True, False)}
    assert rebuildable(versions) == {"ref@1"}
    assert rebuildable({**versions, "actor@0": (3, False, False, False)}) == \
        {"ref@1", "actor@0"}


def test_a_plan_whose_engine_shares_a_sender_it_is_not_hosted_on_is_refused(vgrpo):
    """The engine block (1, 0) shares device 0 with the trainer's sender but is hosted on 1:
    neither loaded in process nor a rank of its own in the group. Every command refuses the
    plan (``check_plan``), and the runtime's call builder does too."""
    from rpeg.errors import PlanError
    from rpeg.plan.validate import check_plan
    plan = _place(split_plan(vgrpo, 2, staleness=0), "rollout", devices=(1, 0), tp=2)
    plan = _place(plan, "actor_step", devices=(0,))
    plan = attrs.evolve(plan, model_homes=(("actor", (0,)),))
    with pytest.raises(PlanError, match="device of its own"):
        check_plan(plan, vgrpo, path="plan.json")
    with pytest.raises(PlanError, match="device of its own"):
        build_calls(vgrpo, plan, steps=3)


def test_every_copy_of_a_frozen_model_is_frozen(monkeypatch):
    """A frozen model's second copy on a device (``ref~tp0-1``, a reader splitting it
    another way) never changes either: a checkpoint rebuilds it rather than writing it, and
    a resume builds it again rather than looking for its files."""
    from types import SimpleNamespace

    from rpeg.runtime.dask import worker as W
    from rpeg.runtime.rundir import checkpoints as ckio
    from rpeg.spec import load
    pipeline = load(PIPELINES / "tiny_ppo.rpeg")
    frozen = {m.name for m in pipeline.models if m.frozen}
    assert ckio.of_frozen("ref~tp0-1", frozen) and ckio.of_frozen("ref", frozen)
    assert not ckio.of_frozen("actor~tp0-1", frozen) and not ckio.of_frozen("actor", frozen)
    ref, copy = SimpleNamespace(version=0), SimpleNamespace(version=0)
    ex = SimpleNamespace(ctx=SimpleNamespace(pipeline=pipeline),
                         replicas={"ref": ref, "ref~tp0-1": copy}, carries=lambda model: False,
                         restore=lambda model, path: pytest.fail(f"{model} read from {path}"))
    monkeypatch.setitem(W._STATE, "executor", ex)
    monkeypatch.setitem(W._STATE, "device", 2)
    versions = ckio.replica_versions()
    assert versions["ref~tp0-1@2"] == (0, False, True, False)
    assert rebuildable(versions) == {"ref@2", "ref~tp0-1@2"}
    assert ckio.restore_replicas({}) == {"ref": 0, "ref~tp0-1": 0}
