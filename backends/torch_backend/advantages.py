"""Advantage estimators on plain arrays: GAE, group normalisation, RLOO, REINFORCE++, ReMax.

    >>> import numpy as np
    >>> adv, ret = gae([1.0], [np.zeros(3, np.float32)], gamma=1.0, lam=1.0)
    >>> adv[0].tolist(), ret[0].tolist()
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    >>> [round(float(a), 3) for a in group_norm(np.array([1.0, 0.0, 0.5, 0.5]),
    ...                                          np.array([0, 0, 1, 1]))]
    [0.707, -0.707, 0.0, 0.0]

Per-token quantities are tuples of float32 arrays, one per response; the
sequence score lands on the last token. A KL penalty to the reference in the
reward (``kl`` of an estimator) is ``-kl * k(t)`` on every token, ``k`` the
chosen estimator (k1, k2, k3). Outcome estimators (group_norm, rloo, reinforce
without a KL, remax) give one advantage per response, which the trainer
broadcasts to its tokens; with a KL in the reward their advantage becomes
per-token: the sequence advantage minus the KL's reward-to-go. Compute ops are
pure numpy: they run on whichever worker the plan names, with no model there.

The ``@implements`` functions are what the executor calls, by the registry's
name, with an :class:`Batch` and the stage's keywords resolved
(``rpeg.spec.functions``); they return the outputs in the registry's order.
"""

from __future__ import annotations

import math

import attrs
import numpy as np

from backends.torch_backend.algorithms import implements


@attrs.frozen
class Batch:
    """What an estimator reads, by role (None where the stage reads no such input)."""

    scores: np.ndarray                      # one per response: the score stages' weighted sum
    lengths: tuple[int, ...]                # tokens of each response
    groups: np.ndarray | None = None        # the prompt (group) of each response
    values: tuple | None = None
    logprobs: tuple | None = None
    ref_logprobs: tuple | None = None
    baseline: np.ndarray | None = None      # remax: the greedy response's score, per response


# --- KL estimators: log p and log p_ref per token -> an estimate of KL(p || p_ref) ------------

def _k1(d: np.ndarray) -> np.ndarray:
    return d


def _k2(d: np.ndarray) -> np.ndarray:
    return 0.5 * d * d


def _k3(d: np.ndarray) -> np.ndarray:
    return np.expm1(-d) + d             # r - log r - 1 with r = p_ref / p = exp(-d)


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_tokens(logprobs, ref_logprobs, estimator: str = "k1") -> tuple[np.ndarray, ...]:
    """Per-token KL estimates, one array per response."""
    fn = KL_ESTIMATORS[estimator]
    return tuple(fn(np.asarray(a, np.float64) - np.asarray(b, np.float64)).astype(np.float32)
                 for a, b in zip(logprobs, ref_logprobs, strict=True))


def token_rewards(scores, logprobs=None, ref_logprobs=None, kl: float = 0.0,
                  lengths=None, estimator: str = "k1") -> tuple[np.ndarray, ...]:
    """Per-token rewards: the score on the last token, minus the KL penalty on every token."""
    if lengths is None:
        lengths = [len(lp) for lp in logprobs]
    penalty = kl_tokens(logprobs, ref_logprobs, estimator) \
        if kl and logprobs is not None and ref_logprobs is not None else None
    out = []
    for i, n in enumerate(lengths):
        r = np.zeros(n, dtype=np.float32)
        if penalty is not None:
            r -= kl * penalty[i]
        if n:
            r[-1] += float(scores[i])
        out.append(r)
    return tuple(out)


# --- the estimators, on plain arrays ----------------------------------------------------

def gae(scores, values, logprobs=None, ref_logprobs=None, kl: float = 0.0,
        gamma: float = 1.0, lam: float = 0.95, estimator: str = "k1"
        ) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Generalised advantage estimation per response; returns (advantages, returns)."""
    rewards = token_rewards(scores, logprobs, ref_logprobs, kl, lengths=[len(v) for v in values],
                            estimator=estimator)
    advs, rets = [], []
    for r, v in zip(rewards, values, strict=True):
        v = np.asarray(v, np.float32)
        n = len(r)
        adv = np.zeros(n, dtype=np.float32)
        last = 0.0
        for t in range(n - 1, -1, -1):
            nxt = v[t + 1] if t + 1 < n else 0.0
            delta = r[t] + gamma * nxt - v[t]
            last = delta + gamma * lam * last
            adv[t] = last
        advs.append(adv)
        rets.append(adv + v)
    return tuple(advs), tuple(rets)


def group_norm(scores, groups, eps: float = 1e-6, scale: bool = True,
               correction: int = 1) -> np.ndarray:
    """GRPO: each score minus its group's mean, over the group's standard deviation with
    Bessel's ``correction`` (1: the sample std, as torch.std; 0: the population std);
    ``scale`` False: centred only, Dr. GRPO. A group of one has no spread: advantage 0."""
    scores = np.asarray(scores, dtype=np.float64)
    groups = np.asarray(groups)
    out = np.zeros_like(scores)
    for g in np.unique(groups):
        sel = groups == g
        centred = scores[sel] - scores[sel].mean()
        if scale:
            dof = max(int(sel.sum()) - correction, 1)
            centred = centred / (np.sqrt((centred ** 2).sum() / dof) + eps)
        out[sel] = centred
    return out.astype(np.float32)


def rloo(scores, groups) -> np.ndarray:
    """REINFORCE leave-one-out: each score minus the mean of the other samples of its prompt."""
    scores = np.asarray(scores, dtype=np.float64)
    groups = np.asarray(groups)
    out = np.zeros_like(scores)
    for g in np.unique(groups):
        sel = groups == g
        k = int(sel.sum())
        if k < 2:
            continue
        out[sel] = scores[sel] - (scores[sel].sum() - scores[sel]) / (k - 1)
    return out.astype(np.float32)


def group_mean(values, groups) -> np.ndarray:
    """Each response's group mean of ``values``."""
    values = np.asarray(values, dtype=np.float64)
    groups = np.asarray(groups)
    out = np.zeros_like(values)
    for g in np.unique(groups):
        sel = groups == g
        out[sel] = values[sel].mean()
    return out


