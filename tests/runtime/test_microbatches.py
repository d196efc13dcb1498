"""Micro-batches: a minibatch as several forward/backward passes with gradients accumulated
gives the update of one pass (up to float rounding), for the policy and the value loss."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from backends.torch_backend.modeling import build_model  # noqa: E402
from backends.torch_backend.train import LossSpec, TokenHeads, TrainBatch, train_step  # noqa: E402
from rpeg.spec.presets import PRESETS  # noqa: E402


def _batch(n: int = 6, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    prompts = tuple(tuple(int(x) for x in rng.integers(3, 60, 5)) for _ in range(n))
    lengths = [int(x) for x in rng.integers(1, 9, n)]          # ragged: unequal token counts
    responses = tuple(tuple(int(x) for x in rng.integers(3, 60, k)) for k in lengths)
    per_token = lambda scale: tuple(rng.normal(0, scale, k).astype(np.float32)  # noqa: E731
                                    for k in lengths)
    return TrainBatch(prompts, responses, old_logprobs=tuple(-np.abs(x) - 1.0
                                                             for x in per_token(1.0)),
                      advantages=per_token(1.0), returns=per_token(1.0),
                      old_values=per_token(0.1), ref_logprobs=tuple(-np.abs(x) - 1.0
                                                                    for x in per_token(1.0)))


def _step(microbatches: int, minibatches: int) -> tuple[list, dict]:
    torch.manual_seed(0)
    model = build_model(PRESETS["tiny"], heads=("lm", "value"), seed=0)
    heads = TokenHeads(model)
    # plain SGD with lr 1: each parameter moves by its (clipped) gradient, so the comparison
    # is of gradients (Adam would divide near-zero gradients by near-zero scales)
    opt = torch.optim.SGD([p for p in heads.parameters() if p.requires_grad], lr=1.0)
    losses = [LossSpec("ppo_clip", clip=0.2), LossSpec("value_mse", clip=0.2, coef=0.5)]
    passes = []
    heads.register_forward_hook(lambda mod, args, out: passes.append(args[0].shape[0]))
    stats = train_step(heads, opt, _batch(), losses, version=0, minibatches=minibatches,
                       microbatches=microbatches)
    # one forward pass per micro-batch, over a share of the rows
    assert len(passes) == minibatches * microbatches and sum(passes) == 6
    return [p.detach().clone() for p in heads.parameters()], stats


@pytest.mark.parametrize("minibatches", [1, 2])
def test_two_microbatches_give_the_one_pass_update(minibatches):
    one, s1 = _step(1, minibatches)
    two, s2 = _step(2, minibatches)
    three, _ = _step(3, minibatches)
    moved = max(float((a - b).abs().max()) for a, b in zip(one, _step(1, minibatches)[0],
                                                           strict=True))
    assert moved == 0.0                                           # deterministic
    for other in (two, three):
        for a, b in zip(one, other, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    for key in ("loss", "policy_loss", "value_loss", "clip_frac", "entropy", "grad_norm"):
        assert s2[key] == pytest.approx(s1[key], rel=1e-5, abs=1e-6), key
