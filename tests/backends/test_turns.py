"""Conversations, token in and token out: the turn driver (``backends.turns``) with a
scripted policy and a real sandbox, and the tool-call formats.

The scripted policy writes given text for each turn, as token ids of the byte codec; the
driver decides what is a call, runs it in the sandbox, appends the observation, and ends
conversations at their caps. What each conversation holds afterwards -- its tokens, which
of them are the policy's, their versions -- is compared with what was written.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from backends import tool_formats as F
from backends.carry import Response
from backends.torch_backend.tokenizer import EOS_ID, codec_for
from backends.turns import Toolbox, converse, turns_of
from rpeg.runtime.usercode.sandbox import Sandbox
from rpeg.spec.kinds import ToolFormat
from rpeg.spec.model import LengthDist
from rpeg.spec.tools import Conversation, Tool

TOOLS = '''\
def calc(text):
    return str(eval(text, {"__builtins__": {}}))


def echo(text):
    return text * 20


def fails(text):
    raise KeyError(text)


class Counter:
    def reset(self, prompt, row):
        self.n = 0
        return "go " + prompt

    def step(self, action):
        self.n += 1
        return f"seen {action}", action == "stop"


class Broken(Counter):
    def reset(self, prompt, row):
        raise ValueError("no maze today")
'''


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    d = tmp_path_factory.mktemp("turns")
    (d / "tools.py").write_text(TOOLS)
    box = Sandbox.start([Tool("calc", "tools", "calc"), Tool("echo", "tools", "echo"),
                         Tool("fails", "tools", "fails"),
                         Tool("env", "tools", "Counter", environment=True),
                         Tool("broken", "tools", "Broken", environment=True)],
                        path=[str(d)], slots=2)
    yield box
    box.close()


CODEC = codec_for(None)


def scripted(script: dict[int, list[str]], version: int = 3):
    """A policy that writes ``script[index][turn]`` (then end-of-sequence when the text ends
    with '$'), one token per byte, as an engine's decode would."""
    def decode(rows):
        for r in rows:
            text = script[r.index][r.turns]
            ids = CODEC.encode(text.rstrip("$")) + ([EOS_ID] if text.endswith("$") else [])
            for k, t in enumerate(ids):
                done = box_of[0].take(r, t, -0.5 - k, version, EOS_ID)
                if done:
                    break
    box_of: list[Toolbox] = []
    return decode, box_of


def talk(sandbox, script, conv, max_len=32, rows=None):
    decode, box_of = scripted(script)
    box = Toolbox(sandbox, conv, CODEC, lambda step, i: {"prompt": f"p{i}"}, max_len)
    box_of.append(box)
    rows = rows or [Response(0, i, np.asarray([257, 97], np.int64)) for i in script]
    ended = [r for batch in converse(rows, decode, box, EOS_ID) for r in batch]
    return rows, ended, box


def text(r, mask_value=None):
    ids = [t for t, m in zip(r.tokens, r.mask, strict=True) if mask_value is None or m == mask_value]
    return CODEC.decode(ids)


CALC = Conversation(tools=("calc", "fails"), max_turns=3, max_obs_len=16, max_total_len=200,
                    turns=LengthDist.fixed(3), obs_len=LengthDist.fixed(16))


def test_a_call_is_run_and_its_result_is_the_next_observation(sandbox):
    rows, ended, box = talk(sandbox, {0: ["let me <calc>6*7</calc>", "it is 42$"]}, CALC)
    (r,) = rows
    assert r.ended and not r.cut and r.turns == 2 and ended == [r]
    assert text(r) == "let me <calc>6*7</calc><result>42</result>it is 42"
    assert text(r, 1) == "let me <calc>6*7</calc>it is 42"          # the policy's, unchanged
    assert text(r, 0) == "<result>42</result>"
    obs = [v for v, m in zip(r.versions, r.mask, strict=True) if m == 0]
    assert set(obs) == {-1} and {v for v, m in zip(r.versions, r.mask, strict=True) if m} == {3}
    assert all(lp == 0.0 for lp, m in zip(r.logprobs, r.mask, strict=True) if m == 0)
    assert box.stats()["tool_calls"] == 1


