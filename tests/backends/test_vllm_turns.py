"""Conversations with the vLLM engine: token ids in every turn (the prefix cache holds the
earlier ones), the policy's tokens kept as sampled, observations marked; under partial
rollouts conversations pause between turns and resume under newer weights, each token
keeping the version that sampled it.

One in-process engine serves the module (``tiny-vllm``, float32); the conversations step
an environment, so every sample has several turns whatever the policy writes. Tolerance:
|vLLM - torch| <= 1e-4 per token, both float32 (as in test_vllm_engine.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from backends.vllm_backend import available

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(not available()[0], reason="vllm is not installed")]

TOL = 1e-4
PROMPTS = 4
ENV = '''\
class Echo:
    def reset(self, prompt, row):
        self.n, self.last = 0, 2 + int(prompt)      # step s's conversations: 2 + s turns

    def step(self, action):
        self.n += 1
        return "seen %d" % len(action), self.n >= self.last
'''


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from backends.torch_backend.modeling import build_model
    from backends.vllm_backend.engine import VllmEngine, VllmOptions
    from backends.vllm_backend.models import save_policy
    from rpeg.runtime.usercode.sandbox import Sandbox
    from rpeg.spec.presets import PRESETS
    from rpeg.spec.tools import Tool

    d = tmp_path_factory.mktemp("env")
    (d / "envs.py").write_text(ENV)
    box = Sandbox.start([Tool("echo", "envs", "Echo", environment=True)], path=[str(d)],
                        slots=2)
    model = build_model(PRESETS["tiny-vllm"], heads=("lm",), seed=0).eval()
    path = save_policy(model, tmp_path_factory.mktemp("tiny") / "actor")
    engine = VllmEngine.start(path, VllmOptions(dtype="float32", max_model_len=256,
                                                cpu_cores="nobind"))
    try:
        yield model, engine, box
    finally:
        engine.shutdown()
        box.close()


def _toolbox(box):
    from backends.torch_backend.tokenizer import codec_for
    from backends.turns import Toolbox
    from rpeg.spec.tools import Conversation
    conv = Conversation(environment="echo", max_turns=3, max_obs_len=16, max_total_len=120)
    return Toolbox(box, conv, codec_for(None), lambda s, i: {"prompt": str(s)}, max_len=8)


def _params(seed: int):
    from backends.api import SamplingParams
    from backends.torch_backend.tokenizer import EOS_ID
    return SamplingParams(8, temperature=1.0, eos_id=EOS_ID, seed=seed)


def _prompts(step: int):
    from backends.torch_backend.tokenizer import BOS_ID, encode
    return tuple(np.array([BOS_ID, *encode(f"{step}+{i}=")], np.int64) for i in range(PROMPTS))


def _logprobs(model, chunk):
    from backends.torch_backend.train import forward_arrays
    return forward_arrays(model, chunk.prompt_ids, chunk.response_ids, "logprobs")


def test_a_conversation_is_token_ids_in_and_out(setup):
    model, engine, box = setup
    (chunk,) = list(engine.generate(list(_prompts(0)), _params(1), chunks=1,
                                    tools=_toolbox(box)))
    fresh = _logprobs(model, chunk)
    for mask, versions, lp, f in zip(chunk.masks, chunk.versions, chunk.logprobs, fresh,
                                     strict=True):
        m = np.asarray(mask, bool)
        assert np.sum(np.diff(np.concatenate([[0], m.astype(int)])) == 1) == 2   # 2 turns
        assert set(versions[m].tolist()) == {engine.version} and set(versions[~m]) == {-1}
        np.testing.assert_allclose(lp[m], f[m], atol=TOL)    # sampled = what torch computes


def test_conversations_pause_between_turns_and_resume_under_new_weights(setup):
    """Step 0 advances its own conversations (two turns) and step 1's (three); when its own
    have ended, step 1's pause between turns. New weights (version 1) arrive; step 1 ends its conversations
    under them: some hold tokens of both versions, each token's logprob that of the
    weights that sampled it."""
    import copy

    import torch

    from backends.api import Cohort
    model, engine, box = setup
    engine.carried.clear()
    tools = _toolbox(box)
    first = [Cohort(s, _prompts(s), _params(10 + s)) for s in (0, 1)]
    list(engine.generate_carried(first, chunks=1, key="rollout", tools=tools))
    paused = {r.index: (list(r.tokens), list(r.mask)) for r in
              engine.carried["rollout"].cohorts[1]}
    assert any(paused[i][0] for i in paused)                # step 1's started early
    old = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.05)
    engine.update_weights(model.state_dict().items(), 1)
    second = [Cohort(s, _prompts(s), _params(20 + s)) for s in (1, 2)]
    (chunk,) = list(engine.generate_carried(second, chunks=1, key="rollout", tools=tools))
    mixed = 0
    new_lp, old_lp = _logprobs(model, chunk), _logprobs(old, chunk)
    for i, ids, versions, lp, mask in zip(chunk.prompt_index, chunk.response_ids,
                                          chunk.versions, chunk.logprobs, chunk.masks,
                                          strict=True):
        tokens, _ = paused[int(i)]
        assert ids[:len(tokens)].tolist() == tokens          # continued, not resampled
        m = np.asarray(mask, bool)
        v0, v1 = (versions == 0) & m, (versions == 1) & m
        mixed += bool(v0.any() and v1.any())
        np.testing.assert_allclose(lp[v0], old_lp[list(chunk.prompt_index).index(i)][v0],
                                   atol=TOL)
        np.testing.assert_allclose(lp[v1], new_lp[list(chunk.prompt_index).index(i)][v1],
                                   atol=TOL)
    assert mixed > 0
    assert chunk.version == 0                                  # its oldest token's


RUN_ENV = '''\
class Staged:
    def reset(self, prompt, row):
        self.n, self.last = 0, int(row["length"])

    def step(self, action):
        self.n += 1
        return "seen", self.n >= self.last
'''

RUN_SPEC = """\
pipeline staged
workload {
    steps = 4; prompts = 2; samples = 2; prompt_len = 8; gen_len = uniform(min = 1, max = 4)
    dataset = "data/rows.jsonl"; seed = 0
}
model actor : tiny-vllm { optimizer = adam(lr = 1e-3) }
reward r = python("rewards:toy_reward")
environment env = python("envs:Staged")
stage rollout    = generate(actor, prompts, max_len = 4, environment = env, max_turns = 3,
                            max_obs_len = 24, max_total_len = 128,
                            engine = vllm) -> responses, logprobs
