"""Forward passes and training steps: the losses of ``losses.py``, and their sum.

    >>> from rpeg.spec.presets import PRESETS
    >>> model = build_model(PRESETS["tiny"], heads=("lm",), seed=0)
    >>> batch = TrainBatch.from_arrays(prompts, responses, old_logprobs=lps, advantages=adv)  # doctest: +SKIP
    >>> stats = train_step(model, optimizer, batch, [LossSpec("ppo_clip", clip=0.2)])        # doctest: +SKIP
    >>> stats["clip_frac"]                                                                   # doctest: +SKIP
    0.0

A batch is plain arrays, one per response. Each loss aggregates its tokens as
it says (``losses.aggregate``). Several losses in one step (actor-critic sharing)
add up into one backward pass and one optimizer step. With ``behaviour_version``
behind the model's version (staleness > 0), or a loss asking for truncated
importance sampling on every batch (``tis``), the surrogate is taken against the
current ("proximal") policy and weighted by the capped importance ratio
``min(pi_prox / pi_behaviour, cap)`` per token.
"""

from __future__ import annotations

import contextlib

import attrs
import numpy as np
import torch
from torch import nn

from backends.torch_backend.distributed import clip_grad_norm
from backends.torch_backend.generation import _autocast
from backends.torch_backend.losses import LossSpec, Norm, compute_loss
from backends.torch_backend.modeling import PolicyModel, build_model  # noqa: F401  (doctest)
from backends.torch_backend.tokenizer import PAD_ID

__all__ = ["LossSpec", "Packed", "TokenHeads", "TrainBatch", "forward_arrays", "train_step"]


@attrs.frozen
class Packed:
    """Prompt + response token ids, right-padded, and where each response token is predicted."""

    ids: torch.Tensor           # [B, L]
    mask: torch.Tensor          # [B, L]
    gather: torch.Tensor        # [B, T] position whose output predicts response token t
    targets: torch.Tensor       # [B, T]
    resp_mask: torch.Tensor     # [B, T] float

    @classmethod
    def build(cls, prompt_ids, response_ids, device="cpu") -> Packed:
        n = len(prompt_ids)
        total = max(len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True))
        t_max = max(len(r) for r in response_ids)
        ids = torch.full((n, total), PAD_ID, dtype=torch.long)
        mask = torch.zeros((n, total), dtype=torch.long)
        gather = torch.zeros((n, t_max), dtype=torch.long)
        targets = torch.full((n, t_max), PAD_ID, dtype=torch.long)
        resp_mask = torch.zeros((n, t_max), dtype=torch.float32)
        for i, (p, r) in enumerate(zip(prompt_ids, response_ids, strict=True)):
            lp, lr = len(p), len(r)
            ids[i, :lp] = torch.as_tensor(p)
            ids[i, lp:lp + lr] = torch.as_tensor(r)
            mask[i, :lp + lr] = 1
            gather[i, :lr] = torch.arange(lp - 1, lp - 1 + lr)
            targets[i, :lr] = torch.as_tensor(r)
            resp_mask[i, :lr] = 1.0
        return cls(ids.to(device), mask.to(device), gather.to(device), targets.to(device),
                   resp_mask.to(device))

    def select(self, idx: torch.Tensor) -> Packed:
        return Packed(self.ids[idx], self.mask[idx], self.gather[idx], self.targets[idx],
                      self.resp_mask[idx])


class TokenHeads(nn.Module):
    """``PolicyModel`` -> per response token: log-probability, entropy, value (what exists)."""

    def __init__(self, model: PolicyModel, temperature: float = 1.0) -> None:
        super().__init__()
        self.model = model
        self.temperature = temperature

    def forward(self, ids, mask, gather):
        with _autocast(str(ids.device)):
            hidden, _ = self.model(ids, mask)
            h = hidden.gather(1, gather[..., None].expand(-1, -1, hidden.shape[-1]))
            logits = self.model.lm_head(h).float() / self.temperature \
                if self.model.lm_head is not None else None
            values = self.model.value_head(h).float().squeeze(-1) \
                if self.model.value_head is not None else None
        return logits, values


def token_outputs(heads: nn.Module, packed: Packed):
    """(logprobs, entropy, values) tensors [B, T]; None for a head the model lacks."""
    logits, values = heads(packed.ids, packed.mask, packed.gather)
    lp = ent = None
    if logits is not None:
        logp = torch.log_softmax(logits, dim=-1)
        lp = logp.gather(-1, packed.targets[..., None]).squeeze(-1)
        ent = -(logp.exp() * logp).sum(-1)
    return lp, ent, values


@torch.no_grad()
def forward_arrays(model: PolicyModel, prompt_ids, response_ids, what: str,
                   device="cpu", temperature: float = 1.0) -> tuple[np.ndarray, ...] | np.ndarray:
    """Per-token ``logprobs`` or ``values`` (tuples of arrays), or per-response ``scores``."""
    packed = Packed.build(prompt_ids, response_ids, device)
    lp, _, values = token_outputs(TokenHeads(model, temperature), packed)
    lengths = [len(r) for r in response_ids]
    if what == "logprobs":
        return _unpad(lp, lengths)
    if what == "values":
        return _unpad(values, lengths)
    last = torch.as_tensor(lengths, device=values.device) - 1
    return values.gather(1, last[:, None]).squeeze(1).cpu().numpy().astype(np.float32)


