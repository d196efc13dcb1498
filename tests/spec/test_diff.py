"""Semantic diffs of pipelines: what counts as a change, what is only a rename."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rpeg.spec import load
from rpeg.spec.diff import ChangeKind, diff

ROOT = Path(__file__).resolve().parents[2]

BASE = (ROOT / "tests" / "fixtures" / "small_ppo.rpeg").read_text() + "staleness rollout <= 1\n"


@pytest.fixture
def spec(tmp_path):
    (tmp_path / "rewards.py").write_text("def score(p, r, a=None):\n    return [0.0] * len(r)\n"
                                         "def other(p, r, a=None):\n    return [1.0] * len(r)\n")
    counter = iter(range(1000))

    def make(text: str):
        path = tmp_path / f"s{next(counter)}.rpeg"
        path.write_text(text)
        return load(path)
    return make


def changes(d) -> set[tuple[str, str, str]]:
    return {(c.section, c.kind.value, c.name) for c in d.changes}


def test_identical_is_empty(spec):
    d = diff(spec(BASE), spec(BASE))
    assert not d.changed and d.text() == "" and d.renames == ()


def test_consistent_renames_are_not_changes(spec):
    renamed = (BASE.replace("model critic", "model vf").replace("(critic,", "(vf,")
               .replace("stage values", "stage v_fwd").replace("-> values", "-> vals")
               .replace("gae(scores, values", "gae(scores, vals").replace("reward r ", "reward rr ")
               .replace("score(r,", "score(rr,").replace("pipeline t", "pipeline u"))
    d = diff(spec(BASE), spec(renamed))
    assert not d.changed, d.text()
    assert {(r.what, r.before, r.after) for r in d.renames} == {
        ("pipeline", "t", "u"), ("model", "critic", "vf"), ("reward", "r", "rr"),
        ("stage", "values", "v_fwd"), ("data", "values", "vals")}


def test_a_keyword_written_at_its_default_is_no_change(spec):
    """temperature = 1.0 is what no temperature means (it was "1.0 -> default", exit 1);
    another value is a change."""
    same = BASE.replace("generate(actor, prompts)", "generate(actor, prompts, temperature = 1.0)")
    assert not diff(spec(BASE), spec(same)).changed
    other = BASE.replace("generate(actor, prompts)", "generate(actor, prompts, temperature = 0.7)")
    assert diff(spec(BASE), spec(other)).changed


def test_renamed_and_changed_stage_is_a_change(spec):
    text = BASE.replace("stage values = forward(critic, responses) -> values",
                        'model vf : tiny { head = value; frozen; weights = "vf" }\n'
                        "stage v2 = forward(vf, responses) -> values")
    d = diff(spec(BASE), spec(text))
    assert ("stages", "-", "values") in changes(d) and ("stages", "+", "v2") in changes(d)


def test_workload_and_model_changes_say_what_they_do(spec):
    text = (BASE.replace("prompts = 4", "prompts = 8")
            .replace("model actor : tiny { optimizer = adam(lr = 1e-3) }",
                     "model actor : small { optimizer = adam(lr = 1e-4) }")
            .replace("model ref : tiny", "model ref : small"))
    d = diff(spec(BASE), spec(text))
    by_name = {c.name: c for c in d.changes}
    assert by_name["prompts"].before == "4" and by_name["prompts"].after == "8"
    assert "responses per step 4 -> 8" in by_name["prompts"].detail
    assert by_name["actor.preset"].after == "small"
    assert "parameters" in by_name["actor.preset"].detail
    assert by_name["actor.optimizer.lr"].before == "0.001"
    assert not any(n.startswith("actor.dims.") for n in by_name)   # implied by the preset


def test_a_checkpoint_cadence_change_is_a_workload_change(spec):
    d = diff(spec(BASE), spec(BASE.replace("gen_len = 16", "gen_len = 16; checkpoint_every = 50")))
    (c,) = d.changes
    assert (c.section, c.name, c.before, c.after) == ("workload", "checkpoint_every", "10", "50")
    assert c.detail == "steps between checkpoints"


@pytest.mark.parametrize("key, value", [("keep_checkpoints", "0"), ("prompt_len", "12")])
def test_every_workload_key_is_a_change(spec, key, value):
    """The diff reads every workload field (keep_checkpoints was left out, exit 0)."""
    text = BASE.replace("gen_len = 16", f"gen_len = 16; {key} = {value}")
    if key in BASE.split("gen_len")[0]:           # a key the base sets: changed in place
        text = re.sub(rf"{key} = \d+", f"{key} = {value}", BASE, count=1)
    d = diff(spec(BASE), spec(text))
    assert [(c.section, c.name, c.after) for c in d.changes] == [("workload", key, value)]


def test_stage_inputs_params_and_edges(spec):
    text = BASE.replace("train(actor, responses, advantages)",
                        "train(actor, responses, advantages, logprobs, minibatches = 2)")
    d = diff(spec(BASE), spec(text))
    got = changes(d)
    assert ("stages", "~", "actor_step.inputs") in got
    assert ("stages", "~", "actor_step.minibatches") in got
    assert ("edges", "+", "rollout -> actor_step [logprobs]") in got
    inputs = next(c for c in d.changes if c.name == "actor_step.inputs")
    assert inputs.detail == "now reads logprobs"


def test_staleness_sharing_colocation_placement(spec):
    text = BASE.replace("staleness rollout <= 1", "staleness rollout <= 3") + (
        "share actor, critic\ncolocate ref_lp, values\nplace rollout on gpus 0..7\n")
    d = diff(spec(BASE), spec(text))
    got = changes(d)
    assert {("staleness", "~", "rollout"), ("sharing", "+", "actor, critic"),
            ("colocation", "+", "ref_lp, values"), ("placement", "+", "rollout")} <= got
    stale = next(c for c in d.changes if c.section == "staleness")
    assert (stale.before, stale.after) == ("1", "3")
    assert "up to 3 updates old" in stale.detail
    back = diff(spec(text), spec(BASE))
    assert ("sharing", "-", "actor, critic") in changes(back)


def test_added_and_removed_models_and_rewards(spec):
    text = BASE.replace('reward r = python("rewards:score")',
                        'reward r = python("rewards:score")\nreward r2 = python("rewards:other")')
    text = text.replace("model ref : tiny { frozen }\n", "model ref : tiny { frozen }\n"
                        "model extra : tiny { frozen }\n")
    d = diff(spec(BASE), spec(text))
    assert {("rewards", "+", "r2"), ("models", "+", "extra")} <= changes(d)


def test_text_and_json_are_deterministic(spec):
    a, b = spec(BASE), spec(BASE.replace("prompts = 4", "prompts = 2") + "share actor, critic\n")
    d1, d2 = diff(a, b), diff(a, b)
    assert d1.text() == d2.text() and d1.to_json() == d2.to_json()
    data = json.loads(d1.to_json())
    assert data["changed"] is True
    assert [c["section"] for c in data["changes"]] == ["workload", "sharing"]
    assert all(c["kind"] in ("added", "removed", "changed") for c in data["changes"])
    lines = d1.text().splitlines()
    assert lines[0].startswith("--- ") and lines[1].startswith("+++ ")
    assert lines[2:5] == ["workload", "  ~ prompts: 4 -> 2  (prompts per step, responses per "
                          "step 4 -> 2)", "sharing"]


def test_extend_is_resolved_before_diffing():
    base = load(ROOT / "pipelines" / "ppo_llama8b.rpeg")
    shared = load(ROOT / "pipelines" / "ppo_shared.rpeg")
    d = diff(base, shared)
    assert [(c.name, c.before, c.after) for c in d.changes] == [
        ("critic.optimizer.lr", "5e-06", "1e-06")]
    assert d.changes[0].kind is ChangeKind.CHANGED


def test_cluster_diff_names_shape_gpu_and_links():
    from rpeg.spec import load_cluster
    from rpeg.spec.diff import diff_clusters

    a = load_cluster(ROOT / "pipelines" / "clusters" / "gh200_64.rpeg")
    b = load_cluster(ROOT / "pipelines" / "clusters" / "h100_64.rpeg")
    d = diff_clusters(a, b)
    got = {(c.section, c.name): (c.before, c.after) for c in d.changes}
    assert got[("cluster", "gpus_per_node")] == ("4", "8")
    assert got[("gpu", "memory")] == ("96 GB", "80 GB")
    assert got[("links", "gpu.bandwidth")] == ("150 GB/s", "450 GB/s")
    assert ("cluster", "num_gpus") not in got                   # both have 64
    assert not diff_clusters(a, a).changed
    import attrs  # the tool cores a tool rollout is priced on
    fewer = diff_clusters(b, attrs.evolve(b, tool_cores=8))
    assert [(c.name, c.before, c.after) for c in fewer.changes] == [
        ("tool_cores", str(b.tool_cores_per_node), "8")]
