"""Each advantage estimator against values worked out by hand, through the registry's names.

The cases are small enough to check on paper; each comment shows the arithmetic. The
tolerance is float32 rounding of numbers of order 1 (the estimators return float32)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from backends.torch_backend.advantages import Batch, kl_tokens
from backends.torch_backend.algorithms import implementation
from rpeg.spec.functions import function

TOL = 1e-6


def run(name: str, batch: Batch, **given):
    """The estimator ``name`` by the backend's implementation, keywords resolved."""
    return implementation(name)(batch, function(name).resolve(given))


def batch(scores, lengths=None, groups=None, **kw) -> Batch:
    scores = np.asarray(scores, np.float32)
    lengths = tuple(lengths or [1] * len(scores))
    return Batch(scores, lengths, None if groups is None else np.asarray(groups), **kw)


def arr(*xs):
    return tuple(np.asarray(x, np.float32) for x in xs)


def close(got, want):
    if isinstance(want, tuple):
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL)
    else:
        np.testing.assert_allclose(got, want, atol=TOL, rtol=TOL)


# --- gae ----------------------------------------------------------------------------------
VALUES = arr([0.5, 0.25])


def test_gae_lambda_one():
    # rewards [0, 1]; t=1: delta = 1 - 0.25 = 0.75; t=0: delta = 0 + 0.25 - 0.5 = -0.25,
    # adv0 = -0.25 + 0.75 = 0.5; returns = adv + values = [1, 1]
    adv, ret = run("gae", batch([1.0], [2], values=VALUES), lam=1.0)
    close(adv, arr([0.5, 0.75]))
    close(ret, arr([1.0, 1.0]))


def test_gae_lambda_and_gamma():
    # lam 0.5: adv0 = -0.25 + 0.5 * 0.75 = 0.125
    adv, _ = run("gae", batch([1.0], [2], values=VALUES), lam=0.5)
    close(adv, arr([0.125, 0.75]))
    # gamma 0.5, lam 1: delta1 = 0.75, delta0 = 0.5 * 0.25 - 0.5 = -0.375; adv0 = -0.375 + 0.375
    adv, _ = run("gae", batch([1.0], [2], values=VALUES), gamma=0.5, lam=1.0)
    close(adv, arr([0.0, 0.75]))


LP, REF = arr([-1.0, -2.0]), arr([-1.5, -1.0])          # log p - log p_ref = [0.5, -1]


@pytest.mark.parametrize(("estimator", "penalty"), [
    ("k1", [0.5, -1.0]),                                  # d
    ("k2", [0.125, 0.5]),                                 # d^2 / 2
    ("k3", [math.exp(-0.5) + 0.5 - 1, math.exp(1) - 1 - 1]),   # e^-d + d - 1
])
def test_gae_kl_in_the_reward(estimator, penalty):
    # zero values, lam = gamma = 1: the advantage is the reward-to-go of
    # r = [-0.1 * k(0), 1 - 0.1 * k(1)]
    r = [-0.1 * penalty[0], 1 - 0.1 * penalty[1]]
    adv, _ = run("gae", batch([1.0], [2], values=arr([0, 0]), logprobs=LP, ref_logprobs=REF),
                 kl=0.1, kl_estimator=estimator, lam=1.0)
    close(adv, arr([r[0] + r[1], r[1]]))
    close(kl_tokens(LP, REF, estimator), arr(penalty))


# --- group estimators ---------------------------------------------------------------------
GROUPS = [0, 0, 1, 1]


