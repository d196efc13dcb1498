"""A model block's architecture keys, checked: the preset's dimensions with what the block sets.

    >>> from rpeg.spec.parser import parse_text
    >>> f = parse_text('model a : custom { layers = 2; hidden = 64; heads = 4; kv_heads = 2;'
    ...                ' ffn = 128; vocab = 259; experts = 8; active_experts = 2;'
    ...                ' expert_ffn = 32 }', "x.rpeg")
    >>> from rpeg.spec.keys import entries
    >>> m = f.items[0]
    >>> d = lower_dims(m.preset, entries(m.block, MODEL_ARCH_KEYS, "m"))
    >>> d.moe, d.experts, d.active_experts
    (True, 8, 2)

Besides the six dimensions (``layers``, ``hidden``, ``heads``, ``kv_heads``, ``ffn``,
``vocab``) a block may give: ``head_dim`` (a head size other than ``hidden / heads``, as
Qwen3's), ``qk_norm`` (a flag), ``mlp = gated | plain``, ``family``, ``tied``; a
mixture of experts (``experts``, ``active_experts``, ``shared_experts``, ``expert_ffn``,
``dense_layers``); multi-head latent attention (``kv_lora``, ``q_lora``, ``rope_dim``,
``v_head``). Each is checked at its own ``FILE:LINE:COL``, and the combination against
the rest (active experts at most the experts, a rotary part inside the head, ...).
"""

from __future__ import annotations

import attrs

from rpeg.errors import Span, SpecError, did_you_mean
from rpeg.spec import ast
from rpeg.spec.keys import ARCHITECTURE, read
from rpeg.spec.presets import DIM_KEYS, PRESETS, ModelDims
from rpeg.spec.registry import Type

FAMILIES = ARCHITECTURE.param("family").choices
MODEL_ARCH_KEYS = ARCHITECTURE.keys
_INT_KEYS = tuple(p.name for p in ARCHITECTURE.params if p.type is Type.INT)
_FIELD = {"head_dim": "head_size", "tied": "tied_embeddings"}   # spec key -> ModelDims field


def lower_dims(preset: ast.Ident, e: dict[str, ast.Entry]) -> ModelDims:
    """The checked dimensions of a model block (``e``: its entries by key)."""
    ints = {k: read(e[k], ARCHITECTURE.param(k)) for k in _INT_KEYS if k in e}
    if preset.value in PRESETS:
        dims = PRESETS[preset.value]
    elif preset.value == "custom":
        missing = [k for k in DIM_KEYS if k not in ints]
        if missing:
            raise SpecError(f"a custom model must give {', '.join(missing)}", preset.span,
                            hint="or name a preset such as llama3.1-8b or qwen3-8b")
        dims = ModelDims("llama", 1, 1, 1, 1, 1, 1)
    else:
        raise SpecError(f"unknown model preset '{preset.value}'", preset.span,
                        hint=did_you_mean(preset.value, list(PRESETS) + ["custom"]) or
                        "presets: " + ", ".join(PRESETS) + ", or custom with explicit dimensions")
    changes: dict[str, object] = {_FIELD.get(k, k): v for k, v in ints.items()}
    for key in ("tied", "qk_norm", "family"):
        if key in e:
            changes[_FIELD.get(key, key)] = read(e[key], ARCHITECTURE.param(key))
    if "mlp" in e:
        changes["gated"] = read(e["mlp"], ARCHITECTURE.param("mlp")) == "gated"
    dims = attrs.evolve(dims, **changes) if changes else dims
    _check(dims, e, preset.span)
    return dims


def _check(d: ModelDims, e: dict[str, ast.Entry], where: Span) -> None:
    def at(*keys: str) -> Span:
        """The first of ``keys`` the block sets: its value, where the mistake is."""
        for k in keys:
            if k in e:
                return e[k].value.span if isinstance(e[k], ast.Assign) else e[k].span
        return where

    if "head_dim" not in e and not d.head_size and d.hidden % d.heads:
        raise SpecError(f"heads ({d.heads}) must divide hidden ({d.hidden})", at("heads"),
                        hint="or give head_dim = SIZE for heads whose width is not "
                             "hidden / heads")
    if d.heads % d.kv_heads:
        raise SpecError(f"kv_heads ({d.kv_heads}) must divide heads ({d.heads})",
                        at("kv_heads"))
    if d.experts or any(k in e for k in ("active_experts", "expert_ffn", "shared_experts",
                                         "dense_layers")):
        if not d.experts:
            raise SpecError("a mixture of experts must give experts = N (routed experts per "
                            "layer)", at("active_experts", "expert_ffn", "shared_experts",
                                         "dense_layers"))
        if "active_experts" not in e and not d.active_experts:
            raise SpecError(f"a mixture of experts must give active_experts = K (the routed "
                            f"experts each token uses, 1..{d.experts})", at("experts"),
                            hint="e.g. active_experts = 2 (top-2 routing)")
        if not 1 <= d.active_experts <= d.experts:
            raise SpecError(f"active_experts must be 1..{d.experts} (the experts), not "
                            f"{d.active_experts}", at("active_experts", "experts"),
                            hint="the routed experts each token uses (top-k)")
        if d.expert_ffn < 1:
            raise SpecError("a mixture of experts must give expert_ffn = WIDTH (one expert's "
                            "MLP)", at("experts"))
        if d.dense_layers >= d.layers:
            raise SpecError(f"dense_layers must be below the {d.layers} layers, not "
                            f"{d.dense_layers}", at("dense_layers"),
                            hint="a model without expert layers sets no experts")
        if d.dense_layers and d.ffn < 1:
            raise SpecError("dense layers need ffn = WIDTH", at("dense_layers"))
    if d.kv_lora or any(k in e for k in ("q_lora", "rope_dim", "v_head")):
        if not d.kv_lora:
            raise SpecError("latent attention must give kv_lora = WIDTH (the compressed KV)",
                            at("q_lora", "rope_dim", "v_head"))
        if not 0 < d.rope_dim < d.head_dim:
            raise SpecError(f"rope_dim must be 1..{d.head_dim - 1} (inside the head_dim of "
                            f"{d.head_dim}), not {d.rope_dim}", at("rope_dim", "kv_lora"))
        if d.v_head < 1:
            raise SpecError("latent attention must give v_head = SIZE (a value head)",
                            at("kv_lora"))


__all__ = ["FAMILIES", "MODEL_ARCH_KEYS", "lower_dims"]
