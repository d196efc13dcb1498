"""A trained replica's checkpoint as torch.distributed.checkpoint writes it: each rank its
own shard, once, readable on any layout.

    >>> save_sharded(trained, world, folder)        # every rank of the replica at once  # doctest: +SKIP
    >>> load_sharded(trained, world, folder)        # any layout: resharded on the way in # doctest: +SKIP
    >>> whole = read_whole(folder)                  # one process, no collective         # doctest: +SKIP
    >>> sorted(whole)[:2]                                                                # doctest: +SKIP
    ['backbone.embed_tokens.weight', 'backbone.embed_tokens.weight::exp_avg']

The state is one flat dict of tensors: each parameter under its name (the float32 master
weights where the optimizer keeps them), its Adam moments as ``NAME::exp_avg`` and
``NAME::exp_avg_sq`` and its step count as ``NAME::step`` (the names the whole checkpoints
use). A tensor sharded by FSDP2 or tensor parallelism is a DTensor and each rank writes
the pieces it holds; a tensor every rank holds whole (DDP, ZeRO-2's between-op weights are
registered sharded first) is written once, by one rank (DCP's de-duplication). The files
are safetensors in DCP's Hugging Face layout (``HuggingFaceStorageWriter``, one file per
rank, the pieces' offsets in each file's own metadata): no pickle is read back. Loading
plans from every file's metadata and each rank reads the slices of its own layout, so a
checkpoint written at dp 2 loads at dp 1 or as a plain model (resharding).
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

import torch

from backends.torch_backend.optim import MasterAdam


def flat_state(trained, create: bool = False) -> dict[str, torch.Tensor]:
    """The replica's weights and Adam state as held on this rank, by name (module doc).

    ``create``: give every trained parameter its Adam state first (zero moments, step 0:
    what Adam starts from), so a checkpoint always holds every key and a fresh replica has
    tensors to load into. The tensors are the replica's own: loading into them loads it."""
    opt = trained.optimizer
    masters = isinstance(opt, MasterAdam)
    out: dict[str, torch.Tensor] = {}
    for name, p in trained.model.named_parameters():
        owner, states = (opt.state[p]["master"], opt.inner.state) if masters \
            else (p, opt.state)
        out[name] = owner
        if not p.requires_grad:
            continue
        st = states.get(owner)
        if not st and create:
            st = states[owner] = {"step": torch.tensor(0.0),
                                  "exp_avg": torch.zeros_like(owner,
                                                              memory_format=torch.preserve_format),
                                  "exp_avg_sq": torch.zeros_like(
                                      owner, memory_format=torch.preserve_format)}
        if st:
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}::{key}"] = st[key]
            step = st["step"]
            if not torch.is_tensor(step):                     # a number: make it a tensor
                step = st["step"] = torch.tensor(float(step))
            out[f"{name}::step"] = step
    return out


def _group(world: tuple[int, ...]) -> dict:
    """DCP's process arguments for a replica trained on ``world`` (its ranks save together)."""
    import torch.distributed as dist
    if len(world) <= 1 or not dist.is_initialized():
        return {"no_dist": True}
    from backends.torch_backend.distributed import group_of
    return {"process_group": group_of(tuple(world))}


@contextlib.contextmanager
def _one_process():
    """DCP's warning that a save or load without a process group is one process's left
    unsaid: where rpeg asks for that (``no_dist``), it is by design."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def save_sharded(trained, world: tuple[int, ...], folder: Path) -> list[Path]:
    """Write this rank's shard of the replica to ``folder`` (every rank of ``world`` calls
    this at once: a collective); the files this rank wrote (its shard, fsync'd by DCP; the
    index file too where one process writes the whole checkpoint)."""
    import torch.distributed.checkpoint as dcp

    with trained.state_on_device():
        trained.unsettle()             # the sharded parameters, as the optimizer holds them
        try:
            state = flat_state(trained, create=True)
            folder.mkdir(parents=True, exist_ok=True)
            writer = _writer_class()(str(folder), save_distributed=len(world) > 1)
            with _one_process():
                dcp.save(state, storage_writer=writer, **_group(world))
        finally:
            trained.settle()
    return writer.written(folder)


def _writer_class():
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    class Writer(HuggingFaceStorageWriter):
        """DCP's Hugging Face writer, keeping the names of the files this rank writes."""

        results = None
        index = None

        def write_data(self, plan, planner):
            fut = super().write_data(plan, planner)
            self.results = fut
            return fut

        def finish(self, metadata, results):
            out = super().finish(metadata, results)
            if not self.save_distributed:             # one process: it wrote the index
                self.index = self.metadata_path
            return out

        def written(self, folder: Path) -> list[Path]:
            got = self.results.wait() if self.results is not None else []
            names = {wr.storage_data.relative_path for wr in got}
            if self.index is not None:
                names.add(self.index)
            return sorted(Path(folder) / n for n in names
                          if (Path(folder) / n).is_file())

    return Writer


def load_sharded(trained, world: tuple[int, ...], folder: Path) -> None:
    """Load a checkpoint :func:`save_sharded` wrote, on whatever layout ``trained`` has now
    (every rank of ``world`` at once); float32 master weights copied to the parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with trained.state_on_device():
        trained.unsettle()
        try:
            state = flat_state(trained, create=True)
            with _one_process():
                dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)),
                         **_group(world))
            if isinstance(trained.optimizer, MasterAdam):
                with torch.no_grad():
                    for p, st in trained.optimizer.state.items():
                        if "master" in st:
                            p.copy_(st["master"])
        finally:
            trained.settle()


def read_whole(folder: Path, keep=lambda name: True) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint whole, in one process (an export, an engine's
    restore): the tensors ``keep`` accepts, as the files hold them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(folder))
    meta = reader.read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items() if keep(k)}
    with _one_process():
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    return state


SHARDED = "sharded"          # a replica folder's meta.json key: the folder of its shards


def sharded_of(replica_folder: Path, meta: dict | None = None) -> Path | None:
    """The folder of a replica's shards when its checkpoint is sharded (else None); ``meta``:
    its meta.json as already read (and checked: ``modeling.read_meta``)."""
    if meta is None:
        import json
        meta = json.loads((Path(replica_folder) / "meta.json").read_text())
    name = meta.get(SHARDED) if isinstance(meta, dict) else None
    return Path(replica_folder).parent / name if isinstance(name, str) else None


def weights_of(replica_folder: Path) -> dict[str, torch.Tensor]:
    """A checkpointed replica's weights, whole, by name: from its shards, or from the whole
    ``model.safetensors`` of a replica written unsharded."""
    shards = sharded_of(replica_folder)
    if shards is not None:
        return read_whole(shards, keep=lambda name: "::" not in name)
    from safetensors.torch import load_file
    return load_file(str(Path(replica_folder) / "model.safetensors"))


def holds_weights(replica_folder: Path) -> bool:
    """Whether a replica folder of a checkpoint holds weights (whole, or as shards)."""
    folder = Path(replica_folder)
    return (folder / "model.safetensors").is_file() or (
        (folder / "meta.json").is_file() and sharded_of(folder) is not None)


def files(folder: Path) -> list[Path]:
    """The files of a sharded checkpoint (one per rank that held something)."""
    return sorted(p for p in Path(folder).iterdir() if p.suffix == ".safetensors")


__all__ = ["SHARDED", "files", "flat_state", "holds_weights", "load_sharded", "read_whole",
           "save_sharded", "sharded_of", "weights_of"]
