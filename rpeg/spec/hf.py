"""A Hugging Face model folder's ``config.json`` read as model dimensions.

    >>> cfg = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 28,
    ...        "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
    ...        "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936,
    ...        "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    >>> dims, dtype = dims_from_config(cfg, "qwen3/config.json")
    >>> dims.family, dims.head_dim, dims.qk_norm, dtype
    ('qwen3', 128, True, 'bf16')
    >>> round(dims.param_count() / 1e6)             # Qwen3-0.6B
    596

``model actor : hf("FOLDER")`` takes its family and dimensions from here, and so
does ``weights = "FOLDER"`` next to a preset, which must then describe the same
model (:func:`disagreements`). Only the JSON file is read: nothing in the folder
runs (no ``trust_remote_code``), and the families are the ones the cost model
and the torch backend know, by their ``architectures`` entry.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

from rpeg.spec.presets import ModelDims

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
# Mixture-of-experts families: read, then refused until the cost model prices experts.
MIXTURES = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
            "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
MAX_CONFIG_BYTES = 1 << 20

# The fields a preset and a folder must agree on: everything the cost model and the backbone
# shape read (max_positions is the context a run may use, not the shape).
COMPARED = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
            "tied_embeddings", "qkv_bias", "head_dim", "qk_norm")


class ConfigProblem(ValueError):
    """What is wrong with a folder's config.json, in words; the caller adds the span."""


def read_config(folder: Path) -> dict:
    """The folder's ``config.json`` as a dict (at most 1 MiB, a regular file, a JSON object)."""
    path = Path(folder) / "config.json"
    try:
        st = path.stat()
    except OSError:
        raise ConfigProblem(f"folder '{folder}' must hold config.json, and it does not") from None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
        raise ConfigProblem(f"'{path}' must be a JSON file of at most {MAX_CONFIG_BYTES:,} bytes")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigProblem(f"'{path}' must be JSON, and it is not ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigProblem(f"'{path}' must hold a JSON object, not {type(cfg).__name__}")
    return cfg


def dims_from_config(cfg: dict, where: str) -> tuple[ModelDims, str | None]:
    """(dimensions, dtype or None) of the model ``cfg`` describes; ConfigProblem if none of
    the known families (``where`` names the file in messages)."""
    archs = cfg.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if arch in MIXTURES:
        raise ConfigProblem(f"{where}: {arch} is a mixture-of-experts model, which the cost "
                            "model does not price yet")
    if arch not in ARCHITECTURES:
        raise ConfigProblem(f"{where}: architectures must name one of "
                            f"{', '.join(ARCHITECTURES)}, not {arch or archs!r}")
    family = ARCHITECTURES[arch]

    def count(key: str, default: int | None = None) -> int:
        v = cfg.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 22:
            raise ConfigProblem(f"{where}: {key} must be a positive integer, not {v!r}")
        return v

    def flag(key: str, default: bool) -> bool:
        v = cfg.get(key, default)
        if not isinstance(v, bool):
            raise ConfigProblem(f"{where}: {key} must be true or false, not {v!r}")
        return v

    heads = count("num_attention_heads")
    hidden = count("hidden_size")
    head_dim = count("head_dim") if cfg.get("head_dim") is not None else hidden // heads
    if head_dim < 1:
        raise ConfigProblem(f"{where}: hidden_size ({hidden}) must be at least "
                            f"num_attention_heads ({heads})")
    dims = ModelDims(
        family, layers=count("num_hidden_layers"), hidden=hidden, heads=heads,
        kv_heads=count("num_key_value_heads", heads), ffn=count("intermediate_size"),
        vocab=count("vocab_size"), tied_embeddings=flag("tie_word_embeddings", False),
        qkv_bias=family == "qwen2" or flag("attention_bias", False),
        max_positions=count("max_position_embeddings", 4096),
        attn_head_dim=head_dim if head_dim * heads != hidden else 0,
        qk_norm=family == "qwen3")
    if heads % dims.kv_heads:
        raise ConfigProblem(f"{where}: num_key_value_heads ({dims.kv_heads}) must divide "
                            f"num_attention_heads ({heads})")
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    return dims, DTYPES.get(dtype) if isinstance(dtype, str) else None


def folder_dims(folder: Path) -> tuple[ModelDims, str | None]:
    """:func:`dims_from_config` of the folder's config.json."""
    return dims_from_config(read_config(folder), str(Path(folder) / "config.json"))


def disagreements(preset: ModelDims, folder: ModelDims) -> list[tuple[str, object, object]]:
    """(field, the preset's value, the folder's value) wherever the two shapes differ."""
    return [(k, getattr(preset, k), getattr(folder, k)) for k in COMPARED
            if getattr(preset, k) != getattr(folder, k)]


def config_for(dims: ModelDims) -> dict:
    """A ``config.json`` for a preset's shape (what an exported preset model is described by)."""
    arch = next(a for a, f in ARCHITECTURES.items() if f == dims.family)
    out = {"architectures": [arch], "model_type": dims.family,
           "num_hidden_layers": dims.layers, "hidden_size": dims.hidden,
           "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
           "intermediate_size": dims.ffn, "vocab_size": dims.vocab,
           "tie_word_embeddings": dims.tied_embeddings,
           "max_position_embeddings": dims.max_positions, "head_dim": dims.head_dim}
    if dims.family in ("llama", "qwen3"):
        out["attention_bias"] = dims.qkv_bias
    return out


__all__ = ["ARCHITECTURES", "MIXTURES", "ConfigProblem", "read_config", "dims_from_config",
           "folder_dims", "disagreements", "config_for"]
