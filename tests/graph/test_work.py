"""A stage's settings as the backends read them: its ``Work``, not its keywords.

How a generate stage samples, a train stage's loss and a score stage's weight travel on
the work; the cost model prices none of them, so two works that differ only there are equal.
"""

from __future__ import annotations

from pathlib import Path

import attrs

from rpeg.graph.work import Sampling, work_of
from rpeg.spec import load

ROOT = Path(__file__).resolve().parents[2]


def _spec(tmp_path, old: str, new: str):
    text = (ROOT / "pipelines" / "tiny_ppo.rpeg").read_text()
    assert old in text
    for name in ("rewards.py", "data"):           # what the spec names beside it
        (tmp_path / name).symlink_to(ROOT / "pipelines" / name)
    path = tmp_path / "p.rpeg"
    path.write_text(text.replace(old, new))
    return load(path)


def test_a_generate_stage_samples_as_its_keywords_say(tmp_path):
    p = _spec(tmp_path, "temperature = 1.0, max_len = 20",
              "temperature = 0.5, top_p = 0.9, max_len = 12, min_len = 3")
    assert work_of(p, "rollout").sampling == Sampling(max_len=12, min_len=3, temperature=0.5,
                                                      top_p=0.9)
    assert work_of(p, "rollout").sampling.logprob_temperature == 0.5
    assert Sampling(max_len=4, temperature=0.0).logprob_temperature == 1.0   # greedy: at 1


def test_max_len_left_unset_is_the_workloads_and_defaults_fill_the_rest(tmp_path):
    p = _spec(tmp_path, "temperature = 1.0, max_len = 20", "temperature = 0.7")
    assert work_of(p, "rollout").sampling == Sampling(
        max_len=p.workload.gen_len.max_len, min_len=0, temperature=0.7, top_p=1.0)


def test_a_train_stage_carries_its_loss_and_a_score_stage_its_weight(tmp_path):
    p = _spec(tmp_path, "score(toy, responses)", "score(toy, responses, weight = 0.25)")
    assert work_of(p, "scores").weight == 0.25
    assert work_of(p, "actor_step").loss == p.stage("actor_step").param("loss")
    assert work_of(p, "actor_step").loss.name == "ppo_clip"


def test_settings_the_cost_model_does_not_price_leave_works_equal(tmp_path):
    p = load(ROOT / "pipelines" / "tiny_ppo.rpeg")
    w = work_of(p, "rollout")
    other = attrs.evolve(w, sampling=attrs.evolve(w.sampling, temperature=0.3))
    assert other == w and hash(other) == hash(w)
