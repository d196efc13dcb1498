"""Tutorial 01 runs as written: every ```sh block, in order, in one fresh folder.

The conventions (exact output after "prints", ``# exit status N``, ```output
blocks not compared) are those of ``tutorial_runner.py``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "tutorial_runner", Path(__file__).with_name("tutorial_runner.py"))
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

TUTORIAL = runner.ROOT / "tutorials" / "01-first-pipeline.md"


def _blocks():
    return runner.blocks(TUTORIAL.read_text(encoding="utf-8"))


def test_tutorial_has_the_steps_the_issue_asks_for():
    text = TUTORIAL.read_text(encoding="utf-8")
    for command in ("rpeg check", "rpeg fmt", "rpeg graph", "rpeg diff", "error:"):
        assert command in text
    blocks = _blocks()
    assert len(blocks) >= 10
    assert sum(b.expected is not None for b in blocks) >= 8      # most outputs are compared
    assert {b.status for b in blocks} == {0, 1}                 # errors shown, and their status


def test_tutorial_runs_as_written(tmp_path):
    session = runner.Session(tmp_path)
    try:
        for block in _blocks():
            session.run(block, timeout=120)
        svg = session.cwd / "first.svg"
        assert svg.stat().st_size > 5000 and "cluster_step2" in svg.read_text()
    finally:
        session.close()