@attrs.frozen
class TrainBatch:
    """What a train step reads; per-token fields are padded [B, T] tensors built on demand."""

    prompt_ids: tuple
    response_ids: tuple
    old_logprobs: tuple | None = None      # behaviour policy, per token
    advantages: tuple | None = None        # per token (GAE) or per response, broadcast
    returns: tuple | None = None
    old_values: tuple | None = None
    ref_logprobs: tuple | None = None
    behaviour_version: int = 0


def train_step(heads: nn.Module, optimizer: torch.optim.Optimizer, batch: TrainBatch,
               losses: list[LossSpec], *, version: int, minibatches: int = 1, epochs: int = 1,
               grad_clip: float = 1.0, normalize: bool = True, seed: int = 0,
               device="cpu", microbatches: int = 1, budget: float = 1.0) -> dict[str, float]:
    """One optimizer step per minibatch, over ``epochs`` passes; returns mean statistics.

    Each minibatch runs as ``microbatches`` forward/backward passes whose gradients add
    up before the step (gradient accumulation): each pass's loss is divided by the
    minibatch's denominators (:class:`losses.Norm`), so the update is the one-pass update
    (up to float rounding) at a fraction of the activation memory. ``budget``: the
    generation budget (tokens) a ``seq_mean_token_sum`` loss divides by."""
    packed = Packed.build(batch.prompt_ids, batch.response_ids, device)
    n, t = packed.targets.shape
    tensors = {name: _pad(getattr(batch, name), n, t, device)
               for name in ("old_logprobs", "advantages", "returns", "old_values", "ref_logprobs")
               if getattr(batch, name) is not None}
    m = packed.resp_mask
    if "advantages" in tensors and normalize:
        a = tensors["advantages"]
        mean = (a * m).sum() / m.sum()
        std = (((a - mean) ** 2 * m).sum() / m.sum()).sqrt()
        tensors["advantages"] = (a - mean) / (std + 1e-6)
    policy = [loss for loss in losses if loss.policy]
    stale = batch.behaviour_version < version or any(loss.tis for loss in policy)
    off_policy = bool(policy) and stale and "old_logprobs" in tensors
    if off_policy:
        with torch.no_grad():
            prox, _, _ = token_outputs(heads, packed)
        behaviour = tensors["old_logprobs"]
        cap = max(loss.is_cap for loss in policy)
        tensors["is_weight"] = torch.exp(prox - behaviour).clamp(max=cap).detach()
        tensors["old_logprobs"] = prox.detach()
    gen = torch.Generator().manual_seed(seed)
    sums: dict[str, float] = {}
    count = 0
    params = [p for p in heads.parameters() if p.requires_grad]
    for _ in range(epochs):
        order = torch.randperm(n, generator=gen).to(device)
        for part in torch.tensor_split(order, max(1, min(minibatches, n))):
            optimizer.zero_grad(set_to_none=True)
            norm = Norm(float(m[part].sum().clamp(min=1.0)), float(len(part)), budget)
            micro = torch.tensor_split(part, max(1, min(microbatches, len(part))))
            stats: dict[str, float] = {}
            for i, piece in enumerate(micro):
                # DDP reduces gradients on the last pass only
                last = i == len(micro) - 1 or not hasattr(heads, "no_sync")
                with contextlib.nullcontext() if last else heads.no_sync():
                    mb = packed.select(piece)
                    mb_t = {k: v[piece] for k, v in tensors.items()}
                    lp, ent, values = token_outputs(heads, mb)
                    total = torch.zeros((), device=device)
                    parts: dict[str, torch.Tensor] = {}
                    for loss in losses:
                        value, s = compute_loss(loss, lp, ent, values, mb.resp_mask, mb_t, norm)
                        total = total + loss.coef * value
                        parts.update(s)
                    total.backward()
                parts["loss"] = total
                for k, v in parts.items():       # each already a share of the minibatch's
                    stats[k] = stats.get(k, 0.0) + float(v.detach() if torch.is_tensor(v)
                                                         else v)
            # DTensor-aware (tp); 0: measured, not clipped
            stats["grad_norm"] = float(clip_grad_norm(params, grad_clip or float("inf")))
            optimizer.step()
            for k, v in stats.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
    out = {k: v / max(count, 1) for k, v in sums.items()}
    if off_policy:
        out["is_weight"] = float(_masked_mean(tensors["is_weight"], m))
    return out


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp(min=1.0)


def _pad(rows, n: int, t: int, device) -> torch.Tensor:
    out = torch.zeros((n, t), dtype=torch.float32)
    for i, r in enumerate(rows):
        r = np.asarray(r, dtype=np.float32)
        if r.ndim == 0:
            out[i, :] = float(r)                # a per-response value, broadcast to its tokens
        else:
            out[i, : len(r)] = torch.from_numpy(r)
    return out.to(device)


def _unpad(x: torch.Tensor, lengths) -> tuple[np.ndarray, ...]:
    x = x.float().cpu().numpy()
    return tuple(x[i, :n].astype(np.float32) for i, n in enumerate(lengths))
