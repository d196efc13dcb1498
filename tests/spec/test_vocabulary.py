"""The field's vocabulary: every name the table holds gets a hint naming rpeg's key, every key
it names exists, and the checker gives the hint where such a name is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.errors import SpecError
from rpeg.spec import check_file, keys
from rpeg.spec.functions import find
from rpeg.spec.overrides import parse_overrides
from rpeg.spec.vocabulary import FOREIGN, STATEMENTS, foreign_hint, lookup

ROOT = Path(__file__).resolve().parents[2]
GRAMMAR = (ROOT / "grammar" / "rpeg.lark").read_text(encoding="utf-8")
SECTIONS = {s.name: s for s in keys.SECTIONS + (keys.profile_section(),)}

# The names the table must hold, at least: what users of verl, OpenRLHF, NeMo-RL and TRL
# write first.
MUST_KNOW = ("kl_coef", "ppo_epochs", "rollout.n", "micro_batch_size", "nodes",
             "gpu_memory_utilization", "max_prompt_length", "clip_ratio_high",
             "clip_ratio_low", "clip_ratio", "eps_clip", "init_kl_coef", "n_samples_per_prompt",
             "num_generations", "max_response_length", "generate_max_len",
             "max_completion_length", "ppo_mini_batch_size", "entropy_coeff", "loss_agg_mode",
             "tensor_model_parallel_size", "nnodes", "n_gpus_per_node", "lr_warmup_steps",
             "max_grad_norm", "beta", "epsilon", "epsilon_high", "num_iterations",
             "train_batch_size", "rollout_batch_size", "use_kl_loss", "kl_loss_coef",
             "adv_estimator", "lambd", "enable_gradient_checkpointing", "use_remove_padding",
             "lora_rank", "test_freq", "total_training_steps", "prompt_key", "num_nodes")


def _exists(ref: str) -> bool:
    if "." not in ref:
        return ref in SECTIONS or find(ref) is not None \
            or (ref in STATEMENTS and f'"{ref}"' in GRAMMAR)
    owner, key = ref.split(".")
    if owner in SECTIONS:
        return SECTIONS[owner].has(key)
    fn = find(owner)
    return fn is not None and fn.has(key)


def test_the_table_holds_the_names_users_bring():
    missing = [n for n in MUST_KNOW if lookup(n) is None]
    assert not missing, f"names the vocabulary must know: {missing}"


@pytest.mark.parametrize("entry", FOREIGN, ids=lambda f: f.names[0])
def test_every_entry_names_keys_that_exist(entry):
    assert entry.rpeg, entry.names
    for ref in entry.rpeg:
        assert _exists(ref), f"{entry.names[0]}: rpeg has no {ref}"


@pytest.mark.parametrize("name", [n for f in FOREIGN for n in f.names])
def test_each_foreign_name_gets_a_hint_naming_rpeg_s_key(name):
    entry = lookup(name)
    hint = foreign_hint(name)
    assert hint.startswith(f"'{name}' is ") and entry.what in hint
    for key in entry.keys():
        assert key in hint, f"the hint for {name} must name rpeg's {key}: {hint}"
    # where rpeg's key is what is accepted, the hint says it is this one
    here = foreign_hint(name, entry.keys())
    if entry.same:
        assert here.endswith(f"here rpeg calls it '{entry.keys()[0]}'"), here
    else:
        assert here == hint


def test_a_dotted_name_is_found_by_its_tail():
    assert lookup("actor_rollout_ref.rollout.n") is lookup("n_samples_per_prompt")
    assert lookup("--clip_ratio_high") is lookup("clip_ratio_high")
    assert lookup("stpes") is None and foreign_hint("stpes") is None


BASE = """\
pipeline p
workload {
    steps = 2
    prompts = 2
    samples = 2
    prompt_len = 8
    gen_len = uniform(min = 1, max = 16)
    WORKLOAD
}
model actor : tiny { optimizer = adam(lr = 1e-3) MODEL }
model ref : tiny { frozen }
reward long = overlong(max_len = 16)
stage rollout = generate(actor, prompts) -> responses, logprobs
stage ref_lp = forward(ref, responses) -> ref_logprobs
stage scores = score(long, responses) -> scores
stage adv = group_norm(scores ADV) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs, LOSS TRAIN)
EXTRA
"""


def _spec(**parts: str) -> str:
    text = BASE
    for slot in ("WORKLOAD", "MODEL", "ADV", "TRAIN", "EXTRA"):
        text = text.replace(f" {slot}" if slot in ("ADV", "TRAIN", "MODEL") else slot,
                            parts.get(slot.lower(), ""))
    return text.replace("LOSS", parts.get("loss", "loss = grpo(0.2)"))


CASES = [
    ("kl_coef in an estimator", _spec(adv=", kl_coef = 0.01"), "here rpeg calls it 'kl'"),
    ("kl_coef in a loss", _spec(loss="loss = grpo(0.2, kl_coef = 0.01)"),
     "here rpeg calls it 'kl'"),
    ("kl_coef in train", _spec(train=", kl_coef = 0.01"), "kl, a keyword of the advantage"),
    ("ppo_epochs", _spec(train=", ppo_epochs = 2"), "here rpeg calls it 'epochs'"),
    ("clip_ratio_high", _spec(loss="loss = grpo(0.2, clip_ratio_high = 0.28)"),
     "here rpeg calls it 'clip_high'"),
    ("max_prompt_length", _spec(workload="max_prompt_length = 8"),
     "here rpeg calls it 'prompt_len'"),
    ("n_samples_per_prompt", _spec(workload="n_samples_per_prompt = 4"),
     "here rpeg calls it 'samples'"),
    ("gpu_memory_utilization",
     _spec(extra="place rollout on gpus 0..0 { gpu_memory_utilization = 0.5 }"),
     "here rpeg calls it 'kv_fraction'"),
    ("micro_batch_size", _spec(extra="place actor_step on gpus 0..0 { micro_batch_size = 4 }"),
     "microbatches, the plan's choice"),
    ("lr in a model", _spec(model="; lr = 1e-6"), "optimizer = adam(lr = ...)"),
    ("max_response_length", _spec(workload="max_response_length = 16"), "gen_len"),
]


@pytest.mark.parametrize(("source", "hint"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_the_checker_gives_the_hint_where_the_name_is_written(tmp_path, source, hint):
    f = tmp_path / "p.rpeg"
    f.write_text(source)
    with pytest.raises(SpecError) as info:
        check_file(f)
    assert info.value.hint and hint in info.value.hint, info.value.render()


def test_nodes_in_a_cluster_points_at_nodes_per_rack_and_racks(tmp_path):
    f = tmp_path / "c.rpeg"
    f.write_text("cluster c {\n    gpu = local_cpu\n    gpus_per_node = 2\n    nodes = 2\n"
                 "    link gpu { bandwidth = 1 GB/s; latency = 200 us }\n}\n")
    with pytest.raises(SpecError) as info:
        check_file(f)
    assert info.value.message == "unknown key 'nodes' in cluster 'c'"
    assert "nodes_per_rack x racks" in info.value.hint


def test_a_hydra_override_from_verl_points_at_rpeg_s(tmp_path):
    with pytest.raises(SpecError) as info:
        parse_overrides(["actor_rollout_ref.rollout.n=8"])
    assert "samples in the workload block" in info.value.hint
    assert info.value.hint.endswith("on the command line: workload.samples=...")
    with pytest.raises(SpecError) as info:
        parse_overrides(["actor_rollout_ref.actor.optim.lr=1e-6"])
    assert info.value.hint.endswith("on the command line: model.NAME.optimizer.lr=...")


def test_a_misspelt_rpeg_key_still_gets_did_you_mean(tmp_path):
    f = tmp_path / "p.rpeg"
    f.write_text(_spec(workload="stpes = 2"))
    with pytest.raises(SpecError) as info:
        check_file(f)
    assert info.value.hint == "did you mean 'steps'?"
