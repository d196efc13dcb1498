"""The torch backend: tokenizer, sampling, forward passes, losses, advantages, checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from backends.api import SamplingParams, chunk_bounds
from backends.torch_backend import advantages as adv
from backends.torch_backend.generation import TorchEngine, sample
from backends.torch_backend.modeling import build_model, load_checkpoint, save_checkpoint
from backends.torch_backend.tokenizer import EOS_ID, byte_tokenizer, decode, encode
from backends.torch_backend.train import (
    LossSpec,
    NonFiniteUpdate,
    TokenHeads,
    TrainBatch,
    forward_arrays,
    train_step,
)
from rpeg.spec.presets import PRESETS

TINY = PRESETS["tiny"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(TINY, heads=("lm", "value"), seed=0)


def _prompts(n=6):
    return [np.array([257] + encode(f"a*{i % 5 + 1}="), dtype=np.int64) for i in range(n)]


def test_tokenizer_is_bytes_with_three_specials():
    tok = byte_tokenizer()
    assert len(tok) == TINY.vocab == 259
    assert encode("hé") == [104, 195, 169]
    assert decode(encode("any ünïcode ✓") + [EOS_ID]) == "any ünïcode ✓"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)


def test_same_seed_same_backbone_and_ref_equals_actor_init():
    a = build_model(TINY, heads=("lm",), seed=3)
    b = build_model(TINY, heads=("lm", "value"), seed=3)
    for (na, pa), (nb, pb) in zip(a.backbone.named_parameters(), b.backbone.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)
    assert torch.equal(a.lm_head.weight, b.lm_head.weight)


def test_generate_chunks_cover_every_prompt_once(model):
    engine = TorchEngine(model)
    params = SamplingParams(max_new_tokens=12, temperature=1.0, eos_id=EOS_ID, seed=5)
    chunks = list(engine.generate(_prompts(7), params, chunks=3))
    assert [len(c) for c in chunks] == [2, 3, 2]
    seen = np.concatenate([c.prompt_index for c in chunks])
    assert sorted(seen.tolist()) == list(range(7))
    for c in chunks:
        assert list(c.prompt_index) == sorted(c.prompt_index)
        for r, lp, fin in zip(c.response_ids, c.logprobs, c.finished, strict=True):
            assert 1 <= len(r) <= 12 and len(lp) == len(r)
            assert bool(fin) == (r[-1] == EOS_ID)
            assert (lp <= 0).all()


def test_finished_responses_leave_first():
    """A response that hits EOS early is in an earlier chunk than one cut at the cap."""
    model = build_model(TINY, heads=("lm",), seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[EOS_ID] = 0.0
    engine = TorchEngine(model)
    # uniform logits: lengths vary; chunks must be ordered by finishing time
    params = SamplingParams(max_new_tokens=40, temperature=1.0, eos_id=EOS_ID, seed=1)
    gen = engine.generate(_prompts(16), params, chunks=4)
    lengths = [max(len(r) for r in c.response_ids) for c in gen]
    assert lengths == sorted(lengths)


def test_generation_logprobs_match_the_forward_pass(model):
    engine = TorchEngine(model)
    params = SamplingParams(max_new_tokens=10, temperature=0.7, eos_id=EOS_ID, seed=2)
    (c,) = list(engine.generate(_prompts(5), params))
    lp = forward_arrays(model, c.prompt_ids, c.response_ids, "logprobs", temperature=0.7)
    for a, b in zip(lp, c.logprobs, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-4)


def test_top_p_keeps_only_the_nucleus():
    logits = torch.tensor([[5.0, 4.0, -10.0, -10.0]])
    gen = torch.Generator().manual_seed(0)
    toks = {int(sample(logits, 1.0, 0.5, gen)[0]) for _ in range(50)}
    assert toks == {0}
    assert chunk_bounds(5, 2) == [(0, 2), (2, 5)]


def test_values_and_scores_have_the_right_shapes(model):
    prompts = _prompts(3)
    responses = [np.array([97, 97]), np.array([98]), np.array([99, 99, 258])]
    values = forward_arrays(model, prompts, responses, "values")
    assert [len(v) for v in values] == [2, 1, 3]
    scores = forward_arrays(model, prompts, responses, "scores")
    assert scores.shape == (3,)


def _batch(model, n=8, seed=0):
    engine = TorchEngine(model)
    params = SamplingParams(max_new_tokens=8, temperature=1.0, eos_id=EOS_ID, seed=seed)
    (c,) = list(engine.generate(_prompts(n), params))
    score = [len(r) / 8 + float((r == 97).mean()) for r in c.response_ids]
    a, ret = adv.gae(score, [np.zeros(len(r), np.float32) for r in c.response_ids])
    return c, a, ret


def test_ppo_and_value_losses_are_finite_and_learn():
    model = build_model(TINY, heads=("lm", "value"), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    c, a, ret = _batch(model)
    batch = TrainBatch(c.prompt_ids, c.response_ids, old_logprobs=c.logprobs, advantages=a,
                       returns=ret, old_values=tuple(np.zeros(len(r), np.float32) for r in ret))
    losses = [LossSpec("ppo_clip", clip=0.2), LossSpec("value_mse", clip=0.2, coef=0.5)]
    first = train_step(TokenHeads(model), opt, batch, losses, version=0, minibatches=2, epochs=2)
    for _ in range(5):
        last = train_step(TokenHeads(model), opt, batch, losses, version=0, minibatches=2, epochs=2)
    assert all(np.isfinite(v) for v in first.values())
    assert last["value_loss"] < first["value_loss"]
    assert 0.0 <= last["clip_frac"] <= 1.0


def test_a_non_finite_gradient_raises_before_the_update_and_leaves_the_weights():
    model = build_model(TINY, heads=("lm", "value"), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    c, a, ret = _batch(model)
    huge = tuple(np.full(len(r), 3e38, np.float32) for r in ret)   # float32's, squared: inf
    batch = TrainBatch(c.prompt_ids, c.response_ids, old_logprobs=c.logprobs, advantages=a,
                       returns=huge, old_values=tuple(np.zeros(len(r), np.float32) for r in ret))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(NonFiniteUpdate) as e:
        train_step(TokenHeads(model), opt, batch, [LossSpec("value_mse", coef=0.5)],
                   version=0)
    assert not np.isfinite(e.value.grad_norm)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_off_policy_batches_are_weighted_and_capped():
    model = build_model(TINY, heads=("lm",), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    c, a, _ = _batch(model)
    stale = TrainBatch(c.prompt_ids, c.response_ids,
                       old_logprobs=tuple(lp - 5.0 for lp in c.logprobs),  # far from current
                       advantages=a, behaviour_version=0)
    stats = train_step(TokenHeads(model), opt, stale, [LossSpec("ppo_clip", is_cap=2.0)],
                       version=3)
    assert stats["is_weight"] == pytest.approx(2.0)     # every ratio e^5 capped at 2
    on = train_step(TokenHeads(model), opt, TrainBatch(c.prompt_ids, c.response_ids,
                    old_logprobs=c.logprobs, advantages=a), [LossSpec("ppo_clip")], version=0)
    assert "is_weight" not in on


def test_grpo_loss_with_kl_to_reference():
    model = build_model(TINY, heads=("lm",), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    c, _, _ = _batch(model)
    groups = np.arange(len(c)) // 4
    scores = np.array([float((r == 97).sum()) for r in c.response_ids])
    a = adv.group_norm(scores, groups)
    batch = TrainBatch(c.prompt_ids, c.response_ids, old_logprobs=c.logprobs,
                       advantages=tuple(a), ref_logprobs=c.logprobs)
    stats = train_step(TokenHeads(model), opt, batch, [LossSpec("grpo", kl=0.1)], version=0)
    assert np.isfinite(stats["loss"]) and abs(stats["kl"]) < 1e-4


def test_gae_by_hand():
    # one response of two tokens, values 0.5 and 0.25, score 1 on the last token, gamma = lam = 1
    a, r = adv.gae([1.0], [np.array([0.5, 0.25], np.float32)], gamma=1.0, lam=1.0)
    np.testing.assert_allclose(a[0], [0.5, 0.75])
    np.testing.assert_allclose(r[0], [1.0, 1.0])
    # the KL penalty lands on every token
    a, _ = adv.gae([0.0], [np.zeros(2, np.float32)], [np.array([-1.0, -1.0])],
                   [np.array([-2.0, -2.0])], kl=0.5, gamma=1.0, lam=1.0)
    np.testing.assert_allclose(a[0], [-1.0, -0.5])


def test_group_norm_and_rloo():
    scores = np.array([1.0, 0.0, 3.0, 3.0])
    groups = np.array([0, 0, 1, 1])
    # the sample std of [1, 0] is sqrt(1/2)
    np.testing.assert_allclose(adv.group_norm(scores, groups),
                               [np.sqrt(0.5), -np.sqrt(0.5), 0.0, 0.0], atol=1e-5)
    np.testing.assert_allclose(adv.group_norm(scores, groups, correction=0),
                               [1.0, -1.0, 0.0, 0.0], atol=1e-5)
    np.testing.assert_allclose(adv.rloo(scores, groups), [1.0, -1.0, 0.0, 0.0])


def test_checkpoint_round_trip_is_atomic_and_pickle_free(tmp_path, model):
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    c, a, _ = _batch(model)
    train_step(TokenHeads(model), opt, TrainBatch(c.prompt_ids, c.response_ids,
               old_logprobs=c.logprobs, advantages=a), [LossSpec("ppo_clip")], version=0)
    path = save_checkpoint(model, tmp_path / "actor", {"version": 1}, opt)
    save_checkpoint(model, tmp_path / "actor", {"version": 2}, opt)      # overwrite in place
    assert sorted(p.name for p in path.iterdir()) == ["meta.json", "model.safetensors",
                                                      "optimizer.safetensors"]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old"))
    other = build_model(TINY, heads=("lm", "value"), seed=9)
    opt2 = torch.optim.Adam(other.parameters(), lr=1e-3)
    meta = load_checkpoint(other, path, opt2)
    assert meta["version"] == 2
    for (_, p), (_, q) in zip(model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(p, q)
    assert len(opt2.state) == len(opt.state)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_generate_and_train_in_bf16():
    model = build_model(TINY, heads=("lm", "value"), seed=0).to("cuda")
    engine = TorchEngine(model, device="cuda")
    params = SamplingParams(max_new_tokens=8, temperature=1.0, eos_id=EOS_ID, seed=0)
    (c,) = list(engine.generate(_prompts(4), params))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    a, ret = adv.gae([1.0] * 4, [np.zeros(len(r), np.float32) for r in c.response_ids])
    stats = train_step(TokenHeads(model), opt, TrainBatch(c.prompt_ids, c.response_ids,
                       old_logprobs=c.logprobs, advantages=a, returns=ret),
                       [LossSpec("ppo_clip"), LossSpec("value_mse")], version=0, device="cuda")
    assert np.isfinite(stats["loss"])


def test_model_from_a_local_weights_directory(tmp_path):
    from transformers import LlamaForCausalLM

    from backends.torch_backend.modeling import hf_config
    torch.manual_seed(1)
    saved = LlamaForCausalLM(hf_config(TINY))
    saved.save_pretrained(tmp_path / "w")
    model = build_model(TINY, heads=("lm", "value"), weights=str(tmp_path / "w"))
    assert torch.equal(model.lm_head.weight, saved.lm_head.weight)
    ids = torch.tensor([[257, 97, 98]])
    with torch.no_grad():
        want = saved(input_ids=ids).logits
        hidden, _ = model(ids, torch.ones_like(ids))
        got = model.lm_head(hidden)
    torch.testing.assert_close(got, want)
    from rpeg.errors import BackendError
    with pytest.raises(BackendError, match="config.json"):
        build_model(TINY, weights=str(tmp_path))