stage scores     = score(r, responses) -> scores
stage adv        = group_norm(scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, loss = grpo(0.2))
staleness rollout <= 1
"""


def test_a_vllm_run_with_an_environment_and_partial_rollouts_verifies(tmp_path):
    """``rpeg run`` on the vLLM engine (tiny-vllm, disaggregated) with conversations carried
    over a step: the rows of even steps talk for one turn, those of odd steps for three, so
    each odd step's conversations pause after their first turn and end under the next
    weights. The run verifies (every token's version checked against the bound), and an
    odd step's output holds policy tokens of two versions."""
    import json
    import os
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import attrs

    from rpeg.runtime.data import step_rows
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load

    pipelines = Path(__file__).resolve().parents[2] / "pipelines"
    rows = [{"prompt": f"p{i}", "answer": "aaa", "id": i} for i in range(8)]
    for step in range(4):                                  # 4 steps of 2 prompts: one epoch
        for r in step_rows(rows, prompts=2, samples=1, seed=0, step=step):
            rows[r["id"]]["length"] = 3 if step % 2 else 1
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "envs.py").write_text(RUN_ENV)
    shutil.copy(pipelines / "rewards.py", tmp_path / "rewards.py")
    spec = tmp_path / "t.rpeg"
    spec.write_text(RUN_SPEC)
    plan = split_plan(load(spec), 2, staleness=0)
    plan = attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, carry=1) if p.stage == "rollout" else p for p in plan.placements))
    plan.save(tmp_path / "plan.json")
    env = {k: v for k, v in os.environ.items() if k != "DASK_DISTRIBUTED__WORKER__DAEMON"}
    run_dir = tmp_path / "run"
    for args in (["run", str(tmp_path / "plan.json"), "--spec", str(spec), "--steps", "4",
                  "--run-dir", str(run_dir), "--no-progress"], ["verify", str(run_dir)]):
        done = subprocess.run([sys.executable, "-m", "rpeg", *args], env=env,
                              capture_output=True, text=True, timeout=1200)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    trace = json.loads((run_dir / "trace.json").read_text())
    gen = [e["args"] for e in trace["traceEvents"] if e.get("ph") == "X"
           and e["name"] == "rollout"]
    assert any(len(e["stats"]["token_versions"]) == 2 for e in gen), gen
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    turns = {len([t for t in s["turns"] if t["who"] == "policy"]) for s in samples}
    assert turns == {1, 3}, turns
