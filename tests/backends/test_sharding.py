"""Training layouts on two real gloo ranks: FSDP2 (ZeRO-2, ZeRO-3) against DDP, activation
recomputation, optimizer offload, packed sequences, tensor against data parallelism, 16-bit
weights with float32 master weights, and a sharded checkpoint's round trip.

Every layout trains the same tiny model on the same batch for ``STEPS`` Adam steps; the
runs differ only in how the arithmetic is laid out, so they agree up to float rounding.
The bound on the weights after the steps follows from what differs (see ``adam_bound``):
a relative perturbation ``delta`` of every gradient — from summing in another order, or
from rounding gradients to bfloat16 before reducing them — changes each Adam update
``m / (sqrt(v) + eps)`` by at most about ``|u| delta`` with ``|u| <= 1 / (1 - beta1)``
in the first steps, so each weight by at most ``lr * 10 * delta`` a step, plus a few
roundings of the weight itself.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.ranks import free_port

STEPS = 3
LR = 1e-3
EPS32 = 2.0 ** -23
EPS_BF16 = 2.0 ** -8
WORLD = 2


def adam_bound(delta: float, scale: float) -> float:
    """Largest difference of a weight of magnitude ``scale`` after ``STEPS`` Adam steps whose
    gradients differ by a relative ``delta`` (module doc): ``1 / (1 - beta1) = 10``."""
    return STEPS * (LR * 10 * delta + 16 * EPS32 * scale)


LAYOUTS = {
    # name: (zero, tp, recompute, offload, packed, dtype, minibatches)
    "ddp": (0, (), False, False, False, "fp32", 2),
    "zero2": (2, (), False, False, False, "fp32", 2),
    "zero3": (3, (), False, False, False, "fp32", 2),
    "zero3+recompute": (3, (), True, False, False, "fp32", 2),
    "zero3+offload": (3, (), False, True, False, "fp32", 2),
    "ddp+offload": (0, (), False, True, False, "fp32", 2),
    "zero3+packed": (3, (), False, False, True, "fp32", 2),
    "ddp+packed": (0, (), False, False, True, "fp32", 2),
    # one minibatch: ranks that split the batch and ranks that each train all of it (tp)
    # then take the same optimizer steps
    "ddp/1": (0, (), False, False, False, "fp32", 1),
    "tp2/1": (0, (0, 1), False, False, False, "fp32", 1),
    "ddp+bf16": (0, (), False, False, False, "bf16", 2),
    "zero3+bf16": (3, (), False, False, False, "bf16", 2),
}


def _batch():
    from backends.torch_backend.train import TrainBatch
    rng = np.random.default_rng(0)
    lengths = [2, 9, 4, 7, 3, 8, 5, 6]
    prompts = tuple(rng.integers(3, 250, 6) for _ in lengths)
    responses = tuple(rng.integers(3, 250, n) for n in lengths)
    return TrainBatch(prompts, responses,
                      old_logprobs=tuple(np.full(n, -5.5, np.float32) for n in lengths),
                      advantages=tuple(rng.standard_normal(n).astype(np.float32)
                                       for n in lengths),
                      returns=tuple(rng.standard_normal(n).astype(np.float32) for n in lengths))


def _rank(rank: int, port: int, tmp: str, q) -> None:
    import torch

    from backends.torch_backend import distributed as D
    from backends.torch_backend.modeling import build_model, load_checkpoint, save_checkpoint
    from backends.torch_backend.sharding import DTYPES, Trained, TrainLayout, state_tensors
    from backends.torch_backend.state import gathered
    from backends.torch_backend.train import LossSpec, TokenHeads, train_step
    from rpeg.spec.model import Head, Model, Optimizer
    from rpeg.spec.presets import PRESETS

    torch.set_num_threads(1)
    D.init_world(rank, WORLD, f"tcp://127.0.0.1:{port}", [(0, 1), (0,), (1,)])
    dims = PRESETS["tiny"]
    members = [Model("actor", "tiny", dims, optimizer=Optimizer("adam", lr=LR)),
               Model("critic", "tiny", dims, head=Head.VALUE, optimizer=Optimizer("adam", lr=LR))]
    batch = _batch()
    losses = [LossSpec("ppo_clip", clip=0.2), LossSpec("value_mse", clip=0.0, coef=0.5)]
    out = {}

    def build(zero, tp, recompute, offload, dtype):
        layout = TrainLayout.of((0, 1), tp, zero=zero, recompute=recompute, offload=offload)
        # as the runtime builds it (backends.torch_backend.replica): where the ranks split
        # it, shapes alone but on the first rank, which holds the whole weights
        split = layout.fsdp or len(tp) > 1
        model = build_model(dims, heads=("lm", "value"), seed=0,
                            device="meta" if split else "cpu")
        whole = build_model(dims, heads=("lm", "value"), seed=0) \
            if split and rank == 0 else None
        return Trained.build(model, TokenHeads(model), members, layout, device="cpu",
                             dtype=DTYPES[dtype], master=True, device_index=rank, whole=whole)

    for name, (zero, tp, recompute, offload, packed, dtype, mb) in LAYOUTS.items():
        trained = build(zero, tp, recompute, offload, dtype)
        dp = WORLD // max(len(tp), 1)
        seen = []
        for step in range(STEPS):
            trained.before_step()
            stats = train_step(trained.heads, trained.optimizer, batch, losses, version=0,
                               minibatches=mb, microbatches=2, seed=step, grad_clip=1.0,
                               rank=rank % dp if dp > 1 else 0, world=dp, packed=packed)
            trained.after_step()
            seen.append(stats["loss"])
            if offload and step == 0:        # between ops the state is in host memory
                out[name + ":freed"] = all(t.to_local().untyped_storage().nbytes() == 0
                                           if hasattr(t, "to_local") else
                                           t.untyped_storage().nbytes() == 0
                                           for t in state_tensors(trained.optimizer))
                trained.offload.bring_in()
                trained.offload.send_out()
        state = gathered(trained)
        out[name] = (seen, {k: v.numpy() for k, v in state.items() if "::" not in k})
        if name == "zero3+bf16":             # a sharded checkpoint: saved whole, loaded again
            save_checkpoint(trained.model, f"{tmp}/ckpt{rank}", {"version": 3},
                            trained.optimizer, whole=state)
            again = build(zero, tp, recompute, offload, dtype)
            again.unsettle()
            load_checkpoint(again.model, f"{tmp}/ckpt{rank}", again.optimizer)
            again.settle()
            back = gathered(again)
            out["ckpt_diff"] = max(float((back[k] - state[k]).abs().max()) for k in state)
    if rank == 0:
        q.put(out)
    D.shutdown_world()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    tmp = tmp_path_factory.mktemp("sharding")
    procs = [ctx.Process(target=_rank, args=(r, port, str(tmp), q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = q.get(timeout=900)                  # a hang guard, not a speed target
    for p in procs:
        p.join(timeout=60)
    return out


def _compare(runs, a: str, b: str, delta: float, losses: bool = True):
    (la, wa), (lb, wb) = runs[a], runs[b]
    assert set(wa) == set(wb)
    scale = max(float(np.abs(w).max()) for w in wb.values())
    worst = max(float(np.abs(wa[k] - wb[k]).max()) for k in wb)
    assert worst <= adam_bound(delta, scale), (a, b, worst, adam_bound(delta, scale))
    if losses:    # the first step's loss: the same forward on the same weights
        assert la[0] == pytest.approx(lb[0], rel=delta + 1e-6)
    return worst


def _terms() -> int:
    """Products one gradient element of the tiny model sums (tokens x (ffn + hidden) x
    layers): the float32 summation-order bound's factor."""
    from rpeg.spec.presets import PRESETS
    d = PRESETS["tiny"]
    tokens = sum(6 + n for n in [2, 9, 4, 7, 3, 8, 5, 6])
    return tokens * (d.ffn + d.hidden) * d.layers