def test_a_failing_tool_is_an_error_observation(sandbox):
    rows, _, box = talk(sandbox, {0: ["<fails>k1</fails>", "sorry$"]}, CALC)
    assert text(rows[0], 0) == "<result>error: Key" + F.TRUNCATED + "</result>"   # 16 tokens
    assert box.stats()["tool_errors"] == 1


def test_a_long_observation_is_cut_with_the_marker(sandbox):
    conv = Conversation(tools=("echo",), max_turns=2, max_obs_len=12, max_total_len=200)
    rows, _, box = talk(sandbox, {0: ["<echo>ab</echo>", "ok$"]}, conv)
    obs = text(rows[0], 0)
    assert obs == "<result>" + "ababab"[:12 - len(F.TRUNCATED)] + F.TRUNCATED + "</result>"
    assert len(CODEC.encode(obs)) == len("<result></result>") + 12
    assert box.stats()["obs_truncated"] == 1


def test_a_conversation_ends_without_a_call_at_max_turns_and_at_its_length(sandbox):
    script = {0: ["no call here$"],                                      # ends by itself
              1: ["<calc>1</calc>", "<calc>2</calc>", "<calc>3</calc>"],  # calls at max_turns
              2: ["x" * 40]}                                             # its turn's budget
    rows, _, _ = talk(sandbox, script, CALC, max_len=32)
    a, b, c = rows
    assert (a.turns, a.cut) == (1, False)
    assert (b.turns, b.cut) == (3, True) and text(b, 0) == "<result>1</result><result>2</result>"
    assert (c.turns, c.cut, c.turn_len) == (1, True, 32)


def test_the_whole_conversation_is_capped(sandbox):
    conv = Conversation(tools=("calc",), max_turns=4, max_obs_len=16, max_total_len=30)
    rows, _, _ = talk(sandbox, {0: ["<calc>11*11</calc>", "<calc>2</calc>" * 3]}, conv)
    assert len(rows[0].tokens) == 30 and rows[0].cut


def test_an_environment_steps_each_turn_until_it_says_done(sandbox):
    conv = Conversation(environment="env", max_turns=5, max_obs_len=32, max_total_len=300)
    rows, _, box = talk(sandbox, {0: ["left$", "stop$"]}, conv)
    r = rows[0]
    assert text(r, 0) == "<result>go p0</result><result>seen left</result>" \
                         "<result>seen stop</result>"
    assert (r.turns, r.cut) == (2, False)
    assert box.stats()["tool_calls"] == 2


def test_a_conversation_whose_environment_fails_to_start_ends_with_the_error(sandbox):
    """An environment that does not start (its reset raised, or it ran past its timeout on
    a busy machine) ends its conversation before the first turn, the error its observation;
    the others go on, and every conversation is handed back as ended."""
    conv = Conversation(environment="broken", max_turns=3, max_obs_len=64, max_total_len=300)
    rows, ended, box = talk(sandbox, {0: ["never$"], 1: ["said$"]}, conv)
    assert ended == rows and [(r.ended, r.cut, r.turns) for r in rows] == [(True, False, 0)] * 2
    for r in rows:
        assert text(r, 1) == "" and "ValueError: no maze today" in text(r, 0), text(r)
    stats = box.stats()
    assert stats["conversations"] == 2
    assert (stats["tool_calls"], stats["tool_errors"]) == (2, 2)    # the failed starts count


def test_the_samples_file_shows_a_conversation_by_turn(sandbox):
    rows, _, _ = talk(sandbox, {0: ["<calc>6*7</calc>", "42$"]}, CALC)
    r = rows[0]
    turns = turns_of(r.tokens, r.mask, r.versions, CODEC.decode)
    assert [(t["who"], t["text"]) for t in turns] == [
        ("policy", "<calc>6*7</calc>"), ("tool", "<result>42</result>"), ("policy", "42")]
    assert [t.get("version") for t in turns] == [3, None, 3]
    assert [t["tokens"] for t in turns] == [16, 19, 3]           # '42' and end-of-sequence
    json.dumps(turns)


