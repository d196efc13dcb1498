"""The losses of a train step: PPO clip, GRPO, GSPO, the value loss; their aggregation.

    >>> import torch
    >>> m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    >>> x = torch.tensor([[1.0, 3.0, 9.0], [4.0, 9.0, 9.0]])
    >>> [round(float(aggregate(x, m, a, Norm(3, 2, 4.0))), 3) for a in AGGREGATIONS]
    [2.667, 3.0, 1.0]

A loss works on per-token tensors [B, T] of one micro-batch (``m`` its response
mask) and returns its value already divided by the whole minibatch's
denominator (:class:`Norm`: its response tokens, its responses, the generation
budget), so the micro-batches' values and gradients add up to the minibatch's,
whatever the aggregation:

* ``token_mean``: every token weighs the same (DAPO's token-level loss);
* ``seq_mean_token_mean``: each response weighs the same (GRPO as published);
* ``seq_mean_token_sum``: token sums over a constant, the generation budget (Dr. GRPO).

Policy losses clip the importance ratio to ``[1 - clip_low, 1 + clip_high]``
(DAPO's clip-higher: a larger ``clip_high``), optionally bound the loss of negative
advantages by ``dual_clip`` x |A| (dual-clip PPO), add an entropy bonus and a KL
term to the reference (k1, k2 or k3). GSPO uses one ratio per response, the
geometric mean of its tokens' ratios, in the token form whose gradient is GSPO's:
``s_it = sg(s_i) * p_t / sg(p_t)``.
"""

from __future__ import annotations

import attrs
import torch

from backends.torch_backend.algorithms import implements

AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@attrs.frozen
class Norm:
    """A minibatch's denominators: response tokens, responses, the generation budget."""

    tokens: float
    seqs: float
    budget: float = 1.0


@attrs.frozen
class LossSpec:
    """One loss of a train step, its keywords resolved (``rpeg.spec.functions``)."""

    kind: str                          # a loss of the registry: ppo_clip, grpo, gspo, value_mse
    clip: float = 0.2
    kl: float = 0.0                    # coefficient of the KL-to-reference loss term
    is_cap: float = 2.0                # cap on the truncated importance weight
    coef: float = 1.0                  # weight of this loss in the sum
    clip_low: float | None = None      # None: clip
    clip_high: float | None = None     # None: clip
    dual_clip: float | None = None
    agg: str = "token_mean"
    entropy: float = 0.0
    kl_estimator: str = "k3"
    whiten: bool = True                # normalise the advantages over the batch first
    tis: bool = False                  # correct every batch (not only stale ones)
    kl_target: float | None = None     # adaptive KL coefficient (the executor adapts kl)
    kl_horizon: float = 10000.0
    clip_frac: str = "binding"         # what the clip_frac metric counts (binding | outside)

    @classmethod
    def from_call(cls, call, *, shared: bool = False, old_values: bool = False) -> LossSpec:
        """From a train stage's ``loss`` value (``rpeg.spec.values.Fn``)."""
        from rpeg.spec.functions import function
        fn = function(call.name)
        args = fn.resolve(dict(call.kwargs))
        if fn.policy:
            tis = args["tis"]
            return cls(fn.name, clip=args["clip"], kl=args["kl"], coef=args["coef"],
                       is_cap=tis if tis is not None else 2.0, tis=tis is not None,
                       clip_low=args["clip_low"], clip_high=args["clip_high"],
                       dual_clip=args["dual_clip"], agg=args["agg"], entropy=args["entropy"],
                       kl_estimator=args["kl_estimator"], whiten=args["whiten"],
                       kl_target=args["kl_target"], kl_horizon=args["kl_horizon"],
                       clip_frac=args["clip_frac"])
        clip = args["clip"]
        if clip is None:                       # derived: 0.2 with the old values as an input
            clip = 0.2 if old_values else 0.0
        coef = args["coef"] if args["coef"] is not None else (0.5 if shared else 1.0)
        return cls(fn.name, clip=clip, coef=coef, whiten=False)

    @property
    def policy(self) -> bool:
        from rpeg.spec.functions import function
        return function(self.kind).policy


def aggregate(x: torch.Tensor, m: torch.Tensor, agg: str, norm: Norm) -> torch.Tensor:
    """Per-token ``x`` of a micro-batch as its share of the minibatch's loss."""
    return _AGGREGATE[agg](x, m, norm)


def _token_mean(x, m, norm):
    return (x * m).sum() / max(norm.tokens, 1.0)


