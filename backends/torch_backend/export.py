"""A run's trained model as a Hugging Face folder: ``rpeg export RUN_DIR -o DIR``.

    >>> out = export_run("runs/smollm2_gsm-...", "out/gsm", step=None)   # doctest: +SKIP
    >>> sorted(p.name for p in out.path.iterdir())                      # doctest: +SKIP
    ['chat_template.jinja', 'config.json', 'generation_config.json', 'model.safetensors',
     'rpeg_export.json', 'tokenizer.json', 'tokenizer_config.json']

The folder is what ``AutoModelForCausalLM.from_pretrained`` and vLLM load: the weights
under the architecture's own tensor names (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight`` unless the embeddings are tied), in the model's dtype (the spec's
``dtype``, else its folder's), the folder's ``config.json`` (or one written for a preset's
shape) and tokenizer files (the folder's, or the byte tokenizer's). The weights are the
trained replica's at the checkpoint (the newest, or ``step``). A LoRA actor exports its
adapter folder (PEFT's ``adapter_config.json`` and ``adapter_model.safetensors``, loadable
over the base model), or with ``merge`` the base model with the adapters folded in.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import attrs

from rpeg.errors import BackendError
from rpeg.graph.ids import ReplicaAt
from rpeg.spec.model import Pipeline

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "generation_config.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@attrs.frozen
class Exported:
    path: Path
    step: int
    version: int
    model: str
    kind: str                      # "model", "adapter" or "merged"


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None,
               model: str = "actor", merge: bool = False) -> Exported:
    """The checkpoint's ``model`` written to the folder ``out``: checked before any work
    (``rpeg.destinations``: never inside a run directory or around the one read, never
    over a folder that is not an earlier export), every tensor checked as it is read
    (:func:`backends.torch_backend.modeling.check_tensors`), written into a temporary
    sibling renamed into place when complete (removed when anything fails)."""
    from rpeg.destinations import (
        EXPORT_MARK,
        check_folder_destination,
        check_not_around,
        written_folder,
    )
    from rpeg.runtime.rundir import checkpoints as ckio
    from rpeg.runtime.rundir import files as rf
    from rpeg.runtime.rundir.serial import loads

    run_dir, out = Path(run_dir), Path(out)
    if not (run_dir / "pipeline.json").is_file():
        raise BackendError(f"'{run_dir}' must be a run directory written by rpeg run, and it "
                           "holds no pipeline.json")
    check_folder_destination(out, "-o", reads=(run_dir,), mark=EXPORT_MARK)
    import torch

    from backends.torch_backend.modeling import expected_of, read_replica

    rf.check_entries(run_dir)
    pipeline = rf.read_parsed(run_dir / "pipeline.json", "pipeline.json", loads)
    if not isinstance(pipeline, Pipeline):
        raise BackendError(f"'{run_dir / 'pipeline.json'}' must hold the pipeline rpeg run "
                           f"wrote, not a {type(pipeline).__name__}")
    if not pipeline.has_model(model):
        raise BackendError(f"--model must name a model of pipeline '{pipeline.name}', not "
                           f"'{model}'", hint="models: " + ", ".join(m.name for m in
                                                                     pipeline.models))
    # its frozen models and a LoRA model's base are built from their weights folders again
    # at every resume and export: an export there changes what the run is
    check_not_around(out, "-o", tuple(Path(m.weights) for m in pipeline.models if m.weights))
    spec = pipeline.model(model)
    if spec.head.value != "lm":
        raise BackendError(f"model '{model}' has a {spec.head.value} head; export writes a "
                           "causal language model", hint="export the actor")
    if merge and spec.lora is None:
        raise BackendError(f"--merge folds LoRA adapters into their base model, and model "
                           f"'{model}' has none: its export is the whole model already",
                           hint="leave out --merge")
    if step is None:
        skipped: list[str] = []
        ck = ckio.latest(run_dir, skipped=skipped)
        for s in skipped:
            print(f"rpeg: warning: skipping a damaged checkpoint: {s}", file=sys.stderr)
        if ck is None:
            raise BackendError(f"run directory '{run_dir}' must hold a complete checkpoint, "
                               "and it holds none")
    else:
        where = ckio.folder(run_dir) / ckio.step_name(step)
        if not (where / ckio.MARKER).is_file():
            have = sorted(p.name for p in ckio.folder(run_dir).glob("step-*")) \
                if ckio.folder(run_dir).is_dir() else []
            raise BackendError(f"--step {step} must name a complete checkpoint, and there is "
                               f"none at {where.name}", hint="checkpoints: " +
                               (", ".join(have) or "none"))
        ck = ckio.validate(where)
    key, replica = _trained_replica(ck, model)
    # whole, from its shards or its file, and every tensor checked against the model
    meta, state = read_replica(replica, expected_of(pipeline, key))
    dtype = getattr(torch, DTYPE_NAMES[spec.dtype])
    kind = "model"
    with written_folder(out, "the export") as tmp:
        if spec.lora is not None and not merge:
            from backends.torch_backend.lora import save_adapter
            save_adapter(state, spec, tmp, dtype)
            kind = "adapter"
        else:
            if spec.lora is not None:
                from backends.torch_backend.lora import merged_state
                from backends.torch_backend.modeling import build_model
                base = build_model(spec.dims, ("lm",), seed=pipeline.workload.seed,
                                   weights=spec.weights)
                state = merged_state(state, spec, base.state_dict())
                kind = "merged"
            _save_weights(state, spec, tmp, dtype)
            (tmp / "config.json").write_text(json.dumps(_config(spec), indent=2,
                                                        sort_keys=True))
        _tokenizer(spec, tmp)
        version = int(meta["version"])
        files = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
        (tmp / EXPORT_MARK).write_text(json.dumps({
            "run": str(run_dir.resolve()), "pipeline": pipeline.name, "model": model,
            "step": ck.step, "version": version, "kind": kind, "dtype": spec.dtype,
            "checkpoint": str(replica), "files": files}, indent=2, sort_keys=True))
    return Exported(out, ck.step, version, model, kind)


def _trained_replica(ck, model: str) -> tuple[str, Path]:
    """The key (``MODEL@DEVICE``) and folder of ``model``'s trained replica in the
    checkpoint (the newest trained copy)."""
    from backends.torch_backend.dcp import sharded_of
    from backends.torch_backend.modeling import read_meta
    found = []
    for key, version in ck.state.get("replicas", {}).items():
        at = ReplicaAt.parse(key)
        folder = ck.path / key
        if at is None or at.key.variant or model not in at.key.backbone.members \
                or not (folder / "meta.json").is_file():
            continue
        sharded = sharded_of(folder, read_meta(folder / "meta.json")) is not None
        if sharded or (folder / "model.safetensors").is_file():
            trained = sharded or (folder / "optimizer.safetensors").is_file()
            found.append((trained, version, key, folder))
    if not found:
        held = sorted({m for key in os.listdir(ck.path) if (at := ReplicaAt.parse(key))
                       and not at.key.variant for m in at.key.backbone.members})
        raise BackendError(f"checkpoint {ck.path.name} must hold model '{model}', and it "
                           "does not", hint="a frozen model is not checkpointed (the run "
                           "rebuilds it from its spec); the checkpoint holds "
                           + (", ".join(held) or "no model"))
    return max(found)[2:]


def hf_state(state: dict, dims) -> dict:
    """A policy model's tensors under the Hugging Face names (value head left out)."""
    from backends.vllm_backend.weights import vllm_name

    out = {}
    for name, tensor in state.items():
        target = vllm_name(name)
        if target is None or name.startswith("value_head"):
            continue
        out[target] = tensor
    if dims.tied_embeddings:
        out.pop("lm_head.weight", None)          # the embeddings are the head
    return out


