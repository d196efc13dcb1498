"""Tensor parallelism in the torch backend: the sharding plan on two real gloo ranks, and the
plan-time refusals and collective order of tensor-parallel op calls."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rpeg.errors import PlanError
from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.runtime.lowering.context import RunContext
from rpeg.runtime.lowering.instances import EXPORT, LOAD, build_calls
from rpeg.spec import load
from rpeg.spec.model import Engine
from tests.backends.ranks import free_port

MODELS = ("actor", "critic", "ref")
PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


@pytest.fixture(scope="module")
def ppo():
    return load(PIPELINES / "tiny_ppo.rpeg")


def tp_plan(pipeline, devs=(0, 1), tp=2, gen=None, homes=None, devices=2) -> Plan:
    """Model stages on ``devs`` with ``tp`` (generation on ``gen`` if given), the rest on 0."""
    places = []
    for s in pipeline.stages:
        kind = s.kind.value
        if s.target in MODELS and kind in ("generate", "forward", "train"):
            d, t = (gen, 1) if (gen is not None and s.target == "actor" and kind != "train") \
                else (devs, tp)
            if s.target == "ref" and gen is not None:
                d, t = gen, 1
            places.append(StagePlacement.of(s.name, d, dp=len(d) // t, tp=t,
                                         chunks=2 if kind == "generate" else 1))
        else:
            places.append(StagePlacement.of(s.name, (0,)))
    return Plan(pipeline.name, "test", devices, tuple(places),
                model_homes=tuple(sorted((homes or {"actor": devs, "critic": devs}).items())),
                staleness=tuple((st, 0) for st, _ in pipeline.staleness),
                strategy=Strategy.MANUAL)


def _with(plan, **changes):
    stage = changes.pop("stage")
    return attrs.evolve(plan, placements=tuple(
        p.changed(**changes) if p.stage == stage else p for p in plan.placements))


# --- plan time ----------------------------------------------------------------------------

def test_tp_ranks_run_every_instance_together_in_one_order_per_device(ppo):
    calls = build_calls(ppo, tp_plan(ppo), steps=2)
    ids = {c.id for c in calls}
    assert {"rollout/s0/c0", "rollout/s0/c0/t1", "actor_step/s0/r0", "actor_step/s0/r1"} <= ids
    by = {c.id: c for c in calls}
    assert by["rollout/s0/c0/t1"].device == 1 and by["rollout/s0/c0"].tp_group == (0, 1)
    assert by["actor_step/s0/r1"].rank == 0 and by["actor_step/s0/r1"].world == 1   # dp rank
    # readers take tp rank 0's output only
    assert by["ref_lp/s0/c0"].deps == ("rollout/s0/c0",)
    # both ranks see the same gangs in the same order, each after the previous one
    gangs = [c for c in calls if c.tp_group]
    order = {d: [] for d in (0, 1)}
    for c in _in_dependency_order(calls):
        if c.tp_group:
            order[c.device].append(c.id.removesuffix("/t1").replace("/r1", "/r0"))
    assert order[0] == order[1] and len(order[0]) == len(gangs) // 2
    for c in gangs:         # members wait for the same work: dependencies, earlier gangs
        mate = next(m for m in gangs if m.id != c.id and m.op == c.op and m.step == c.step
                    and m.chunk == c.chunk)
        assert set(c.all_deps) == set(mate.all_deps) and c.id not in mate.all_deps


def _in_dependency_order(calls):
    done, out, left = set(), [], list(calls)
    while left:
        ready = [c for c in left if set(c.all_deps) <= done]
        assert ready, "a dependency cycle"
        for c in ready:
            done.add(c.id)
            out.append(c)
        left = [c for c in left if c.id not in done]
    return out


def test_replica_layouts_follow_the_tp_groups(ppo):
    plan = tp_plan(ppo)
    ctx = RunContext.create(ppo, plan, build_calls(ppo, plan, 1), run_dir="")
    assert {(r.model, r.device): r.tp for r in ctx.replicas} == {
        (m, d): (0, 1) for m in MODELS for d in (0, 1)}
    assert {r.world for r in ctx.replicas if r.trainable} == {(0, 1)}
    assert ctx.needs_collectives


def test_a_tp_trainer_exports_from_each_rank_and_the_reader_joins_them(ppo):
    """Both tensor-parallel ranks gather each weight whole; the first broadcasts it to the
    reader on device 2: one collective of the three devices, no data through Dask."""
    plan = tp_plan(ppo, devs=(0, 1), gen=(2,), devices=3)
    calls = {c.id: c for c in build_calls(ppo, plan, steps=2)}
    exports = sorted(i for i, c in calls.items() if c.role == EXPORT and c.step == 0)
    assert exports == ["sync_actor/s0/export", "sync_actor/s0/export/t1"]
    load = calls["sync_actor/s0/load@2"]
    assert load.role == LOAD and load.deps == () and load.inputs == ()
    assert {calls[e].gang for e in exports} == {load.gang} == {(0, 1, 2)}
    assert load.sources == (0, 1) and load.collective


@pytest.mark.parametrize("change, match", [
    (dict(stage="ref_lp", devices=(0, 1, 2), dp=1, tp=3), "tp must divide the 4 attention"),
    (dict(stage="actor_step", devices=(0, 1), dp=1, tp=1, pp=2), "pp = 1"),
    (dict(stage="ref_lp", devices=(0, 1, 2), dp=1, tp=2), "dp x tp = 1 x 2 devices, not 3"),
    (dict(stage="rollout", engine=Engine.VLLM, devices=tuple(range(16)), dp=1, tp=16),
     "tp = 8 with engine = vllm"),
])
def test_degrees_the_backend_cannot_run_are_refused_at_plan_time(ppo, change, match):
    with pytest.raises(PlanError, match=match):
        build_calls(ppo, _with(tp_plan(ppo, devices=3), **change), steps=1)


def test_a_model_read_split_another_way_on_its_home_gets_a_resharded_copy(ppo):
    """Trained unsplit on device 0, generated at tp = 2 on devices 0-1: the generator reads
    a second copy, ``actor~tp0-1``, loaded by weight sync like a replica elsewhere."""
    plan = _with(tp_plan(ppo), stage="actor_step", devices=(0,), dp=1, tp=1)
    plan = attrs.evolve(plan, model_homes=(("actor", (0,)), ("critic", (0, 1))))
    calls = {c.id: c for c in build_calls(ppo, plan, steps=2)}
    assert calls["rollout/s1/c0"].model == "actor~tp0-1"
    assert calls["actor_step/s0"].model == "actor"
    loads = sorted(i for i, c in calls.items() if c.role == LOAD)
    assert loads == ["sync_actor~tp0-1/s0/load@0", "sync_actor~tp0-1/s0/load@1"]
    assert "sync_actor~tp0-1/s0/load@0" in calls["rollout/s1/c0"].after
    ctx = RunContext.create(ppo, plan, tuple(calls.values()), run_dir="")
    copies = {(r.model, r.device): (r.tp, r.trainable) for r in ctx.replicas
              if r.model.startswith("actor")}
    assert copies == {("actor", 0): ((), True), ("actor~tp0-1", 0): ((0, 1), False),
                      ("actor~tp0-1", 1): ((0, 1), False)}


# --- the sharding plan on two real ranks ---------------------------------------------------


LR = 1e-3
EPS32 = 2.0 ** -23          # float32's machine epsilon
# Adam's first step and this test's check of it round about eight times each (moments,
# bias corrections, square root, division, the update of p), each by at most half an ulp
# of the step (at most lr) or of p: 16 ulps of |p| + lr bound their difference.
ADAM_ROUNDINGS = 16


def _whole(t):
    """A parameter or gradient as one tensor (a DTensor gathered: both ranks call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rank(rank: int, port: int, tmp: str, q) -> None:
    import numpy as np
    import torch

    from backends.torch_backend import distributed as D
    from backends.torch_backend.modeling import build_model, load_checkpoint, save_checkpoint
    from backends.torch_backend.train import Packed, TokenHeads, token_outputs
    from rpeg.spec.presets import PRESETS

    torch.set_num_threads(1)
    D.init_world(rank, 2, f"tcp://127.0.0.1:{port}", [(0, 1)])
    model = build_model(PRESETS["tiny"], heads=("lm", "value"), seed=0)
    whole = build_model(PRESETS["tiny"], heads=("lm", "value"), seed=0)
    D.shard_tp(model, (0, 1), "cpu")
    out = {}
    attn = model.backbone.layers[0].self_attn
    out["shapes"] = [tuple(attn.q_proj.weight.to_local().shape),
                     tuple(attn.k_proj.weight.to_local().shape),
                     tuple(attn.o_proj.weight.to_local().shape),
                     tuple(model.backbone.layers[0].mlp.down_proj.weight.to_local().shape),
                     tuple(model.backbone.embed_tokens.weight.to_local().shape),
                     tuple(model.lm_head.weight.to_local().shape)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=5) for _ in range(3)]
    responses = [rng.integers(3, 250, size=n) for n in (4, 2, 6)]
    packed = Packed.build(prompts, responses)
    opts = [torch.optim.Adam(m.parameters(), lr=LR) for m in (model, whole)]
    norms, grads, before, heads_out = [], [], [], []
    for m, opt in zip((model, whole), opts, strict=True):
        lp, ent, v = token_outputs(TokenHeads(m), packed, temperature=0.7)
        heads_out.append((lp.detach(), ent.detach()))
        (-(lp * packed.resp_mask).sum() - 0.1 * (ent * packed.resp_mask).sum()
         + (v ** 2).sum()).backward()
        norms.append(float(D.clip_grad_norm(list(m.parameters()), 0.5)))
        grads.append({k: _whole(p.grad).clone() for k, p in m.named_parameters()
                      if p.grad is not None})
        before.append({k: _whole(p).detach().clone() for k, p in m.named_parameters()
                       if p.grad is not None})
        opt.step()
    out["norms"] = norms
    # log-probabilities and entropies reduced over the vocabulary's two halves, against the
    # whole vocabulary's: a sum of at most vocab terms, each rounded once more
    out["head_err"] = max(float((a - b).abs().max() / b.abs().max().clamp(min=1.0))
                          for a, b in zip(*heads_out, strict=True))
    out["head_tol"] = PRESETS["tiny"].vocab * EPS32
    out["tied"] = _tied_split_trains_as_whole(packed)
    # The split model's gradients equal the whole one's up to float32 summation order: each
    # element accumulates at most tokens x (ffn + hidden) products per layer.
    dims = PRESETS["tiny"]
    terms = int(packed.mask.sum()) * (dims.ffn + dims.hidden) * dims.layers
    out["grad_tol"] = terms * EPS32
    scale = max(float(g.abs().max()) for g in grads[1].values())
    out["grad_err"] = max(float((grads[0][k] - grads[1][k]).abs().max()) for k in grads[1]) \
        / scale
    # Each shard takes Adam's first step from its own gradient: p - lr g / (|g| + eps), up
    # to a few roundings of p and of the step (no BLAS in it, so no CPU dependence).
    full = D.full_state(model)
    eps = opts[0].defaults["eps"]
    err = 0.0
    for k, p0 in before[0].items():
        g = grads[0][k]
        want = p0 - LR * g / (g.abs() + eps)
        err = max(err, float(((full[k] - want).abs() / (p0.abs() + LR)).max()))
    out["update_err"] = err
    # shards joined without a collective equal the gathered whole
    q.put((rank, "pieces", {k: (t.numpy(), d) for k, (t, d) in D.shard_state(model).items()}))
    save_checkpoint(model, f"{tmp}/tp{rank}", {"version": 1}, opts[0])
    fresh = build_model(PRESETS["tiny"], heads=("lm", "value"), seed=5)
    load_checkpoint(fresh, f"{tmp}/tp{rank}")             # whole tensors: loads unsplit
    out["ckpt_diff"] = max(float((fresh.state_dict()[k] - full[k]).abs().max()) for k in full)
    back = build_model(PRESETS["tiny"], heads=("lm", "value"), seed=5)
    D.shard_tp(back, (0, 1), "cpu")
    opt = torch.optim.Adam(back.parameters(), lr=1e-3)
    load_checkpoint(back, f"{tmp}/tp{rank}", opt)         # ... and split again
    again = D.full_state(back)
    out["resplit_diff"] = max(float((again[k] - full[k]).abs().max()) for k in full)
    out["moments"] = sum(1 for st in opt.state.values() if D.is_sharded(st["exp_avg"]))
    q.put((rank, "out", out))
    D.shutdown_world()