WHITEN_EPS = 1e-8          # under the variance's square root, as verl's and OpenRLHF's


def whitening(flat: np.ndarray) -> tuple[float, float]:
    """(mean, 1 / sqrt(variance + WHITEN_EPS)) of the values ``flat``, the variance
    unbiased (verl's ``masked_whiten``, OpenRLHF's): ``(x - mean) * scale`` whitens them.
    One value (no unbiased variance) has variance 0; none, mean 0 and scale 1."""
    if flat.size == 0:
        return 0.0, 1.0
    var = float(flat.var(ddof=1)) if flat.size > 1 else 0.0
    return float(flat.mean()), 1.0 / math.sqrt(var + WHITEN_EPS)


def reinforce_pp(scores, lengths, logprobs=None, ref_logprobs=None, kl: float = 0.0,
                 gamma: float = 1.0, groups=None, estimator: str = "k1"
                 ) -> tuple[np.ndarray, ...]:
    """REINFORCE++: discounted per-token returns of the token rewards, whitened over every
    token of the batch; with ``groups``, each score minus its group's mean first."""
    scores = np.asarray(scores, dtype=np.float64)
    if groups is not None:
        scores = scores - group_mean(scores, groups)
    rewards = token_rewards(scores, logprobs, ref_logprobs, kl, lengths=lengths,
                            estimator=estimator)
    returns = [_returns(r, gamma) for r in rewards]
    mean, scale = whitening(np.concatenate(returns) if returns else np.zeros(0))
    return tuple(((g - mean) * scale).astype(np.float32) for g in returns)


def _returns(rewards: np.ndarray, gamma: float) -> np.ndarray:
    out = np.zeros(len(rewards), dtype=np.float64)
    acc = 0.0
    for t in range(len(rewards) - 1, -1, -1):
        acc = float(rewards[t]) + gamma * acc
        out[t] = acc
    return out


def with_kl_to_go(adv: np.ndarray, x: Batch, kl: float, estimator: str):
    """A per-response advantage, minus the reward-to-go of a KL penalty in the reward when
    there is one (then per token); unchanged otherwise."""
    if not kl:
        return np.asarray(adv, np.float32)
    penalty = kl_tokens(x.logprobs, x.ref_logprobs, estimator)
    return tuple((float(a) - kl * np.cumsum(p[::-1])[::-1]).astype(np.float32)
                 for a, p in zip(adv, penalty, strict=True))


# --- conversations: the policy's tokens only --------------------------------------------------

def policy_only(x: Batch, masks) -> Batch:
    """``x`` with a conversation's observation tokens left out of every per-token input: an
    estimator sees the policy's tokens as one sequence (its score on the last of them, its
    KL and discounting over them), whatever observations sat between its turns."""
    keep = [np.asarray(m, bool) for m in masks]

    def cut(xs):
        return None if xs is None else tuple(np.asarray(a)[k] for a, k in zip(xs, keep,
                                                                              strict=True))
    return attrs.evolve(x, lengths=tuple(int(k.sum()) for k in keep), values=cut(x.values),
                        logprobs=cut(x.logprobs), ref_logprobs=cut(x.ref_logprobs))


def at_policy_tokens(outputs, masks):
    """An estimator's outputs of :func:`policy_only` inputs, back at every token: per-token
    arrays spread over the policy's positions, 0 at the observations' (which the trainer
    masks out); per-response values unchanged."""
    def spread(a, m):
        m = np.asarray(m, bool)
        full = np.zeros(len(m), np.float32)
        full[m] = np.asarray(a, np.float32)
        return full
    out = []
    for o in outputs:
        if isinstance(o, tuple):
            out.append(tuple(spread(a, m) for a, m in zip(o, masks, strict=True)))
        else:
            out.append(o)
    return tuple(out)


# --- what the executor calls, by registry name ----------------------------------------------

@implements("gae")
def gae_op(x: Batch, args: dict):
    return gae(x.scores, x.values, x.logprobs, x.ref_logprobs, kl=args["kl"],
               gamma=args["gamma"], lam=args["lam"], estimator=args["kl_estimator"])


@implements("group_norm")
def group_norm_op(x: Batch, args: dict):
    a = group_norm(x.scores, x.groups, eps=args["eps"], scale=args["std"],
                   correction=args["correction"])
    return (with_kl_to_go(a, x, args["kl"], args["kl_estimator"]),)


@implements("rloo")
def rloo_op(x: Batch, args: dict):
    return (with_kl_to_go(rloo(x.scores, x.groups), x, args["kl"], args["kl_estimator"]),)


@implements("reinforce")
def reinforce_op(x: Batch, args: dict):
    groups = x.groups if args["baseline"] == "group" else None
    return (reinforce_pp(x.scores, x.lengths, x.logprobs, x.ref_logprobs, kl=args["kl"],
                         gamma=args["gamma"], groups=groups, estimator=args["kl_estimator"]),)


@implements("remax")
def remax_op(x: Batch, args: dict):
    a = np.asarray(x.scores, np.float64) - np.asarray(x.baseline, np.float64)
    return (with_kl_to_go(a.astype(np.float32), x, args["kl"], args["kl_estimator"]),)
