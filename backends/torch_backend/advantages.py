"""Advantage estimators on plain arrays: GAE (PPO), group normalisation (GRPO), RLOO.

    >>> import numpy as np
    >>> adv, ret = gae([1.0], [np.zeros(3, np.float32)], gamma=1.0, lam=1.0)
    >>> adv[0].tolist(), ret[0].tolist()
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    >>> group_norm(np.array([1.0, 0.0, 0.5, 0.5]), np.array([0, 0, 1, 1])).round(3).tolist()
    [1.0, -1.0, 0.0, 0.0]

Per-token quantities are tuples of float32 arrays, one per response; the
sequence score lands on the last token, and a KL penalty to the reference
(``-kl * (logp - ref_logp)``) on every token. Compute ops are pure numpy:
they run on whichever worker the plan names, with no model there.
"""

from __future__ import annotations

import numpy as np


def token_rewards(scores, logprobs=None, ref_logprobs=None, kl: float = 0.0,
                  lengths=None) -> tuple[np.ndarray, ...]:
    """Per-token rewards: the score on the last token, minus the KL penalty on every token."""
    if lengths is None:
        lengths = [len(lp) for lp in logprobs]
    out = []
    for i, n in enumerate(lengths):
        r = np.zeros(n, dtype=np.float32)
        if kl and logprobs is not None and ref_logprobs is not None:
            r -= kl * (np.asarray(logprobs[i], np.float32) - np.asarray(ref_logprobs[i], np.float32))
        r[-1] += float(scores[i])
        out.append(r)
    return tuple(out)


def gae(scores, values, logprobs=None, ref_logprobs=None, kl: float = 0.0,
        gamma: float = 1.0, lam: float = 0.95) -> tuple[tuple[np.ndarray, ...], tuple[np.ndarray, ...]]:
    """Generalised advantage estimation per response; returns (advantages, returns)."""
    rewards = token_rewards(scores, logprobs, ref_logprobs, kl, lengths=[len(v) for v in values])
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


def group_norm(scores, groups, eps: float = 1e-6, scale: bool = True) -> np.ndarray:
    """GRPO: each score minus its group's mean, over the group's standard deviation."""
    scores = np.asarray(scores, dtype=np.float64)
    groups = np.asarray(groups)
    out = np.zeros_like(scores)
    for g in np.unique(groups):
        sel = groups == g
        centred = scores[sel] - scores[sel].mean()
        out[sel] = centred / (scores[sel].std() + eps) if scale else centred
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
