"""Every key the checker accepts changes what runs or what the plan predicts.

The keys are enumerated from the registry (every keyword of every function) and from the
model and workload blocks; each has a witness here: two specs that differ by that key (and
what it needs to act), and where the difference must show -- the metrics of a 2-step
in-process run (``run``), the plan's predicted step time and memory (``plan``, on this
machine's CPU profile or ``plan@CLUSTER``), or either.
A key the checker accepts with no witness fails ``test_every_key_has_a_witness``.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from rpeg.plan.evaluate import Evaluator
from rpeg.runtime.calibrate.inline import run_inline
from rpeg.runtime.placement import split_plan
from rpeg.spec import load, load_cluster
from rpeg.spec.functions import FUNCTIONS
from rpeg.spec.lower import MODEL_KEYS, WORKLOAD_KEYS
from tests.conftest import save_chat_model, save_reward_model

ROOT = Path(__file__).resolve().parents[2]
CLUSTERS = ROOT / "pipelines" / "clusters"
NOT_COMPARED = ("step_time_s", "tokens_per_s", "tool_s")   # wall-clock: differ run to run

GRPO = """\
pipeline g
workload {
    steps = 2; prompts = 2; samples = 2; prompt_len = 8; gen_len = uniform(min = 1, max = 8)
    dataset = "data/toy.jsonl"; seed = 0
}
model actor : tiny { optimizer = adam(lr = 3e-3) }
model ref : tiny { frozen }
reward toy = python("rewards:toy_reward")
stage rollout = generate(actor, prompts) -> responses, logprobs
stage ref_lp = forward(ref, responses) -> ref_logprobs
stage scores = score(toy, responses) -> scores
stage adv = group_norm(scores) -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs, loss = grpo(0.2),
                         minibatches = 2)
"""
PPO = """\
pipeline p
workload {
    steps = 2; prompts = 4; prompt_len = 8; gen_len = uniform(min = 1, max = 8)
    dataset = "data/toy.jsonl"; seed = 0
}
model actor : tiny { optimizer = adam(lr = 3e-3) }
model critic : tiny { head = value; optimizer = adam(lr = 1e-3) }
model ref : tiny { frozen }
reward toy = python("rewards:toy_reward")
stage rollout = generate(actor, prompts) -> responses, logprobs
stage ref_lp = forward(ref, responses) -> ref_logprobs
stage values = forward(critic, responses) -> values
stage scores = score(toy, responses) -> scores
stage adv = gae(scores, values, logprobs, ref_logprobs) -> advantages, returns
stage actor_step = train(actor, responses, advantages, logprobs, minibatches = 2)
stage critic_step = train(critic, responses, returns, values, loss = value_mse, minibatches = 2)
"""


def sub(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


def arg(text: str, call: str, extra: str) -> str:
    """``call`` (its text up to where keywords go) with ``extra`` appended: ``, key = v``."""
    return sub(text, call, call + extra)


def estimator(name: str, reads: str = "scores, logprobs, ref_logprobs") -> str:
    return sub(GRPO, "group_norm(scores)", f"{name}({reads})")


GREEDY = sub(GRPO, "stage scores =", "stage greedy = generate(actor, prompts, temperature = 0) "
             "-> greedy_responses\nstage greedy_scores = score(toy, greedy_responses) -> "
             "greedy_scores\nstage scores =")
REMAX = sub(GREEDY, "group_norm(scores)",
            "remax(scores, logprobs, ref_logprobs, baseline = greedy_scores)")
# an actor that ends a response with probability 1/4 a token (the ``eos`` weights folder), so
# responses have different lengths: what aggregations, min_len and length rewards act on
# (its reference the same folder: a KL to a random initialisation is refused)
EOS = sub(sub(GRPO, "model actor : tiny {", 'model actor : tiny { weights = "eos";'),
          "model ref : tiny { frozen }", 'model ref : tiny { frozen; weights = "eos" }')
OVERLONG = sub(sub(EOS, "reward toy", "reward long = overlong()\nreward toy"),
               "stage adv = group_norm(scores)",
               "stage penalty = score(long, responses) -> penalty\n"
               "stage adv = group_norm(scores, penalty)")
REWARD_MODEL = sub(sub(GRPO, "model ref", 'model rm : tiny { head = reward; frozen; weights = '
                                          '"rm" }\nmodel ref'),
                   "stage adv = group_norm(scores)",
                   "stage rm_scores = score(rm, responses) -> rm_scores\n"
                   "stage adv = group_norm(scores, rm_scores)")

W: dict[str, tuple[str, str, str]] = {}          # key -> (where it shows, spec A, spec B)

TOOLS = """\
import time


