"""Partial rollouts in the torch engine: cohorts carried over steps, behaviour logprobs,
versions, the KV cache rebuilt under new weights, and a fresh start after a lost buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from backends.api import Cohort, SamplingParams
from backends.torch_backend.generation import TorchEngine
from backends.torch_backend.modeling import build_model
from backends.torch_backend.tokenizer import EOS_ID, encode
from backends.torch_backend.train import forward_arrays
from rpeg.cost.partial import step_budget
from rpeg.spec.presets import PRESETS

MAX = 16
PROMPTS = 6


def _model(seed: int = 0):
    """The tiny preset with sharper logits and EOS likely enough that lengths vary (about
    one in ten tokens ends a response): some responses end in one step, others carry."""
    model = build_model(PRESETS["tiny"], heads=("lm",), seed=seed)
    head = nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 40)
        head.bias.zero_()
        head.bias[EOS_ID] = 3.0
    model.lm_head = head
    return model.eval()


def _cohorts(step: int, carry: int, replica: int = 0, paced: bool = True) -> list[Cohort]:
    """The cohorts of a call at ``step``, those started early with the budget the executor
    gives them (``paced``), else none."""
    out = []
    for c in range(step, step + carry + 1):
        prompts = tuple(np.array([257] + encode(f"{c}+{i}="), dtype=np.int64)
                        for i in range(PROMPTS))
        seed = ((7 * 1_000_003 + step) * 64 + replica) * 128 + (c - step)
        out.append(Cohort(c, prompts, SamplingParams(MAX, temperature=1.0, eos_id=EOS_ID,
                                                     seed=seed),
                          budget=step_budget(MAX, carry, c - step) if paced else 0))
    return out


def _perturb(model, version: int) -> None:
    """New weights, as a training step would make them."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)


def _run(engine, steps: int, carry: int, chunks: int = 2, before=None):
    """Every step's chunks (and, per step, what the buffer held before the call)."""
    out = []
    for s in range(steps):
        if before is not None:
            before(s)
        out.append(list(engine.generate_carried(_cohorts(s, carry), chunks=chunks,
                                                key="rollout")))
    return out


@pytest.mark.parametrize("carry", [1, 2])
def test_every_cohort_leaves_at_its_own_step_and_tokens_are_conserved(carry):
    engine = TorchEngine(_model())
    steps = 5
    emitted = _run(engine, steps, carry)
    buf = engine.carried["rollout"]
    for s, chunks in enumerate(emitted):
        assert len(chunks) == 2
        idx = np.concatenate([c.prompt_index for c in chunks])
        assert sorted(idx.tolist()) == list(range(PROMPTS))          # each prompt once
        for c in chunks:
            for i, p, r, lp, fin in zip(c.prompt_index, c.prompt_ids, c.response_ids,
                                        c.logprobs, c.finished, strict=True):
                assert p.tolist() == [257] + encode(f"{s}+{i}=")     # cohort s's prompts
                assert 1 <= len(r) <= MAX and len(lp) == len(r) and (lp <= 0).all()
                assert bool(fin) == (r[-1] == EOS_ID)
                assert bool(fin) or len(r) == MAX
    # what the buffer holds: the next carry cohorts, started early
    assert sorted(buf.cohorts) == list(range(steps, steps + carry))
    out = sum(len(r) for chunks in emitted for c in chunks for r in c.response_ids)
    kept = sum(len(r.tokens) for rs in buf.cohorts.values() for r in rs)
    assert out + kept == buf.sampled and kept > 0
    # responses really span steps: some finished earlier than their own step
    lengths = [len(r) for chunks in emitted for c in chunks for r in c.response_ids]
    assert len(set(lengths)) > 3


def test_behaviour_logprobs_are_the_sampling_policy_and_the_cache_is_rebuilt():
    """Weights change every step: a carried response's tokens from earlier steps keep the
    old policy's logprobs, those sampled now equal a fresh forward of the current model
    (so the re-prefilled cache is right), and the chunk reports the oldest version."""
    model = _model()
    engine = TorchEngine(model)
    old_model = _model()                       # the weights of the previous step
    had: dict[tuple[int, int], int] = {}

    def before(s):
        if s:
            old_model.load_state_dict(model.state_dict())
            _perturb(model, s)
            engine.version = s
        had.clear()
        buf = engine.carried.get("rollout")
        if buf:
            had.update({(r.cohort, r.index): len(r.tokens)
                        for rs in buf.cohorts.values() for r in rs})

    carried_seen = 0
    for s in range(3):
        before(s)
        chunks = list(engine.generate_carried(_cohorts(s, 1), chunks=2, key="rollout"))
        for c in chunks:
            now = forward_arrays(model, c.prompt_ids, c.response_ids, "logprobs")
            then = forward_arrays(old_model, c.prompt_ids, c.response_ids, "logprobs")
            oldest = s
            for i, lp, fresh, prev in zip(c.prompt_index, c.logprobs, now, then, strict=True):
                k = had.get((s, int(i)), 0)            # tokens it had before this step
                np.testing.assert_allclose(lp[k:], fresh[k:], atol=2e-4)
                if k:
                    carried_seen += 1
                    oldest = s - 1
                    np.testing.assert_allclose(lp[:k], prev[:k], atol=2e-4)
                    assert not np.allclose(lp[:k], fresh[:k], atol=2e-4)
            assert c.version == oldest >= s - 1
    assert carried_seen > 0


