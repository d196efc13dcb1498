"""Tutorial 03 runs as written: a run, its verification, its summary and pictures, and the
diff of a synchronous and an asynchronous run (slow: three real runs on a local Dask cluster)."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "tutorial_runner", Path(__file__).with_name("tutorial_runner.py"))
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

TUTORIAL = runner.ROOT / "tutorials" / "03-run-verify-diff.md"


def test_tutorial_shows_run_verify_trace_and_diff():
    text = TUTORIAL.read_text(encoding="utf-8")
    for words in ("rpeg run", "rpeg verify", "rpeg show", "ui.perfetto.dev", "rpeg diff runs/"):
        assert words in text
    assert len(runner.blocks(text)) >= 4


@pytest.mark.slow
def test_tutorial_runs_as_written(tmp_path):
    session = runner.Session(tmp_path)
    (session.work / "pipelines").symlink_to(runner.ROOT / "pipelines")
    outputs = []
    try:
        for block in runner.blocks(TUTORIAL.read_text(encoding="utf-8")):
            outputs.append(session.run(block, timeout=600))
    finally:
        session.close()
    joined = "\n".join(outputs)
    assert "placement, dependencies, versions - ok" in joined
    first = session.work / "runs" / "first"
    assert json.loads((first / "record.json").read_text())["status"] == "ok"
    for name in ("timeline", "memory", "curves"):
        assert (first / "plots" / f"{name}.png").stat().st_size > 5000
    # the asynchronous plan spends the bound by reading older weights or carrying responses
    assert re.search(r"(staleness|carry) rollout: 0 -> 1", outputs[-1]), outputs[-1][-2000:]
