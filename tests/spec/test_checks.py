"""What cannot run is refused at ``rpeg check``, by class, at the right FILE:LINE:COL.

The classes come from the registry: keyword ranges (a probability above 1), the roles of
what a stage reads and writes (a forward with no responses, an estimator missing an input,
more outputs than a function produces), keywords that need an input or another keyword,
keywords that moved, and whole-pipeline facts (samples per prompt, context length,
trainable models no stage trains, a weights folder that disagrees with its preset). Each
case is one edit of a small GRPO pipeline or of BASE (tests/fixtures/small_ppo.rpeg).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpeg.errors import SpecError
from rpeg.spec import check_file

PPO = (Path(__file__).resolve().parents[1] / "fixtures" / "small_ppo.rpeg").read_text()
#  1 pipeline t            6 reward r = ...         11 stage adv = ...
#  2 workload { ... }      7 stage rollout = ...    12 stage actor_step = ...
#  3 model actor ...       8 stage ref_lp = ...     13 stage critic_step = ...
#  4 model critic ...      9 stage values = ...
#  5 model ref ...        10 stage scores = ...
GRPO = """\
pipeline g
workload { steps = 10; prompts = 4; samples = 4; prompt_len = 8; gen_len = 16 }
model actor : tiny { optimizer = adam(lr = 1e-3) }
model ref : tiny { frozen }
reward r = python("rewards:score")
stage rollout = generate(actor, prompts) -> responses, logprobs
stage ref_lp = forward(ref, responses) -> ref_logprobs
stage scores = score(r, responses) -> scores
stage adv = group_norm(scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs, loss = grpo(0.2))
"""
REWARDS = "def score(prompts, responses, answers=None):\n    return [0.0] * len(responses)\n"


def sub(old: str, new: str, text: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def g(old: str, new: str) -> str:
    return sub(old, new, GRPO)


def p(old: str, new: str) -> str:
    return sub(old, new, PPO)


# (id, text, line, col, message substring)
CASES = [
    # --- values outside their declared range ----------------------------------------------
    ("probability-above-one", g("generate(actor, prompts)", "generate(actor, prompts, top_p = 1.5)"),
     6, 50, "top_p must be in (0, 1], not 1.5"),
    ("filter-rate-of-one", g("generate(actor, prompts)",
                             "generate(actor, prompts, refill_rounds = 2, filter_rate = 1)"),
     6, 75, "filter_rate must be in [0, 1), not 1"),
    ("negative-temperature", g("generate(actor, prompts)",
                               "generate(actor, prompts, temperature = -1)"), 6, 56,
     "temperature must be in [0, 100], not -1"),
    ("clip-above-one", g("grpo(0.2)", "grpo(1.5)"), 10, 92, "clip must be in (0, 1), not 1.5"),
    ("lam-above-one", p("gae(scores, values, logprobs, ref_logprobs)",
                        "gae(scores, values, logprobs, ref_logprobs, lam = 2)"), 11, 63,
     "lam must be in [0, 1], not 2"),
    ("zero-minibatches", g("loss = grpo(0.2))", "loss = grpo(0.2), minibatches = 0)"), 10, 112,
     "minibatches must be at least 1, not 0"),
    ("context-too-long", g("prompt_len = 8; gen_len = 16", "prompt_len = 400; gen_len = 200"),
     2, 68, "must fit model 'actor''s context of 512 positions"),
    ("max-len-above-gen-len", g("generate(actor, prompts)",
                                "generate(actor, prompts, max_len = 32)"), 6, 42,
     "max_len must be at most the workload's gen_len max (16), not 32"),
    ("min-len-above-max-len", g("generate(actor, prompts)",
                                "generate(actor, prompts, max_len = 8, min_len = 9)"), 6, 55,
     "min_len must be at most max_len (8), not 9"),
    # --- inputs and outputs by role ---------------------------------------------------------
    ("forward-without-responses", g("forward(ref, responses)", "forward(ref)"), 7, 16,
     "forward(...) must read generated responses"),
    ("forward-of-scores", g("stage ref_lp = forward(ref, responses)",
                            "stage ref_lp = forward(ref, scores)"), 7, 29,
     "'scores' must be responses to be read by forward(...), not one reward per response"),
    ("estimator-missing-values", p("gae(scores, values, logprobs, ref_logprobs)",
                                   "gae(scores, logprobs, ref_logprobs)"), 11, 13,
     "gae(...) must read per-token value estimates"),
    ("estimator-missing-scores", g("group_norm(scores)", "group_norm(ref_logprobs)"), 9, 13,
     "group_norm(...) must read one reward per response"),
    ("estimator-too-many-outputs", g("-> advantages\n", "-> advantages, returns\n"), 9, 47,
     "group_norm(...) must name at most 1 output (advantages), not 2"),
    ("generate-too-many-outputs", g("-> responses, logprobs", "-> responses, logprobs, extra"),
     6, 66, "generate(...) must name at most 2 outputs (responses, logprobs), not 3"),
    ("train-reading-scores", g("advantages, logprobs, ref_logprobs, loss",
                               "advantages, scores, logprobs, ref_logprobs, loss"), 10, 56,
     "'scores' must be responses, advantages, logprobs, ref_logprobs to be read by train(...)"),
    ("policy-loss-without-advantages", g("train(actor, responses, advantages, logprobs",
                                         "train(actor, responses, logprobs"), 10, 20,
     "train(...) must read advantages"),
    ("two-of-one-role", p("stage actor_step = train(actor, responses, advantages)",
                          "stage actor_step = train(actor, responses, advantages, logprobs, "
                          "ref_logprobs, values)"), 12, 80,
     "'values' must be responses, advantages, logprobs, ref_logprobs to be read by train(...)"),
    ("remax-baseline-not-scores", g("stage adv = group_norm(scores)",
                                    "stage adv = remax(scores, baseline = ref_logprobs)"), 9, 27,
     "not a frozen reference model's per-token log-probabilities"),
    # each score minus no baseline: NaN advantages, a run stopped at its first update
    ("remax-without-baseline", g("stage adv = group_norm(scores)",
                                 "stage adv = remax(scores)"), 9, 1,
     "remax must name its baseline"),
    # --- keywords that need an input or another keyword -------------------------------------
    ("kl-without-ref", g("train(actor, responses, advantages, logprobs, ref_logprobs, loss = "
                         "grpo(0.2))", "train(actor, responses, advantages, logprobs, loss = "
                         "grpo(0.2, kl = 0.1))"), 10, 83,
     "kl = 0.1 needs a frozen reference model's per-token log-probabilities"),
    ("reward-kl-without-logprobs", g("group_norm(scores)", "group_norm(scores, kl = 0.1)"),
     9, 32, "kl = 0.1 needs the policy's per-token log-probabilities"),
    ("value-clip-without-values", p("train(critic, responses, returns)",
                                    "train(critic, responses, returns, loss = value_mse(0.2))"),
     13, 72, "clip = 0.2 needs per-token value estimates"),
    ("estimator-alone", g("grpo(0.2)", "grpo(0.2, kl_estimator = k2)"), 10, 112,
     "kl_estimator must come with kl in grpo(...), not alone"),
    # a schedule given, at the value that turns it off: not "alone"
    ("min-lr-constant", g("adam(lr = 1e-3)", "adam(lr = 1e-3, schedule = constant, "
                                             "min_lr = 1e-4)"), 3, 80,
     "min_lr does nothing with schedule = constant in adam(...)"),
    ("filter-rate-alone", g("generate(actor, prompts)",
                            "generate(actor, prompts, filter_rate = 0.3)"), 6, 56,
     "filter_rate must come with refill_rounds in generate(...)"),
    ("min-lr-alone", g("adam(lr = 1e-3)", "adam(lr = 1e-3, min_lr = 1e-5)"), 3, 59,
     "min_lr must come with schedule in adam(...)"),
    ("refill-without-scores", g("stage scores = score(r, responses) -> scores\n"
                                "stage adv = group_norm(scores)",
                                "stage scores = score(r, logprobs) -> scores\n"
                                "stage adv = group_norm(scores)"), 8, 25,
     "'logprobs' must be responses to be read by score(...)"),
    # --- keywords that moved, or never did anything -----------------------------------------
    ("train-grad-clip", g("loss = grpo(0.2))", "loss = grpo(0.2), grad_clip = 1.0)"), 10, 98,
     "train(...) takes no key 'grad_clip'"),
    ("train-kl", g("loss = grpo(0.2))", "loss = grpo(0.2), kl = 0.01)"), 10, 98,
     "train(...) takes no key 'kl'"),
    ("train-entropy", g("loss = grpo(0.2))", "loss = grpo(0.2), entropy = 0.01)"), 10, 98,
     "train(...) takes no key 'entropy'"),
    ("train-value-clip", p("train(critic, responses, returns)",
                           "train(critic, responses, returns, value_clip = 0.2)"), 13, 55,
     "train(...) takes no key 'value_clip'"),
    ("train-microbatch", g("loss = grpo(0.2))", "loss = grpo(0.2), microbatch = 2)"), 10, 98,
     "train(...) takes no key 'microbatch'"),
    ("forward-microbatch", g("forward(ref, responses)", "forward(ref, responses, microbatch = 2)"),
     7, 40, "forward(...) takes no key 'microbatch'"),
    ("generate-chunks", g("generate(actor, prompts)", "generate(actor, prompts, chunks = 2)"),
     6, 42, "generate(...) takes no key 'chunks'"),
    ("estimator-adaptive-kl", g("group_norm(scores)", "group_norm(scores, kl_target = 0.1)"),
     9, 32, "group_norm(...) takes no key 'kl_target'"),
    ("weight-of-unread-scores", g("stage adv =", "stage extra = score(r, responses, weight = 2) "
                                  "-> extra\nstage adv ="), 9, 35,
     "weight must weigh scores an estimator adds up, and no estimator adds up 'extra'"),
    ("shared-optimizers-differ", p("model critic : tiny { head = value }",
                                   "model critic : tiny { head = value; optimizer = "
                                   "adamw(lr = 1e-3) }") + "share actor, critic\n", 4, 1,
     "its optimizer must be the same but for lr, not differ in kind, weight_decay"),
    ("old-estimator-name", g("group_norm(scores)", "grpo_advantages(scores)"), 9, 13,
     "unknown stage kind 'grpo_advantages'"),
    ("loss-as-stage", g("group_norm(scores)", "ppo_clip(scores)"), 9, 13,
     "unknown stage kind 'ppo_clip'"),
    # --- whole-pipeline facts -------------------------------------------------------------------
    ("group-norm-one-sample", g("samples = 4", "samples = 1"), 9, 13,
     "group_norm(...) needs at least 2 samples per prompt, not 1"),
    ("rloo-one-sample", g("samples = 4; ", "").replace("group_norm(", "rloo("), 9, 13,
     "rloo(...) needs at least 2 samples per prompt, not 1"),
    ("refill-one-sample", g("samples = 4", "samples = 1").replace(
        "group_norm(scores)", "reinforce(scores)").replace(
        "generate(actor, prompts)", "generate(actor, prompts, refill_rounds = 2)"), 6, 42,
     "generate(...) needs at least 2 samples per prompt, not 1"),
    ("trainable-never-trained", p("stage critic_step = train(critic, responses, returns)\n", ""),
     4, 1, "model 'critic' must be trained by a stage or marked frozen"),
    ("reward-model-trained", p("model critic : tiny { head = value }",
                               "model critic : tiny { head = reward }"), 13, 21,
     "no loss trains a model with head = reward ('critic')"),
]


def _write(tmp_path: Path, text: str | bytes, name: str = "case.rpeg") -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_the_bases_are_valid(tmp_path):
    assert check_file(_write(tmp_path, GRPO)).value.name == "g"
    assert check_file(_write(tmp_path, PPO)).value.name == "t"


@pytest.mark.parametrize(("text", "line", "col", "message"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_refused(tmp_path, text, line, col, message):
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, text))
    err = info.value
    assert message in err.message, err.render()
    assert (err.span.line, err.span.col) == (line, col), err.render()
    assert err.render().startswith(f"{err.span.path}:{line}:{col}: error: ")


def test_moved_keys_say_where_they_went(tmp_path):
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, g("loss = grpo(0.2))", "loss = grpo(0.2), kl = 0.01)")))
    assert info.value.hint == "a KL loss term belongs to the loss: loss = grpo(0.2, kl = 0.01)"


def test_what_now_works_is_accepted(tmp_path):
    """Keys that were no-ops and now run are accepted where they belong."""
    text = g("generate(actor, prompts)", "generate(actor, prompts, min_len = 2, max_len = 12, "
             "refill_rounds = 2, filter_rate = 0.3)")
    text = sub("group_norm(scores)", "group_norm(scores, logprobs, ref_logprobs, kl = 0.01, "
               "eps = 1e-4, correction = 0)", text)
    text = sub("loss = grpo(0.2))", "loss = grpo(0.2, kl = 0.04, entropy = 0.001, tis = 2, "
               "clip_high = 0.28, agg = seq_mean_token_sum))", text)
    p = check_file(_write(tmp_path, text)).value
    assert p.workload.gen_len.max_len == 12 and p.workload.gen_len.floor == 2
    assert dict(p.stage("actor_step").param("loss").kwargs)["tis"] == 2.0


def test_a_reward_model_scores_and_two_scores_add_up(tmp_path):
    text = sub("reward r = python", 'model rm : tiny { head = reward; frozen; weights = "rm" }'
               "\nreward r = python",
               GRPO)
    text = sub("stage adv = group_norm(scores)",
               "stage rm_scores = score(rm, responses, weight = 0.5) -> rm_scores\n"
               "stage adv = group_norm(scores, rm_scores)", text)
    p = check_file(_write(tmp_path, text)).value
    assert p.stage("adv").inputs == ("scores", "rm_scores")


def test_weights_folder_must_agree_with_the_preset(tmp_path):
    folder = tmp_path / "w"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
        "vocab_size": 259}))
    text = g("model actor : tiny { optimizer", 'model actor : tiny { weights = "w"; optimizer')
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, text))
    err = info.value
    assert "preset tiny must describe the model in its weights folder" in err.message
    assert "hidden 64 (folder: 128)" in err.message
    assert err.span.line == 3
    (folder / "config.json").write_text("{not json")
    with pytest.raises(SpecError, match="config.json"):
        check_file(_write(tmp_path, text))


def test_an_extending_file_is_blamed_for_what_it_breaks(tmp_path):
    """samples = 1 in the extending file breaks the base's group_norm: the error is at the
    extending file's line, with a note at the base's."""
    _write(tmp_path, GRPO, "base.rpeg")
    derived = _write(tmp_path, 'extend "base.rpeg"\npipeline d\nworkload {\n    samples = 1\n}\n',
                     "derived.rpeg")
    with pytest.raises(SpecError) as info:
        check_file(derived)
    err = info.value
    assert err.span.path == str(derived) and (err.span.line, err.span.col) == (4, 5)
    assert "needs at least 2 samples per prompt" in err.message
    (text, span), *_ = err.notes
    assert span.path.endswith("base.rpeg") and span.line == 9
    assert "base.rpeg:9:" in err.render()


def test_an_error_of_the_base_alone_stays_in_the_base(tmp_path):
    _write(tmp_path, g("generate(actor, prompts)", "generate(actor, prompts, top_p = 2)"),
           "base.rpeg")
    derived = _write(tmp_path, 'extend "base.rpeg"\npipeline d\n', "derived.rpeg")
    with pytest.raises(SpecError) as info:
        check_file(derived)
    assert info.value.span.path.endswith("base.rpeg")


def test_a_stray_control_byte_is_reported_where_it_is(tmp_path):
    raw = GRPO.replace("pipeline g\n", "pipeline g\n# a comment \x00 with a NUL\n").encode()
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, raw))
    err = info.value
    assert (err.span.line, err.span.col) == (2, 13)
    assert "NUL byte" in err.message and err.hint == "delete the stray byte"
