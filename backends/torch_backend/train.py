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

from backends.torch_backend.advantages import whitening
from backends.torch_backend.attention import packed as packed_rows
from backends.torch_backend.batching import Flat, Padded, balance, micro_batches
from backends.torch_backend.batching import build as build_rows
from backends.torch_backend.distributed import clip_grad_norm, token_log_probs
from backends.torch_backend.generation import _autocast
from backends.torch_backend.losses import LossSpec, Norm, compute_loss
from backends.torch_backend.modeling import PolicyModel, build_model  # noqa: F401  (doctest)
from backends.torch_backend.tokenizer import PAD_ID

__all__ = ["LossSpec", "Packed", "TokenHeads", "TrainBatch", "forward_arrays", "train_step"]


Packed = Padded     # prompt + response ids, right-padded (the name used before packing)


class TokenHeads(nn.Module):
    """``PolicyModel`` -> per response token: logits, value (what exists). The logits are
    the model's own, in its compute dtype; :func:`token_outputs` scales them by the sampling
    temperature."""

    def __init__(self, model: PolicyModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids, mask, gather, positions=None):
        with _autocast(str(ids.device)):
            hidden, _ = self.model(ids, mask, positions)
            h = hidden.gather(1, gather[..., None].expand(-1, -1, hidden.shape[-1]))
            logits = self.model.lm_head(h) if self.model.lm_head is not None else None
            # a copy, not a view: FSDP2 hooks the outputs of the module it wraps
            values = self.model.value_head(h).float().squeeze(-1).clone() \
                if self.model.value_head is not None else None
        return logits, values


def token_outputs(heads: nn.Module, packed: Padded | Flat, temperature: float = 1.0):
    """(logprobs, entropy, values) tensors [B, T]; None for a head the model lacks. The
    log-probabilities and the entropy are those of the policy at ``temperature``,
    ``log_softmax(logits / temperature)`` over the whole vocabulary: the distribution the
    responses were sampled from (a greedy stage's: 1). The logits are held once, in the
    compute dtype, and reduced where they lie when split over tensor-parallel ranks
    (``distributed.token_log_probs``)."""
    logits, values = heads(packed.ids, packed.mask, packed.gather, packed.positions)
    lp = ent = None
    if logits is not None:
        lp, ent = token_log_probs(logits, packed.targets, temperature, own=True)
    return lp, ent, values


@torch.no_grad()
def forward_arrays(model: PolicyModel, prompt_ids, response_ids, what: str,
                   device="cpu", temperature: float = 1.0, microbatches: int = 1,
                   packed: bool = False) -> tuple[np.ndarray, ...] | np.ndarray:
    """Per-token ``logprobs`` or ``values`` (tuples of arrays), or per-response ``scores``;
    in ``microbatches`` token-balanced passes, each padded or ``packed`` into one row.

    A value at response token t is the head's output where token t is predicted (the
    state before it); a score is the head's output at the response's last token itself,
    where a reward model (a sequence classifier) reads it: one placeholder token is
    appended, whose prediction position is that last token (causal: it changes nothing
    before it)."""
    if what == "scores":
        response_ids = tuple(np.append(np.asarray(r, np.int64), PAD_ID) for r in response_ids)
    lengths = [len(p) + len(r) for p, r in zip(prompt_ids, response_ids, strict=True)]
    groups = [g for g in micro_batches(lengths, microbatches) if g]
    lp, _, values = _per_sequence(TokenHeads(model), prompt_ids, response_ids, groups,
                                  packed, device, temperature)
    if what == "logprobs":
        return tuple(lp)
    if what == "values":
        return tuple(values)
    return np.asarray([v[-1] for v in values], dtype=np.float32)


def _per_sequence(heads, prompt_ids, response_ids, groups, packed: bool, device,
                  temperature: float = 1.0):
    """(logprobs, entropy, values): one array per sequence (None where a head is missing)
    for the sequences in ``groups``, one forward pass per group, at ``temperature``."""
    n = len(response_ids)
    out = [[None] * n, [None] * n, [None] * n]
    for group in groups:
        rows = build_rows([prompt_ids[i] for i in group], [response_ids[i] for i in group],
                          packed, device)
        lengths = [len(response_ids[i]) for i in group]
        with packing(heads, packed):
            outputs = token_outputs(heads, rows, temperature)
        for k, x in enumerate(outputs):
            if x is not None:
                for i, a in zip(group, rows.split(x, lengths), strict=True):
                    out[k][i] = a
    return out


@attrs.frozen
class TrainBatch:
    """What a train step reads: one array per response (per token, or one value broadcast)."""

    prompt_ids: tuple
    response_ids: tuple
    old_logprobs: tuple | None = None      # behaviour policy, per token
    advantages: tuple | None = None        # per token (GAE) or per response, broadcast
    returns: tuple | None = None
    old_values: tuple | None = None
    ref_logprobs: tuple | None = None
    behaviour_version: int = 0
    temperature: float = 1.0               # the behaviour policy's (the responses' sampling)
    loss_mask: tuple | None = None         # conversations: 1 policy token, 0 observation


