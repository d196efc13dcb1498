"""Each loss and knob against values worked out by hand; micro-batching never changes a step.

Per-token tensors are [B, T] with a response mask; the comments show the arithmetic.
Tolerances are float32 rounding of numbers of order 1."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backends.torch_backend.losses import (
    AGGREGATIONS,
    LossSpec,
    Norm,
    adapt_kl,
    compute_loss,
)
from rpeg.spec.values import Fn

TOL = 1e-6
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])        # two responses: 2 tokens and 1
NORM = Norm(tokens=3, seqs=2, budget=4)


def tensors(ratio, adv, **extra):
    """old logprobs 0, current logprobs log(ratio): the importance ratios are ``ratio``."""
    lp = torch.log(torch.tensor(ratio, dtype=torch.float32))
    t = {"old_logprobs": torch.zeros_like(lp), "advantages": torch.tensor(adv)}
    t.update({k: torch.tensor(v) for k, v in extra.items()})
    return lp, t


def loss_value(spec: LossSpec, lp, t, ent=None, values=None, norm=NORM) -> tuple[float, dict]:
    ent = torch.zeros_like(lp) if ent is None else ent
    value, stats = compute_loss(spec, lp, ent, values, MASK, t, norm)
    return float(value), {k: float(v) for k, v in stats.items()}


# ratios 1.5 and 0.5 (advantage 1), 1.1 (advantage -1); clip 0.2:
# min(1.5, 1.2) = 1.2, min(0.5, 0.5) = 0.5, min(-1.1, -1.1) = -1.1
RATIO, ADV = [[1.5, 0.5], [1.1, 1.0]], [[1.0, 1.0], [-1.0, 0.0]]


@pytest.mark.parametrize(("agg", "want"), [
    ("token_mean", -(1.2 + 0.5 - 1.1) / 3),                  # over the 3 tokens
    ("seq_mean_token_mean", -((1.2 + 0.5) / 2 - 1.1) / 2),   # per response, then over 2
    ("seq_mean_token_sum", -(1.2 + 0.5 - 1.1) / (2 * 4)),    # sums over 2 x budget 4
])
def test_ppo_clip_aggregations(agg, want):
    value, stats = loss_value(LossSpec("ppo_clip", agg=agg), *tensors(RATIO, ADV))
    assert value == pytest.approx(want, abs=TOL)
    # clip_frac counts the tokens where the clip binds: 1.5 with advantage 1 (0.5 is below
    # the band with a positive advantage: its unclipped term is the smaller), 1 of 3
    assert stats["clip_frac"] == pytest.approx(1 / 3, abs=TOL)


@pytest.mark.parametrize(("counts", "want"), [("binding", 2 / 4), ("outside", 4 / 4)])
def test_clip_frac_counts_where_the_clip_binds_or_every_ratio_outside(counts, want):
    """Four ratios outside [0.8, 1.2]: the clip binds on 1.5 with A > 0 and 0.5 with A < 0
    (verl's pg_clipfrac, TRL's clip_ratio), not on 0.5 with A > 0 nor 1.5 with A < 0."""
    lp, t = tensors([[1.5, 0.5], [0.5, 1.5]], [[1.0, 1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    _, stats = compute_loss(LossSpec("ppo_clip", clip_frac=counts), lp, torch.zeros_like(lp),
                            None, mask, t, Norm(4, 2, 2.0))
    assert float(stats["clip_frac"]) == pytest.approx(want, abs=TOL)


def test_clip_higher_and_clip_lower():
    # clip_high 0.6: 1.5 is inside [0.8, 1.6]: min(1.5, 1.5) = 1.5
    value, _ = loss_value(LossSpec("ppo_clip", clip_high=0.6), *tensors(RATIO, ADV))
    assert value == pytest.approx(-(1.5 + 0.5 - 1.1) / 3, abs=TOL)
    # negative advantage, ratio 0.5: clip 0.2 gives min(-0.5, -0.8) = -0.8;
    # clip_low 0.6 gives min(-0.5, -0.5) = -0.5
    lp, t = tensors([[0.5, 1.0], [1.0, 1.0]], [[-1.0, 0.0], [0.0, 0.0]])
    assert loss_value(LossSpec("ppo_clip"), lp, t)[0] == pytest.approx(0.8 / 3, abs=TOL)
    assert loss_value(LossSpec("ppo_clip", clip_low=0.6), lp, t)[0] == \
        pytest.approx(0.5 / 3, abs=TOL)


def test_dual_clip_bounds_negative_advantages():
    # ratio 5, advantage -1: min(-5, -1.2) = -5; dual clip 3: max(-5, -3) = -3
    lp, t = tensors([[5.0, 1.0], [1.0, 1.0]], [[-1.0, 0.0], [0.0, 0.0]])
    assert loss_value(LossSpec("ppo_clip"), lp, t)[0] == pytest.approx(5 / 3, abs=1e-5)
    assert loss_value(LossSpec("ppo_clip", dual_clip=3.0), lp, t)[0] == \
        pytest.approx(3 / 3, abs=1e-5)


def test_entropy_bonus():
    lp, t = tensors(RATIO, ADV)
    ent = torch.tensor([[2.0, 1.0], [3.0, 9.0]])           # token mean over the mask: 2
    base, _ = loss_value(LossSpec("ppo_clip"), lp, t, ent)
    bonus, stats = loss_value(LossSpec("ppo_clip", entropy=0.1), lp, t, ent)
    assert bonus == pytest.approx(base - 0.1 * 2.0, abs=TOL)
    assert stats["entropy"] == pytest.approx(2.0, abs=TOL)


@pytest.mark.parametrize(("estimator", "per_token"), [
    ("k1", lambda d: d), ("k2", lambda d: d * d / 2), ("k3", lambda d: math.exp(-d) + d - 1)])
def test_kl_in_the_loss(estimator, per_token):
    # log p = log ratio; log p_ref = 0, so d = log ratio per token
    lp, t = tensors(RATIO, ADV, ref_logprobs=[[0.0, 0.0], [0.0, 0.0]])
    base, _ = loss_value(LossSpec("grpo"), lp, t)
    with_kl, stats = loss_value(LossSpec("grpo", kl=0.5, kl_estimator=estimator), lp, t)
    d = [math.log(1.5), math.log(0.5), math.log(1.1)]
    assert with_kl == pytest.approx(base + 0.5 * sum(per_token(x) for x in d) / 3, abs=TOL)
    assert stats["kl"] == pytest.approx(sum(d) / 3, abs=TOL)          # reported as k1


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_of_a_masked_token_is_finite_and_has_no_gradient(estimator):
    # a padded (or observation) token: the trainer fills its reference logprob with 0, so
    # d is the policy's own logprob there; -120 would make k3's exp(-d) inf in float32
    lp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.1), -120.0]],
                      requires_grad=True)
    t = {"old_logprobs": torch.zeros(2, 2), "advantages": torch.tensor(ADV),
         "ref_logprobs": torch.zeros(2, 2)}
    value, _ = compute_loss(LossSpec("grpo", kl=0.5, kl_estimator=estimator), lp,
                            torch.zeros(2, 2), None, MASK, t, NORM)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(lp.grad).all()
    assert lp.grad[1, 1] == 0.0
    unmasked = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.1), 0.0]])
    want, _ = compute_loss(LossSpec("grpo", kl=0.5, kl_estimator=estimator), unmasked,
                           torch.zeros(2, 2), None, MASK, t, NORM)
    assert float(value) == pytest.approx(float(want), abs=TOL)


def test_gspo_one_clipped_ratio_per_response():
    # response 0: log ratios log 1.5, log 0.5 -> geometric mean sqrt(0.75) = 0.866, inside
    # [0.8, 1.2]; response 1: 1.1 with advantage -1. seq_mean_token_mean: (0.866 - 1.1) / 2
    lp, t = tensors(RATIO, ADV)
    value, _ = loss_value(LossSpec("gspo", clip=0.2, agg="seq_mean_token_mean"), lp, t)
    assert value == pytest.approx(-(math.sqrt(0.75) - 1.1) / 2, abs=TOL)
    # clip 0.1: 0.866 -> clipped to 0.9 (advantage 1: min(0.866, 0.9) = 0.866, unclipped side)
    # and 1.1 stays: the same; clip 0.05 for response 1: min(-1.1, -1.05) = -1.1
    value, _ = loss_value(LossSpec("gspo", clip=0.05, agg="seq_mean_token_mean"), lp, t)
    assert value == pytest.approx(-(math.sqrt(0.75) - 1.1) / 2, abs=TOL)


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_score_function():
    # d/d lp_t of -s * A / 1 response, seq_mean_token_mean: -(s * A) / |y| per token
    lp = torch.log(torch.tensor([[1.5, 0.5]])).requires_grad_(True)
    t = {"old_logprobs": torch.zeros(1, 2), "advantages": torch.ones(1, 2)}
    value, _ = compute_loss(LossSpec("gspo", clip=0.5, agg="seq_mean_token_mean"), lp,
                            torch.zeros(1, 2), None, torch.ones(1, 2), t, Norm(2, 1))
    value.backward()
    s = math.sqrt(0.75)
    np.testing.assert_allclose(lp.grad.numpy(), [[-s / 2, -s / 2]], atol=TOL)


def test_value_mse_and_its_clip():
    values = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    t = {"returns": torch.tensor([[3.0, 3.0], [0.0, 0.0]]),
         "old_values": torch.tensor([[0.5, 0.5], [0.0, 0.0]])}
    lp = torch.zeros(2, 2)
    # unclipped: errors 4, 1, 0 -> 0.5 * 5 / 3
    assert loss_value(LossSpec("value_mse", clip=0.0), lp, t, values=values)[0] == \
        pytest.approx(2.5 / 3, abs=TOL)
    # clip 0.2: clipped values 0.7, 0.7 -> errors 5.29, 5.29, 0 (the larger of each pair)
    assert loss_value(LossSpec("value_mse", clip=0.2), lp, t, values=values)[0] == \
        pytest.approx(0.5 * 10.58 / 3, abs=1e-5)


def test_truncated_importance_weight_multiplies_each_token():
    lp, t = tensors(RATIO, ADV, is_weight=[[2.0, 1.0], [0.5, 1.0]])
    value, _ = loss_value(LossSpec("ppo_clip"), lp, t)
    assert value == pytest.approx(-(2 * 1.2 + 0.5 - 0.5 * 1.1) / 3, abs=TOL)


def test_from_call_resolves_the_registry_defaults():
    spec = LossSpec.from_call(Fn("ppo_clip", (), (("clip", 0.3), ("clip_high", 0.28),
                                                  ("tis", 3.0))))
    assert (spec.clip, spec.clip_low, spec.clip_high, spec.whiten) == (0.3, None, 0.28, True)
    assert spec.tis and spec.is_cap == 3.0
    assert LossSpec.from_call(Fn("grpo")).whiten is False
    assert LossSpec.from_call(Fn("gspo")).agg == "seq_mean_token_mean"
    assert LossSpec.from_call(Fn("value_mse"), shared=True, old_values=True).coef == 0.5
    assert LossSpec.from_call(Fn("value_mse"), old_values=True).clip == 0.2
    assert LossSpec.from_call(Fn("value_mse")).clip == 0.0


def test_adaptive_kl_controller():
    # KL twice the target: error clipped to 0.2; 1000 responses over a 10000 horizon: +2%
    assert adapt_kl(0.1, 0.04, 0.02, 1000, 10000) == pytest.approx(0.102)
    # KL at the target: unchanged; half of it: error -0.5 -> -0.2 -> -2%
    assert adapt_kl(0.1, 0.02, 0.02, 1000, 10000) == pytest.approx(0.1)
    assert adapt_kl(0.1, 0.01, 0.02, 1000, 10000) == pytest.approx(0.098)


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("kind", ["ppo_clip", "gspo"])
def test_micro_batches_add_up_to_the_minibatch(agg, kind):
    """Each micro-batch's loss is divided by the minibatch's denominators: their gradients
    sum to the one-pass gradient for every aggregation."""
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(6, 5, generator=g).requires_grad_(True)
    mask = (torch.rand(6, 5, generator=g) > 0.3).float()
    mask[:, 0] = 1.0
    t = {"old_logprobs": torch.randn(6, 5, generator=g) * 0.1 + lp.detach(),
         "advantages": torch.randn(6, 5, generator=g)}
    spec = LossSpec(kind, agg=agg, clip=0.3)
    norm = Norm(float(mask.sum()), 6.0, 5.0)
    ent = torch.zeros(6, 5)
    whole, _ = compute_loss(spec, lp, ent, None, mask, t, norm)
    (g_whole,) = torch.autograd.grad(whole, lp)
    parts = 0.0
    for idx in torch.tensor_split(torch.arange(6), 3):
        v, _ = compute_loss(spec, lp[idx], ent[idx], None, mask[idx],
                            {k: x[idx] for k, x in t.items()}, norm)
        parts = parts + v
    (g_parts,) = torch.autograd.grad(parts, lp)
    assert float(parts.detach()) == pytest.approx(float(whole.detach()), abs=1e-6)
    np.testing.assert_allclose(g_parts.numpy(), g_whole.numpy(), atol=1e-7)
