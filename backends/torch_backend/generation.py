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
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch

from backends.api import RolloutChunk, SamplingParams
from backends.torch_backend.modeling import PolicyModel, build_model  # noqa: F401  (doctest)
from backends.torch_backend.tokenizer import EOS_ID, PAD_ID


class TorchEngine:
    """A generation engine over a :class:`PolicyModel` (shared with training when colocated)."""

    def __init__(self, model: PolicyModel, device: str = "cpu", version: int = 0) -> None:
        self.model = model
        self.device = device
        self.version = version

    def generate(self, prompt_ids: list[np.ndarray], params: SamplingParams,
                 chunks: int = 1) -> Iterator[RolloutChunk]:
        n = len(prompt_ids)
        bounds = chunk_bounds(n, chunks)
        # Sampling draws on the CPU from this generator: the same seed, the same tokens, on
        # any device and on every rank of a tensor-parallel group.
        gen = torch.Generator().manual_seed(int(params.seed))
        eos = EOS_ID if params.eos_id is None else params.eos_id
        done_order: list[int] = []
        tokens = torch.full((n, params.max_new_tokens), PAD_ID, dtype=torch.long)
        logps = torch.zeros((n, params.max_new_tokens), dtype=torch.float32)
        lengths = torch.zeros(n, dtype=torch.long)
        finished = torch.zeros(n, dtype=torch.bool)
        emitted = 0
        for t, (tok, lp, active) in enumerate(self._decode(prompt_ids, params, gen, eos)):
            tokens[active, t] = tok
            logps[active, t] = lp
            lengths[active] += 1
            ended = active.clone()
            ended[active] = tok == eos
            if t + 1 == params.max_new_tokens:
                ended = active
            finished |= ended & active & (tokens[:, t] == eos)
            done_order += torch.nonzero(ended).flatten().tolist()
            while emitted < len(bounds) and len(done_order) >= bounds[emitted][1]:
                lo, hi = bounds[emitted]
                yield self._chunk(prompt_ids, sorted(done_order[lo:hi]), tokens, logps,
                                  lengths, finished)
                emitted += 1
        assert emitted == len(bounds), "every response must finish by max_new_tokens"

    @torch.no_grad()
    def _decode(self, prompt_ids, params, gen, eos):
        """Yield (tokens, logprobs, active mask) per position; finished rows drop out of the cache."""
        model, dev = self.model, self.device
        n = len(prompt_ids)
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((n, width), PAD_ID, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p):] = torch.as_tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        rows = torch.arange(n)                       # original index of each live row
        from transformers import DynamicCache
        cache = DynamicCache(config=model.config)
        with _autocast(dev):
            hidden, cache = model(ids, mask, pos, cache)
        same_on_all = _tp_agreement(model)
        for _ in range(params.max_new_tokens):
            logits = model.lm_head(hidden[:, -1]).float()
            tok, lp = sample(logits, params.temperature, params.top_p, gen)
            tok = same_on_all(tok)
            active = torch.zeros(n, dtype=torch.bool)
            active[rows] = True
            yield tok.cpu(), lp.cpu(), active
            keep = (tok != eos).to(mask.device)
            if not bool(keep.any()):
                return
            if not bool(keep.all()):
                # Drop finished rows: the batch shrinks as responses end.
                cache.batch_select_indices(torch.nonzero(keep).flatten())
                rows, mask, pos, tok = rows[keep.cpu()], mask[keep], pos[keep], tok[keep]
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            pos = pos[:, -1:] + 1
            with _autocast(dev):
                hidden, cache = model(tok[:, None], mask, pos, cache)

    def _chunk(self, prompt_ids, idx, tokens, logps, lengths, finished) -> RolloutChunk:
        return RolloutChunk(
            prompt_index=np.asarray(idx, dtype=np.int64),
            prompt_ids=tuple(np.asarray(prompt_ids[i], dtype=np.int64) for i in idx),
            response_ids=tuple(tokens[i, : lengths[i]].numpy().astype(np.int64) for i in idx),
            logprobs=tuple(logps[i, : lengths[i]].numpy().astype(np.float32) for i in idx),
            finished=finished[idx].numpy().astype(bool),
            version=self.version,
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: int) -> None:
        own = self.model.state_dict()
        with torch.no_grad():
            for name, value in named_tensors:
                own[name].copy_(torch.as_tensor(value))
        self.version = version

    def shutdown(self) -> None:
        self.model = None


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
    tok = torch.multinomial(probs.cpu(), 1, generator=gen if gen.device.type == "cpu" else None)
    tok = tok.to(logits.device).squeeze(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


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


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """Cumulative [lo, hi) counts of finished responses that close each chunk."""
    chunks = max(1, min(chunks, n))
    edges = [round(i * n / chunks) for i in range(chunks + 1)]
    return [(edges[i], edges[i + 1]) for i in range(chunks)]


def _autocast(device: str):
    if str(device).startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)
