"""Tools and environments in the language: declared, named by a generate stage, checked.

The base spec (tests/fixtures/tools.rpeg) declares a tool and an environment and uses each
in a generate stage; each case is one edit of it and the error it must give, at its place.
The code a declaration names is read (never run) from ``tools.py`` next to the spec.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rpeg.errors import SpecError
from rpeg.spec import check_file, load
from rpeg.spec.diff import diff
from rpeg.spec.kinds import ToolFormat
from rpeg.spec.model import LengthKind
from rpeg.spec.parser import parse_text
from rpeg.spec.tools import Latency, conversation, trajectory_len

BASE = (Path(__file__).resolve().parents[1] / "fixtures" / "tools.rpeg").read_text()
REWARDS = "def score(prompts, responses, answers=None):\n    return [0.0] * len(responses)\n"
TOOLS = '''\
def calc(text):
    return str(eval(text))

def two(a, b):
    return a

class Maze:
    def reset(self, prompt, row=None):
        self.at = 0
    def step(self, action):
        return "wall", True

class NoStep:
    def reset(self):
        pass

class Sized:
    def __init__(self, size):
        self.size = size
    def step(self, action):
        return "wall", True
'''


def sub(old: str, new: str, text: str = BASE) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def write(tmp_path: Path, text: str) -> Path:
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "tools.py").write_text(TOOLS)
    path = tmp_path / "case.rpeg"
    path.write_text(text)
    return path


def test_the_base_declares_a_tool_and_an_environment(tmp_path):
    p = load(write(tmp_path, BASE))
    calc, maze = p.tool("calc"), p.tool("maze")
    assert (calc.ref, calc.environment, calc.timeout) == ("tools:calc", False, 2.0)
    assert calc.latency == Latency.lognormal(0.02, 1.0)
    assert (maze.ref, maze.environment, maze.memory, maze.latency) == ("tools:Maze", True,
                                                                       256e6, None)
    conv = conversation(p.stage("rollout"), 16)
    assert (conv.tools, conv.max_turns, conv.max_obs_len, conv.format) == (
        ("calc",), 3, 16, ToolFormat.RPEG)
    assert conv.max_total_len == 3 * (16 + 16)            # the derived cap
    assert conversation(p.stage("game"), 16).environment == "maze"
    assert conversation(p.stage("rollout"), 16).turns.max_len == 3


def test_fmt_round_trips_the_declarations(tmp_path):
    path = write(tmp_path, BASE)
    out = subprocess.run([sys.executable, "-m", "rpeg", "fmt", str(path)], capture_output=True,
                         text=True, check=True).stdout
    assert "\ntool calc = python(" in out and "\nenvironment maze = python(" in out
    assert parse_text(out).items == parse_text(BASE).items
    path.write_text(out)
    again = subprocess.run([sys.executable, "-m", "rpeg", "fmt", str(path)],
                           capture_output=True, text=True, check=True).stdout
    assert again == out


# (id, text, line, col, message substring)
CASES = [
    ("unknown-tool", sub("tools = [calc]", "tools = [clac]"), 7, 51, "unknown tool 'clac'"),
    ("environment-as-tool", sub("tools = [calc]", "tools = [maze]"), 7, 51,
     "'maze' is an environment, and tools names tools"),
    ("tool-as-environment", sub("environment = maze", "environment = calc"), 8, 53,
     "'calc' is a tool, and environment names environments"),
    ("tools-not-a-list", sub("tools = [calc]", "tools = calc"), 7, 50,
     "tools must be a list of names such as [calc]"),
    ("tool-listed-twice", sub("tools = [calc]", "tools = [calc, calc]"), 7, 57,
     "tools lists 'calc' twice"),
    ("turn-key-alone", sub("tools = [calc], ", ""), 7, 42,
     "max_turns must come with tools or an environment"),
    ("unknown-format", sub("max_turns = 3,", "max_turns = 3, format = json,"), 7, 82,
     "format must be one of rpeg, hermes, llama3, mistral, not 'json'"),
    ("turns-past-max", sub("max_turns = 3,", "max_turns = 3, turns = uniform(min = 1, max = 5),"),
     7, 73, "turns must lie within max_turns (3), not reach 5"),
    ("timeout-without-unit", sub("timeout = 2 s", "timeout = 2"), 5, 44,
     "timeout must be a duration such as 5 us, not 2 (no unit)"),
    ("timeout-out-of-range", sub("timeout = 2 s", "timeout = 2 h"), 5, 44,
     "timeout must be in [0.001, 3600]"),
    ("latency-not-a-distribution", sub("latency = lognormal(median = 20 ms, max = 1 s)",
                                       "latency = normal(mean = 2 s)"), 5, 59,
     "latency distribution must be one of fixed, uniform, lognormal, not 'normal'"),
    ("latency-max-below-median", sub("max = 1 s)", "max = 1 ms)"), 5, 59,
     "lognormal max must be at least the median"),
    ("unknown-tool-kind", sub('python("tools:calc"', 'shell("tools:calc"'), 5, 13,
     "tool 'calc' must be one of python(...)"),
    ("missing-function", sub("tools:calc", "tools:cal"), 5, 20,
     "has no function 'cal'"),
    ("two-arguments", sub("tools:calc", "tools:two"), 5, 20,
     "must be callable as two(text), and it needs 2 positional arguments"),
    ("tool-names-a-class", sub("tools:calc", "tools:Maze"), 5, 20,
     "tool 'calc' must name a function of the argument text, not a class"),
    ("environment-without-step", sub("tools:Maze", "tools:NoStep"), 6, 27,
     "must define step(self, action)"),
    ("environment-names-a-function", sub("tools:Maze", "tools:calc"), 6, 27,
     "environment 'maze' must name a class with reset and step"),
    ("tool-and-model-same-name", sub("tool calc", "tool actor"), 5, 1,
     "name 'actor' is defined twice"),
    ("tool-twice", sub("environment maze", "tool calc"), 6, 1, "tool 'calc' is defined twice"),
    ("unknown-tool-key", sub("timeout = 2 s", "timeuot = 2 s"), 5, 34, "unknown key 'timeuot'"),
    ("refill-with-tools", sub("max_turns = 3,", "max_turns = 3, refill_rounds = 1,"), 7, 73,
     "refill_rounds must generate single responses, not conversations"),
    ("conversation-past-context", sub("max_obs_len = 16)", "max_obs_len = 200)"), 2, 65,
     "prompt_len + the longest response (8 + 648 = 656 tokens)"),
    ("environment-needs-arguments", sub("tools:Maze", "tools:Sized"), 6, 27,
     "'Sized.__init__' in"),
    ("tools-and-environment", sub("environment = maze,", "tools = [calc], environment = maze,"),
     8, 39, "generate(...) takes tools or an environment, not both"),
]


def test_cases_are_unique():
    assert len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("text,line,col,message", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_error(tmp_path, text, line, col, message):
    with pytest.raises(SpecError) as e:
        check_file(write(tmp_path, text))
    err = e.value
    assert message in err.message, err.message
    assert (err.span.line, err.span.col) == (line, col), str(err)


def test_an_unused_tool_is_a_warning(tmp_path):
    checked = check_file(write(tmp_path, sub("tools = [calc], max_turns = 3, max_obs_len = 16",
                                             "environment = maze, max_obs_len = 8")))
    assert any("tool 'calc' is declared but no generate stage uses it" in w.message
               for w in checked.warnings)


def test_tools_with_one_turn_are_a_warning(tmp_path):
    """max_turns = 1: a turn's call would be answered only in a second turn, which never
    comes; every call is cut (a run records no tool call at all)."""
    checked = check_file(write(tmp_path, sub("max_turns = 3,", "max_turns = 1,")))
    assert any("max_turns = 1 with tools" in w.message for w in checked.warnings)


def test_overlong_measures_a_conversation_against_its_total_length(tmp_path):
    """A conversation's length is its policy's and observations' tokens together, so its
    overlong penalty is reachable up to max_total_len (3 x (16 + 16) = 96), not past it."""
    long = sub('reward r = python("rewards:score")',
               'reward r = python("rewards:score")\nreward long = overlong(max_len = 40)')
    long = sub("stage adv = group_norm(scores, moved)",
               "stage length = score(long, responses) -> length\n"
               "stage adv = group_norm(scores, moved, length)", long)
    check_file(write(tmp_path, long))                       # starts at 30 of 96: reachable
    with pytest.raises(SpecError) as e:
        check_file(write(tmp_path, long.replace("max_len = 40", "max_len = 200")))
    assert "starts at max_len - buffer = 150 tokens" in e.value.message
    assert "max_len = 96 (the generate stage's max_total_len)" in e.value.hint


def test_the_conversation_length_sums_turns_and_observations(tmp_path):
    p = load(write(tmp_path, sub("max_turns = 3,", "max_turns = 3, turns = fixed(2), "
                                                   "obs_len = fixed(5),")))
    conv = conversation(p.stage("rollout"), 16)
    dist = trajectory_len(p.workload.gen_len, conv)
    assert dist.kind is LengthKind.EMPIRICAL and dist.max_len == conv.max_total_len
    assert dist.mean() == 2 * 16 + 5          # two turns of 16 tokens, one observation


def test_diff_shows_tool_and_turn_changes(tmp_path):
    a = load(write(tmp_path, BASE))
    b_path = tmp_path / "b.rpeg"
    b_path.write_text(sub("max = 1 s)", "max = 3 s)", sub("max_turns = 3", "max_turns = 2")))
    text = diff(a, load(b_path)).text()
    assert "~ calc.latency: lognormal(median = 20 ms, max = 1 s) -> lognormal(median = 20 ms, " \
           "max = 3 s)" in text
    assert "~ rollout.max_turns: 3 -> 2" in text


def test_help_documents_tools_and_turn_keywords():
    out = subprocess.run([sys.executable, "-m", "rpeg", "help", "functions"], capture_output=True,
                         text=True, check=True).stdout
    assert "Tools: tool NAME = KIND(...)" in out and "Environments: environment NAME" in out
    for key in ("tools", "environment", "max_turns", "format", "max_obs_len", "max_total_len",
                "turns", "obs_len", "timeout", "latency"):
        assert f"\n      {key} " in out, key