@pytest.mark.parametrize("layout", ["zero2", "zero3", "ddp+offload", "ddp+packed"])
def test_layouts_train_as_ddp_does(runs, layout):
    """FSDP2 at ZeRO-2 and ZeRO-3, offload and packing: the DDP run's losses and weights."""
    _compare(runs, layout, "ddp", _terms() * EPS32)


@pytest.mark.parametrize("layout", ["zero3+recompute", "zero3+offload", "zero3+packed"])
def test_zero3_variants_train_as_zero3_does(runs, layout):
    """Recomputation, offload and packing under FSDP2 change where the arithmetic happens,
    not what it computes."""
    _compare(runs, layout, "zero3", _terms() * EPS32)


def test_tensor_parallel_trains_as_data_parallel_does(runs):
    """The same two ranks splitting the model (tp = 2) or the batch (dp = 2): the same
    updates (each rank reports the loss of the tokens it trained on, so those differ)."""
    _compare(runs, "tp2/1", "ddp/1", _terms() * EPS32, losses=False)


def test_bf16_with_float32_master_weights_under_fsdp2_and_ddp(runs):
    """16-bit weights, float32 masters. FSDP2 and DDP both reduce gradients in bfloat16
    (rpeg.cost.memory.grad_reduce_bytes), in different orders and buckets;
    where the ranks' gradients nearly cancel, the rounded sum can change an update's sign,
    so the runs agree within Adam's largest step (``lr (1 - beta1) / sqrt(1 - beta2)``, the
    Adam paper's bound, twice, per step). What they keep are float32 masters: updates finer
    than bfloat16's resolution accumulate, which 16-bit weights alone would round away."""
    import torch
    adam_step = LR * 0.1 / 0.001 ** 0.5
    for name in ("zero3+bf16", "ddp+bf16"):
        seen, weights = runs[name]
        other = runs["ddp+bf16" if name == "zero3+bf16" else "zero3+bf16"][1]
        worst = max(float(np.abs(weights[k] - other[k]).max()) for k in weights)
        assert worst <= STEPS * 2 * adam_step
        finer = sum(int((torch.from_numpy(w).bfloat16().float().numpy() != w).sum())
                    for w in weights.values())
        assert finer > 0, name                 # masters hold bits bfloat16 does not
        assert seen[0] == pytest.approx(runs["ddp"][0][0], rel=0.05)   # near float32's


