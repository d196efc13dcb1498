"""A torch replica's checkpoint: written and read back whatever the layout, with the partial
rollouts its engines keep.

    >>> checkpoint(ex, "actor", "ckpt/step-4/actor@0", {"step": 4})    # doctest: +SKIP
    'ckpt/step-4/actor@0'
    >>> restore(ex, "actor", "ckpt/step-4/actor@0")                    # doctest: +SKIP
    4

A trained replica (not LoRA) writes through torch.distributed.checkpoint, every rank its
own shard (``backends.torch_backend.dcp``); a read copy its whole weights (a tensor-parallel
one gathered from every rank's pieces); a vLLM engine's own copy its version. Any of them
also writes the partial rollouts its engines carry.
"""

from __future__ import annotations

import torch

from backends.api import EngineCopy
from backends.torch_backend.modeling import load_checkpoint, save_checkpoint
from rpeg.errors import BackendError


def checkpoint(ex, model: str, path: str, meta: dict) -> str:
    replica = ex.replicas[model]
    if isinstance(replica, EngineCopy):  # a vLLM engine's copy: version, no weights
        replica.checkpoint(path, meta)
        _save_carried(replica, path)
        return path
    if replica.trained is not None and replica.lora is None:
        return _checkpoint_sharded(model, replica, path, meta)
    with _state_on_device(replica):
        if replica.trained is not None and (replica.fsdp or _masters(replica)
                                            or replica.trained.offload is not None
                                            or replica.lora is not None):
            from backends.torch_backend.state import gathered
            whole = gathered(replica.trained)      # every rank of a sharded model at once
            if replica.lora is not None:    # the adapters alone: the backbone is rebuilt
                from backends.torch_backend.lora import adapter_names
                keep = set(adapter_names(replica.model))
                whole = {k: v for k, v in whole.items() if k.split("::")[0] in keep}
        elif replica.lora is not None:      # a copy that reads the adapters
            from backends.torch_backend.lora import adapter_state
            whole = adapter_state(replica.model, replica.optimizer)
        else:
            whole = _gather_whole(ex, model, replica) if replica.sharded else None
        save_checkpoint(replica.model, path, {**meta, "model": model,
                                              "version": replica.version,
                                              "kl_coef": dict(replica.kl_coef)},
                        replica.optimizer, whole=whole)
    _save_carried(replica, path)
    return path


def _checkpoint_sharded(model: str, replica, path: str, meta: dict) -> str:
    """A trained replica through torch.distributed.checkpoint: every rank of its world at
    once writes its own shard, once, into one folder beside the replicas' (``MODEL.dcp``);
    the replica's folder holds its meta.json naming it (``backends.torch_backend.dcp``)."""
    import json
    from pathlib import Path

    from backends.torch_backend.dcp import SHARDED, save_sharded
    folder = Path(path)
    shards = folder.parent / f"{model}.dcp"
    from rpeg.runtime.rundir.checkpoints import hash_written
    # each rank hashes the shard it wrote, at once, while it is in its page cache: the
    # driver that commits the checkpoint reads none of them back
    hash_written(save_sharded(replica.trained, replica.trained.layout.world, shards))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "meta.json").write_text(json.dumps(
        {**meta, "model": model, "version": replica.version,
         "kl_coef": dict(replica.kl_coef), SHARDED: shards.name,
         "world": list(replica.trained.layout.world)}, indent=2, sort_keys=True))
    _save_carried(replica, path)
    return path


def _gather_whole(ex, model: str, replica) -> dict:
    """Whole weights and moments of a tensor-parallel replica, from every rank's pieces.

    The other ranks' pieces are read on their workers through Dask (no collective), so
    this works whether one rank checkpoints or all of them do at once.
    """
    from backends.torch_backend.distributed import join_pieces, pieces
    try:
        from distributed import get_client, get_worker
        get_worker()
    except (ImportError, ValueError):
        get_client = None
    if get_client is None:                  # not in a Dask worker: the ranks gather together
        from backends.torch_backend.distributed import full_state
        return {**full_state(replica.model), **_moments_whole(replica)}
    got = get_client().run(tp_pieces, model, replica.tp)
    by_device = {d: p for per in got.values() if per for d, p in per.items()}
    by_device[ex.device_index] = _numpy_pieces(pieces(replica.model, replica.optimizer))
    missing = [d for d in replica.tp if d not in by_device]
    if missing:
        raise BackendError(f"checkpoint of '{model}' must read every tensor-parallel rank, "
                           f"and devices {missing} did not answer")
    return join_pieces([_torch_pieces(by_device[d]) for d in replica.tp])


