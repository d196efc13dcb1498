"""A conversation from the torch engine, trained on: the observations carry no weight, and
the log-probabilities the trainer computes are the ones the engine sampled with, token for
token, at a sampling temperature other than 1.

The conversations come from the tiny model's own sampling against an environment (every
turn is an action, so every sample has several turns whatever the policy writes), run in
the sandbox like any tool.
"""

from __future__ import annotations

import attrs
import numpy as np
import pytest
import torch

from backends.api import SamplingParams
from backends.torch_backend.advantages import Batch, gae, policy_only
from backends.torch_backend.advantages import at_policy_tokens as spread
from backends.torch_backend.generation import TorchEngine
from backends.torch_backend.losses import LossSpec
from backends.torch_backend.modeling import build_model
from backends.torch_backend.tokenizer import EOS_ID, codec_for
from backends.torch_backend.train import TokenHeads, TrainBatch, forward_arrays, train_step
from backends.turns import Toolbox
from rpeg.runtime.usercode.sandbox import Sandbox
from rpeg.spec.presets import PRESETS
from rpeg.spec.tools import Conversation, Tool

ENV = '''\
class Echo:
    def reset(self, prompt, row):
        self.n = 0

    def step(self, action):
        self.n += 1
        return "seen " + action[:5], self.n >= 3
'''
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    d = tmp_path_factory.mktemp("env")
    (d / "envs.py").write_text(ENV)
    box = Sandbox.start([Tool("echo", "envs", "Echo", environment=True)], path=[str(d)])
    try:
        model = build_model(PRESETS["tiny"], seed=3)
        engine = TorchEngine(model, version=5)
        conv = Conversation(environment="echo", max_turns=4, max_obs_len=24,
                            max_total_len=120)
        tools = Toolbox(box, conv, codec_for(None), lambda s, i: {"prompt": "k"}, max_len=8)
        params = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, eos_id=EOS_ID,
                                seed=11)
        prompts = [np.array([257, 97 + i], np.int64) for i in range(6)]
        chunks = list(engine.generate(prompts, params, chunks=1, tools=tools))
        yield model, chunks[0], tools.stats()
    finally:
        box.close()


def test_every_sample_is_a_conversation_with_its_observations_marked(conversations):
    _, chunk, stats = conversations
    assert len(chunk) == 6 and chunk.masks is not None
    for mask, versions, lps in zip(chunk.masks, chunk.versions, chunk.logprobs, strict=True):
        mask = np.asarray(mask, bool)
        turns = int(np.sum(np.diff(np.concatenate([[0], mask.astype(int)])) == 1))
        assert turns == 3 and (~mask).any()            # done after its third step
        assert set(versions[mask].tolist()) == {5} and set(versions[~mask].tolist()) == {-1}
        assert np.all(lps[~mask] == 0.0) and np.all(lps[mask] < 0.0)
    assert stats["conversations"] == 6 and stats["multi_turn"] == 6 and stats["turns"] == 18


def test_trained_logprobs_are_the_sampled_ones_token_for_token(conversations):
    """The trainer's forward over prompt + conversation, at the sampling temperature, gives
    every policy token the log-probability the engine sampled it with: nothing was decoded
    and encoded again, and each turn continued from the tokens before it. (The engine's
    cache-by-cache decoding and the trainer's one pass differ by float32 rounding only.)"""
    model, chunk, _ = conversations
    recomputed = forward_arrays(model, chunk.prompt_ids, chunk.response_ids, "logprobs",
                                temperature=TEMPERATURE)
    heads = TokenHeads(model)
    from backends.torch_backend.batching import Padded
    from backends.torch_backend.train import token_outputs
    with torch.no_grad():
        lp, _, _ = token_outputs(heads, Padded.build(chunk.prompt_ids, chunk.response_ids),
                                 TEMPERATURE)
    for i, (mask, sampled) in enumerate(zip(chunk.masks, chunk.logprobs, strict=True)):
        mask = np.asarray(mask, bool)
        np.testing.assert_allclose(recomputed[i][mask], sampled[mask], rtol=0, atol=2e-5)
        np.testing.assert_allclose(lp[i, :len(mask)].numpy()[mask], sampled[mask], rtol=0,
                                   atol=2e-5)


