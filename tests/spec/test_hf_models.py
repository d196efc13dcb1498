"""``model NAME : hf("FOLDER")`` and ``weights = "FOLDER"``: the shape from config.json.

Folders here hold a config.json only (what the checker reads); the published configs of
each family are written out field by field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rpeg.errors import SpecError
from rpeg.spec import PRESETS, load
from rpeg.spec.parser import parse_text
from rpeg.spec.printer import fmt

ROOT = Path(__file__).resolve().parents[2]

SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_attention_heads": 9, "num_hidden_layers": 30,
           "num_key_value_heads": 3, "vocab_size": 49152, "tie_word_embeddings": True,
           "max_position_embeddings": 8192, "torch_dtype": "bfloat16"}
QWEN3_06B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "head_dim": 128,
             "intermediate_size": 3072, "num_attention_heads": 16, "num_hidden_layers": 28,
             "num_key_value_heads": 8, "vocab_size": 151936, "tie_word_embeddings": True,
             "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "hidden_size": 4096,
              "intermediate_size": 14336, "num_attention_heads": 32, "num_hidden_layers": 32,
              "num_key_value_heads": 8, "vocab_size": 32768, "max_position_embeddings": 32768,
              "torch_dtype": "bfloat16"}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1,
                 "head_dim": 128, "hidden_size": 2048, "intermediate_size": 6144,
                 "max_position_embeddings": 40960, "mlp_only_layers": [],
                 "moe_intermediate_size": 768, "num_attention_heads": 32, "num_experts": 128,
                 "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
                 "tie_word_embeddings": False, "vocab_size": 151936, "torch_dtype": "bfloat16"}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "first_k_dense_replace": 3,
               "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
               "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_routed_experts": 256,
               "n_shared_experts": 1, "num_attention_heads": 128, "num_experts_per_tok": 8,
               "num_hidden_layers": 61, "num_key_value_heads": 128, "q_lora_rank": 1536,
               "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
               "vocab_size": 129280, "tie_word_embeddings": False,
               "max_position_embeddings": 163840, "torch_dtype": "bfloat16"}
QWEN2_05B = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 896,
             "intermediate_size": 4864, "num_attention_heads": 14, "num_hidden_layers": 24,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
             "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}


def _folder(tmp_path: Path, name: str, cfg: dict) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def _spec(tmp_path: Path, actor: str) -> Path:
    text = (ROOT / "pipelines/tiny_grpo.rpeg").read_text()
    lines = [x for x in text.splitlines() if not x.startswith("model actor")]
    at = next(n for n, x in enumerate(lines) if x.startswith("model"))
    lines.insert(at, actor)
    # the reference starts where the actor does: its folder, frozen
    weights = re.search(r'weights = "[^"]*"', actor)
    ref = actor.split("{")[0].replace("model actor", "model ref").rstrip() + " { frozen" + \
        (f"; {weights.group(0)}" if weights else "") + " }"
    lines = [ref if x.startswith("model ref") else x for x in lines]
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    spec = tmp_path / "p.rpeg"
    spec.write_text("\n".join(lines) + "\n")
    return spec


@pytest.mark.parametrize("cfg,family,params", [
    (SMOLLM2, "llama", 134.5e6), (QWEN3_06B, "qwen3", 596.0e6),
    (MISTRAL_7B, "mistral", 7248.0e6), (QWEN2_05B, "qwen2", 494.0e6)])
def test_hf_takes_family_and_shape_from_config(tmp_path, cfg, family, params):
    _folder(tmp_path, "m", cfg)
    p = load(_spec(tmp_path, 'model actor : hf("m") { optimizer = adam(lr = 1e-5) }'))
    actor = p.model("actor")
    assert actor.preset == "hf" and actor.weights == str((tmp_path / "m").resolve())
    assert actor.dims.family == family and actor.dtype == "bf16"
    # parameter counts of the published models, to the nearest million
    assert abs(actor.dims.param_count() - params) < 1e6, actor.dims.param_count()


def test_qwen3_keeps_its_head_dim_and_qk_norm(tmp_path):
    _folder(tmp_path, "q", QWEN3_06B)
    dims = load(_spec(tmp_path, 'model actor : hf("q")')).model("actor").dims
    assert (dims.head_dim, dims.hidden // dims.heads, dims.qk_norm) == (128, 64, True)
    assert dims.kv_bytes_per_token(2) == 2 * 28 * 8 * 128 * 2


def test_the_smollm2_folder_matches_its_preset(tmp_path):
    _folder(tmp_path, "s", SMOLLM2)
    spec = _spec(tmp_path, 'model actor : smollm2-135m { weights = "s" }')
    assert load(spec).model("actor").dims == PRESETS["smollm2-135m"]


def test_preset_and_folder_disagreeing_is_an_error(tmp_path):
    _folder(tmp_path, "s", SMOLLM2)
    spec = _spec(tmp_path, 'model actor : qwen2.5-0.5b { weights = "s" }')
    with pytest.raises(SpecError) as info:
        load(spec)
    err = info.value
    assert (err.span.line, err.span.col) == (14, 15), err.render()
    assert err.message.startswith("preset qwen2.5-0.5b must describe the model in its weights "
                                  "folder, and it differs: family qwen2 (folder: llama), "
                                  "layers 24 (folder: 30)"), err.message
    assert "note: the weights folder is named here" in err.render()


@pytest.mark.parametrize("actor,message", [
    ('model actor : hf("nowhere")', "hf(...) folder 'nowhere' must exist"),
    ('model actor : hf("m") { layers = 2 }', "'layers' must not be set here"),
    ('model actor : hf', "hf needs the model's folder"),
    ('model actor : tiny("m")', 'a model read from a folder is written hf("FOLDER")'),
    ('model actor : hf("moe")', "MixtralForCausalLM is a mixture-of-experts model whose shape"),
    ('model actor : hf("m") { experts = 8 }', "'experts' must not be set here"),
    ('model actor : hf("odd")', "architectures must name one of LlamaForCausalLM"),
    ('model actor : hf("bad")', "num_hidden_layers must be a positive integer, not '30'"),
])
def test_hf_errors_point_at_the_model(tmp_path, actor, message):
    _folder(tmp_path, "m", SMOLLM2)
    _folder(tmp_path, "moe", {**QWEN3_06B, "architectures": ["MixtralForCausalLM"]})
    _folder(tmp_path, "odd", {**SMOLLM2, "architectures": ["GPT2LMHeadModel"]})
    _folder(tmp_path, "bad", {**SMOLLM2, "num_hidden_layers": "30"})
    with pytest.raises(SpecError) as info:
        load(_spec(tmp_path, actor))
    assert message in info.value.message, info.value.render()
    assert info.value.span.line == 14


@pytest.mark.parametrize("cfg,preset", [(QWEN3_30B_A3B, "qwen3-30b-a3b"),
                                        (DEEPSEEK_V3, "deepseek-v3")])
def test_a_mixture_of_experts_folder_is_its_preset(tmp_path, cfg, preset):
    """The experts (and DeepSeek-V3's latent attention) are read from config.json as the
    preset states them: rpeg check accepts the folder, its cost is the preset's, and a
    preset naming the folder agrees with it."""
    _folder(tmp_path, "m", cfg)
    dims = load(_spec(tmp_path, 'model actor : hf("m")')).model("actor").dims
    assert dims.backbone_key() == PRESETS[preset].backbone_key()
    assert dims.param_count() == PRESETS[preset].param_count()
    load(_spec(tmp_path, f'model actor : {preset} {{ weights = "m" }}'))


def test_dense_layers_of_a_qwen3_moe_folder_are_counted(tmp_path):
    _folder(tmp_path, "m", {**QWEN3_30B_A3B, "mlp_only_layers": [0, 1], "decoder_sparse_step": 2})
    dims = load(_spec(tmp_path, 'model actor : hf("m")')).model("actor").dims
    # layers 2..47 with (i + 1) even are sparse: 23 of them
    assert (dims.moe_layers, dims.dense_layers, dims.ffn) == (23, 25, 6144)


def test_a_moe_folder_is_checked_but_not_run_by_rpegs_runtime(tmp_path):
    from rpeg.errors import PlanError
    from rpeg.plan.compile import check_backend
    from rpeg.plan.space import Limits
    from rpeg.spec import load_cluster

    _folder(tmp_path, "m", QWEN3_30B_A3B)
    p = load(_spec(tmp_path, 'model actor : hf("m") { optimizer = adam(lr = 1e-6) }'))
    cluster = load_cluster(ROOT / "pipelines/clusters/h100_64.rpeg")
    with pytest.raises(PlanError, match="must be of a family this executor builds") as info:
        check_backend(p, Limits.runtime(), cluster)
    assert info.value.span.line == 14
    check_backend(p, Limits(), cluster)            # priced for any executor


def test_hf_source_round_trips_through_fmt():
    src = 'pipeline p\nmodel actor:hf( "w/smol" ){ optimizer = adam(lr = 1e-5) }\n'
    out = fmt(parse_text(src, "p.rpeg"))
    assert out == 'pipeline p\nmodel actor : hf("w/smol") { optimizer = adam(lr = 1e-5) }\n'
    assert parse_text(out, "p.rpeg") == parse_text(src, "p.rpeg")