def _seq_mean_token_mean(x, m, norm):
    return ((x * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / max(norm.seqs, 1.0)


def _seq_mean_token_sum(x, m, norm):
    return (x * m).sum() / (max(norm.seqs, 1.0) * max(norm.budget, 1.0))


_AGGREGATE = {"token_mean": _token_mean, "seq_mean_token_mean": _seq_mean_token_mean,
              "seq_mean_token_sum": _seq_mean_token_sum}


def kl_estimate(lp: torch.Tensor, ref: torch.Tensor, estimator: str,
                mask: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(p || p_ref) from log-probabilities; 0 where ``mask`` is 0
    (padding, a tool's observation: the trainer fills their ``ref`` with 0, so k3's
    exp(-d) there would overflow to inf, and inf times the mask's 0 is NaN in the loss and
    its gradient), with no gradient there."""
    d = lp - ref if mask is None else torch.where(mask > 0, lp - ref, torch.zeros_like(lp))
    if estimator == "k1":
        return d
    if estimator == "k2":
        return 0.5 * d * d
    return torch.expm1(-d) + d           # k3: r - log r - 1, r = p_ref / p


KL_ESTIMATORS = ("k1", "k2", "k3")


def compute_loss(loss: LossSpec, lp, ent, values, m, t, norm: Norm) -> tuple[torch.Tensor, dict]:
    """(value, statistics) of ``loss`` on one micro-batch, by the registry's implementation."""
    from backends.torch_backend.algorithms import implementation
    return implementation(loss.kind)(loss, lp, ent, values, m, t, norm)


def _policy(loss: LossSpec, lp, ent, m, t, norm: Norm, sequence: bool):
    log_ratio = lp - t["old_logprobs"]
    if sequence:
        seq = (log_ratio * m).sum(-1) / m.sum(-1).clamp(min=1.0)
        log_ratio = seq.detach()[:, None] + lp - lp.detach()
    ratio = torch.exp(log_ratio)
    adv = t["advantages"]
    low = loss.clip if loss.clip_low is None else loss.clip_low
    high = loss.clip if loss.clip_high is None else loss.clip_high
    obj = torch.min(ratio * adv, ratio.clamp(1 - low, 1 + high) * adv)
    if loss.dual_clip is not None:
        obj = torch.where(adv < 0, torch.max(obj, loss.dual_clip * adv), obj)
    if "is_weight" in t:
        obj = obj * t["is_weight"]
    value = aggregate(-obj, m, loss.agg, norm)
    clipped = _clipped(ratio.detach(), adv, low, high, loss.clip_frac)
    stats = {"policy_loss": value.detach(), "clip_frac": _token_mean(clipped, m, norm).detach(),
             "entropy": _token_mean(ent, m, norm).detach()}
    if loss.entropy:
        value = value - loss.entropy * aggregate(ent, m, loss.agg, norm)
    if "ref_logprobs" in t:
        stats["kl"] = _token_mean(lp - t["ref_logprobs"], m, norm).detach()
        if loss.kl:
            value = value + loss.kl * aggregate(kl_estimate(lp, t["ref_logprobs"],
                                                            loss.kl_estimator, m),
                                                m, loss.agg, norm)
    return value, stats


def _clipped(ratio, adv, low: float, high: float, counts: str) -> torch.Tensor:
    """1 for each token the clip_frac metric counts: where the clip binds (its gradient is
    cut: above the band with a positive advantage, below it with a negative one), or every
    token outside the band (``counts = "outside"``)."""
    above, below = ratio > 1 + high, ratio < 1 - low
    if counts == "outside":
        return (above | below).float()
    return ((above & (adv > 0)) | (below & (adv < 0))).float()


@implements("ppo_clip")
def ppo_clip(loss, lp, ent, values, m, t, norm):
    return _policy(loss, lp, ent, m, t, norm, sequence=False)


@implements("grpo")
def grpo(loss, lp, ent, values, m, t, norm):
    return _policy(loss, lp, ent, m, t, norm, sequence=False)


@implements("gspo")
def gspo(loss, lp, ent, values, m, t, norm):
    return _policy(loss, lp, ent, m, t, norm, sequence=True)


@implements("value_mse")
def value_mse(loss, lp, ent, values, m, t, norm):
    ret = t["returns"]
    err = (values - ret) ** 2
    if "old_values" in t and loss.clip > 0:
        old = t["old_values"]
        clipped = old + (values - old).clamp(-loss.clip, loss.clip)
        err = torch.max(err, (clipped - ret) ** 2)
    value = 0.5 * _token_mean(err, m, norm)
    return value, {"value_loss": value.detach()}


def adapt_kl(coef: float, measured: float, target: float, responses: int,
             horizon: float) -> float:
    """The adaptive KL controller (Ziegler et al. 2019): the coefficient moves by up to 20%
    of ``responses / horizon`` towards the target.

    >>> round(adapt_kl(0.1, 0.04, 0.02, 1000, 10000), 4)
    0.102
    """
    error = min(max(measured / target - 1.0, -0.2), 0.2)
    return coef * (1.0 + error * responses / horizon)