def _save_weights(state: dict, spec, folder: Path, dtype) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype).contiguous() for k, v in hf_state(state, spec.dims).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    # safetensors creates its file owner-only; the export's other files are as the user's
    # umask makes a new file (what a user sharing the folder with a server expects)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder / "model.safetensors", 0o666 & ~umask)


def _config(spec) -> dict:
    from backends.torch_backend.tokenizer import BOS_ID, EOS_ID, PAD_ID
    from rpeg.spec.hf import config_for

    source = Path(spec.weights) / "config.json" if spec.weights else None
    if source is not None and source.is_file():
        cfg = json.loads(source.read_text(encoding="utf-8"))
        cfg.pop("quantization_config", None)
    else:
        cfg = {**config_for(spec.dims), "pad_token_id": PAD_ID, "bos_token_id": BOS_ID,
               "eos_token_id": EOS_ID}
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = DTYPE_NAMES[spec.dtype]
    return cfg


def _tokenizer(spec, folder: Path) -> None:
    src = Path(spec.weights) if spec.weights else None
    copied = []
    if src is not None and src.is_dir():
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copyfile(src / name, folder / name)
                copied.append(name)
    if not any(n in copied for n in ("tokenizer.json", "tokenizer_config.json")):
        from backends.torch_backend.tokenizer import byte_tokenizer
        byte_tokenizer().save_pretrained(folder)
