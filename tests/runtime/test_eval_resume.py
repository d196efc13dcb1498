"""A real run with an eval block, sampled responses kept, and a resume that continues with
the next prompt: the steps it runs again read exactly the prompts the first run read, and
the run reads the dataset epoch by epoch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpeg.runtime import RunOptions
from rpeg.runtime.dask.resume import resume_run
from rpeg.runtime.dask.runner import Resilience, run_resilient
from rpeg.runtime.data import row_indices
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

pytestmark = pytest.mark.slow          # two real runs on a local Dask cluster, minutes

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
STEPS = 4


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec")
    shutil.copy(PIPELINES / "rewards.py", folder)
    (folder / "data").mkdir()
    rows = [json.loads(x) for x in (PIPELINES / "data/toy.jsonl").read_text().splitlines()]
    # 20 rows, 8 prompts a step: 4 steps read 32, an epoch and a half
    (folder / "data/train.jsonl").write_text("".join(
        json.dumps({"q": r["prompt"], "a": r["answer"], "n": n}) + "\n"
        for n, r in enumerate(rows[:20])))
    (folder / "data/test.jsonl").write_text("".join(json.dumps({"q": r["prompt"],
                                                                "a": r["answer"]}) + "\n"
                                                    for r in rows[20:26]))
    text = (PIPELINES / "tiny_grpo.rpeg").read_text()
    text = text.replace('dataset    = "data/toy.jsonl"', 'dataset = "data/train.jsonl"\n'
                        '    prompt_field = "q"\n    answer_field = "a"')
    text = text.replace("prompts    = 16", "prompts    = 8")
    text += ('eval { dataset = "data/test.jsonl"; every = 2; samples = 2; temperature = 1.0 }\n'
             "log { samples = 32 }\n")
    (folder / "p.rpeg").write_text(text)
    return folder / "p.rpeg"


def _rows(path: Path, name: str) -> list[dict]:
    return [json.loads(x) for x in (path / name).read_text().splitlines()]


def _prompts_by_step(run: Path) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for r in _rows(run, "samples.jsonl"):
        if not r.get("eval") and r["index"] % 4 == 0:      # one response per prompt
            out.setdefault(r["step"], []).append(r["prompt"])
    return out


def test_eval_samples_and_resume_with_the_next_prompt(spec, tmp_path):
    pipeline = load(spec)
    plan = split_plan(pipeline, 2, staleness=1)
    first = run_resilient(pipeline, plan, RunOptions(steps=STEPS, root=str(tmp_path),
                                                     progress=False),
                          spec_path=str(spec), resilience=Resilience(checkpoint_every=2)).path
    evals = _rows(first, "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert [e["version"] for e in evals] == [0, 2, 4]         # the weights after `step` updates
    for e in evals:
        assert e["prompts"] == 6 and e["samples"] == 2 and 0.0 <= e["reward"] <= 1.0
    # every response of every step kept (32 = 8 prompts x 4 samples), with its reward
    by_step = _prompts_by_step(first)
    assert sorted(by_step) == list(range(STEPS)) and all(len(v) == 8 for v in by_step.values())
    samples = [r for r in _rows(first, "samples.jsonl") if not r.get("eval")]
    assert all({"prompt", "response", "answer", "reward"} <= set(r) for r in samples)
    # the data order: an epoch of 20 rows, then the next, from the seed alone
    train = [json.loads(x)["q"] for x in (spec.parent / "data/train.jsonl").read_text()
             .splitlines()]
    stream = [p for s in range(STEPS) for p in by_step[s]]
    assert stream == [train[i] for i in row_indices(20, 0, 32, pipeline.workload.seed)]
    assert sorted(stream[:20]) == sorted(train)

    # cut the run back to its checkpoint at step 2 and resume: steps 2 and 3 run again
    again = tmp_path / "again"
    shutil.copytree(first, again)
    shutil.rmtree(again / "checkpoints" / "step-000004")
    meta = json.loads((again / "run.json").read_text())
    (again / "run.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    resume_run(again, RunOptions(progress=False), Resilience(checkpoint_every=2))
    assert _prompts_by_step(again) == by_step
    assert [e["step"] for e in _rows(again, "eval.jsonl")] == [0, 2, 4]
    assert json.loads((again / "checkpoints/step-000004/state.json").read_text())["data"] == \
        {"step": 4, "position": 32}