FIELDS = ("old_logprobs", "advantages", "returns", "old_values", "ref_logprobs", "loss_mask")


class NonFiniteUpdate(ValueError):
    """A minibatch's gradient norm is NaN or infinite: its update is not applied (the
    optimizer would write NaN into every weight), and the run stops."""

    def __init__(self, grad_norm: float, loss: float):
        super().__init__(f"gradient norm {grad_norm}, loss {loss}")
        self.grad_norm, self.loss = grad_norm, loss


def train_step(heads: nn.Module, optimizer: torch.optim.Optimizer, batch: TrainBatch,
               losses: list[LossSpec], *, version: int, minibatches: int = 1, epochs: int = 1,
               grad_clip: float = 1.0, normalize: bool = True, seed: int = 0,
               device="cpu", microbatches: int = 1, rank: int = 0, world: int = 1,
               packed: bool = False, budget: float = 1.0) -> dict[str, float]:
    """One optimizer step per minibatch, over ``epochs`` passes; returns mean statistics.

    ``batch`` is the train op's whole batch, the same on every data-parallel rank; rank
    ``rank`` of ``world`` trains on its token-balanced share (:func:`balance`). Each rank
    splits its share into the same number of minibatches; each minibatch runs as
    ``microbatches`` token-balanced forward/backward passes (padded, or ``packed`` into
    one row each) whose gradients add up before the step. A pass's loss is divided by the
    denominators of the minibatch over all ranks (:class:`losses.Norm`: its response
    tokens, its responses, the generation ``budget`` a ``seq_mean_token_sum`` loss divides
    by) and multiplied by ``world``, which the data-parallel average divides out, so the
    update is the one-pass update over the whole minibatch (up to float rounding) whatever
    the aggregation, ranks and micro-batches. Which responses form each minibatch does
    depend on the ranks (each shuffles its own share, as verl's data-parallel ranks do):
    with one minibatch a step, one device and two give the same update; with several, the
    same responses in other minibatches. Advantages are normalised over every response
    token of the batch."""
    n = len(batch.response_ids)
    resp = [len(r) for r in batch.response_ids]
    cost = [len(p) + r for p, r in zip(batch.prompt_ids, resp, strict=True)]
    fields = {name: list(getattr(batch, name)) for name in FIELDS
              if getattr(batch, name) is not None}
    # the tokens a loss counts: a conversation's observations are not the policy's; what
    # any input says at them is set aside (0) before anything reads it
    counted = resp if batch.loss_mask is None else [int(np.sum(m)) for m in batch.loss_mask]
    if batch.loss_mask is not None:
        fields = {name: v if name == "loss_mask" else _at_policy(v, batch.loss_mask)
                  for name, v in fields.items()}
    if "advantages" in fields and normalize:
        fields["advantages"] = _normalized(fields["advantages"], resp, batch.loss_mask)
    parts = balance(cost, world)
    mine = parts[rank]
    policy = [loss for loss in losses if loss.policy]
    stale = batch.behaviour_version < version or any(loss.tis for loss in policy)
    off_policy = bool(policy) and stale and "old_logprobs" in fields
    collective = world > 1
    if off_policy:
        groups = _micro(mine, cost, microbatches, collective)
        with torch.no_grad():
            prox = _per_sequence(heads, batch.prompt_ids, batch.response_ids,
                                 [g or [0] for g in groups], packed, device,
                                 batch.temperature)[0]
        cap = max(loss.is_cap for loss in policy)
        fields["is_weight"] = [None] * n
        for i in mine:
            behaviour = np.asarray(fields["old_logprobs"][i], np.float32)
            fields["is_weight"][i] = np.minimum(np.exp(prox[i] - behaviour), cap)
            fields["old_logprobs"][i] = prox[i]
    gens = [torch.Generator().manual_seed(seed + 1_000_003 * r) for r in range(world)]
    k = max(1, min(minibatches, max(len(p) for p in parts)))
    sums: dict[str, float] = {}
    count = 0
    for _ in range(epochs):
        splits = []
        for r in range(world):              # every rank's split: the minibatch's totals
            order = torch.randperm(len(parts[r]), generator=gens[r]).tolist()
            splits.append([[parts[r][j] for j in piece.tolist()]
                           for piece in torch.tensor_split(torch.tensor(order), k)])
        for j in range(k):
            everyone = [i for r in range(world) for i in splits[r][j]]
            norm = Norm(float(max(sum(counted[i] for i in everyone), 1)),
                        float(max(len(everyone), 1)), budget)
            part = splits[rank][j]
            optimizer.zero_grad(set_to_none=True)
            micro = _micro(part, cost, microbatches, collective)
            stats: dict[str, float] = {}
            for m, group in enumerate(micro):
                # DDP reduces gradients on the last pass only
                last = m == len(micro) - 1 or not hasattr(heads, "no_sync")
                with contextlib.nullcontext() if last else heads.no_sync(), \
                        packing(heads, packed):
                    dummy = not group     # a rank with nothing here still joins collectives
                    group = group or [0]
                    rows = build_rows([batch.prompt_ids[i] for i in group],
                                      [batch.response_ids[i] for i in group], packed, device)
                    mb_t = {name: rows.sequence_layout([_or_zero(v[i]) for i in group], device)
                            for name, v in fields.items()}
                    lp, ent, values = (None if x is None else rows.per_sequence(x)
                                       for x in token_outputs(heads, rows, batch.temperature))
                    mask = rows.sequence_mask()
                    if "loss_mask" in mb_t:        # observations weigh nothing, anywhere
                        mask = mask * mb_t.pop("loss_mask")
                    total = torch.zeros((), device=device)
                    terms: dict[str, torch.Tensor] = {}
                    for loss in losses:
                        value, st = compute_loss(loss, lp, ent, values, mask, mb_t, norm)
                        total = total + loss.coef * value
                        terms.update(st)
                    (total * (0.0 if dummy else float(world))).backward()
                if dummy:       # nothing of the step's here, but every rank reports each key
                    for key in (*terms, "loss"):
                        stats.setdefault(key, 0.0)
                    continue
                terms["loss"] = total
                for key, v in terms.items():    # each a share of the minibatch's, all ranks'
                    stats[key] = stats.get(key, 0.0) + world * float(
                        v.detach() if torch.is_tensor(v) else v)
            # DTensor-aware; 0: measured, not clipped. The parameters as registered now, after
            # the backward: FSDP2 registers its sharded ones again there, which hold the
            # gradients (a forward before, e.g. the off-policy correction's, registered the
            # gathered ones)
            params = [p for p in heads.parameters() if p.requires_grad]
            stats["grad_norm"] = float(clip_grad_norm(params, grad_clip or float("inf")))
            if not np.isfinite(stats["grad_norm"]):     # the norm is every rank's: all stop
                optimizer.zero_grad(set_to_none=True)
                raise NonFiniteUpdate(stats["grad_norm"], stats.get("loss", float("nan")))
            optimizer.step()
            for key, v in stats.items():
                sums[key] = sums.get(key, 0.0) + v
            count += 1
    out = {key: v / max(count, 1) for key, v in sums.items()}
    out["tokens"] = int(sum(counted[i] for i in mine))       # this rank's share
    if off_policy:
        w = [fields["is_weight"][i] if batch.loss_mask is None else
             fields["is_weight"][i][np.asarray(batch.loss_mask[i], bool)] for i in mine]
        w = np.concatenate(w) if mine else np.zeros(1)
        out["is_weight"] = float(w.mean()) if w.size else 1.0
    return out


