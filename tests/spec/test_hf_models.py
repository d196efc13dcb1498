"""``model NAME : hf("FOLDER")`` and ``weights = "FOLDER"``: the shape from config.json.

Folders here hold a config.json only (what the checker reads); the published configs of
each family are written out field by field.
"""

from __future__ import annotations

import json
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
    ('model actor : hf("moe")', "Qwen3MoeForCausalLM is a mixture-of-experts model"),
    ('model actor : hf("odd")', "architectures must name one of LlamaForCausalLM"),
    ('model actor : hf("bad")', "num_hidden_layers must be a positive integer, not '30'"),
])
def test_hf_errors_point_at_the_model(tmp_path, actor, message):
    _folder(tmp_path, "m", SMOLLM2)
    _folder(tmp_path, "moe", {**QWEN3_06B, "architectures": ["Qwen3MoeForCausalLM"]})
    _folder(tmp_path, "odd", {**SMOLLM2, "architectures": ["GPT2LMHeadModel"]})
    _folder(tmp_path, "bad", {**SMOLLM2, "num_hidden_layers": "30"})
    with pytest.raises(SpecError) as info:
        load(_spec(tmp_path, actor))
    assert message in info.value.message, info.value.render()
    assert info.value.span.line == 14


def test_hf_source_round_trips_through_fmt():
    src = 'pipeline p\nmodel actor:hf( "w/smol" ){ optimizer = adam(lr = 1e-5) }\n'
    out = fmt(parse_text(src, "p.rpeg"))
    assert out == 'pipeline p\nmodel actor : hf("w/smol") { optimizer = adam(lr = 1e-5) }\n'
    assert parse_text(out, "p.rpeg") == parse_text(src, "p.rpeg")