def _step(model_seed: int, batch: TrainBatch) -> tuple[dict, dict]:
    model = build_model(PRESETS["tiny"], seed=model_seed)
    heads = TokenHeads(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    batch = attrs.evolve(batch, temperature=TEMPERATURE)      # the responses' sampling
    stats = train_step(heads, opt, batch, [LossSpec("grpo", kl=0.1, agg="token_mean",
                                                    whiten=False)], version=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, stats


def test_observation_tokens_carry_zero_loss_weight(conversations):
    """Whatever the advantages, behaviour and reference log-probabilities say at an
    observation's tokens, the update is the same to the bit; and token counts (the
    token-mean's denominator) are the policy's tokens."""
    _, chunk, _ = conversations
    rng = np.random.default_rng(0)
    masks = tuple(np.asarray(m, np.float32) for m in chunk.masks)
    adv = tuple(rng.normal(size=len(r)).astype(np.float32) for r in chunk.response_ids)
    ref = tuple(lp - 0.1 for lp in chunk.logprobs)

    def noisy(xs):                 # the same at the policy's tokens, garbage elsewhere
        return tuple(np.where(m > 0, x, rng.normal(size=len(x)) * 100).astype(np.float32)
                     for x, m in zip(xs, masks, strict=True))
    base = TrainBatch(chunk.prompt_ids, chunk.response_ids, old_logprobs=chunk.logprobs,
                      advantages=adv, ref_logprobs=ref, loss_mask=masks)
    other = TrainBatch(chunk.prompt_ids, chunk.response_ids,
                       old_logprobs=noisy(chunk.logprobs), advantages=noisy(adv),
                       ref_logprobs=noisy(ref), loss_mask=masks)
    a, stats = _step(1, base)
    b, _ = _step(1, other)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert stats["tokens"] == chunk.policy_tokens() < sum(len(r) for r in chunk.response_ids)
    # (the garbage advantages alone: garbage log-probabilities of +-100 at unmasked tokens
    # overflow k3's exp, a gradient that is not finite, which the step refuses)
    unmasked, _ = _step(1, TrainBatch(chunk.prompt_ids, chunk.response_ids,
                                      old_logprobs=chunk.logprobs, advantages=noisy(adv),
                                      ref_logprobs=ref))
    assert not all(torch.equal(a[k], unmasked[k]) for k in a)   # the mask is what did it


def test_an_estimator_sees_the_policy_tokens_as_one_sequence():
    """GAE over a conversation: the policy's tokens as if the observations were not there
    (the score on the last policy token, values and KL over policy tokens only); the
    observations get advantage 0."""
    mask = np.array([1, 1, 0, 0, 0, 1, 1, 0], np.uint8)
    values = (np.linspace(0.1, 0.8, 8).astype(np.float32),)
    lp = (np.full(8, -1.0, np.float32),)
    ref = (np.full(8, -1.5, np.float32),)
    batch = Batch(np.array([1.0], np.float32), (8,), None, values, lp, ref)
    cut = policy_only(batch, (mask,))
    adv, ret = spread(gae(cut.scores, cut.values, cut.logprobs, cut.ref_logprobs, kl=0.1,
                          lam=0.9), (mask,))
    want, _ = gae([1.0], (values[0][mask == 1],), (lp[0][mask == 1],), (ref[0][mask == 1],),
                  kl=0.1, lam=0.9)
    assert adv[0][mask == 0].tolist() == [0.0] * 4
    np.testing.assert_array_equal(adv[0][mask == 1], want[0])


STAGED = '''\
class Staged:
    def reset(self, prompt, row):
        self.n, self.last = 0, 2 + int(prompt)      # step s's conversations: 2 + s turns

    def step(self, action):
        self.n += 1
        return "seen", self.n >= self.last
'''


def test_carried_conversations_pause_between_turns_and_resume_under_new_weights(tmp_path):
    """Partial rollouts with the torch engine: step 0 ends its own conversations (two turns)
    while step 1's (three turns) advance beside them and pause between turns; with new
    weights (version 1) step 1 ends them, each token keeping the version that sampled it."""
    from backends.api import Cohort
    (tmp_path / "envs.py").write_text(STAGED)
    box = Sandbox.start([Tool("env", "envs", "Staged", environment=True)], path=[str(tmp_path)])
    try:
        model = build_model(PRESETS["tiny"], seed=4)
        engine = TorchEngine(model, version=0)
        conv = Conversation(environment="env", max_turns=3, max_obs_len=8, max_total_len=80)
        tools = Toolbox(box, conv, codec_for(None), lambda s, i: {"prompt": str(s)}, max_len=6)

        def cohorts(step):
            return [Cohort(s, tuple(np.array([257, 97 + i], np.int64) for i in range(3)),
                           SamplingParams(6, temperature=1.0, eos_id=EOS_ID, seed=100 + s))
                    for s in (step, step + 1)]
        list(engine.generate_carried(cohorts(0), chunks=1, key="g", tools=tools))
        paused = {r.index: list(r.tokens) for r in engine.carried["g"].cohorts[1]}
        assert all(paused.values())                         # started, not finished
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        engine.version = 1
        (chunk,) = list(engine.generate_carried(cohorts(1), chunks=1, key="g", tools=tools))
        for i, ids, versions, mask in zip(chunk.prompt_index, chunk.response_ids,
                                          chunk.versions, chunk.masks, strict=True):
            assert ids[:len(paused[int(i)])].tolist() == paused[int(i)]
            policy = versions[np.asarray(mask, bool)]
            assert set(policy.tolist()) == {0, 1}           # turns of both versions
        assert chunk.version == 0
    finally:
        box.close()