def test_offloaded_optimizer_state_leaves_the_device_between_ops(runs):
    assert runs["ddp+offload:freed"] and runs["zero3+offload:freed"]


def test_a_sharded_checkpoint_round_trips_exactly(runs):
    assert runs["ckpt_diff"] == 0.0


# --- a 2-D mesh: four ranks ------------------------------------------------------------------

def _mesh_rank(rank: int, port: int, q) -> None:
    """dp 2 x tp 2 under FSDP2 (ZeRO-3 over dp, the tensor-parallel split over tp) against
    dp 2 alone, on the same four ranks (the dp-alone run on ranks 0 and 2's halves)."""
    import torch

    from backends.torch_backend import distributed as D
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.sharding import Trained, TrainLayout
    from backends.torch_backend.state import gathered
    from backends.torch_backend.train import LossSpec, TokenHeads, train_step
    from rpeg.spec.model import Model, Optimizer
    from rpeg.spec.presets import PRESETS

    torch.set_num_threads(1)
    # the groups the runtime makes for both (rpeg.cost.passes.train_groups)
    D.init_world(rank, 4, f"tcp://127.0.0.1:{port}",
                 [(0, 1), (0, 1, 2, 3), (0, 2), (1, 3), (2, 3)])
    dims = PRESETS["tiny"]
    members = [Model("actor", "tiny", dims, optimizer=Optimizer("adam", lr=LR))]
    out = {}
    for name, world, tp in (("dp2xtp2", (0, 1, 2, 3), (0, 1) if rank < 2 else (2, 3)),
                            ("dp2", (0, 2) if rank % 2 == 0 else (1, 3), ())):
        # as the runtime builds it: shapes alone but on the world's first rank
        model = build_model(dims, heads=("lm",), seed=0, device="meta")
        whole = build_model(dims, heads=("lm",), seed=0) if rank == world[0] else None
        trained = Trained.build(model, TokenHeads(model), members,
                                TrainLayout.of(world, tp, zero=3), device="cpu",
                                dtype=torch.float32, master=True, device_index=rank,
                                whole=whole)
        dp_rank = rank // 2 if tp else world.index(rank)
        for step in range(STEPS):
            trained.before_step()
            train_step(trained.heads, trained.optimizer, _batch(), [LossSpec("ppo_clip")],
                       version=0, minibatches=1, microbatches=2, seed=step, rank=dp_rank,
                       world=2)
            if step == 0:       # the first update's gradients, whole (a collective)
                out[name + ":grads"] = {
                    k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                        ).numpy() for k, p in trained.model.named_parameters()}
            trained.after_step()
        out[name] = {k: v.numpy() for k, v in gathered(trained).items() if "::" not in k}
    if rank == 0:
        q.put(out)
    D.shutdown_world()


@pytest.mark.slow
def test_a_dp_by_tp_mesh_trains_as_dp_alone():
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_mesh_rank, args=(r, port, q)) for r in range(4)]
    for p in procs:
        p.start()
    out = q.get(timeout=1800)                 # a hang guard, not a speed target
    for p in procs:
        p.join(timeout=60)
    # The first update's gradients agree to float32 summation order: dp x tp sums each
    # element's products in another order (split matmuls, vocabulary-split log-softmax).
    got, want = out["dp2xtp2:grads"], out["dp2:grads"]
    scale = max(float(np.abs(g).max()) for g in want.values())
    worst = max(float(np.abs(got[k] - want[k]).max()) for k in want)
    assert worst <= _terms() * EPS32 * scale, (worst, scale)
    # The weights after the steps: within Adam's largest step (``lr (1 - beta1) /
    # sqrt(1 - beta2)``), twice, per step. No tighter bound holds: rounding is relative to
    # an element's summed products, not to the element, so a gradient that nearly cancels
    # can change sign between the layouts, and Adam's normalised update turns that sign
    # into a whole step the other way.
    worst = max(float(np.abs(out["dp2xtp2"][k] - out["dp2"][k]).max()) for k in out["dp2"])
    assert worst <= STEPS * 2 * LR * 0.1 / 0.001 ** 0.5, worst
