"""Each estimator and loss of the registry, 3 steps on a real local Dask cluster, verified.

Every run is ``rpeg run``'s path (the runtime, two worker processes, the torch backend)
with a hand-built split plan, and must pass ``rpeg verify``. Two cover the most moving
parts in the default suite (DAPO: dynamic sampling, clip-higher, token-level loss and
overlong shaping; ReMax with a reward model scoring beside a python reward); the others run
with the slow tests.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from rpeg.runtime import RunOptions, run_pipeline, verify_run
from rpeg.runtime.placement import split_plan
from rpeg.spec import load
from tests.conftest import save_reward_model

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3

HEAD = """\
pipeline {name}
workload {{
    steps = 3; prompts = 4; samples = {samples}; prompt_len = 8
    gen_len = uniform(min = 1, max = 12); dataset = "data/toy.jsonl"; seed = 0
}}
model actor : tiny {{ optimizer = {optimizer} }}
model ref : tiny {{ frozen }}
reward toy = python("rewards:toy_reward")
reward first = python("first:first_letter")
stage rollout = generate(actor, prompts{gen}) -> responses, logprobs
stage ref_lp = forward(ref, responses) -> ref_logprobs
stage scores = score(toy, responses) -> scores
"""
FIRST = '''\
def first_letter(prompts, responses, answers=None):
    """1 when the response starts with the answer's letter: a random policy mostly scores 0,
    so many groups have equal rewards (what dynamic sampling refills)."""
    answers = answers or [""] * len(responses)
    return [1.0 if a and r[:1] == a[:1] else 0.0 for r, a in zip(responses, answers)]
'''

# name -> (samples, optimizer, generate keywords, the rest of the spec)
CASES = {
    "dapo": (4, "adam(lr = 3e-3)", ", refill_rounds = 2, filter_rate = 0.6", """\
reward long = overlong(buffer = 4)
stage hits = score(first, responses) -> hits
stage penalty = score(long, responses, weight = 0.5) -> penalty
stage adv = group_norm(hits, penalty) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs,
                         loss = grpo(clip_low = 0.2, clip_high = 0.28, agg = token_mean),
                         minibatches = 2)
"""),
    "remax_rm": (1, "adamw(lr = 3e-3, schedule = cosine, warmup = 1, min_lr = 1e-4)", "", """\
model rm : tiny { head = reward; frozen; weights = "rm" }
stage greedy = generate(actor, prompts, temperature = 0) -> greedy_responses
stage greedy_scores = score(toy, greedy_responses) -> greedy_scores
stage rm_scores = score(rm, responses, weight = 0.1) -> rm_scores
stage adv = remax(scores, rm_scores, baseline = greedy_scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs,
                         loss = ppo_clip(0.2, kl = 0.05, kl_target = 0.01, tis = 2,
                                         entropy = 0.001, dual_clip = 3))
"""),
    "dr_grpo": (4, "adam(lr = 3e-3)", "", """\
stage adv = group_norm(scores, std = false) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs,
                         loss = grpo(0.2, agg = seq_mean_token_sum), minibatches = 2)
"""),
    "rloo": (4, "adam(lr = 3e-3)", "", """\
stage adv = rloo(scores, logprobs, ref_logprobs, kl = 0.01, kl_estimator = k2) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, loss = ppo_clip(0.2))
"""),
    "reinforce_pp": (2, "adam(lr = 3e-3)", "", """\
stage adv = reinforce(scores, logprobs, ref_logprobs, kl = 0.01, gamma = 0.99) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, loss = ppo_clip(0.2))
"""),
    "reinforce_pp_baseline": (4, "adam(lr = 3e-3)", "", """\
stage adv = reinforce(scores, baseline = group) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs,
                         loss = grpo(0.2, kl = 0.01, kl_estimator = k1))
"""),
    "gspo": (4, "adam(lr = 3e-3)", ", min_len = 2", """\
stage adv = group_norm(scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs,
                         loss = gspo(clip_low = 3e-4, clip_high = 4e-4), minibatches = 2)
"""),
    "gae_k3": (1, "adam(lr = 3e-3)", "", """\
model critic : tiny { head = value; optimizer = adamw(lr = 1e-3, grad_clip = 0.5) }
stage values = forward(critic, responses) -> values
stage adv = gae(scores, values, logprobs, ref_logprobs, kl = 0.05, kl_estimator = k3,
                lam = 0.9) -> advantages, returns
stage actor_step = train(actor, responses, advantages, logprobs, loss = ppo_clip(0.2),
                         epochs = 2)