def look(text):
    return text[::-1]


class Maze:
    def reset(self, prompt, row):
        self.n = 0

    def step(self, action):
        self.n += 1
        return "wall " * self.n, self.n >= 3


class Slow(Maze):
    def step(self, action):
        time.sleep(0.3)
        return super().step(action)


class Heavy(Maze):
    def step(self, action):
        self.blob = bytearray(200 * 1024 * 1024)
        return super().step(action)


class Loud(Maze):
    def step(self, action):
        return "x" * 2048, False
"""


def witness(key: str, where: str, a: str, b: str) -> None:
    assert key not in W, key
    assert a != b, key
    W[key] = (where, a, b)


# --- stage functions -------------------------------------------------------------------------
gen = "generate(actor, prompts"
witness("generate.temperature", "run", GRPO, arg(GRPO, gen, ", temperature = 0.5"))
witness("generate.top_p", "run", GRPO, arg(GRPO, gen, ", top_p = 0.5"))
witness("generate.max_len", "plan", GRPO, arg(GRPO, gen, ", max_len = 4"))
witness("generate.min_len", "either", EOS, arg(EOS, gen, ", min_len = 6"))
witness("generate.engine", "plan", GRPO, arg(GRPO, gen, ", engine = vllm"))
# the torch engine decodes in waves of max_num_seqs; vLLM's KV cache takes kv_fraction
witness("generate.max_num_seqs", "plan", GRPO, arg(GRPO, gen, ", max_num_seqs = 1"))
witness("generate.kv_fraction", "plan@gh200_8", arg(GRPO, gen, ", engine = vllm"),
        arg(GRPO, gen, ", engine = vllm, kv_fraction = 0.2"))
witness("generate.refill_rounds", "plan", GRPO, arg(GRPO, gen, ", refill_rounds = 2"))
witness("generate.filter_rate", "plan", arg(GRPO, gen, ", refill_rounds = 2"),
        arg(GRPO, gen, ", refill_rounds = 2, filter_rate = 0.9"))
witness("score.weight", "run", GRPO, arg(GRPO, "score(toy, responses", ", weight = 0.5"))
witness("train.loss", "run", GRPO, sub(GRPO, ", loss = grpo(0.2)", ""))
witness("train.minibatches", "either", GRPO, sub(GRPO, "minibatches = 2", "minibatches = 1"))
witness("train.epochs", "either", GRPO, arg(GRPO, "minibatches = 2", ", epochs = 2"))

# --- advantage estimators ----------------------------------------------------------------------
_GAE_KL = sub(PPO, "ref_logprobs) ->", "ref_logprobs, kl = 0.5) ->")
witness("gae.kl", "run", PPO, _GAE_KL)
witness("gae.kl_estimator", "run", _GAE_KL, sub(_GAE_KL, "kl = 0.5", "kl = 0.5, kl_estimator = k3"))
witness("gae.gamma", "run", PPO, sub(PPO, "ref_logprobs) ->", "ref_logprobs, gamma = 0.5) ->"))
witness("gae.lam", "run", PPO, sub(PPO, "ref_logprobs) ->", "ref_logprobs, lam = 0.5) ->"))
for name in ("group_norm", "rloo", "reinforce"):
    base = estimator(name)
    with_kl = sub(base, "ref_logprobs) ->", "ref_logprobs, kl = 0.5) ->")
    witness(f"{name}.kl", "run", base, with_kl)
    witness(f"{name}.kl_estimator", "run", with_kl,
            sub(with_kl, "kl = 0.5", "kl = 0.5, kl_estimator = k3"))
witness("group_norm.std", "run", GRPO, sub(GRPO, "group_norm(scores)", "group_norm(scores, "
                                                                         "std = false)"))
witness("group_norm.correction", "run", GRPO, sub(GRPO, "group_norm(scores)",
                                                  "group_norm(scores, correction = 0)"))
witness("group_norm.eps", "run", GRPO, sub(GRPO, "group_norm(scores)", "group_norm(scores, "
                                                                         "eps = 0.5)"))
witness("reinforce.gamma", "run", estimator("reinforce"),
        estimator("reinforce", "scores, logprobs, ref_logprobs, gamma = 0.5"))
witness("reinforce.baseline", "run", estimator("reinforce"),
        estimator("reinforce", "scores, logprobs, ref_logprobs, baseline = group"))
witness("remax.baseline", "run", GREEDY, REMAX)
_REMAX_KL = sub(REMAX, "baseline = greedy_scores", "baseline = greedy_scores, kl = 0.5")
witness("remax.kl", "run", REMAX, _REMAX_KL)
witness("remax.kl_estimator", "run", _REMAX_KL, sub(_REMAX_KL, "kl = 0.5", "kl = 0.5, "
                                                                           "kl_estimator = k3"))

# --- losses ----------------------------------------------------------------------------------
# gspo's ratios are responses' geometric means: a few epochs at a higher rate move them past
# its default clip (0.0004), which the witnesses then open
GSPO = sub(sub(GRPO, "adam(lr = 3e-3)", "adam(lr = 3e-2)"), "minibatches = 2",
           "minibatches = 2, epochs = 3")
for loss in ("ppo_clip", "grpo", "gspo"):
    base = sub(GSPO if loss == "gspo" else GRPO, "grpo(0.2)", f"{loss}(0.2)")
    tight = "0.5" if loss == "gspo" else "0.001"

    def with_(extra: str, text: str = base, loss: str = loss) -> str:
        return sub(text, f"{loss}(0.2", f"{loss}(0.2, {extra}")
    witness(f"{loss}.clip", "run", base, sub(base, f"{loss}(0.2)", f"{loss}({tight})"))
    witness(f"{loss}.clip_low", "run", base, with_(f"clip_low = {tight}"))
    witness(f"{loss}.clip_high", "run", base, with_(f"clip_high = {tight}"))
    # dual-clip bounds a negative advantage's loss where its ratio rose: with whole-response
    # ratios that takes a response the update moved against its advantage, which three
    # prompts' minibatches have (two, as laid out here, move none so)
    dual = sub(base, "prompts = 2", "prompts = 3") if loss == "gspo" else base
    witness(f"{loss}.dual_clip", "run", dual, with_("dual_clip = 1.0001", dual))
    lengths = sub(EOS, "grpo(0.2)", f"{loss}(0.2)")
    witness(f"{loss}.agg", "run", lengths, with_("agg = token_mean" if loss == "gspo" else
                                                  "agg = seq_mean_token_mean", lengths))
    witness(f"{loss}.entropy", "run", base, with_("entropy = 0.5"))
    witness(f"{loss}.kl", "run", base, with_("kl = 0.5"))
    witness(f"{loss}.kl_estimator", "run", with_("kl = 0.5"), with_("kl = 0.5, kl_estimator = k2"))
    witness(f"{loss}.kl_target", "run", with_("kl = 0.5"), with_("kl = 0.5, kl_target = 0.001"))
    witness(f"{loss}.kl_horizon", "run", with_("kl = 0.5, kl_target = 0.001"),
            with_("kl = 0.5, kl_target = 0.001, kl_horizon = 1"))
    witness(f"{loss}.whiten", "run", base,
            with_("whiten = false" if loss == "ppo_clip" else "whiten = true"))
    witness(f"{loss}.tis", "either", base, with_("tis = 1"))
    witness(f"{loss}.coef", "run", base, with_("coef = 3"))
    # a tight clip: the second minibatch's ratios leave the band both ways, whatever the sign
    # of their advantage, so counting every one differs from counting where the clip binds
    narrow = sub(base, f"{loss}(0.2)", f"{loss}({tight})")
    witness(f"{loss}.clip_frac", "run", narrow,
            sub(narrow, f"{loss}({tight})", f"{loss}({tight}, clip_frac = outside)"))
witness("value_mse.clip", "run", PPO, sub(PPO, "loss = value_mse", "loss = value_mse(0.001)"))
witness("value_mse.coef", "run", PPO, sub(PPO, "loss = value_mse", "loss = value_mse(coef = 3)"))

# --- rewards -----------------------------------------------------------------------------------
witness("python.ref", "run", GRPO, sub(GRPO, "rewards:toy_reward", "rewards:exact_match"))
# recorded in the metrics when declared (reward_errors.STAGE: how many scored 0)
witness("python.on_error", "run", GRPO, sub(GRPO, 'python("rewards:toy_reward")',
                                            'python("rewards:toy_reward", on_error = zero)'))

# --- tools and environments: conversations -----------------------------------------------------
# an environment steps every turn whatever the (random) policy writes, so every sample holds
# several turns and observations; a tool the random policy never calls shows in the plan
TOOLED = sub(arg(GRPO, gen, ", tools = [look], max_obs_len = 16"), "reward toy",
             'tool look = python("tools:look")\nreward toy')
ENV = sub(arg(GRPO, gen, ", environment = maze, max_obs_len = 16"), "reward toy",
          'environment maze = python("tools:Maze")\nreward toy')
witness("generate.tools", "either", GRPO, TOOLED)
witness("generate.environment", "run", GRPO, ENV)
witness("generate.max_turns", "either", ENV, arg(ENV, "environment = maze", ", max_turns = 2"))
witness("generate.format", "run", ENV, arg(ENV, "environment = maze", ", format = hermes"))
witness("generate.max_obs_len", "either", ENV, sub(ENV, "max_obs_len = 16", "max_obs_len = 6"))
witness("generate.max_total_len", "either", ENV, arg(ENV, "max_obs_len = 16",
                                                     ", max_total_len = 20"))
witness("generate.turns", "plan", TOOLED, arg(TOOLED, "max_obs_len = 16", ", turns = fixed(1)"))
witness("generate.obs_len", "plan", TOOLED, arg(TOOLED, "max_obs_len = 16",
                                                ", obs_len = fixed(2)"))
# a step sleeps 0.3 s: past the 0.1 s timeout always; its start may be cut too on a busy
# machine (the conversation then ends before its first turn, the error its observation)
SLOW = sub(ENV, "tools:Maze", "tools:Slow")
witness("python.timeout", "run", SLOW, sub(SLOW, '"tools:Slow"', '"tools:Slow", timeout = 0.1 s'))
HEAVY = sub(ENV, "tools:Maze", "tools:Heavy")       # a step allocates 200 MB
witness("python.memory", "run", HEAVY, sub(HEAVY, '"tools:Heavy"',
                                           '"tools:Heavy", memory = 50 MB'))
LOUD = sub(ENV, "tools:Maze", "tools:Loud")         # a step answers 2 KB
witness("python.max_output", "run", LOUD, sub(LOUD, '"tools:Loud"',
                                              '"tools:Loud", max_output = 1 KB'))
witness("python.cores", "plan@h100_64", TOOLED,         # 12 cores a GPU there: 12 calls, or 1
        sub(TOOLED, '"tools:look"', '"tools:look", cores = 12'))
witness("python.latency", "plan", TOOLED, sub(TOOLED, '"tools:look"',
                                              '"tools:look", latency = fixed(2 s)'))
witness("overlong.max_len", "run", OVERLONG, sub(OVERLONG, "overlong()", "overlong(max_len = 4)"))
witness("overlong.buffer", "run", OVERLONG, sub(OVERLONG, "overlong()", "overlong(buffer = 1)"))

# --- optimizers ----------------------------------------------------------------------------------
for kind in ("adam", "adamw"):
    base = sub(GRPO, "adam(lr = 3e-3)", f"{kind}(lr = 3e-3)")

    def opt(extra: str, text: str = base, kind: str = kind) -> str:
        return sub(text, f"{kind}(lr = 3e-3", f"{kind}(lr = 3e-3, {extra}")
    witness(f"{kind}.lr", "run", base, sub(base, "lr = 3e-3", "lr = 1e-2"))
    witness(f"{kind}.beta1", "run", base, opt("beta1 = 0.5"))
    witness(f"{kind}.beta2", "run", base, opt("beta2 = 0.5"))
    witness(f"{kind}.weight_decay", "run", base, opt("weight_decay = 0.5"))
    witness(f"{kind}.eps", "run", base, opt("eps = 0.1"))
    witness(f"{kind}.grad_clip", "run", base, opt("grad_clip = 0.01"))
    witness(f"{kind}.schedule", "run", base, opt("schedule = linear"))
    longer = sub(base, "steps = 2", "steps = 3")        # a warmup shorter than the run
    witness(f"{kind}.warmup", "run", longer, opt("warmup = 2", longer))
    witness(f"{kind}.min_lr", "run", opt("schedule = cosine"),
            opt("schedule = cosine, min_lr = 1e-3"))
    # a 16-bit model's masters: priced (4 bytes a parameter), and on a GPU its FSDP2/DDP
    # optimizer keeps them or not; the CPU runs float32, whose weights are their own masters
    witness(f"{kind}.master_weights", "plan@gh200_8", base, opt("master_weights = false"))

def arch(extra: str, text: str = GRPO) -> str:
    """The actor (and its reference) with ``extra`` architecture keys."""
    return sub(sub(text, "adam(lr = 3e-3) }", f"adam(lr = 3e-3); {extra} }}"),
               "model ref : tiny { frozen }", f"model ref : tiny {{ frozen; {extra} }}")


# --- model keys ------------------------------------------------------------------------------------
witness("model.optimizer", "run", sub(GRPO, " { optimizer = adam(lr = 3e-3) }", ""), GRPO)
witness("model.head", "run", GRPO, REWARD_MODEL)
# a frozen critic reads its value head from its folder (a reward model's checkpoint)
witness("model.frozen", "run", PPO, sub(sub(PPO, "head = value; optimizer = adam(lr = 1e-3)",
                                            'head = value; frozen; weights = "rm"'),
                                        "stage critic_step = train(critic, responses, returns, "
                                        "values, loss = value_mse, minibatches = 2)\n", ""))
witness("model.dtype", "plan@gh200_8", GRPO, sub(GRPO, "adam(lr = 3e-3) }",
                                                 "adam(lr = 3e-3); dtype = fp32 }"))
# the reference starts where the actor does: the same folder, the same architecture
witness("model.weights", "run", GRPO, sub(sub(GRPO, "model actor : tiny {",
                                              'model actor : tiny { weights = "w";'),
                                          "model ref : tiny { frozen }",
                                          'model ref : tiny { frozen; weights = "w" }'))
witness("model.tied", "plan", GRPO, arch("tied"))
witness("model.family", "run", GRPO, arch("family = qwen2"))
for key, value in (("layers", 3), ("hidden", 128), ("heads", 8), ("kv_heads", 4), ("ffn", 256),
                   ("vocab", 300), ("head_dim", 32), ("mlp", "plain")):
    witness(f"model.{key}", "plan", GRPO, arch(f"{key} = {value}"))
# priced (its norms' weights); the torch backend builds it only with the family that has it
witness("model.qk_norm", "plan", GRPO, arch("qk_norm"))
witness("model.lora", "plan@gh200_8", GRPO, sub(GRPO, "adam(lr = 3e-3) }",
                                                "adam(lr = 3e-3); lora = lora(rank = 4) }"))


MOE = "experts = 4; active_experts = 2; expert_ffn = 64"
witness("model.experts", "plan@gh200_8", arch(MOE), arch(MOE.replace("experts = 4",
                                                                     "experts = 8")))
witness("model.active_experts", "plan@gh200_8", arch(MOE),
        arch(MOE.replace("active_experts = 2", "active_experts = 1")))
witness("model.expert_ffn", "plan@gh200_8", arch(MOE),
        arch(MOE.replace("expert_ffn = 64", "expert_ffn = 128")))
witness("model.shared_experts", "plan@gh200_8", arch(MOE), arch(MOE + "; shared_experts = 1"))
witness("model.dense_layers", "plan@gh200_8", arch(MOE), arch(MOE + "; dense_layers = 1"))
MLA = "kv_lora = 32; rope_dim = 8; v_head = 16"
witness("model.kv_lora", "plan@gh200_8", arch(MLA), arch(MLA.replace("kv_lora = 32",
                                                                     "kv_lora = 48")))
witness("model.q_lora", "plan@gh200_8", arch(MLA), arch(MLA + "; q_lora = 32"))
witness("model.rope_dim", "plan@gh200_8", arch(MLA), arch(MLA.replace("rope_dim = 8",
                                                                      "rope_dim = 4")))
witness("model.v_head", "plan@gh200_8", arch(MLA), arch(MLA.replace("v_head = 16",
                                                                    "v_head = 32")))

# --- workload keys -----------------------------------------------------------------------------------
witness("workload.steps", "run", GRPO, sub(GRPO, "steps = 2", "steps = 3"))
witness("workload.prompts", "plan", GRPO, sub(GRPO, "prompts = 2", "prompts = 3"))
witness("workload.samples", "plan", GRPO, sub(GRPO, "samples = 2", "samples = 3"))
witness("workload.prompt_len", "plan", GRPO, sub(GRPO, "prompt_len = 8", "prompt_len = 16"))
witness("workload.gen_len", "plan", GRPO, sub(GRPO, "uniform(min = 1, max = 8)",
                                              "uniform(min = 4, max = 8)"))
witness("workload.dataset", "run", GRPO, sub(GRPO, "data/toy.jsonl", "data/other.jsonl"))
witness("workload.seed", "run", GRPO, sub(GRPO, "seed = 0", "seed = 1"))
# a cut a step (2 in 2 steps) against the default's one at the end: priced, not computed
witness("workload.checkpoint_every", "plan", GRPO,
        sub(GRPO, "seed = 0", "seed = 0; checkpoint_every = 1"))
# what the checkpointer prunes to (a real run's kept checkpoints:
# tests/runtime/test_checkpoint_cadence_run.py)
witness("workload.keep_checkpoints", "kept", GRPO,
        sub(GRPO, "seed = 0", "seed = 0; keep_checkpoints = 0"))
# the toy prompts are 5 or 6 tokens with BOS: at prompt_len 4 each is cut, at its end or start
witness("workload.truncation", "run", sub(GRPO, "prompt_len = 8", "prompt_len = 4; truncation = left"),
        sub(GRPO, "prompt_len = 8", "prompt_len = 4; truncation = right"))
# the data keys: columns of a dataset with two of each (fields.jsonl), the splits of a saved
# dataset (the folder ``saved``), the chat template of a folder whose tokenizer has one
FIELDS = sub(GRPO, "data/toy.jsonl", "data/fields.jsonl")
witness("workload.prompt_field", "run", sub(FIELDS, "seed = 0", 'seed = 0; prompt_field = "q1"'),
        sub(FIELDS, "seed = 0", 'seed = 0; prompt_field = "q2"'))
witness("workload.answer_field", "run",
        sub(FIELDS, "seed = 0", 'seed = 0; prompt_field = "q1"; answer_field = "a1"'),
        sub(FIELDS, "seed = 0", 'seed = 0; prompt_field = "q1"; answer_field = "a2"'))
SAVED = sub(GRPO, '"data/toy.jsonl"', '"data/saved"')
witness("workload.split", "run", sub(SAVED, "seed = 0", 'seed = 0; split = "train"'),
        sub(SAVED, "seed = 0", 'seed = 0; split = "other"'))
CHAT = sub(sub(GRPO, "model actor : tiny {", 'model actor : tiny { weights = "chat";'),
           "model ref : tiny {", 'model ref : tiny { weights = "chat";')
witness("workload.template", "run", sub(CHAT, "seed = 0", "seed = 0; template = raw"),
        sub(CHAT, "seed = 0", "seed = 0; template = chat"))


def accepted_keys() -> set[str]:
    """Every key the checker accepts: each registry keyword, each model and workload key."""
    return ({f"{f.name}.{p.name}" for f in FUNCTIONS for p in f.params}
            | {f"model.{k}" for k in MODEL_KEYS} | {f"workload.{k}" for k in WORKLOAD_KEYS})


def test_every_key_has_a_witness():
    assert accepted_keys() - set(W) == set(), "keys the checker accepts without a witness"
    assert set(W) - accepted_keys() == set(), "witnesses of keys the checker does not accept"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with the specs' neighbours: the rewards, two datasets, a weights folder."""
    d = tmp_path_factory.mktemp("keys")
    shutil.copy(ROOT / "pipelines" / "rewards.py", d / "rewards.py")
    (d / "tools.py").write_text(TOOLS)
    (d / "data").mkdir()
    shutil.copy(ROOT / "pipelines" / "data" / "toy.jsonl", d / "data" / "toy.jsonl")
    rows = (ROOT / "pipelines" / "data" / "toy.jsonl").read_text().splitlines()
    (d / "data" / "other.jsonl").write_text("\n".join(reversed(rows)) + "\n")
    import torch
    from transformers import LlamaForCausalLM

    from backends.torch_backend.modeling import hf_config
    from rpeg.spec.presets import PRESETS
    torch.manual_seed(7)                          # weights other than the preset's seed-0 init
    LlamaForCausalLM(hf_config(PRESETS["tiny"])).save_pretrained(d / "w")
    _eos_model(hf_config(PRESETS["tiny"])).save_pretrained(d / "eos")
    save_chat_model(d / "chat")
    save_reward_model(d / "rm")
    with (d / "data" / "fields.jsonl").open("w") as out:     # two prompt and answer columns
        for n, row in enumerate(map(json.loads, rows)):
            out.write(json.dumps({"q1": row["prompt"], "q2": f"b*{n % 5 + 1}=",
                                  "a1": row["answer"], "a2": "b" * (n % 5 + 1)}) + "\n")
    from datasets import Dataset, DatasetDict
    table = [json.loads(r) for r in rows]
    DatasetDict({"train": Dataset.from_list(table),
                 "other": Dataset.from_list(table[::-1])}).save_to_disk(str(d / "data" / "saved"))
    return d


