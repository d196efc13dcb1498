"""Sampling knobs in the torch engine: min_len keeps end-of-sequence away, greedy is greedy."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from backends.api import SamplingParams
from backends.torch_backend.generation import TorchEngine, sample_at_least
from backends.torch_backend.modeling import build_model
from backends.torch_backend.tokenizer import EOS_ID
from rpeg.spec.presets import PRESETS


class _EndsAtOnce(nn.Module):
    """The model's head, plus a large end-of-sequence logit: responses end at their first
    token unless end-of-sequence is masked."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head

    def forward(self, h):
        out = self.head(h)
        out[..., EOS_ID] += 50.0
        return out


def _engine():
    model = build_model(PRESETS["tiny"], seed=0)
    model.lm_head = _EndsAtOnce(model.lm_head)
    return TorchEngine(model)


def _lengths(engine, **kw):
    params = SamplingParams(max_new_tokens=8, eos_id=EOS_ID, seed=1, **kw)
    chunks = list(engine.generate([np.array([257, 97])] * 4, params))
    return sorted(len(r) for c in chunks for r in c.response_ids)


def test_min_len_holds_end_of_sequence_back():
    engine = _engine()
    assert _lengths(engine) == [1, 1, 1, 1]                    # ends at once
    # five tokens first, then end-of-sequence at the first chance (as vLLM's min_tokens)
    assert _lengths(engine, min_new_tokens=5) == [6, 6, 6, 6]


def test_min_len_reports_the_model_s_own_log_probability():
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0]])
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    tok, lp = sample_at_least(logits, params, gen, eos=3, short=True)
    assert int(tok) != 3
    assert float(lp) == torch.log_softmax(logits, -1)[0, int(tok)].item()


def test_greedy_takes_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    tok, _ = sample_at_least(logits, SamplingParams(max_new_tokens=1, temperature=0.0), gen,
                             eos=1, short=True)
    assert int(tok) == 2                                         # 1 is end-of-sequence, held
