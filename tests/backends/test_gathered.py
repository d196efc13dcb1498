"""A forward pass on a trainer's ZeRO-3 shards, read in place (``backends.torch_backend.
gathered``), on two real gloo ranks: each rank runs its share with the trainer's FSDP2
module, and every rank gets what a whole copy of the trainer's current weights computes,
before and after a train step, with more responses and micro-batches on one rank than on
the other (the short rank's extra passes keep the layers' all-gathers paired)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.backends.ranks import free_port
from tests.backends.test_sharding import EPS32, LR, WORLD, _batch

pytestmark = pytest.mark.slow

LENGTHS = [2, 9, 4, 7, 3]       # five responses: three on one rank (three passes), two (two)


def _terms() -> int:
    """Products one output of the tiny model sums (tokens x (ffn + hidden) x layers): the
    float32 summation-order bound's factor (a whole pass against a share's)."""
    from rpeg.spec.presets import PRESETS
    d = PRESETS["tiny"]
    return max(6 + n for n in LENGTHS) * (d.ffn + d.hidden) * d.layers


def _rank(rank: int, port: int, q) -> None:
    import torch

    from backends.torch_backend import distributed as D
    from backends.torch_backend.gathered import forward_on_shards
    from backends.torch_backend.modeling import build_model
    from backends.torch_backend.sharding import Trained, TrainLayout
    from backends.torch_backend.state import gathered
    from backends.torch_backend.train import LossSpec, TokenHeads, forward_arrays, train_step
    from rpeg.spec.model import Head, Model, Optimizer
    from rpeg.spec.presets import PRESETS

    torch.set_num_threads(1)
    D.init_world(rank, WORLD, f"tcp://127.0.0.1:{port}", [(0, 1), (0,), (1,)])
    dims = PRESETS["tiny"]
    members = [Model("actor", "tiny", dims, optimizer=Optimizer("adam", lr=LR)),
               Model("critic", "tiny", dims, head=Head.VALUE, optimizer=Optimizer("adam", lr=LR))]
    model = build_model(dims, heads=("lm", "value"), seed=0)
    trained = Trained.build(model, TokenHeads(model), members, TrainLayout.of((0, 1), zero=3),
                            device="cpu", dtype=torch.float32, master=True, device_index=rank)
    batch = _batch()
    prompts, responses = batch.prompt_ids[:len(LENGTHS)], batch.response_ids[:len(LENGTHS)]
    out = {}
    for step in range(2):
        for what in ("logprobs", "values"):
            mine = forward_on_shards(trained, prompts, responses, what, rank=rank,
                                     world=WORLD, microbatches=3)
            whole = build_model(dims, heads=("lm", "value"), seed=1)   # other weights first
            state = {k: v for k, v in gathered(trained).items() if "::" not in k}
            whole.load_state_dict(state)
            want = forward_arrays(whole, prompts, responses, what)
            out[(step, what)] = ([np.asarray(a) for a in mine], [np.asarray(a) for a in want])
        trained.before_step()
        train_step(trained.heads, trained.optimizer, batch, [LossSpec("ppo_clip", clip=0.2),
                   LossSpec("value_mse", clip=0.0, coef=0.5)], version=0, minibatches=1,
                   microbatches=2, seed=step, rank=rank, world=WORLD)
        trained.after_step()
    q.put((rank, out))
    D.shutdown_world()


@pytest.fixture(scope="module")
def outputs():
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=600) for _ in procs)   # a hang guard, not a speed target
    for p in procs:
        p.join(timeout=60)
    return got


@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("what", ["logprobs", "values"])
def test_every_rank_reads_the_trainers_current_weights(outputs, step, what):
    for rank in range(WORLD):
        mine, want = outputs[rank][(step, what)]
        assert [len(a) for a in mine] == LENGTHS
        scale = max(float(np.abs(a).max()) for a in want)
        for a, b in zip(mine, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=_terms() * EPS32 * max(scale, 1.0))


def test_the_weights_read_change_with_the_train_step(outputs):
    """The pass after the step reads the new weights: not the ones it read before."""
    before, _ = outputs[0][(0, "logprobs")]
    after, _ = outputs[0][(1, "logprobs")]
    assert max(float(np.abs(a - b).max()) for a, b in zip(before, after, strict=True)) \
        > 100 * _terms() * EPS32
