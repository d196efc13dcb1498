"""LoRA adapters on a policy model, with the ``peft`` library: the backbone stays frozen.

    >>> model = build_model(PRESETS["tiny"], seed=0)                     # doctest: +SKIP
    >>> apply_lora(model, Lora(rank=4, targets=("q_proj", "v_proj")), seed=0)   # doctest: +SKIP
    >>> sorted({n.split(".")[-3] for n in adapter_names(model)})         # doctest: +SKIP
    ['lora_A', 'lora_B']

``apply_lora`` injects the adapters (``peft.inject_adapter_in_model``; A from the seed, B
zero, so every replica starts from the same weights and the model equals its base) and
leaves only them trainable. What moves and what is kept is the adapters alone: weight sync
to the generator sends them (``executor._export``), a checkpoint holds them and their Adam
moments (:func:`adapter_state`; the backbone is rebuilt from its folder or seed), and
``rpeg export`` writes them as a PEFT adapter folder (:func:`save_adapter`) or folds them
into the base weights (:func:`merged_state`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from rpeg.errors import BackendError

_ADAPTER = re.compile(r"\.lora_(A|B)\.default\.weight$")


def _peft():
    try:
        import peft
    except ImportError:
        raise BackendError("lora adapters need the peft package, and it is not installed",
                           hint="pip install 'rpeg[lora]'") from None
    return peft


def apply_lora(model, lora, seed: int = 0):
    """Inject ``lora``'s adapters into ``model``'s backbone; only they stay trainable."""
    peft = _peft()
    config = peft.LoraConfig(r=lora.rank, lora_alpha=lora.alpha or lora.rank,
                             target_modules=list(lora.targets), lora_dropout=lora.dropout,
                             bias="none")
    torch.manual_seed(seed + 2)
    peft.inject_adapter_in_model(config, model.backbone)
    for name, p in model.named_parameters():
        p.requires_grad_(bool(_ADAPTER.search(name)))
    return model


def has_lora(model) -> bool:
    return any(_ADAPTER.search(n) for n, _ in model.named_parameters())


def adapter_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if _ADAPTER.search(n)]


def adapter_state(model, optimizer) -> dict[str, torch.Tensor]:
    """The adapters and their Adam moments (``name::exp_avg``), for a checkpoint."""
    out = {}
    for name, p in model.named_parameters():
        if not _ADAPTER.search(name):
            continue
        out[name] = p.detach().to("cpu", torch.float32).clone()
        for key, val in (optimizer.state.get(p, {}) if optimizer is not None else {}).items():
            if torch.is_tensor(val) and val.dim() > 0:
                out[f"{name}::{key}"] = val.detach().cpu().clone()
    return out


def peft_name(name: str) -> str:
    """``backbone.layers.0.self_attn.q_proj.lora_A.default.weight`` -> PEFT's
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    inner = name.removeprefix("backbone.").replace(".default.weight", ".weight")
    return f"base_model.model.model.{inner}"


def save_adapter(state: dict, spec, folder: Path, dtype) -> None:
    """A PEFT adapter folder: ``adapter_config.json`` and ``adapter_model.safetensors``."""
    from safetensors.torch import save_file

    lora = spec.lora
    tensors = {peft_name(k): v.to(dtype).contiguous() for k, v in state.items()
               if _ADAPTER.search(k)}
    if not tensors:
        raise BackendError(f"the checkpoint of '{spec.name}' must hold its LoRA adapters, and "
                           "it holds none")
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha or lora.rank, "lora_dropout": lora.dropout,
              "target_modules": list(lora.targets), "bias": "none", "fan_in_fan_out": False,
              "inference_mode": True, "base_model_name_or_path": spec.weights or spec.preset}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def merged_state(state: dict, spec, base: dict) -> dict[str, torch.Tensor]:
    """The base model's weights ``base`` (from its folder, or its preset and seed) with each
    adapter folded in: ``W + alpha / r * B @ A``, under the policy model's own names."""
    out = {k: v.detach().to(torch.float32).clone() for k, v in base.items()}
    scale = spec.lora.scale
    for name, a in state.items():
        m = _ADAPTER.search(name)
        if not m or m.group(1) != "A":
            continue
        stem = name[: m.start()]
        b = state[f"{stem}.lora_B.default.weight"]
        out[f"{stem}.weight"] += scale * (b.float() @ a.float())
    return out