def _eos_model(config):
    """Layers that add nothing and one embedding for every token: the last hidden state is the
    same everywhere, and the head gives end-of-sequence logit log(86) against 258 zeros
    (probability 1/4), every other token the same chance."""
    import torch
    from transformers import LlamaForCausalLM

    from backends.torch_backend.tokenizer import EOS_ID
    torch.manual_seed(3)
    m = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in m.model.layers.parameters():
            p.zero_()
        e = torch.randn(config.hidden_size)
        m.model.embed_tokens.weight[:] = e
        h = e / e.pow(2).mean().sqrt()                 # the final RMSNorm's output
        m.lm_head.weight.zero_()
        m.lm_head.weight[EOS_ID] = math.log(86.0) * h / h.pow(2).sum()
    return m


class _Outcomes:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.cache: dict[tuple[str, str], object] = {}

    def spec(self, text: str):
        path = self.folder / f"s{abs(hash(text))}.rpeg"
        path.write_text(text)
        return load(path)

    def run(self, text: str):
        if ("run", text) not in self.cache:
            p = self.spec(text)
            rows = run_inline(p, split_plan(p, 1, staleness=0), steps=p.workload.steps)
            self.cache[("run", text)] = [{k: v for k, v in r.items() if k not in NOT_COMPARED}
                                         for r in rows]
        return self.cache[("run", text)]

    def plan(self, text: str, cluster: str):
        if (cluster, text) not in self.cache:
            p = self.spec(text)
            predicted = Evaluator(p, load_cluster(CLUSTERS / f"{cluster}.rpeg")).evaluate(
                split_plan(p, 1, staleness=0)).plan.predicted
            # what each op computes too: a key that changes the FLOPs of a step that host time
            # bounds (a tiny model on a GPU) changes what is priced, not the step
            self.cache[(cluster, text)] = (predicted.step_time_s, predicted.peak_memory,
                                           tuple(round(u.flops) for u in predicted.ops))
        return self.cache[(cluster, text)]


@pytest.fixture(scope="module")
def outcomes(folder):
    return _Outcomes(folder)


def test_a_run_is_repeatable(outcomes):
    """Without this, 'differs' below could be noise."""
    first = outcomes.run(GRPO)
    outcomes.cache.pop(("run", GRPO))
    assert outcomes.run(GRPO) == first


@pytest.mark.parametrize("key", sorted(W))
def test_key_takes_effect(key, outcomes):
    where, a, b = W[key]
    shows = []
    if where.startswith("plan") or where == "either":
        cluster = where.partition("@")[2] or "local_cpu"
        shows.append(outcomes.plan(a, cluster) != outcomes.plan(b, cluster))
    if where in ("run", "either"):
        shows.append(outcomes.run(a) != outcomes.run(b))
    if where == "kept":
        from rpeg.runtime.dask.runner import kept
        shows.append(kept(outcomes.spec(a)) != kept(outcomes.spec(b)))
    assert any(shows), f"{key}: {where} is the same with and without it"