stage critic_step = train(critic, responses, returns, values, loss = value_mse(0.2))
"""),
}
QUICK = ("dapo", "remax_rm")


@pytest.fixture(scope="module")
def scheduler(local_cluster):
    with local_cluster(2) as address:
        yield address


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("algorithms")
    shutil.copy(ROOT / "pipelines" / "rewards.py", d / "rewards.py")
    (d / "first.py").write_text(FIRST)
    (d / "data").mkdir()
    shutil.copy(ROOT / "pipelines" / "data" / "toy.jsonl", d / "data" / "toy.jsonl")
    save_reward_model(d / "rm")
    return d


def spec_text(name: str) -> str:
    samples, optimizer, gen, rest = CASES[name]
    return HEAD.format(name=name, samples=samples, optimizer=optimizer, gen=gen) + rest


def _run(name, folder, scheduler, tmp_path):
    path = folder / f"{name}.rpeg"
    path.write_text(spec_text(name))
    p = load(path)
    result = run_pipeline(p, split_plan(p, 2, staleness=0),
                          RunOptions(steps=STEPS, scheduler=scheduler, root=str(tmp_path),
                                     progress=False), spec_path=str(path))
    report = verify_run(result.path)
    assert report.ok, str(report)
    assert len(result.metrics) == STEPS
    for row in result.metrics:
        for key in ("reward", "entropy", "policy_loss"):
            assert math.isfinite(row[key]), (name, key, row)
    return result.metrics


def test_every_case_checks():
    for name in CASES:
        assert spec_text(name).startswith("pipeline")


def test_dapo(folder, scheduler, tmp_path):
    rows = _run("dapo", folder, scheduler, tmp_path)
    # dynamic sampling ran: groups were filtered and refilled, in at most 2 rounds
    assert all(0.0 <= r["filtered"] <= 1.0 and r["refill_rounds"] <= 2 for r in rows)
    assert any(r["filtered"] > 0 for r in rows)
    # each score stage's own mean, and the estimator's weighted sum of them
    for r in rows:
        assert r["reward"] == pytest.approx(r["reward.hits"] + 0.5 * r["reward.penalty"],
                                            abs=1e-6)


def test_remax_with_a_reward_model(folder, scheduler, tmp_path):
    rows = _run("remax_rm", folder, scheduler, tmp_path)
    assert all("reward.rm_scores" in r and "reward.greedy_scores" in r for r in rows)
    # the adaptive KL coefficient moves; the schedule warms up then decays
    coefs = [r["kl_coef.actor_step"] for r in rows]
    assert coefs[0] != 0.05 and len(set(coefs)) == STEPS
    lrs = [r["lr.actor_step"] for r in rows]
    assert lrs[0] == pytest.approx(3e-3) and lrs[-1] == pytest.approx(1e-4)
    assert all("is_weight" in r for r in rows)                  # tis: corrected every batch


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in CASES if n not in QUICK])
def test_estimator_and_loss(name, folder, scheduler, tmp_path):
    _run(name, folder, scheduler, tmp_path)


def test_dapo_filtering_most_groups_with_passes_split_over_blocks(folder, scheduler, tmp_path):
    """Dynamic sampling refills the groups it filters (``backends.torch_backend.sampling``):
    a step's batch never shrinks, so a pass and per-sample host ops split over two blocks
    (``rpeg.plan.oplayout.split_parts``) get every sequence of it, one full part each, as
    priced, however many groups were filtered."""
    import attrs

    from rpeg.runtime.lowering.instances import build_calls
    path = folder / "dapo_split.rpeg"
    path.write_text(spec_text("dapo").replace("pipeline dapo", "pipeline dapo_split"))
    p = load(path)
    plan = split_plan(p, 2, staleness=0)
    split = {"ref_lp", "hits", "penalty"}
    plan = attrs.evolve(plan, placements=tuple(
        x.changed(devices=(0, 1), dp=2) if x.stage in split
        else attrs.evolve(x, chunks=1) if x.stage == "rollout" else x   # not streamed
        for x in plan.placements))
    parts = {(c.stages[0], c.chunk): c.parts
             for c in build_calls(p, plan, steps=1) if c.parts}
    assert parts == {(s, b): 2 for s in split for b in (0, 1)}
    result = run_pipeline(p, plan, RunOptions(steps=STEPS, scheduler=scheduler,
                                              root=str(tmp_path), progress=False),
                          spec_path=str(path))
    report = verify_run(result.path)
    assert report.ok, str(report)
    rows = result.metrics
    assert len(rows) == STEPS and all(math.isfinite(r["policy_loss"]) for r in rows)
    # most groups filtered (a random policy rarely hits the answer's first letter)
    assert sum(r["filtered"] for r in rows) / STEPS >= 0.5, rows