@pytest.mark.parametrize("fmt,turn,call,at_eos", [
    (ToolFormat.RPEG, "so <calc>1+1</calc>", ("calc", "1+1"), False),
    (ToolFormat.RPEG, "<calc>1+1</calc> and more", None, False),
    (ToolFormat.HERMES, '<tool_call>\n{"name": "calc", "arguments": {"e": "1+1"}}\n'
                        '</tool_call><|im_end|>', ("calc", '{"e": "1+1"}'), True),
    (ToolFormat.HERMES, '<tool_call>{"name": "other", "arguments": {}}</tool_call>', None, False),
    (ToolFormat.LLAMA3, '<|python_tag|>{"name": "calc", "parameters": {"e": "2"}}<|eom_id|>',
     ("calc", '{"e": "2"}'), False),
    (ToolFormat.MISTRAL, '[TOOL_CALLS][{"name": "calc", "arguments": {"e": "3"}}]</s>',
     ("calc", '{"e": "3"}'), True),
    (ToolFormat.MISTRAL, "just text", None, True),
])
def test_each_format_parses_its_calls(fmt, turn, call, at_eos):
    got = F.of(fmt).parse(turn, ("calc",))
    assert (got.name, got.arg) == call if call else got is None
    head, tail = F.of(fmt).wrap("42", at_eos)
    assert head and tail


def test_chat_formats_close_the_turn_the_policy_left_open():
    head_open, _ = F.of(ToolFormat.HERMES).wrap("x", ended_at_eos=False)
    head_closed, _ = F.of(ToolFormat.HERMES).wrap("x", ended_at_eos=True)
    assert head_open.startswith("<|im_end|>") and not head_closed.startswith("<|im_end|>")
    assert F.observation_text(ToolFormat.MISTRAL, False, "", "boom") == '"error: boom"'


def test_an_example_call_in_the_prompt_is_not_the_policys(sandbox):
    """A system message showing how to call (SmolLM2's, Qwen's) holds a whole call in the
    prompt's last tokens: the call the policy writes is the one run, and a turn without
    one makes none (the example was read as the call, and failed to parse, before)."""
    import attrs
    conv = attrs.evolve(CALC, tools=("echo",), format=ToolFormat.HERMES, max_obs_len=64,
                        max_total_len=2000)
    prompt = CODEC.encode('call: <tool_call>{"name": "echo", "arguments": {"x": "9*9"}}'
                          '</tool_call>\nuser: ')
    script = {0: ['<tool_call>{"name": "echo", "arguments": {"x": "2+3"}}</tool_call>', "ok$"],
              1: ["no call here$"]}
    rows = [Response(0, i, np.asarray(prompt, np.int64)) for i in script]
    rows, ended, box = talk(sandbox, script, conv, max_len=400, rows=rows)
    seen = text(rows[0], 0)
    assert "2+3" in seen and "9*9" not in seen and rows[0].turns == 2, seen
    assert rows[1].turns == 1 and text(rows[1], 0) == ""


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_lone_surrogate_in_a_tools_text_is_a_replacement_character(fmt):
    """Text a tool decoded with surrogateescape holds lone surrogates no tokenizer encodes
    (the run stopped at the encoding): each becomes U+FFFD, the rest as it was."""
    seen = F.observation_text(fmt, True, "bad \ud800 name \udcff é", "")
    assert "\ud800" not in seen and "\udcff" not in seen
    body = json.loads(seen) if fmt is ToolFormat.MISTRAL else seen
    assert body == "bad \ufffd name \ufffd é"
    CODEC.encode(seen)


def test_a_special_tokens_name_in_a_tools_text_stays_text(sandbox):
    """A tool that prints '<eos>' (or a chat model's '<|im_end|>') gives characters, not the
    token: an observation cannot end the policy's turn or open a turn of its own."""
    rows, ended, box = talk(sandbox, {0: ["<calc>'v<'+'eos>after'</calc>", "done$"]},
                            CALC, max_len=64)
    observed = [t for t, m in zip(rows[0].tokens, rows[0].mask, strict=True) if m == 0]
    assert EOS_ID not in observed and "v<eos>after" in CODEC.decode(observed)

