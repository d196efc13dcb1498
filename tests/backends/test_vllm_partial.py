"""Partial rollouts with the vLLM engine: cohorts carried over steps under new weights,
prefix logprobs and versions kept, and a checkpointed buffer continued exactly.

One in-process engine serves the module. The policy is ``tiny-vllm`` made to end a
response with about one token in ten in any context (:func:`eos_logit`), so that lengths
vary and some responses end in the step they start while others carry. Tolerance: |vLLM - torch| <=
1e-4 per token, both float32 (as in test_vllm_engine.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.vllm_backend import available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not available()[0], reason="vllm is not installed")]

TOL = 1e-4
MAX = 16
PROMPTS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):

    from backends.torch_backend.modeling import build_model
    from backends.vllm_backend.engine import VllmEngine, VllmOptions
    from backends.vllm_backend.models import save_policy
    from rpeg.spec.presets import PRESETS

    model = build_model(PRESETS["tiny-vllm"], heads=("lm",), seed=0).eval()
    from backends.torch_backend.tokenizer import EOS_ID as eos
    eos_logit(model, eos, 3.4)
    path = save_policy(model, tmp_path_factory.mktemp("tiny") / "actor")
    engine = VllmEngine.start(path, VllmOptions(dtype="float32", max_model_len=128,
                                                cpu_cores="nobind"))
    try:
        yield model, engine, eos
    finally:
        engine.shutdown()


def eos_logit(model, eos: int, logit: float) -> None:
    """Make EOS about as likely in every context (about one token in ten at 3.4) and the
    other tokens' logits depend on the context: one hidden coordinate is a large constant
    of every token's embedding, which the final norm turns into a constant that only
    EOS's output row reads."""
    import torch
    with torch.no_grad():
        emb = model.backbone.embed_tokens.weight
        emb.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
        emb[:, 0] = 50.0
        model.lm_head.weight.mul_(30)
        model.lm_head.weight[:, 0] = 0.0
        hidden = emb.shape[1]
        steady = 50.0 / ((50.0**2 + hidden - 1) / hidden) ** 0.5     # the normed coordinate
        model.lm_head.weight[eos, 0] = logit / steady


def _cohorts(step: int, carry: int, eos: int):
    """A call's cohorts, those started early with the budget the executor gives them."""
    from backends.api import Cohort, SamplingParams
    from backends.torch_backend.tokenizer import BOS_ID, encode
    from rpeg.cost.partial import step_budget
    out = []
    for c in range(step, step + carry + 1):
        prompts = tuple(np.array([BOS_ID, *encode(f"{c}+{i}=")], dtype=np.int64)
                        for i in range(PROMPTS))
        out.append(Cohort(c, prompts, SamplingParams(MAX, temperature=1.0, eos_id=eos,
                                                     seed=1000 * step + c),
                          budget=step_budget(MAX, carry, c - step)))
    return out


def _perturb(model, engine, version: int) -> None:
    import torch
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    engine.update_weights(model.state_dict().items(), version)


def _logprobs(model, chunk):
    from backends.torch_backend.train import forward_arrays
    return forward_arrays(model, chunk.prompt_ids, chunk.response_ids, "logprobs")


def test_carried_responses_resume_under_new_weights_with_their_prefix_kept(setup):
    import copy

    model, engine, eos = setup
    engine.carried.clear()
    carried_seen, lengths = 0, set()
    for s in range(4):
        if s:
            old = copy.deepcopy(model)
            _perturb(model, engine, s)
        buf = engine.carried.get("rollout")
        had = {(r.cohort, r.index): (list(r.tokens), list(r.logprobs))
               for rs in (buf.cohorts.values() if buf else ()) for r in rs}
        chunks = list(engine.generate_carried(_cohorts(s, 1, eos), chunks=2, key="rollout"))
        assert len(chunks) == 2
        idx = np.concatenate([c.prompt_index for c in chunks])
        assert sorted(idx.tolist()) == list(range(PROMPTS))        # each prompt once
        for c in chunks:
            fresh = _logprobs(model, c)
            oldest = s
            for i, r, lp, f in zip(c.prompt_index, c.response_ids, c.logprobs, fresh,
                                   strict=True):
                lengths.add(len(r))
                assert 1 <= len(r) <= MAX and (r[-1] == eos or len(r) == MAX)
                tokens, logprobs = had.get((s, int(i)), ([], []))
                k = len(tokens)
                assert r[:k].tolist() == tokens                    # continued, not resampled
                np.testing.assert_array_equal(lp[:k], np.float32(logprobs))   # kept as sampled
                np.testing.assert_allclose(lp[k:], f[k:], atol=TOL)  # sampled now: new weights
                if k:
                    oldest = s - 1                       # sampled a step before, or ended then
                if 0 < k < len(r):
                    carried_seen += 1
                    then = _logprobs(old, c)[list(c.prompt_index).index(i)]
                    np.testing.assert_allclose(lp[:k], then[:k], atol=TOL)
            assert c.version == oldest
        # the next cohort advanced by its share, no further
        assert all(len(r.tokens) <= MAX // 2 for r in engine.carried["rollout"].cohorts[s + 1])
    assert carried_seen > 0 and len(lengths) > 3


def test_a_checkpointed_buffer_continues_the_same_responses(setup, tmp_path):
    from rpeg.runtime.rundir.checkpoints import load_tree, save_tree

    model, engine, eos = setup
    engine.carried.clear()
    for s in range(8):                  # until the buffer holds a response half made
        list(engine.generate_carried(_cohorts(s, 1, eos), chunks=1, key="rollout"))
        kept = {(r.cohort, r.index): list(r.tokens) for rs in engine.carried["rollout"]
                .cohorts.values() for r in rs}
        if any(kept.values()):
            break
    assert any(kept.values())
    save_tree(tmp_path, "carried", {"buffers": engine.carried_state()})
    nxt = s + 1
    straight = list(engine.generate_carried(_cohorts(nxt, 1, eos), chunks=1, key="rollout"))
    engine.restore_carried(tuple(load_tree(tmp_path, "carried")["buffers"]))
    resumed = list(engine.generate_carried(_cohorts(nxt, 1, eos), chunks=1, key="rollout"))
    (a,), (b,) = straight, resumed
    assert [r.tolist() for r in a.response_ids] == [r.tolist() for r in b.response_ids]
    for i, r in zip(b.prompt_index, b.response_ids, strict=True):
        assert r[:len(kept[(nxt, int(i))])].tolist() == kept[(nxt, int(i))]
    # a buffer from another step is not continued: the call starts afresh
    engine.restore_carried(tuple(load_tree(tmp_path, "carried")["buffers"]))
    list(engine.generate_carried(_cohorts(nxt + 3, 1, eos), chunks=1, key="rollout"))
    assert sorted(engine.carried["rollout"].cohorts) == [nxt + 4]