def restore(ex, model: str, path: str) -> int:
    """Load a replica written by :meth:`checkpoint` (weights, optimizer state, version)."""
    replica = ex.replicas[model]
    if isinstance(replica, EngineCopy):
        version = replica.restore(path)
        _restore_carried(replica, path)
        return version
    from backends.torch_backend.dcp import sharded_of
    shards = sharded_of(path)
    if shards is not None:                    # written sharded: read on this layout
        meta = _restore_sharded(replica, path, shards)
    else:
        with _state_on_device(replica):
            if replica.trained is not None:
                replica.trained.unsettle()
            meta = load_checkpoint(replica.model, path, replica.optimizer)
            if replica.trained is not None:
                replica.trained.settle()       # ZeRO-2: whole again (every rank at once)
    replica.version = int(meta["version"])
    replica.kl_coef = {str(k): float(v) for k, v in meta.get("kl_coef", {}).items()}
    if replica.engine is not None:
        replica.engine.version = replica.version
    _restore_carried(replica, path)
    return replica.version


def _restore_sharded(replica, path: str, shards) -> dict:
    """A replica from a sharded checkpoint, whatever layout wrote it: a trained one loads
    its own pieces of every tensor (every rank of its world at once: DCP reshards, so a
    checkpoint of dp 2 resumes at dp 1), a copy that reads the model its whole weights."""
    import json
    from pathlib import Path

    from backends.torch_backend.dcp import load_sharded, weights_of
    from backends.torch_backend.distributed import load_full
    if replica.trained is not None:
        load_sharded(replica.trained, replica.trained.layout.world, shards)
    else:
        with torch.no_grad():
            load_full(replica.model, ((k, v.to(replica.dtype))
                                      for k, v in weights_of(Path(path)).items()))
    return json.loads((Path(path) / "meta.json").read_text())


CARRIED = "carried"           # a replica checkpoint's partial rollouts: carried.json + .safetensors


def carried_states(replica) -> tuple:
    """The partial rollouts the replica's engines keep (their buffers' states)."""
    return tuple(s for e in (replica.engine, getattr(replica, "vllm_engine", None))
                 if e is not None and hasattr(e, "carried_state") for s in e.carried_state())


def _save_carried(replica, path: str) -> None:
    """Write the partial rollouts the replica's engines keep, so a resumed run continues
    the same responses (nothing is written when they keep none)."""
    states = carried_states(replica)
    if states:
        from pathlib import Path

        from rpeg.runtime.rundir.checkpoints import save_tree
        save_tree(Path(path), CARRIED, {"buffers": states})


def _restore_carried(replica, path: str) -> None:
    """The partial rollouts a checkpoint holds, into the replica's engines (none: they start
    afresh). A vLLM engine not started yet gets them when it starts."""
    from pathlib import Path
    states: tuple = ()
    if (Path(path) / f"{CARRIED}.json").exists():
        from rpeg.runtime.rundir.checkpoints import load_tree
        states = tuple(load_tree(Path(path), CARRIED)["buffers"])
    if replica.engine is not None:
        replica.engine.restore_carried(states)
    vllm = getattr(replica, "vllm_engine", None)
    if vllm is not None:
        vllm.restore_carried(states)
    else:
        replica.carried_restore = states


def tp_pieces(model: str, group: tuple[int, ...]) -> dict | None:
    """On a worker: its pieces of ``model`` when it holds a rank of the tp ``group``."""
    from backends.torch_backend.distributed import pieces
    from rpeg.runtime.dask.worker import current_executor
    ex = current_executor()
    replica = ex.replicas.get(model) if ex is not None else None
    if replica is None or replica.tp != tuple(group):
        return None
    return {ex.device_index: _numpy_pieces(pieces(replica.model, replica.optimizer))}


def _numpy_pieces(p: dict) -> dict:
    return {k: (t.numpy(), d) for k, (t, d) in p.items()}


def _torch_pieces(p: dict) -> dict:
    return {k: (torch.as_tensor(t), d) for k, (t, d) in p.items()}


def _moments_whole(replica) -> dict:
    out = {}
    if replica.optimizer is None:
        return out
    for name, p in replica.model.named_parameters():
        for key, val in replica.optimizer.state.get(p, {}).items():
            if torch.is_tensor(val) and val.dim() > 0:
                out[f"{name}::{key}"] = (val.full_tensor() if hasattr(val, "full_tensor")
                                         else val).detach().cpu()
    return out


def _state_on_device(replica):
    """Offloaded optimizer state brought back for a checkpoint, and sent out again after."""
    import contextlib
    if replica.trained is None:
        return contextlib.nullcontext()
    return replica.trained.state_on_device()


def _masters(replica) -> bool:
    from backends.torch_backend.optim import MasterAdam
    return isinstance(replica.optimizer, MasterAdam)
