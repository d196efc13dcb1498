"""A model block's architecture keys (head size, QK-norm, MLP kind, experts, latent attention,
LoRA, FP8): what they mean, the presets with exact public dimensions, and every way to get
one wrong, with the line:col each error points at."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.errors import PlanError, SpecError
from rpeg.plan.compile import check_backend
from rpeg.plan.space import Limits
from rpeg.spec import check_file, load, load_cluster
from rpeg.spec.presets import PRESETS
from rpeg.spec.training import Lora

ROOT = Path(__file__).resolve().parents[2]
REWARDS = "def score(prompts, responses, answers=None):\n    return [0.0] * len(responses)\n"


def _spec(tmp_path: Path, model_line: str) -> Path:
    text = ("pipeline p\n"
            "workload { steps = 1; prompts = 4; samples = 2; prompt_len = 16; gen_len = 16 }\n"
            f"{model_line}\n"
            'reward r = python("rewards:score")\n'
            "stage rollout = generate(actor, prompts) -> responses\n"
            "stage scores = score(r, responses) -> scores\n"
            "stage adv = group_norm(scores) -> advantages\n"
            "stage actor_step = train(actor, responses, advantages, loss = grpo)\n")
    (tmp_path / "rewards.py").write_text(REWARDS)
    path = tmp_path / "p.rpeg"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("name", "params", "active"), [
    ("qwen3-0.6b", 0.596, 0.596), ("qwen3-8b", 8.19, 8.19), ("qwen3-32b", 32.76, 32.76),
    ("qwen3-30b-a3b", 30.53, 3.35), ("qwen3-235b-a22b", 235.09, 22.19),
    ("deepseek-v3", 671.03, 37.55), ("llama3.2-1b", 1.24, 1.24), ("opt-6.7b", 6.66, 6.66)])
def test_presets_count_the_published_parameters(name, params, active):
    d = PRESETS[name]
    assert round(d.param_count() / 1e9, 2) == pytest.approx(params, abs=0.01)
    assert round(d.active_param_count() / 1e9, 2) == pytest.approx(active, abs=0.01)


def test_qwen3_heads_are_wider_than_hidden_over_heads():
    d = PRESETS["qwen3-32b"]
    assert (d.head_dim, d.q_dim, d.hidden, d.qk_norm) == (128, 8192, 5120, True)
    assert d.kv_bytes_per_token(2) == 64 * 2 * 8 * 128 * 2
    # the latent cache of DeepSeek-V3 holds 512 + 64 values per token and layer
    assert PRESETS["deepseek-v3"].kv_bytes_per_token(2) == 61 * 576 * 2


def test_a_block_states_an_architecture_the_presets_lack(tmp_path):
    p = load(_spec(tmp_path, "model actor : custom { layers = 4; hidden = 256; heads = 8; "
                             "kv_heads = 2; ffn = 512; vocab = 1000; head_dim = 64; qk_norm; "
                             "mlp = plain; experts = 16; active_experts = 2; "
                             "shared_experts = 1; expert_ffn = 128; dense_layers = 1; "
                             "lora = lora(rank = 8, targets = [q_proj, up_proj]); "
                             "dtype = fp8 }"))
    m = p.model("actor")
    d = m.dims
    assert (d.head_dim, d.q_dim, d.qk_norm, d.gated) == (64, 512, True, False)
    assert (d.experts, d.active_experts, d.shared_experts, d.expert_ffn, d.moe_layers) == \
        (16, 2, 1, 128, 3)
    assert (m.lora, m.dtype) == (Lora(8, targets=("q_proj", "up_proj")), "fp8")
    # q_proj on every layer; up_proj on the dense layer and on each of the 17 experts of
    # the 3 expert layers
    assert m.lora.params(d) == 8 * (4 * (256 + 512) + 1 * (256 + 512) + 3 * 17 * (256 + 128))
    assert d.features() == {"head_dim", "qk_norm", "plain_mlp", "moe"}


CASES = [
    ("active-over-experts", "model actor : qwen3-30b-a3b { active_experts = 200 }", 3, 48,
     "active_experts must be 1..128 (the experts), not 200"),
    ("experts-without-width", "model actor : custom { layers = 2; hidden = 64; heads = 4; "
     "kv_heads = 2; ffn = 128; vocab = 259; experts = 4; active_experts = 2 }", 3, 108,
     "must give expert_ffn = WIDTH"),
    ("dense-layers-all", "model actor : qwen3-30b-a3b { dense_layers = 48 }", 3, 46,
     "dense_layers must be below the 48 layers, not 48"),
    ("heads-not-dividing", "model actor : custom { layers = 2; hidden = 100; heads = 8; "
     "kv_heads = 2; ffn = 128; vocab = 259 }", 3, 58,
     "heads (8) must divide hidden (100)"),
    ("rope-outside-head", "model actor : deepseek-v3 { rope_dim = 192 }", 3, 40,
     "rope_dim must be 1..191"),
    ("mlp-kind", "model actor : llama3.1-8b { mlp = relu }", 3, 35,
     "mlp must be one of gated, plain, not 'relu'"),
    ("lora-frozen", "model actor : llama3.1-8b { frozen; lora = lora(rank = 8) }", 3, 37,
     "lora adapts a trained language model; this one is frozen"),
    ("lora-rank-alone", "model actor : llama3.1-8b { lora = 8 }", 3, 36,
     "lora must be lora(rank = ...), not 8"),
    ("lora-gate-on-plain-mlp", "model actor : opt-6.7b { lora = lora(rank = 8, targets = "
     "[q_proj, gate_proj]) }", 3, 67, "a lora target must be a projection the model has"),
    ("lora-rank-over-hidden", "model actor : tiny { lora = lora(rank = 65) }", 3, 41,
     "rank must be at most 64"),
    # alpha 0 would scale the adapters by 0; it ran as alpha = rank
    ("lora-alpha-zero", "model actor : tiny { lora = lora(rank = 4, alpha = 0) }", 3, 52,
     "alpha must be positive, not 0"),
    ("dtype", "model actor : llama3.1-8b { dtype = int4 }", 3, 37,
     "dtype must be one of bf16, fp16, fp32, fp8, not 'int4'"),
]


@pytest.mark.parametrize(("line_text", "line", "col", "message"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_a_wrong_architecture_is_refused_where_it_is_written(tmp_path, line_text, line, col,
                                                            message):
    with pytest.raises(SpecError) as info:
        check_file(_spec(tmp_path, line_text))
    err = info.value
    assert message in err.message, err.render()
    assert (err.span.line, err.span.col) == (line, col), err.render()


def test_rpeg_run_refuses_what_its_runtime_does_not_build(tmp_path):
    cluster = load_cluster(ROOT / "pipelines/clusters/h100_64.rpeg")
    moe = load(_spec(tmp_path, "model actor : qwen3-30b-a3b { optimizer = adam(lr = 1e-6) }"))
    with pytest.raises(PlanError, match="family this executor builds") as info:
        check_backend(moe, Limits.runtime(), cluster)
    assert info.value.span.line == 3
    check_backend(moe, Limits(), cluster)            # any executor prices it
    # LoRA runs with peft in the torch engine; vLLM is not given the adapters
    lora = load(_spec(tmp_path, "model actor : llama3.1-8b { lora = lora(rank = 16) }"))
    check_backend(lora, Limits.runtime(), cluster)
    path = _spec(tmp_path, "model actor : llama3.1-8b { lora = lora(rank = 16) }")
    path.write_text(path.read_text().replace("generate(actor, prompts)",
                                             "generate(actor, prompts, engine = vllm)"))
    with pytest.raises(PlanError, match="trains LoRA adapters"):
        check_backend(load(path), Limits.runtime(), cluster)
    # Qwen3's own head size and QK-norm are built by the torch backend
    check_backend(load(_spec(tmp_path, "model actor : qwen3-0.6b")), Limits.runtime(), cluster)


def test_fp8_needs_a_gpu_with_fp8_throughput(tmp_path):
    p = load(_spec(tmp_path, "model actor : llama3.1-8b { dtype = fp8 }"))
    with pytest.raises(PlanError, match="its profile gives no FP8 throughput"):
        check_backend(p, Limits(), load_cluster(ROOT / "pipelines/clusters/a100_16.rpeg"))


def test_prompt_lengths_may_be_a_distribution(tmp_path):
    path = _spec(tmp_path, "model actor : llama3.1-8b")
    text = path.read_text().replace("prompt_len = 16", "prompt_len = lognormal(median = 200, "
                                                       "max = 1024)")
    path.write_text(text)
    w = load(path).workload
    assert w.prompt_len == 1024 and w.prompt_lens.median == 200      # cut at its maximum
    path.write_text(text.replace("lognormal(median = 200, max = 1024)", "gamma(2)"))
    with pytest.raises(SpecError, match="prompt_len distribution must be one of") as info:
        check_file(path)
    assert (info.value.span.line, info.value.span.col) == (2, 62)
