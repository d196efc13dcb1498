"""Docs that cannot drift: every output a tutorial shows is checked against what its command
prints, or is marked as illustrative.

A tutorial's fenced blocks are, by their language:

* ``sh``: commands, run by the tutorial's test (``test_tutorial_NN.py``), in order; a
  ```text block after "prints" is their exact output, compared by that test;
* ``console``: ``$ rpeg ...`` lines, each followed by what it prints (``[exit N]`` first
  when it fails on purpose; a ``...`` line for lines left out). ``scripts/update_docs.py``
  runs them and rewrites what they print; ``test_console_blocks_print_what_they_show`` runs
  them and fails, naming that command, when a block is stale;
* ``text`` or ``json`` after ``<!-- file: PATH -->``: an excerpt of a repository file, each
  line of it (but ``...``) a line of the file;
* ``output`` (or ``json``) after ``<!-- illustrative: WHY -->``: what a command printed once
  (a measured time, a machine's addresses), not compared -- the comment says why;
* ``rpeg``, ``python``: what the reader writes.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TUTORIALS = sorted((ROOT / "tutorials").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
MARK = re.compile(r"<!-- (illustrative|file): ?(.*?) -->\s*$", re.S)
LANGUAGES = {"sh", "console", "text", "json", "output", "rpeg", "python"}
STALE = "run `python scripts/update_docs.py` and commit what it rewrites"


def _update_docs():
    spec = importlib.util.spec_from_file_location("update_docs",
                                                  ROOT / "scripts" / "update_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("update_docs", module)
    spec.loader.exec_module(module)
    return module


def _blocks(text: str):
    """(language, body, the prose before it, line) of every fenced block."""
    last = 0
    for m in FENCE.finditer(text):
        yield m.group(1), m.group(2), text[last:m.start()], text[:m.start()].count("\n") + 1
        last = m.end()


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_every_output_a_tutorial_shows_is_checked_or_illustrative(path):
    text = path.read_text(encoding="utf-8")
    wrong = []
    for lang, _body, before, line in _blocks(text):
        where = f"{path.name}:{line}: ```{lang}"
        mark = MARK.search(before)
        prose = before.strip().split("\n\n")[-1].strip() if before.strip() else ""
        if lang not in LANGUAGES:
            wrong.append(f"{where}: a tutorial's blocks are {', '.join(sorted(LANGUAGES))}")
        elif lang == "text" and not (prose == "prints" or (mark and mark.group(1) == "file")):
            wrong.append(f"{where}: a text block must follow 'prints' (its command's output, "
                         "compared) or <!-- file: PATH --> (an excerpt of that file); mark "
                         "anything else <!-- illustrative: WHY --> and fence it as output")
        elif lang == "output" and not (mark and mark.group(1) == "illustrative"
                                       and mark.group(2).strip()):
            wrong.append(f"{where}: an output block must follow <!-- illustrative: WHY --> "
                         "saying why it is not compared (or be a console block, compared)")
        elif lang == "json" and not mark:
            wrong.append(f"{where}: a json block must follow <!-- file: PATH --> or "
                         "<!-- illustrative: WHY -->")
    assert not wrong, "\n".join(wrong)
    if any(b[2].strip().split("\n\n")[-1].strip() == "prints" for b in _blocks(text)):
        number = path.name[:2]
        assert (ROOT / "tests" / "tutorials" / f"test_tutorial_{number}.py").exists(), \
            f"{path.name} shows outputs after 'prints': a test must run it"


@pytest.mark.parametrize("path", TUTORIALS, ids=lambda p: p.name)
def test_a_file_excerpt_is_the_file_s(path):
    text = path.read_text(encoding="utf-8")
    for _lang, body, before, line in _blocks(text):
        mark = MARK.search(before)
        if not mark or mark.group(1) != "file":
            continue
        source = ROOT / mark.group(2).strip()
        assert source.is_file(), f"{path.name}:{line}: no file {mark.group(2)}"
        have = {x.strip() for x in source.read_text(encoding="utf-8").splitlines()}
        for x in body.splitlines():
            if x.strip() and x.strip() != "...":
                assert x.strip() in have, f"{path.name}:{line}: {x!r} is not a line of {source}"


def test_console_blocks_are_rpeg_commands():
    docs = _update_docs()
    found = 0
    for path in TUTORIALS:
        for m in docs.CONSOLE.finditer(path.read_text(encoding="utf-8")):
            for cmd in docs.parse_console(m.group(1)):
                assert cmd.line.startswith("rpeg "), cmd.line
                found += 1
    assert found >= 10


def test_an_excerpt_keeps_its_first_and_last_lines():
    docs = _update_docs()
    cmd = docs.parse_console("$ rpeg compile x\n[exit 1]\nfirst 1.5 s\n...\nlast\n")[0]
    assert (cmd.status, cmd.cut) == (1, (1, 1))
    output = ["first 2.5 s", "middle", "more", "last"]
    assert docs.shown_part(cmd, output) == ["first 2.5 s", "...", "last"]
    assert not docs.agrees(cmd, output)
    assert docs.agrees(cmd, ["first 1.5 s", "anything", "last"])
    planned = docs.parse_console("$ rpeg compile x\np, seed 0, planned in 42.6 s\n")[0]
    assert docs.agrees(planned, ["p, seed 0, planned in 3.1 s"])      # measured: not compared


# Tutorial 02 explains its plan in prose: each claim, and what the outputs must show for it
# to hold. When a change to the planner makes one false, rewrite that paragraph.
TUTORIAL_02 = ROOT / "tutorials" / "02-compile-and-read-a-plan.md"
CLAIMS = [
    ("spends that allowance on a **partial rollout**", "carries responses over 1 step"),
    ("Generation runs on vLLM (the `rollout` row)", re.compile(r"^  rollout .* vllm ", re.M)),
    ("fuses the\n  reference forward with the scores, and the values forward with the advantages",
     "fusion: ref_lp + scores; values + adv"),
    ("the search generates whole batches", "streaming: none (whole batches)"),
    ("above 3% of the step a note\n  says so", "note: the control plane takes"),
    ("The first line under the step time is the checkpoints' share",
     "is checkpoints: 20 in 200 steps (every 10 and the last)"),
    ("The line after it is the control plane's share",
     "is the control plane's time in its client and Dask scheduler"),
    ("lets one backbone carry both heads", "sharing: actor + critic"),
    ("carries responses over a step (`carry rollout`)", "carry rollout: 0 -> 1"),
]
FIGURE = re.compile(r"\b\d+(?:\.\d+)?(?: s\b|x\b)|\bGPUs \d+-\d+")


def _shown_outputs(text: str) -> str:
    return "\n".join(m.group(1) for m in re.finditer(r"^```console\n(.*?)^```\n", text,
                                                      re.M | re.S))


def test_tutorial_02_says_what_its_outputs_show():
    text = TUTORIAL_02.read_text(encoding="utf-8")
    shown = _shown_outputs(text)
    prose = FENCE.sub("", text)
    for claim, evidence in CLAIMS:
        assert claim in prose, f"tutorial 02 no longer says {claim!r}: update CLAIMS"
        held = evidence.search(shown) if isinstance(evidence, re.Pattern) else evidence in shown
        assert held, (f"tutorial 02 says {claim!r}, and its outputs no longer show "
                      f"{getattr(evidence, 'pattern', evidence)!r}: rewrite that paragraph")
    for figure in FIGURE.findall(prose):
        assert figure in shown, (f"tutorial 02's prose quotes {figure!r}, which no output "
                                 "shows: quote the output, or describe it")


@pytest.mark.slow         # the tutorials' commands: six 64-GPU searches, minutes on 2 cores
def test_console_blocks_print_what_they_show():
    docs = _update_docs()
    for path, regenerated in docs.tutorial_outputs():
        current = path.read_text(encoding="utf-8")
        if regenerated != current:
            import difflib
            diff = "".join(difflib.unified_diff(current.splitlines(True),
                                                regenerated.splitlines(True),
                                                str(path.name), "what the commands print"))
            raise AssertionError(f"{path.name} shows outputs its commands no longer print: "
                                 f"{STALE}\n{diff}")


# README's figures come from scripts in benchmarks/: each part of its figures names the
# command that measured it and the results file it wrote.
README = ROOT / "README.md"
COMMAND = re.compile(r"`[^`]*\bbenchmarks/\w+\.py[^`]*`")
README_FIGURE = re.compile(r"\d(?:[\d,.]*\d)?\s?(?:%|×|x\b|s\b|ms\b|GB\b|MB\b|tokens/s)")


def _section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else len(text)]


def test_readme_figures_name_their_commands():
    text = README.read_text(encoding="utf-8")
    figures = _section(text, "Figures, and the commands behind them")
    intro, *parts = re.split(r"\n(?=\*\*[^*\n]+\*\* — )", figures)
    assert len(parts) >= 8 and not README_FIGURE.search(intro.split("\n\n", 1)[1])
    for part in parts:
        name = part.split("**")[1]
        assert COMMAND.search(part.split("\n\n")[0]), f"README's '{name}' names no command"
        assert "benchmarks/results/" in part, f"README's '{name}' names no results file"
    reliability = _section(text, "Reliability")
    listed = {m.group(1) for m in re.finditer(r"^- (\w+): `[^`]*benchmarks/", reliability, re.M)}
    for part in re.split(r"\n(?=\*\*[^*\n]+\*\*)", reliability)[1:]:
        name = part.split("**")[1].rstrip(":")
        if README_FIGURE.search(part) and not COMMAND.search(part):
            assert set(name.lower().split()) & listed, \
                f"README's '{name}' figures name no command (list it under Reliability)"
