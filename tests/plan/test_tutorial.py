"""Every command in tutorials/02-compile-and-read-a-plan.md runs, with the exit status shown."""

from __future__ import annotations

import re
import shlex

import pytest

from rpeg.cli import main

from .conftest import ROOT

TUTORIAL = ROOT / "tutorials" / "02-compile-and-read-a-plan.md"


def test_tutorial_lists_its_commands():
    names = [argv[0] for argv, _, _ in commands()]
    assert names.count("compile") >= 3 and {"check", "simulate", "diff"} <= set(names)


def commands() -> list[tuple[list[str], int, str]]:
    """(argv, expected exit status, first line of shown output) for each `$ rpeg` line."""
    out = []
    for block in re.findall(r"```console\n(.*?)```", TUTORIAL.read_text(), re.S):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if not line.startswith("$ rpeg "):
                continue
            rest = lines[i + 1:]
            rc = 0
            if rest and (m := re.fullmatch(r"\[exit (\d+)\]", rest[0])):
                rc, rest = int(m.group(1)), rest[1:]
            first = rest[0] if rest and not rest[0].startswith("$") else ""
            out.append((shlex.split(line[2:])[1:], rc, first))
    return out


@pytest.mark.slow          # three 64-GPU compiles: ~12 s of CPU, longer on a busy machine
def test_tutorial_commands_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "pipelines").symlink_to(ROOT / "pipelines")
    monkeypatch.chdir(tmp_path)
    cmds = commands()
    assert len(cmds) >= 6
    for argv, rc, first in cmds:
        assert main(argv) == rc, argv
        shown = capsys.readouterr()
        if first:
            words = re.split(r"[\d.]+", first)[0].strip()     # the part before any figure
            assert words in shown.out + shown.err, (argv, words)
    assert (tmp_path / "ppo64.json").exists() and (tmp_path / "ppo64-gantt.png").exists()
