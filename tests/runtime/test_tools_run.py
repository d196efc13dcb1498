"""Runs whose policy talks to tools: a tool that misbehaves in any way is an error
observation and the run goes on; pipelines/tiny_tools.rpeg runs on the local Dask cluster
and verifies, every token's version checked, its samples conversations of several turns.

The prompts open a call of the tool (``<t>KEY``), so a turn that ends closes it and every
sample calls the tool from the first step, whatever the untrained policy writes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpeg.runtime.calibrate.inline import run_inline
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

ROOT = Path(__file__).resolve().parents[2]

TOOLS = '''\
import os
import time


def sleeps(text):
    time.sleep(30)
    return "late"


def allocates(text):
    return str(len(bytearray(4 * 1024 ** 3)))


def forks(text):
    while True:
        os.fork()


def writes(text):
    with open(os.environ.get("OUTSIDE", "/tmp/rpeg-outside-%d" % os.getuid()), "w") as f:
        f.write("written")
    return "wrote"


def prints(text):
    chunk = "x" * (1 << 20)
    for _ in range(100):
        print(chunk)
    return "printed"


def raises(text):
    raise ValueError("no key " + text)
'''

SPEC = """\
pipeline t
workload {{
    steps = 2; prompts = 2; samples = 2; prompt_len = 8; gen_len = uniform(min = 1, max = 4)
    dataset = "data/keys.jsonl"; seed = 0
}}
model actor : tiny {{ optimizer = adam(lr = 1e-3) }}
reward r = python("rewards:lookup_reward")
tool t = python("tools:{tool}", timeout = 1 s, memory = 256 MB, max_output = 4 KB)
stage rollout = generate(actor, prompts, max_len = 4, tools = [t], max_turns = 2,
                         max_obs_len = 16) -> responses, logprobs
stage scores = score(r, responses) -> scores
stage adv = group_norm(scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, loss = grpo(0.2))
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools_run")
    (d / "tools.py").write_text(TOOLS)
    shutil.copy(ROOT / "pipelines" / "rewards.py", d / "rewards.py")
    (d / "data").mkdir()
    (d / "data" / "keys.jsonl").write_text("".join(
        json.dumps({"prompt": f"<t>{k}", "answer": "abc"}) + "\n" for k in ("kem", "ubc")))
    return d


@pytest.mark.parametrize("tool", ["sleeps", "allocates", "forks", "writes", "prints", "raises"])
def test_a_misbehaving_tool_is_an_error_observation_and_the_run_goes_on(folder, tool):
    before = sorted(p.name for p in folder.rglob("*"))
    path = folder / f"{tool}.rpeg"
    path.write_text(SPEC.format(tool=tool))
    p = load(path)
    rows = run_inline(p, split_plan(p, 1, staleness=0), steps=2)
    assert len(rows) == 2
    for row in rows:
        assert row["tool_calls"] == 4 and row["tool_errors"] == 4     # every sample called
        assert row["turns"] == 2.0
    assert sorted(p.name for p in folder.rglob("*") if p.name != path.name
                  and p.name != "__pycache__" and p.parent.name != "__pycache__") == \
        sorted(n for n in before if n != "__pycache__" and not n.endswith(".pyc"))
    assert not Path(f"/tmp/rpeg-outside-{__import__('os').getuid()}").exists()


@pytest.mark.slow
def test_tiny_tools_runs_on_the_local_cluster_and_verifies(tmp_path):
    from rpeg.cli import main
    run_dir = tmp_path / "run"
    code = main(["run", str(ROOT / "pipelines" / "tiny_tools.rpeg"), "--steps", "3",
                 "--run-dir", str(run_dir), "--no-progress"])
    assert code in (0, None)
    assert main(["verify", str(run_dir)]) in (0, None)
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    talks = [s for s in samples if len(s.get("turns", [])) >= 2]
    assert talks and all(t["who"] in ("policy", "tool") for s in talks for t in s["turns"])
    assert all("version" in t for s in talks for t in s["turns"] if t["who"] == "policy")
    trace = json.loads((run_dir / "trace.json").read_text())
    gen = [e["args"] for e in trace["traceEvents"] if e.get("cat") == "generate"]
    assert gen and all(e["stats"].get("token_versions") for e in gen)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m["tool_calls"] > 0 and m["turns"] >= 2 for m in metrics)


