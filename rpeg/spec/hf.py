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
knows, by their ``architectures`` entry: Llama, Qwen2, Qwen3 and Mistral, which the
torch backend also runs (as causal language models, or as one-label sequence classifiers:
reward models, their ``score`` head read as the reward head), and the mixtures of experts Qwen3-MoE and DeepSeek-V3 (latent
attention), which it prices and ``rpeg check`` accepts but rpeg's runtime does not build
(``rpeg compile`` and ``rpeg run`` say so; ``--any-executor`` prices them).

    >>> moe = dict(cfg, architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=48,
    ...            hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
    ...            intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
    ...            num_experts_per_tok=8, tie_word_embeddings=False)
    >>> dims, _ = dims_from_config(moe, "qwen3-30b-a3b/config.json")
    >>> round(dims.param_count() / 1e9, 1), round(dims.active_param_count() / 1e9, 1)
    (30.5, 3.4)
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
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
# Mixture-of-experts families whose shape ModelDims does not say (a shared expert of its own
# width, experts on every other layer of another scheme): recognised, and refused by name.
CLASSIFIER = "ForSequenceClassification"     # a reward model's checkpoint: backbone + score
MIXTURES = ("Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV2ForCausalLM")
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
MAX_CONFIG_BYTES = 1 << 20

# The fields a preset and a folder must agree on: everything the cost model and the backbone
# shape read (max_positions is the context a run may use, not the shape).
COMPARED = ("family", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
            "tied_embeddings", "qkv_bias", "head_dim", "qk_norm", "experts", "active_experts",
            "shared_experts", "expert_ffn", "dense_layers", "kv_lora", "q_lora", "rope_dim",
            "v_head")


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
    if arch and arch.endswith(CLASSIFIER):      # a reward model: the family's backbone
        arch = arch[: -len(CLASSIFIER)] + "ForCausalLM"
    if arch in MIXTURES:
        raise ConfigProblem(f"{where}: {arch} is a mixture-of-experts model whose shape rpeg "
                            "does not read (it reads Qwen3MoeForCausalLM and "
                            "DeepseekV3ForCausalLM)")
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
    layers = count("num_hidden_layers")
    extra: dict[str, object] = {}
    if family == "deepseek_v3":        # latent attention: the head is its no-rope and rope parts
        extra = dict(kv_lora=count("kv_lora_rank"), rope_dim=count("qk_rope_head_dim"),
                     v_head=count("v_head_dim"),
                     q_lora=count("q_lora_rank") if cfg.get("q_lora_rank") is not None else 0)
        head_dim = count("qk_nope_head_dim") + extra["rope_dim"]
    else:
        head_dim = count("head_dim") if cfg.get("head_dim") is not None else hidden // heads
    if head_dim < 1:
        raise ConfigProblem(f"{where}: hidden_size ({hidden}) must be at least "
                            f"num_attention_heads ({heads})")
    ffn = count("intermediate_size")
    if family in ("qwen3_moe", "deepseek_v3"):
        extra.update(_experts(cfg, family, layers, count, where))
        if not extra["dense_layers"]:
            ffn = 0                    # no layer has a dense MLP
    dims = ModelDims(
        family, layers=layers, hidden=hidden, heads=heads,
        kv_heads=count("num_key_value_heads", heads), ffn=ffn,
        vocab=count("vocab_size"), tied_embeddings=flag("tie_word_embeddings", False),
        qkv_bias=family == "qwen2" or flag("attention_bias", False),
        max_positions=count("max_position_embeddings", 4096),
        head_size=head_dim if head_dim * heads != hidden else 0,
        qk_norm=family in ("qwen3", "qwen3_moe"), **extra)
    if heads % dims.kv_heads:
        raise ConfigProblem(f"{where}: num_key_value_heads ({dims.kv_heads}) must divide "
                            f"num_attention_heads ({heads})")
    if dims.moe and not 1 <= dims.active_experts <= dims.experts:
        raise ConfigProblem(f"{where}: num_experts_per_tok must be 1..{dims.experts} (the "
                            f"experts), not {dims.active_experts}")
    dtype = cfg.get("torch_dtype", cfg.get("dtype"))
    return dims, DTYPES.get(dtype) if isinstance(dtype, str) else None


def _experts(cfg: dict, family: str, layers: int, count, where: str) -> dict[str, int]:
    """The mixture of experts of a Qwen3-MoE or DeepSeek-V3 config: routed experts, the ones
    a token uses, shared ones, an expert's width, and how many layers keep a dense MLP (placed
    first in ModelDims; the count is what the cost depends on)."""
    if family == "qwen3_moe":
        step = count("decoder_sparse_step", 1)
        dense_at = cfg.get("mlp_only_layers") or []
        if not isinstance(dense_at, list) or not all(isinstance(i, int) for i in dense_at):
            raise ConfigProblem(f"{where}: mlp_only_layers must be a list of layer numbers, not "
                                f"{dense_at!r}")
        sparse = sum(1 for i in range(layers) if i not in dense_at and (i + 1) % step == 0)
        return dict(experts=count("num_experts"), active_experts=count("num_experts_per_tok"),
                    shared_experts=0, expert_ffn=count("moe_intermediate_size"),
                    dense_layers=layers - sparse)
    first = cfg.get("first_k_dense_replace", 0)
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < layers:
        raise ConfigProblem(f"{where}: first_k_dense_replace must be 0..{layers - 1}, not {first!r}")
    every = count("moe_layer_freq", 1)
    sparse = sum(1 for i in range(first, layers) if i % every == 0)
    shared = cfg.get("n_shared_experts") or 0
    return dict(experts=count("n_routed_experts"), active_experts=count("num_experts_per_tok"),
                shared_experts=count("n_shared_experts") if shared else 0,
                expert_ffn=count("moe_intermediate_size"), dense_layers=layers - sparse)


def folder_dims(folder: Path) -> tuple[ModelDims, str | None]:
    """:func:`dims_from_config` of the folder's config.json."""
    return dims_from_config(read_config(folder), str(Path(folder) / "config.json"))


def disagreements(preset: ModelDims, folder: ModelDims) -> list[tuple[str, object, object]]:
    """(field, the preset's value, the folder's value) wherever the two shapes differ."""
    return [(k, getattr(preset, k), getattr(folder, k)) for k in COMPARED
            if getattr(preset, k) != getattr(folder, k)]


def config_for(dims: ModelDims) -> dict:
    """A ``config.json`` for a preset's shape (what an exported preset model is described by):
    a dense family the torch backend builds."""
    arch = next(a for a, f in ARCHITECTURES.items() if f == dims.family)
    if dims.moe or dims.mla:
        raise ConfigProblem(f"a {dims.family} model's config.json is written by its own "
                            "folder, not rebuilt from its dimensions")
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
