"""Every mistake a user can make in a .rpeg file: the message, and exactly where it points.

Each case is a malformed input (most are one edit of BASE, a small valid PPO
pipeline) with the substring its error message must contain and the exact
line:col it must point at. Cases run through ``check_file`` on a real file,
next to a ``rewards.py``, as ``rpeg check`` does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rpeg.errors import RpegError, SpecError
from rpeg.spec import check_file

# BASE is tests/fixtures/small_ppo.rpeg; its line numbers, for reading the cases below:
#  1 pipeline t            6 reward r = ...         11 stage adv = ...
#  2 workload { ... }      7 stage rollout = ...    12 stage actor_step = ...
#  3 model actor ...       8 stage ref_lp = ...     13 stage critic_step = ...
#  4 model critic ...      9 stage values = ...
#  5 model ref ...        10 stage scores = ...     (appended lines start at 14)
BASE = (Path(__file__).resolve().parents[1] / "fixtures" / "small_ppo.rpeg").read_text()

CLUSTER = """\
cluster c {
    gpu = "p.rpeg"
    gpus_per_node = 4
    link gpu { bandwidth = 100 GB/s; latency = 2 us }
}
"""

PROFILE = "profile p { memory = 80 GB; matmul_flops = 500 TFLOPS; mem_bandwidth = 2 TB/s }\n"

REWARDS = "def score(prompts, responses, answers=None):\n    return [0.0] * len(responses)\n"


def sub(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def add(*lines: str) -> str:
    return BASE + "".join(line + "\n" for line in lines)


# (id, text, line, col, message substring)
CASES: list[tuple[str, str, int, int, str]] = [
    # --- syntax: labelled, never a parser-state dump ----------------------------------
    ("pipeline-without-name", "pipeline\n", 1, 9, "expected a name after 'pipeline'"),
    ("model-without-colon", "pipeline p\nmodel a tiny\n", 2, 9, "expected ':'"),
    ("staleness-with-equals", sub("stage critic_step", "staleness rollout = 1\nstage critic_step"),
     13, 19, "expected '<='"),
    ("unterminated-string", 'pipeline p\nextend "base.rpeg\n', 2, 8, "unterminated string"),
    ("stray-character", "pipeline p\nshare a, b @\n", 2, 12, "unexpected character '@'"),
    ("misspelt-keyword", "pipeline p\nstgae x = f()\n", 2, 1, "expected a statement"),
    ("missing-value", "pipeline p\nworkload {\n    steps =\n}\n", 3, 12, "expected"),
    ("unclosed-block", "pipeline p\nworkload {\n    steps = 1\n", 3, 14, "end of file"),
    ("two-statements-one-line", "pipeline p share a, b\n", 1, 12, "expected end of line"),
    ("unclosed-call", sub("generate(actor, prompts) ->", "generate(actor, prompts ->"),
     7, 41, "expected ',', '=', '(' or ')', not '->'"),
    ("unknown-escape", 'pipeline p\nextend "a\\q.rpeg"\n', 2, 10, "unknown escape '\\q'"),
    # --- names: unknown, duplicate -----------------------------------------------------
    ("unknown-model", sub("generate(actor,", "generate(actr,"), 7, 26, "unknown model 'actr'"),
    ("duplicate-model", sub("model ref : tiny", "model actor : tiny"), 5, 1,
     "model 'actor' is defined twice"),
    ("duplicate-stage", add("stage values = forward(critic, responses) -> v2"), 14, 1,
     "stage 'values' is defined twice"),
    ("model-and-reward-same-name", sub("reward r =", "reward ref ="), 6, 1,
     "name 'ref' is defined twice"),
    ("unknown-stage-kind", sub("generate(actor", "generat(actor"), 7, 17,
     "unknown stage kind 'generat'"),
    ("unknown-preset", sub("model ref : tiny", "model ref : llama3-8b"), 5, 13,
     "unknown model preset 'llama3-8b'"),
    ("unknown-workload-key", sub("steps = 10", "stpes = 10"), 2, 12,
     "unknown key 'stpes' in the workload block"),
    ("unknown-reward", sub("score(r,", "score(rr,"), 10, 22, "unknown reward or model 'rr'"),
    ("duplicate-pipeline", sub("pipeline t\n", "pipeline t\npipeline u\n"), 2, 1,
     "a file holds one pipeline; 'pipeline u' is a second one"),
    # --- dataflow ------------------------------------------------------------------------
    ("never-produced", sub("forward(ref, responses)", "forward(ref, respones)"), 8, 29,
     "'respones' is read by stage 'ref_lp' but no stage produces it"),
    ("produced-twice", add("stage again = forward(ref, responses) -> scores"), 14, 42,
     "'scores' is produced by two stages, 'scores' and 'again'"),
    ("cycle-in-step", add("stage a = forward(ref, y) -> x", "stage b = forward(ref, x) -> y"),
     14, 1, "stages depend on each other in a cycle"),
    ("model-as-data", sub("forward(ref, responses)", "forward(ref, actor)"), 8, 29,
     "'actor' is a model or reward, not data"),
    ("output-named-like-model", sub("-> ref_logprobs", "-> ref"), 8, 43,
     "output 'ref' has the name of a model or reward"),
    ("generate-without-prompts", sub("generate(actor, prompts)", "generate(actor)"), 7, 17,
     "generate(...) must read the workload's prompts"),
    ("train-with-outputs", sub("train(actor, responses, advantages)",
                               "train(actor, responses, advantages) -> new_actor"), 12, 1,
     "a train stage produces a new version of its model, not data"),
    ("stage-produces-nothing", add("stage lost = forward(ref, responses)"), 14, 14,
     "stage 'lost' produces nothing"),
    ("workload-data-as-output", add("stage p2 = forward(ref, responses) -> prompts"), 14, 39,
     "'prompts' comes from the workload"),
    # --- staleness ------------------------------------------------------------------------
    ("staleness-frozen-model", add("staleness ref_lp <= 1"), 14, 1,
     "reads frozen model 'ref'"),
    ("staleness-no-model", add("staleness adv <= 1"), 14, 1, "which reads no model"),
    ("staleness-reward", add("staleness scores <= 1"), 14, 1, "which reads reward 'r'"),
    ("staleness-untrained-model", sub("stage actor_step = train(actor, responses, advantages)\n",
                                      "") + "staleness rollout <= 1\n", 13, 1,
     "reads model 'actor' that no stage trains"),
    ("staleness-negative", add("staleness rollout <= -1"), 14, 22,
     "staleness bound must be a non-negative integer, not -1"),
    ("staleness-fraction", add("staleness rollout <= 1.5"), 14, 22,
     "staleness bound must be an integer, not 1.5"),
    ("staleness-with-unit", add("staleness rollout <= 1 s"), 14, 22,
     "staleness bound must be a plain integer, not 1 s"),
    ("staleness-unknown-stage", add("staleness rollot <= 1"), 14, 11,
     "staleness names unknown stage 'rollot'"),
    ("staleness-train-stage", add("staleness actor_step <= 1"), 14, 1,
     "staleness on train stage 'actor_step'"),
    ("staleness-twice", add("staleness rollout <= 1", "staleness rollout <= 2"), 15, 1,
     "staleness of stage 'rollout' is defined twice"),
    # --- models: frozen, sharing, heads ---------------------------------------------------
    ("train-frozen", add("stage ref_step = train(ref, responses, advantages)"), 14, 24,
     "cannot train frozen model 'ref'"),
    ("trained-twice", add("stage actor_step2 = train(actor, responses, advantages)"), 14, 27,
     "model 'actor' is trained by two stages, 'actor_step' and 'actor_step2'"),
    ("frozen-with-optimizer", sub("{ frozen }", "{ frozen; optimizer = adam(lr = 1e-3) }"),
     5, 28, "model 'ref' is frozen and cannot have an optimizer"),
    ("master-weights-of-fp32", sub("{ optimizer = adam(lr = 1e-3) }",
                                   "{ optimizer = adam(lr = 1e-3, master_weights = false); "
                                   "dtype = fp32 }"),
     3, 22, "master_weights = false must be asked of a 16-bit model, not of dtype fp32"),
    ("master-weights-not-a-flag", sub("adam(lr = 1e-3)", "adam(lr = 1e-3, master_weights = 0)"),
     3, 67, "master_weights must be true or false, not a number (0)"),
    ("share-different-architectures", sub("model critic : tiny", "model critic : small")
     + "share actor, critic\n", 14, 14, "cannot share models of different architectures"),
    ("share-unknown-model", add("share actor, critc"), 14, 14, "share names unknown model 'critc'"),
    ("second-workload-block", add("workload { steps = 4 }"), 14, 1,
     "a pipeline has one workload block, and this is a second"),
    ("share-frozen", add("share actor, ref"), 14, 14,
     "cannot share the backbone of frozen model 'ref'"),
    ("share-in-two-groups", sub("model ref : tiny { frozen }", "model ref : tiny")
     + "share actor, critic\nshare critic, ref\n", 15, 7,
     "model 'critic' is already shared with actor; a model may be in one share group only"),
    ("share-one-model", add("share actor"), 14, 1, "share needs at least two models"),
    ("value-loss-on-policy", sub("train(actor, responses, advantages)",
                                 "train(actor, responses, advantages, loss = value_mse)"), 12, 63,
     "loss value_mse trains a value head"),
    ("unknown-loss", sub("train(actor, responses, advantages)",
                         "train(actor, responses, advantages, loss = ppo)"), 12, 63,
     "loss must be one of ppo_clip, grpo, gspo, value_mse, not 'ppo'"),
    ("generate-value-model", sub("generate(actor, prompts)", "generate(critic, prompts)"), 7, 26,
     "generate(...) needs a language model"),
    # --- numbers and units ---------------------------------------------------------------
    ("unit-on-count", sub("steps = 10", "steps = 10 GB"), 2, 20,
     "steps must be a plain integer, not 10 GB"),
    ("zero-prompts", sub("prompts = 4", "prompts = 0"), 2, 34, "prompts must be at least 1, not 0"),
    ("fractional-prompts", sub("prompts = 4", "prompts = 1.5"), 2, 34,
     "prompts must be an integer, not 1.5"),
    ("huge-steps", sub("steps = 10", "steps = 99999999999"), 2, 20, "steps must be at most"),
    ("string-for-number", sub("steps = 10", 'steps = "10"'), 2, 20,
     "steps must be an integer, not a string"),
    ("lr-out-of-range", sub("adam(lr = 1e-3)", "adam(lr = 2)"), 3, 44, "lr must be in (0, 1)"),
    ("bad-distribution", sub("gen_len = 16", "gen_len = normal(16)"), 2, 63,
     "gen_len distribution must be one of fixed, uniform, lognormal, empirical, not 'normal'"),
    ("lognormal-max-below-median", sub("gen_len = 16", "gen_len = lognormal(median = 64, max = 8)"),
     2, 63, "lognormal max must be at least the median"),
    ("uniform-max-below-min", sub("gen_len = 16", "gen_len = uniform(min = 9, max = 3)"), 2, 63,
     "uniform max must be at least min"),
    ("place-reversed", add("place rollout on gpus 8..0"), 14, 23,
     "gpu range must run low..high, not 8..0"),
    ("colocate-unknown", add("colocate rollout, valeus"), 14, 19,
     "colocate names unknown stage or model 'valeus'"),
    # --- files ---------------------------------------------------------------------------
    ("empty-file", "", 1, 1, "file holds nothing"),
    ("only-comments", "# nothing here\n", 1, 1, "file holds only comments"),
    ("no-workload", "pipeline p\nmodel a : tiny\n", 1, 1, "pipeline 'p' has no workload block"),
    ("missing-workload-key", sub("prompt_len = 8; ", ""), 2, 1,
     "the workload block must set prompt_len"),
    ("no-pipeline-name", sub("pipeline t\n", ""), 1, 1, "a pipeline file must name its pipeline"),
    ("pipeline-and-cluster", BASE + CLUSTER, 1, 1,
     "a file holds one pipeline or one cluster, not both"),
    ("reward-module-missing", sub("rewards:score", "nowhere_mod:score"), 6, 19,
     "reward module 'nowhere_mod' not found"),
    ("reward-function-missing", sub("rewards:score", "rewards:scroe"), 6, 19,
     "module 'rewards' (" ),
    ("extend-missing-file", sub("pipeline t\n", 'pipeline t\nextend "nope.rpeg"\n'), 2, 8,
     "extend: no such file 'nope.rpeg'"),
    ("extend-self", sub("pipeline t\n", 'pipeline t\nextend "case.rpeg"\n'), 2, 8,
     "extend cycle: case.rpeg -> case.rpeg"),
    # --- clusters ------------------------------------------------------------------------
    ("link-without-unit", sub("bandwidth = 100 GB/s", "bandwidth = 100", CLUSTER), 4, 28,
     "bandwidth must be a bandwidth such as 25 GB/s, not 100 (no unit)"),
    ("link-wrong-unit", sub("latency = 2 us", "latency = 2 GB", CLUSTER), 4, 48,
     "latency must be a duration such as 5 us, not 2 GB (a size)"),
    ("cluster-unknown-key", sub("gpus_per_node = 4", "gpus_per_nod = 4", CLUSTER), 3, 5,
     "unknown key 'gpus_per_nod'"),
    ("profile-wrong-unit", sub("memory = 80 GB", "memory = 80 GB/s", PROFILE), 1, 22,
     "memory must be a size such as 80 GB, not 80 GB/s (a bandwidth)"),
    ("link-bits", sub("100 GB/s", "800 Gb/s", CLUSTER), 4, 32,
     "unknown unit 'Gb/s' after a number"),
    ("profile-lowercase-unit", sub("80 GB", "80 gb", PROFILE), 1, 25,
     "unknown unit 'gb' after a number"),
    ("workload-word-unit", sub("steps = 10", "steps = 10 steps"), 2, 23,
     "unknown unit 'steps' after a number"),
]


def _write(tmp_path: Path, text: str | bytes) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "p.rpeg").write_text(PROFILE)
    path = tmp_path / "case.rpeg"
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_the_table_is_large_and_unique():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES)


def test_base_is_valid(tmp_path):
    checked = check_file(_write(tmp_path, BASE))
    assert checked.value.name == "t"
    assert check_file(_write(tmp_path, CLUSTER)).value.num_gpus == 4


@pytest.mark.parametrize(("text", "line", "col", "message"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_error(tmp_path, text, line, col, message):
    path = _write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        check_file(path)
    err = info.value
    assert message in err.message, err.render()
    assert err.span is not None
    assert (err.span.line, err.span.col) == (line, col), err.render()
    rendered = err.render()
    assert rendered.startswith(f"{err.span.path}:{line}:{col}: error: ")
    assert "Traceback" not in rendered
    assert "Token(" not in rendered and "__ANON" not in rendered    # no parser internals


def test_master_weights_false_reaches_the_model(tmp_path):
    text = BASE.replace("adam(lr = 1e-3)", "adam(lr = 1e-3, master_weights = false)")
    p = tmp_path / "p.rpeg"
    p.write_text(text)
    (tmp_path / "rewards.py").write_text(REWARDS)
    from rpeg.spec import load
    check_file(p)
    pipeline = load(p)
    assert pipeline.model("actor").optimizer.master is False
    assert pipeline.model("critic").optimizer.master is True


def test_two_producers_names_both_spans(tmp_path):
    path = _write(tmp_path, add("stage again = forward(ref, responses) -> scores"))
    with pytest.raises(SpecError) as info:
        check_file(path)
    (note, span), = info.value.notes
    assert "also produced by 'scores'" in note
    assert (span.line, span.col) == (10, 39)
    assert "note:" in info.value.render()


def test_hints_suggest_the_right_name(tmp_path):
    cases = {sub("generate(actor,", "generate(actr,"): "did you mean 'actor'?",
             add("staleness rollot <= 1"): "did you mean 'rollout'?",
             sub("model ref : tiny", "model ref : tinyy"): "did you mean 'tiny'?",
             "pipeline p\nstgae x = f()\n": "did you mean 'stage'?",
             sub("steps = 10", "stpes = 10"): "did you mean 'steps'?"}
    for text, hint in cases.items():
        with pytest.raises(SpecError) as info:
            check_file(_write(tmp_path, text))
        assert info.value.hint == hint, info.value.render()


def test_an_unknown_unit_is_named_with_the_unit_meant(tmp_path):
    """A unit the language lacks is said as one (not as a statement that should end), with
    the unit a misspelling means, bits told apart from bytes, and a digit separator named."""
    cases = {sub("500 TFLOPS", "500 TFLOP/s", PROFILE): "did you mean 'TFLOPS'?",
             sub("80 GB", "80 gb", PROFILE): "did you mean 'GB'?",
             sub("100 GB/s", "800 Gb/s", CLUSTER): "rpeg's units are bytes: a figure in "
                                                   "Gb/s is an eighth of it in GB/s",
             sub("steps = 10", "steps = 1_000"): "write a number without separators",
             sub("steps = 10", "steps = 10 steps"): "a number takes no unit, or one of"}
    for text, hint in cases.items():
        with pytest.raises(SpecError) as info:
            check_file(_write(tmp_path, text))
        assert "unknown unit" in info.value.message and info.value.hint.startswith(hint), \
            info.value.render()


def test_a_repeated_share_group_counts_once(tmp_path):
    checked = check_file(_write(tmp_path, add("share actor, critic", "share critic, actor")))
    assert checked.value.shares == (("actor", "critic"),)


def test_extend_cycle_through_two_files(tmp_path):
    _write(tmp_path, BASE)
    (tmp_path / "a.rpeg").write_text('extend "b.rpeg"\npipeline a\n')
    (tmp_path / "b.rpeg").write_text('extend "a.rpeg"\npipeline b\n')
    with pytest.raises(SpecError) as info:
        check_file(tmp_path / "a.rpeg")
    assert "extend cycle: a.rpeg -> b.rpeg -> a.rpeg" in info.value.message
    assert info.value.span.path.endswith("b.rpeg")
    assert (info.value.span.line, info.value.span.col) == (1, 8)


def test_error_in_base_names_the_base_and_the_extend(tmp_path):
    _write(tmp_path, BASE)
    (tmp_path / "base.rpeg").write_text(sub("steps = 10", "steps = -3"))
    (tmp_path / "derived.rpeg").write_text('extend "base.rpeg"\npipeline d\n')
    with pytest.raises(SpecError) as info:
        check_file(tmp_path / "derived.rpeg")
    assert info.value.span.path.endswith("base.rpeg")
    assert "steps must be at least 1" in info.value.message


@pytest.mark.parametrize(("raw", "message", "where"), [
    (b"pipeline p\x00\x01\x02", "not binary", (1, 11)),
    (b"pipeline p\n\xff\xfe model", "not valid UTF-8 text: byte 0xff here", (2, 1)),
    (b"pipeline p\n# caf\xe9\n", "not valid UTF-8 text: byte 0xe9 here", (2, 6)),
])
def test_binary_and_undecodable_files(tmp_path, raw, message, where):
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, raw))
    assert message in info.value.message
    assert (info.value.span.line, info.value.span.col) == where    # at the byte


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        check_file(tmp_path / "absent.rpeg")
    with pytest.raises(SpecError, match="is a directory"):
        check_file(tmp_path)


def test_check_cli_prints_caret_and_exits_1(tmp_path):
    path = _write(tmp_path, sub("generate(actor,", "generate(actr,"))
    proc = subprocess.run([sys.executable, "-m", "rpeg", "check", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == f"{path}:7:26: error: unknown model 'actr'"
    assert lines[1].strip() == "stage rollout = generate(actr, prompts) -> responses, logprobs"
    assert lines[2].index("^") - lines[1].index("stage") == 25
    assert lines[-1] == "hint: did you mean 'actor'?"
    assert "Traceback" not in proc.stderr


def test_every_error_is_an_rpeg_error():
    assert issubclass(SpecError, RpegError)


def test_caret_lands_under_the_mistake_after_tabs_and_form_feeds(tmp_path):
    text = sub("steps = 10", "steps = x").replace("workload { ", "workload {\t")
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, text))
    source, caret = info.value.render().splitlines()[1:3]
    assert source[caret.index("^")] == "x"
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, "pipeline p\x0c\nshare a b\n"))
    source, caret = info.value.render().splitlines()[1:3]
    assert source.strip() == "share a b" and source[caret.index("^")] == "b"


def test_control_characters_are_echoed_as_escapes_with_the_caret_under_the_mistake(tmp_path):
    """A file's escape sequences (clear the screen, retitle the terminal, a bell) are shown
    as ``\\xNN``, never written to the terminal raw; the caret still lands under the
    mistake on the line as shown."""
    text = sub("steps = 10", "steps = 1\x1b]0;owned\x07\x1b[2J0")
    with pytest.raises(SpecError) as info:
        check_file(_write(tmp_path, text))
    rendered = info.value.render()
    assert not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) < 0xa0 for c in rendered)
    source, caret = rendered.splitlines()[1:3]
    assert "\\x1b]0;owned\\x07\\x1b[2J0" in source
    assert source[caret.index("^"):].startswith("\\x1b]0;owned")