def packing(heads: nn.Module, packed: bool):
    """Packed rows are attended per sequence inside the block: the forward and the backward
    (whose activation recomputation runs the layers again) alike."""
    if not packed:
        return contextlib.nullcontext()
    model = next(m for m in heads.modules() if isinstance(m, PolicyModel))
    return packed_rows(model.config)


def _or_zero(row):
    return np.float32(0.0) if row is None else row       # a dummy pass's rows: weighted 0


def _micro(part: list[int], cost, count: int, collective: bool) -> list[list[int]]:
    """``count`` token-balanced micro-batches of the sequences ``part``; an empty one is kept
    where ranks must run the same passes (``collective``), else dropped."""
    groups = [[part[i] for i in g] for g in micro_batches([cost[i] for i in part], count)]
    return groups if collective else [g for g in groups if g] or [[]]


def _normalized(advantages, lengths, masks=None) -> list[np.ndarray]:
    """Advantages minus their mean over every response token (the policy's, of a
    conversation), over their standard deviation (:func:`advantages.whitening`)."""
    flat = np.concatenate([
        np.broadcast_to(np.asarray(a, np.float32), (n,))[
            slice(None) if masks is None else np.asarray(masks[i], bool)]
        for i, (a, n) in enumerate(zip(advantages, lengths, strict=True))]).astype(np.float64)
    mean, scale = whitening(flat)
    return [((np.asarray(a, np.float32) - mean) * scale).astype(np.float32)
            for a in advantages]


def _at_policy(rows, masks) -> list:
    """Per-token rows with 0 at the observations' tokens (per-response values unchanged)."""
    out = []
    for x, m in zip(rows, masks, strict=True):
        x = np.asarray(x, np.float32)
        out.append(x if x.ndim == 0 else np.where(np.asarray(m) > 0, x, 0.0).astype(np.float32))
    return out


def _masked_mean(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return (x * m).sum() / m.sum().clamp(min=1.0)


def _unpad(x: torch.Tensor, lengths) -> tuple[np.ndarray, ...]:
    x = x.float().cpu().numpy()
    return tuple(x[i, :n].astype(np.float32) for i, n in enumerate(lengths))
