"""Messages that must say what is wrong in the user's terms: a number far out of range
without thousands of digits echoed, the override that makes two models unlike, the
bracket left open lines before the error surfaces."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.errors import SpecError
from rpeg.spec import check_file

BASE = (Path(__file__).resolve().parents[1] / "fixtures" / "small_ppo.rpeg").read_text()
REWARDS = "def score(prompts, responses, answers=None):\n    return [0.0] * len(responses)\n"


def _error(tmp_path, text: str) -> SpecError:
    (tmp_path / "rewards.py").write_text(REWARDS)
    f = tmp_path / "p.rpeg"
    f.write_text(text)
    with pytest.raises(SpecError) as info:
        check_file(f)
    info.value.render()
    return info.value


@pytest.mark.parametrize("digits, says", [
    ("9" * 5000, "steps must be at most 10,000,000, not a 5,000-digit number"),
    ("-" + "9" * 5000, "steps must be at least 1, not a 5,000-digit number"),
    ("9" * 30, "steps must be at most 10,000,000, not a 30-digit number"),
])
def test_a_number_with_thousands_of_digits_says_the_range_and_cuts_the_echo(tmp_path, digits,
                                                                              says):
    err = _error(tmp_path, BASE.replace("steps = 10", f"steps = {digits}"))
    assert says in str(err), str(err)
    assert len(str(err)) < 300, "the headline echoes the whole number"
    assert (err.span.line, err.span.col) == (2, 20)


def test_sharing_models_of_one_preset_names_the_override(tmp_path):
    text = BASE.replace("model critic : tiny { head = value }",
                        "model critic : tiny { head = value; layers = 3 }")
    err = _error(tmp_path, text + "share actor, critic\n")
    message = str(err)
    assert "both tiny" in message and "layers = 2 and layers = 3" in message, message
    assert "override" in message
    assert [s.line for _, s in err.notes] == [3, 4]


def test_sharing_models_of_two_presets_names_both_and_the_dimension(tmp_path):
    text = BASE.replace("model critic : tiny", "model critic : small")
    err = _error(tmp_path, text + "share actor, critic\n")
    assert "'actor' is tiny (" in str(err) and "'critic' is small (" in str(err), str(err)


def test_an_unclosed_parenthesis_in_a_block_is_pointed_at(tmp_path):
    text = ("pipeline p\nworkload {\n    steps = 3\n    gen_len = uniform(min = 1, max = 8\n"
            "    prompts = 4\n}\n")
    err = _error(tmp_path, text)
    assert (err.span.line, err.span.col) == (5, 5), str(err)
    assert [(t, s.line, s.col) for t, s in err.notes] == [
        ("the '(' opened here is not closed", 4, 22)]
    assert "close the '(' on line 4 with ')'" in (err.hint or "")


def test_an_unclosed_parenthesis_across_lines(tmp_path):
    text = BASE.replace("stage ref_lp = forward(ref, responses) -> ref_logprobs",
                        "stage ref_lp = forward(ref, responses")
    err = _error(tmp_path, text)
    assert err.span.line > 8, str(err)
    assert [(s.line, s.col) for _, s in err.notes] == [(8, 23)]
    assert "line 8" in (err.hint or "")


def test_an_error_inside_a_block_mentions_no_bracket(tmp_path):
    err = _error(tmp_path, "pipeline p\nworkload {\n    steps = = 3\n}\n")
    assert not err.notes