def test_group_norm_with_and_without_std():
    # group 0: [1, 0], mean 0.5, sample std sqrt(0.5 / 1) -> +-0.5 / (0.7071 + eps);
    # group 1: all 0.5 -> [0, 0]
    (a,) = run("group_norm", batch([1, 0, 0.5, 0.5], groups=GROUPS))
    x = 0.5 / (np.sqrt(0.5) + 1e-6)
    close(a, np.array([x, -x, 0, 0], np.float32))
    # correction = 0: the population std 0.5 -> +-0.5 / (0.5 + eps)
    (a,) = run("group_norm", batch([1, 0, 0.5, 0.5], groups=GROUPS), correction=0)
    x = 0.5 / (0.5 + 1e-6)
    close(a, np.array([x, -x, 0, 0], np.float32))
    (a,) = run("group_norm", batch([1, 0, 0.5, 0.5], groups=GROUPS), std=False)   # Dr. GRPO
    close(a, np.array([0.5, -0.5, 0, 0], np.float32))
    (a,) = run("group_norm", batch([1, 0, 0.5, 0.5], groups=GROUPS), eps=0.5,
               correction=0)                                                    # 0.5 / 1.0
    close(a, np.array([0.5, -0.5, 0, 0], np.float32))


def test_group_norm_std_is_torch_std():
    """The default is torch.std's (Bessel-corrected), as verl's and TRL's group std."""
    scores = np.array([0.2, 1.0, 0.0, 0.7, 0.3, 0.3, 0.9, 0.1])
    groups = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    (a,) = run("group_norm", batch(scores.tolist(), groups=groups.tolist()))
    s = torch.tensor(scores).view(2, 4)
    want = (s - s.mean(1, keepdim=True)) / (s.std(1, keepdim=True) + 1e-6)
    close(a, want.reshape(-1).numpy().astype(np.float32))


def test_group_norm_kl_in_the_reward_is_a_reward_to_go():
    # A = +-0.5 / (sqrt(0.5) + eps); k1 per token [0.5, -1] for both, its reverse cumsum
    # [-0.5, -1]: minus 0.1 times it adds [0.05, 0.1]
    lp, ref = arr([-1, -2], [-1, -2]), arr([-1.5, -1], [-1.5, -1])
    (a,) = run("group_norm", batch([1, 0], [2, 2], [0, 0], logprobs=lp, ref_logprobs=ref),
               kl=0.1)
    x = 0.5 / (np.sqrt(0.5) + 1e-6)
    close(a, arr([x + 0.05, x + 0.1], [-x + 0.05, -x + 0.1]))


def test_rloo():
    # each score minus the mean of the other two: 1 - 0.25, 0 - 0.75, 0.5 - 0.5
    (a,) = run("rloo", batch([1, 0, 0.5], groups=[0, 0, 0]))
    close(a, np.array([0.75, -0.75, 0.0], np.float32))


def test_reinforce_pp_whitens_over_every_token():
    # returns [1], [0], [1], [1]: mean 0.75, unbiased variance 0.25 (verl's masked_whiten)
    (a,) = run("reinforce", batch([1, 0, 1, 1], groups=GROUPS))
    s = math.sqrt(0.25 + 1e-8)
    close(a, arr([0.25 / s], [-0.75 / s], [0.25 / s], [0.25 / s]))


def test_reinforce_pp_with_a_group_baseline():
    # minus the group mean: [0.5, -0.5, 0, 0]; mean 0, unbiased variance 0.5 / 3
    (a,) = run("reinforce", batch([1, 0, 1, 1], groups=GROUPS), baseline="group")
    s = math.sqrt(0.5 / 3 + 1e-8)
    close(a, arr([0.5 / s], [-0.5 / s], [0.0], [0.0]))


def test_reinforce_pp_discounts():
    # one response of 3 tokens, score 1 on the last, gamma 0.5: returns [0.25, 0.5, 1]
    (a,) = run("reinforce", batch([1.0], [3], [0]), gamma=0.5)
    g = np.array([0.25, 0.5, 1.0])
    close(a, arr((g - g.mean()) / math.sqrt(g.var(ddof=1) + 1e-8)))


def test_remax_subtracts_the_greedy_score():
    (a,) = run("remax", batch([1.0, 0.5], groups=[0, 1], baseline=np.array([0.75, 0.75])))
    close(a, np.array([0.25, -0.25], np.float32))
