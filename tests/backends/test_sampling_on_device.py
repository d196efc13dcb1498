"""The torch engine samples on its device: per decoded token nothing of size vocabulary
reaches the host (before, the whole batch x vocabulary probability matrix was copied to
the CPU every token, ~78 MB a step at Qwen's vocabulary and 128 rows). On a CPU the host
is the device, so the test records what is asked to move there (``Tensor.cpu``): a token's
ids, a chunk's responses, never a row of probabilities. And on a CPU the tokens are the
ones the host-side sampler drew (the same generator, the same draws)."""

from __future__ import annotations

import numpy as np
import torch

from backends.api import SamplingParams
from backends.torch_backend.generation import TorchEngine, generator, sample
from backends.torch_backend.modeling import build_model
from rpeg.spec.presets import PRESETS


def test_decoding_moves_nothing_of_vocabulary_size_to_the_host(monkeypatch):
    model = build_model(PRESETS["tiny"], seed=0)
    vocab = model.lm_head.weight.shape[0]
    moved: list[tuple[int, ...]] = []
    real = torch.Tensor.cpu

    def cpu(self, *args, **kwargs):
        moved.append(tuple(self.shape))
        return real(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "cpu", cpu)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=3)
    chunks = list(TorchEngine(model).generate([np.array([257, 97, 98])] * 6, params, chunks=2))
    assert sum(len(c) for c in chunks) == 6
    assert moved and all(vocab not in shape for shape in moved), moved


def test_on_a_cpu_it_draws_what_the_host_sampler_drew():
    logits = torch.randn(5, 259, generator=torch.Generator().manual_seed(0))
    tok, lp = sample(logits, 0.8, 0.95, generator("cpu", 11))
    gen = torch.Generator().manual_seed(11)
    logp = torch.log_softmax(logits / 0.8, dim=-1)
    probs = logp.exp()
    ordered, order = probs.sort(dim=-1, descending=True)
    ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered > 0.95, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, ordered)
    want = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    assert torch.equal(tok, want)
    assert torch.allclose(lp, logp.gather(-1, want[:, None]).squeeze(-1))