def _tied_split_trains_as_whole(packed) -> dict:
    """Tied embeddings split over the vocabulary stay one tensor, and its gradient (lookup
    and head together) is the whole model's."""
    import attrs

    from backends.torch_backend import distributed as D
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.train import TokenHeads, token_outputs
    from rpeg.spec.presets import PRESETS

    dims = attrs.evolve(PRESETS["tiny"], tied_embeddings=True)
    split, whole = (build_model(dims, heads=("lm",), seed=0) for _ in range(2))
    D.shard_tp(split, (0, 1), "cpu")
    grads = []
    for m in (split, whole):
        lp, _, _ = token_outputs(TokenHeads(m), packed)
        (-(lp * packed.resp_mask).sum()).backward()
        grads.append(_whole(m.lm_head.weight.grad))
    scale = float(grads[1].abs().max())
    return {"one_tensor": split.lm_head.weight is split.backbone.embed_tokens.weight,
            "err": float((grads[0] - grads[1]).abs().max()) / scale,
            "tol": int(packed.mask.sum()) * (dims.ffn + dims.hidden) * dims.layers * EPS32}


def test_the_sharding_plan_on_two_gloo_ranks(tmp_path):
    import multiprocessing as mp

    import numpy as np

    from backends.torch_backend.distributed import join_shards

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp_path), q)) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    for _ in range(4):
        rank, what, value = q.get(timeout=600)        # a hang guard, not a speed target
        got[(rank, what)] = value
    for p in procs:
        p.join(timeout=30)
    out = got[(0, "out")]
    # tiny: 4 heads of 16, 2 KV heads, ffn 128 -> each rank 2 heads, 1 KV head, half the MLP
    # ... and the vocabulary's 259 rows split 130 + 129 (torch.chunk), embeddings and head
    assert out["shapes"] == [(32, 64), (16, 64), (64, 32), (64, 64), (130, 64), (130, 64)]
    assert out["head_err"] <= out["head_tol"], out
    tied = out["tied"]
    assert tied["one_tensor"] and tied["err"] <= tied["tol"], tied
    assert out["grad_err"] <= out["grad_tol"], out
    assert out["norms"][0] == pytest.approx(out["norms"][1], rel=out["grad_tol"])
    assert out["update_err"] <= ADAM_ROUNDINGS * EPS32, out
    assert out["ckpt_diff"] == 0.0 and out["resplit_diff"] == 0.0 and out["moments"] > 0
    import torch
    a, b = got[(0, "pieces")], got[(1, "pieces")]
    q_proj = "backbone.layers.0.self_attn.q_proj.weight"
    assert a[q_proj][1] == 0 and a["backbone.norm.weight"][1] is None
    joined = join_shards([(torch.as_tensor(a[q_proj][0]), 0), (torch.as_tensor(b[q_proj][0]), 0)])
    assert joined.shape == (64, 64) and not np.allclose(a[q_proj][0], b[q_proj][0])


def test_rpeg_run_refuses_a_plan_file_with_an_unsplittable_tp_before_any_worker(ppo, tmp_path,
                                                                                capsys):
    from rpeg.cli import main
    plan = _with(tp_plan(ppo, devices=3), stage="ref_lp", devices=(0, 1, 2), dp=1, tp=3)
    plan.save(tmp_path / "plan.json")
    code = main(["run", str(tmp_path / "plan.json"), "--spec", str(ppo.path), "--steps", "1",
                 "--no-progress", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 1 and "tp must divide the 4 attention heads of model 'ref', not 3" in err
    assert "dashboard" not in err and not (tmp_path / "run").exists()