def test_same_weights_same_logprobs_as_one_pass():
    """Without a weight change, re-prefilling a carried response changes nothing: every
    token's logprob equals one forward pass over the whole response."""
    model = _model()
    engine = TorchEngine(model)
    for chunks in _run(engine, 4, carry=2):
        for c in chunks:
            fresh = forward_arrays(model, c.prompt_ids, c.response_ids, "logprobs")
            for lp, f in zip(c.logprobs, fresh, strict=True):
                np.testing.assert_allclose(lp, f, atol=2e-4)
            assert c.version == 0


def test_sampling_is_deterministic_and_a_lost_buffer_starts_afresh():
    a, b = TorchEngine(_model()), TorchEngine(_model())
    ra, rb = _run(a, 3, carry=1), _run(b, 3, carry=1)
    for ca, cb in zip(ra, rb, strict=True):
        for x, y in zip(ca, cb, strict=True):
            assert [r.tolist() for r in x.response_ids] == [r.tolist() for r in y.response_ids]
    # a resumed run: step 5 without step 4 before it admits cohorts 5 and 6 afresh
    chunks = list(a.generate_carried(_cohorts(5, 1), chunks=1, key="rollout"))
    assert sorted(chunks[0].prompt_index.tolist()) == list(range(PROMPTS))
    buf = a.carried["rollout"]
    assert buf.step == 5 and sorted(buf.cohorts) == [6]
    assert all(len(r.tokens) <= MAX for r in buf.cohorts[6])


@pytest.mark.parametrize("carry", [0, 1])
def test_max_seqs_decodes_in_waves_and_streams_every_response_once(carry):
    """A plan's max_num_seqs: the torch engine decodes at most that many sequences at once;
    every response still comes out once, in full, and its logprobs are the policy's."""
    import attrs

    model = _model()
    engine = TorchEngine(model)
    seen = []
    real_advance, real_decode = engine._advance, engine._decode

    def advance(live, *a, **k):
        seen.append(len(live))
        return real_advance(live, *a, **k)

    def decode(prompts, *a):
        seen.append(len(prompts))
        return real_decode(prompts, *a)
    engine._advance, engine._decode = advance, decode
    for s in range(3):
        cohorts = [attrs.evolve(c, params=attrs.evolve(c.params, max_num_seqs=4))
                   for c in _cohorts(s, carry)]
        chunks = (list(engine.generate_carried(cohorts, chunks=2, key="rollout")) if carry
                  else list(engine.generate(list(cohorts[0].prompt_ids), cohorts[0].params,
                                            chunks=2)))
        assert sorted(np.concatenate([c.prompt_index for c in chunks]).tolist()) == \
            list(range(PROMPTS))
        for c in chunks:
            fresh = forward_arrays(model, c.prompt_ids, c.response_ids, "logprobs")
            for r, lp, f in zip(c.response_ids, c.logprobs, fresh, strict=True):
                assert (r[-1] == EOS_ID or len(r) == MAX) and len(lp) == len(r)
                np.testing.assert_allclose(lp, f, atol=2e-4)
    assert seen and max(seen) <= 4 and len(seen) > 3


@pytest.mark.parametrize("carry", [1, 2])
def test_cohorts_started_early_advance_by_their_share_a_step(carry):
    """Every response runs to the length cap (no end-of-sequence): a cohort started early
    holds at most its budget after each call, and every step after the first decodes a
    share of the longest response, as the cost model prices it (``rpeg.cost.partial``)."""
    model = _model()
    with torch.no_grad():
        model.lm_head.bias[EOS_ID] = -1e4
    engine = TorchEngine(model)
    cap = -(-MAX // (carry + 1))
    sampled = []
    for s in range(6):
        before = engine.carried["rollout"].sampled if s else 0
        chunks = list(engine.generate_carried(_cohorts(s, carry), chunks=1, key="rollout"))
        assert all(len(r) == MAX for c in chunks for r in c.response_ids)
        buf = engine.carried["rollout"]
        sampled.append(buf.sampled - before)
        for c, rs in buf.cohorts.items():
            assert all(len(r.tokens) <= step_budget(MAX, carry, c - s) for r in rs)
    # the first step decodes its own responses whole; later ones about an equal share each
    assert sampled[0] >= PROMPTS * MAX
    assert all(0 < n <= PROMPTS * (carry + 1) * cap for n in sampled[1:])
    if carry == 1:
        assert sampled[1:] == [PROMPTS * MAX] * 5


def test_without_budgets_the_steps_alternate_between_whole_responses_and_none():
    """What the budgets prevent: the next cohort carried along to the cap, so the step after
    has nothing to decode."""
    model = _model()
    with torch.no_grad():
        model.lm_head.bias[EOS_ID] = -1e4
    engine = TorchEngine(model)
    sampled = []
    for s in range(4):
        before = engine.carried["rollout"].sampled if s else 0
        list(engine.generate_carried(_cohorts(s, 1, paced=False), chunks=1, key="rollout"))
        sampled.append(engine.carried["rollout"].sampled - before)
    assert sampled == [2 * PROMPTS * MAX, 0, 2 * PROMPTS * MAX, 0]
