"""Sampling with a KV cache; finished responses leave in chunks.

    >>> from rpeg.spec.presets import PRESETS
    >>> engine = TorchEngine(build_model(PRESETS["tiny"], seed=0))
    >>> params = SamplingParams(max_new_tokens=8, temperature=1.0, eos_id=EOS_ID, seed=1)
    >>> chunks = list(engine.generate([np.array([257, 97])] * 4, params, chunks=2))
    >>> [len(c) for c in chunks], chunks[0].version
    ([2, 2], 0)

The batch decodes together (left-padded prompts, one cache). When enough
responses have finished — reached EOS or the length cap — to fill the next
chunk, that chunk is yielded, so work downstream starts on short responses
while long ones still decode. ``TorchEngine`` implements
``backends.api.GenerationEngine``.

Partial rollouts (a plan's ``carry``, ``generate_carried``) work in cohorts: the
generate op of step s outputs the responses to step s's prompts, as without
carry, but the engine also starts the responses of the next ``carry`` steps
early and keeps them between calls. At step s it admits every cohort up to
s + carry it does not hold yet, prefills each carried response's prompt and
tokens so far under the current weights (the weights changed since), and decodes
all of them together until every response of cohort s ended; later cohorts'
responses stay, finished or not. A later cohort's responses advance by at most their
share of tokens a step (``Cohort.budget``: ``rpeg.cost.partial.step_budget``), then
wait, so that each step decodes about an equal part of the longest response. A token keeps the logprob of the policy that
sampled it; a chunk's ``version`` is the oldest version among its tokens:

    >>> cohorts = [Cohort(s, (np.array([257, 97]),) * 4, params) for s in (0, 1)]
    >>> [len(c) for c in engine.generate_carried(cohorts, chunks=2, key="rollout")]
    [2, 2]
    >>> sorted(engine.carried["rollout"].cohorts)                # step 1's, started early
    [1]

The buffer lives in this engine (one per generate op): a call for any step but
the one after the last starts afresh (a resumed run, a replaced worker) and
simply admits the cohorts it lacks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from backends import carry, turns
from backends.api import CarriedState, Cohort, RolloutChunk, SamplingParams, chunk_bounds
from backends.torch_backend.modeling import PolicyModel, build_model  # noqa: F401  (doctest)
from backends.torch_backend.tokenizer import EOS_ID, PAD_ID
from backends.torch_backend.weights import whole


class TorchEngine:
    """A generation engine over a :class:`PolicyModel` (shared with training when colocated)."""

    converses = True              # holds conversations with tools (``tools=``)

    def __init__(self, model: PolicyModel, device: str = "cpu", version: int = 0) -> None:
        self.model = model
        self.device = device
        self.version = version
        self.carried: dict[str, carry.Carried] = {}     # generate op -> its partial rollouts

    def generate(self, prompt_ids: list[np.ndarray], params: SamplingParams,
                 chunks: int = 1, tools=None) -> Iterator[RolloutChunk]:
        if tools is not None:
            yield from self._converse([carry.Response(0, i, np.asarray(p, dtype=np.int64))
                                       for i, p in enumerate(prompt_ids)],
                                      params, {0: generator(self.device, params.seed)},
                                      chunks, tools)
            return
        n = len(prompt_ids)
        bounds = chunk_bounds(n, chunks)
        dev = self.device
        # Sampling draws on the device from this generator: the same seed, the same tokens,
        # on every rank of a tensor-parallel group (and on a CPU, as before on any device).
        gen = generator(dev, params.seed)
        eos = EOS_ID if params.eos_id is None else params.eos_id
        done_order: list[int] = []
        # the responses so far stay on the device; a token moves to the host once, in its
        # chunk (per step the host reads only which rows ended: O(batch), never O(vocab))
        tokens = torch.full((n, params.max_new_tokens), PAD_ID, dtype=torch.long, device=dev)
        logps = torch.zeros((n, params.max_new_tokens), dtype=torch.float32, device=dev)
        lengths = torch.zeros(n, dtype=torch.long, device=dev)
        finished = torch.zeros(n, dtype=torch.bool, device=dev)
        emitted = 0
        width = params.max_num_seqs if 0 < params.max_num_seqs < n else max(n, 1)
        for lo in range(0, n, width):            # waves of at most max_num_seqs sequences
            wave = torch.arange(lo, min(lo + width, n), device=dev)
            for t, (tok, lp, live) in enumerate(self._decode(prompt_ids[lo:lo + width],
                                                             params, gen, eos)):
                rows = wave[live]
                tokens[rows, t] = tok
                logps[rows, t] = lp
                lengths[rows] += 1
                ended = torch.ones_like(tok, dtype=torch.bool) \
                    if t + 1 == params.max_new_tokens else tok == eos
                finished[rows[tok == eos]] = True
                done_order += rows[ended].tolist()
                while emitted < len(bounds) and len(done_order) >= bounds[emitted][1]:
                    lo_, hi_ = bounds[emitted]
                    yield self._chunk(prompt_ids, sorted(done_order[lo_:hi_]), tokens, logps,
                                      lengths, finished)
                    emitted += 1
        assert emitted == len(bounds), "every response must finish by max_new_tokens"

    @torch.no_grad()
    def _decode(self, prompt_ids, params, gen, eos):
        """Yield (tokens, logprobs, live rows) per position, on the device; finished rows
        drop out of the cache."""
        model, dev = self.model, self.device
        n = len(prompt_ids)
        hidden, cache, mask, pos = _prefill(model, dev, prompt_ids)
        rows = torch.arange(n, device=dev)           # wave index of each live row
        same_on_all = _tp_agreement(model)
        for t in range(params.max_new_tokens):
            logits = whole(model.lm_head(hidden[:, -1])).float()   # split: gathered
            tok, lp = sample_at_least(logits, params, gen, eos, t < params.min_new_tokens)
            tok = same_on_all(tok)
            yield tok, lp, rows
            keep = tok != eos
            if not bool(keep.any()):
                return
            if not bool(keep.all()):
                # Drop finished rows: the batch shrinks as responses end.
                cache.batch_select_indices(torch.nonzero(keep).flatten())
                rows, mask, pos, tok = rows[keep], mask[keep], pos[keep], tok[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            with _autocast(dev):
                hidden, cache = model(tok[:, None], mask, pos, cache)

    def generate_carried(self, cohorts: list[Cohort], chunks: int = 1,
                         key: str = "", tools=None) -> Iterator[RolloutChunk]:
        """Partial rollouts: advance the responses of ``cohorts`` together until every
        response of ``cohorts[0]`` (this step's) finished; stream those in ``chunks`` groups
        (the ones that finished in earlier steps first). The other cohorts' responses stay
        in this engine, finished or not, for their own steps (see the module doc). With
        ``tools``, conversations: the later cohorts' pause between turns."""
        buf, own = carry.admit(self.carried, key, cohorts)
        params = cohorts[0].params
        # each cohort samples from its own generator: seeded per step, cohort and replica
        gens = {c.step: generator(self.device, c.params.seed) for c in cohorts}
        if tools is not None:
            yield from self._converse(own, params, gens, chunks, tools, buf)
            return
        stream = carry.Stream(own, chunks, EOS_ID if params.eos_id is None else params.eos_id)
        yield from stream.ready()
        if stream.complete:
            return
        live = carry.live(own, buf)
        width = params.max_num_seqs if params.max_num_seqs > 0 else max(len(live), 1)
        for lo in range(0, len(live), width):    # waves; this step's own responses first
            decoding = self._advance(live[lo:lo + width], params, gens, stream.eos,
                                     stop=lambda r: carry.paused(buf, r))
            for ended, rows in decoding:
                buf.sampled += rows
                carry.mark_ended(buf, ended)
                stream.add(ended)
                yield from stream.ready()
                if stream.complete:
                    decoding.close()
                    return
        raise AssertionError("every response must finish by max_new_tokens")

    def _converse(self, own: list[carry.Response], params: SamplingParams, gens, chunks: int,
                  tools, buf: carry.Carried | None = None) -> Iterator[RolloutChunk]:
        """Conversations (``backends.turns``): this call's own, and under partial rollouts
        the later cohorts' beside them until the own ones all ended; a turn a round, every
        live conversation's turn decoded together (in waves of ``max_num_seqs``)."""
        eos = EOS_ID if params.eos_id is None else params.eos_id
        stream = carry.Stream(own, chunks, eos)
        yield from stream.ready()
        if stream.complete:
            return
        rows = carry.live(own, buf) if buf is not None else own

        def decode(live: list[carry.Response]) -> None:
            width = params.max_num_seqs if params.max_num_seqs > 0 else max(len(live), 1)
            for lo in range(0, len(live), width):
                for _ in self._advance(live[lo:lo + width], params, gens, eos, tools.take):
                    pass
                for r in live[lo:lo + width]:
                    r.ended = False             # a turn ended, not its conversation
        for ended in turns.converse(rows, decode, tools, eos, until=lambda: stream.complete):
            if buf is not None:
                buf.sampled += sum(r.turn_len for r in rows)
                carry.mark_ended(buf, ended)
            stream.add(ended)
            yield from stream.ready()
            if stream.complete:
                return
        raise AssertionError("every conversation must end by max_turns")

    @torch.no_grad()
    def _advance(self, live: list[carry.Response], params: SamplingParams, gens, eos: int,
                 take=None, stop=None):
        """Decode ``live`` responses together, one token each per round, from their prompt
        and the tokens they have: the KV cache is rebuilt under the current weights (a
        carried response's earlier tokens came from older ones). After each round, yield
        (responses that ended, rows decoded); ended rows drop out of the batch, and so do
        rows ``stop`` says wait for a later call (a cohort's budget, unfinished). ``take``
        records a token and says whether the row is done (default: the response ends at
        end-of-sequence or ``max_new_tokens``); ``min_new_tokens`` counts a row's current
        turn (``turn_start``)."""
        if take is None:
            def take(r, tok, logp, version, eos_):
                return carry.record(r, tok, logp, version, params.max_new_tokens, eos_)
        model, dev = self.model, self.device
        contexts = [r.context() for r in live]
        hidden, cache, mask, pos = _prefill(model, dev, contexts)
        same_on_all = _tp_agreement(model)
        rows = list(live)
        while True:
            logits = whole(model.lm_head(hidden[:, -1])).float()   # split: gathered
            tok = torch.empty(len(rows), dtype=torch.long, device=logits.device)
            lp = torch.empty(len(rows), dtype=torch.float32, device=logits.device)
            for cohort, idx in _by_cohort(rows):
                short = torch.tensor([rows[i].turn_len < params.min_new_tokens
                                      for i in idx.tolist()])
                t, lps = sample_at_least(logits[idx], params, gens[cohort], eos, short)
                tok[idx], lp[idx] = t, lps
            tok = same_on_all(tok)
            ended = []
            for r, t, logp in zip(rows, tok.cpu().tolist(), lp.cpu().tolist(), strict=True):
                if take(r, t, logp, self.version, eos):
                    r.ended = True
                    ended.append(r)
            yield ended, len(rows)
            kept = [not r.ended and not (stop is not None and stop(r)) for r in rows]
            keep = torch.tensor(kept)
            if not any(kept):
                return
            if not all(kept):
                cache.batch_select_indices(torch.nonzero(keep).flatten().to(mask.device))
                rows = [r for r, k in zip(rows, kept, strict=True) if k]
                k = keep.to(mask.device)
                mask, pos, tok = mask[k], pos[k], tok[k]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            with _autocast(dev):
                hidden, cache = model(tok[:, None], mask, pos, cache)

    def _chunk(self, prompt_ids, idx, tokens, logps, lengths, finished) -> RolloutChunk:
        at = torch.as_tensor(idx, dtype=torch.long, device=tokens.device)
        tokens, logps = tokens[at].cpu().numpy(), logps[at].cpu().numpy()   # the chunk's rows
        lengths, finished = lengths[at].cpu().numpy(), finished[at].cpu().numpy()
        return RolloutChunk(
            prompt_index=np.asarray(idx, dtype=np.int64),
            prompt_ids=tuple(np.asarray(prompt_ids[i], dtype=np.int64) for i in idx),
            response_ids=tuple(tokens[j, : lengths[j]].astype(np.int64) for j in range(len(idx))),
            logprobs=tuple(logps[j, : lengths[j]].astype(np.float32) for j in range(len(idx))),
            finished=finished.astype(bool),
            version=self.version,
            versions=tuple(np.full(int(lengths[j]), self.version, np.int64)
                           for j in range(len(idx))),
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, value in named_tensors:
                own[name].copy_(torch.as_tensor(value))
        self.version = version

    def carried_state(self) -> tuple[CarriedState, ...]:
        return carry.export(self.carried)

    def restore_carried(self, states: tuple[CarriedState, ...]) -> None:
        self.carried = carry.restore(states)

    def shutdown(self) -> None:
        self.model = None


def _prefill(model, dev, contexts):
    """One forward pass over left-padded ``contexts``: (hidden states, KV cache, attention
    mask, positions) to decode from."""
    n, width = len(contexts), max(len(p) for p in contexts)
    ids = torch.full((n, width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(contexts):
        ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    with _autocast(dev):
        hidden, cache = model(ids, mask, pos, cache)
    return hidden, cache, mask, pos


def generator(device, seed: int) -> torch.Generator:
    """A random generator on ``device`` seeded with ``seed``: sampling draws there."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def sample(logits: torch.Tensor, temperature: float, top_p: float,
           gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; its log-probability under the temperature-scaled distribution."""
    if temperature <= 0:
        logp = torch.log_softmax(logits, dim=-1)
        tok = logits.argmax(-1)
        return tok, logp.gather(-1, tok[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / temperature, dim=-1)
    probs = logp.exp()
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cut = sorted_p.cumsum(-1) - sorted_p > top_p      # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(cut, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    # on the logits' device, from a generator there (``generator``): no host copy of the
    # batch x vocabulary probabilities
    tok = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def sample_at_least(logits: torch.Tensor, params: SamplingParams, gen: torch.Generator, eos: int,
                    short) -> tuple[torch.Tensor, torch.Tensor]:
    """``sample``, except that rows still ``short`` of ``min_new_tokens`` (a bool, or a mask
    per row) cannot end: their end-of-sequence logit is masked out. The log-probability is
    the model's own (unmasked) one, as the trainer computes it."""
    if not bool(torch.as_tensor(short).any()) or not 0 <= eos < logits.shape[-1]:
        return sample(logits, params.temperature, params.top_p, gen)
    rows = torch.as_tensor(short, device=logits.device).expand(logits.shape[0])
    masked = logits.clone()
    masked[rows, eos] = float("-inf")
    tok, _ = sample(masked, params.temperature, params.top_p, gen)
    scale = params.temperature if params.temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, dim=-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def _by_cohort(rows: list[carry.Response]):
    """(cohort, row positions) for the cohorts among ``rows``, oldest cohort first."""
    out: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        out.setdefault(r.cohort, []).append(i)
    return [(c, torch.tensor(out[c])) for c in sorted(out)]


def _tp_agreement(model):
    """For a tensor-parallel model: the tokens of the group's first rank, broadcast, so every
    rank keeps decoding the same rows (their logits agree; this makes it certain)."""
    from backends.torch_backend.distributed import is_sharded
    mesh = next((p.device_mesh for p in model.parameters() if is_sharded(p)), None)
    if mesh is None:
        return lambda tok: tok
    import torch.distributed as dist
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)

    def agree(tok):
        dist.broadcast(tok, src=src, group=group)
        return tok
    return agree


def _autocast(device: str):
    if str(device).startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