def test_the_tool_tasks_reward_pays_only_an_answer_after_the_tools_value():
    """``rewards:lookup_reward``: no observation, an error observation or no answer after the
    value score 0 (so neither skipping the tool nor stopping after it is a resting place);
    the value itself scores 1, a wrong letter the lowercase credit; the best fixed answer's
    expectation (``guess_ceiling``) lies between."""
    import sys
    sys.path.insert(0, str(ROOT / "pipelines"))
    try:
        from rewards import guess_ceiling, lookup_reward
    finally:
        sys.path.remove(str(ROOT / "pipelines"))
    responses = ["h", "<result>h</result>", "<result>error: no key</result>h",
                 "<result>h</result>h", "<result>h</result>x"]
    assert lookup_reward(["<k>kem"] * 5, responses, ["h"] * 5) == \
        pytest.approx([0.0, 0.0, 0.0, 1.0, 0.2 + 0.8 * 0.3])
    answers = [json.loads(x)["answer"] for x in
               (ROOT / "pipelines" / "data" / "keys.jsonl").read_text().splitlines()]
    assert 0.2 + 0.8 * 0.3 < guess_ceiling(answers) < 1.0


ENV = '''\
class Echo:
    def reset(self, prompt, row):
        return "P=" + prompt

    def step(self, action):
        return "ok", True
'''

ENV_REWARD = '''\
def same_prompt(prompts, responses, answers=None):
    return [float(("P=" + p) in r) for p, r in zip(prompts, responses)]
'''


def test_an_environment_is_reset_with_its_own_steps_prompt(tmp_path):
    """Each step's conversations start their environments on that step's prompts and rows
    (step 1 reset them on step 0's before): the environment echoes the prompt it got, and
    the reward pays the echo of the sample's own prompt."""
    (tmp_path / "envs.py").write_text(ENV)
    (tmp_path / "same.py").write_text(ENV_REWARD)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keys.jsonl").write_text("".join(
        json.dumps({"prompt": f"<t>{k}", "answer": "abc"}) + "\n"
        for k in ("kem", "ubc", "xyz", "qrs")))
    spec = SPEC.replace('tool t = python("tools:{tool}", timeout = 1 s, memory = 256 MB, '
                        'max_output = 4 KB)', 'environment e = python("envs:Echo")').replace(
        "tools = [t]", "environment = e").replace("rewards:lookup_reward", "same:same_prompt")
    path = tmp_path / "env.rpeg"
    path.write_text(spec.replace("{{", "{").replace("}}", "}"))
    p = load(path)
    rows = run_inline(p, split_plan(p, 1, staleness=0), steps=2)
    assert [row["reward"] for row in rows] == [1.0, 1.0]


def test_overlong_measures_a_conversation_against_its_total_length(tmp_path):
    """A conversation's length counts its observations, so its overlong default is the
    conversation's max_total_len, 100 here: the penalty starts at 75 tokens, above any of
    these conversations (against 2 x 4 policy tokens before, which every conversation with
    an observation passed)."""
    (tmp_path / "envs.py").write_text(ENV)
    (tmp_path / "same.py").write_text(ENV_REWARD)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keys.jsonl").write_text("".join(
        json.dumps({"prompt": f"<t>{k}", "answer": "abc"}) + "\n" for k in ("kem", "ubc")))
    spec = SPEC.replace('tool t = python("tools:{tool}", timeout = 1 s, memory = 256 MB, '
                        'max_output = 4 KB)', 'environment e = python("envs:Echo")\n'
                        'reward long = overlong()').replace(
        "tools = [t]", "environment = e").replace("rewards:lookup_reward", "same:same_prompt")
    spec = spec.replace("max_obs_len = 16", "max_obs_len = 16, max_total_len = 100").replace(
        "stage adv = group_norm(scores)", "stage length = score(long, responses) -> length\n"
                        "stage adv = group_norm(scores, length)")
    path = tmp_path / "long.rpeg"
    path.write_text(spec.replace("{{", "{").replace("}}", "}"))
    p = load(path)
    rows = run_inline(p, split_plan(p, 1, staleness=0), steps=1)
    assert rows[0]["obs_len"] > 0 and rows[0]["response_len"] + rows[0]["obs_len"] < 75, rows
    assert rows[0]["reward.length"] == 0.0, rows
