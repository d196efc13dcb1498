"""A vLLM engine serving a model's copy of its own: on devices no trainer uses, or at tp > 1.

    >>> replica = EngineReplica.start(spec, pipeline, device=0, use_cuda=False)   # doctest: +SKIP
    >>> replica.receive(sync, version=1, host=0)     # the trainer's rank 0 sends meanwhile  # doctest: +SKIP
    {'bytes': 1867776, 'buckets': 1}
    >>> chunks = replica.ready().generate(prompts, params, chunks=2)              # doctest: +SKIP
    >>> replica.shutdown()                                                        # doctest: +SKIP

The runtime gives such a copy (``actor~vllm``, ``rpeg.runtime.lowering.instances``) to the Dask
worker of the first device of the engine's tensor-parallel block; vLLM's own workers
span the block (child processes when tp > 1; on GPU they see the block's devices). No
torch model stays beside it: the engine starts from the model's weights folder, or from
a checkpoint of the model built as the trainer builds it (version 0, the only disk
write), and every later version arrives through collectives from the trainer
(``receive``; ``backends.vllm_backend.sync``), or, for an engine sharing a device with a
sender, from that sender in process (``load_local``; CUDA IPC handles on a GPU): one
process group never holds two ranks on one GPU.

A checkpoint of the copy holds its version and its partial rollouts, not weights: a
restore loads the weights of that version from the replica of the model the same
checkpoint holds (the trainer's, at a cut they agree).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from backends.vllm_backend.engine import (
    SyncRecord,
    VllmEngine,
    VllmOptions,
    engine_dtype,
    random_state_kept,
    with_concurrency,
)
from rpeg.errors import BackendError


class EngineReplica:
    """The runtime's replica for an engine copy: its engine, version and pending receive
    (``backends.api.EngineCopy``: the executor keeps torch replicas beside these)."""

    def __init__(self, key: str, engine: VllmEngine, workdir: Path | None) -> None:
        # Use EngineReplica.start.
        self.key = key
        self.engine = engine
        self.workdir = workdir
        self.version = 0
        self.syncs: list[SyncRecord] = []

    @classmethod
    def start(cls, spec, pipeline, device: int, gpus: str = "", max_num_seqs: int = 0,
              kv_fraction: float = 0.0, devices: int = 1, cuda_graph: bool = False,
              sleep: bool = False, build_on: str = "cpu") -> EngineReplica:
        """Start the engine of ``spec`` (a ``rpeg.runtime.lowering.context.Replica`` with ``engine``
        set) serving version 0 of its model; ``gpus``: on a GPU, its block's GPUs as their
        node names them, its host's first (``rpeg.runtime.dask.devices.block_gpus``); ``sleep``:
        it shares a GPU with a trainer and sleeps between generate calls; ``build_on``: the
        device the trainer builds version 0 on, where a random init draws the same."""
        from rpeg.runtime.lowering.instances import base_of
        members = [pipeline.model(m) for m in base_of(spec.model).members]
        weights = next((m.weights for m in members if m.weights), None)
        gpu = bool(gpus) and _cuda()
        workdir = None
        if weights and (Path(weights) / "config.json").exists():
            path = Path(weights)
        else:
            from backends.torch_backend.modeling import build_model
            from backends.vllm_backend.models import save_policy
            workdir = Path(tempfile.mkdtemp(prefix="rpeg-vllm-"))
            with random_state_kept():        # built as the trainer builds version 0
                model = build_model(members[0].dims, spec.heads, seed=pipeline.workload.seed,
                                    weights=weights, device=build_on)
                path = save_policy(model, workdir / "policy")
            del model
        options = VllmOptions(dtype=engine_dtype(members[0].dtype, gpu),
                              tensor_parallel=len(spec.engine), cpu_cores="nobind",
                              gpus=gpus if gpu else "", sleep=sleep and gpu)
        options = with_concurrency(options, max_num_seqs, kv_fraction, devices, cuda_graph)
        return cls(spec.model, VllmEngine.start(path, options), workdir)

    def ready(self) -> VllmEngine:
        """The engine, serving the version last received."""
        return self.engine

    # -- weights ------------------------------------------------------------------------

    def receive(self, sync, version: int, host: int) -> dict:
        """One update through ``sync`` (a ``WeightSync``) for the engine on ``host``."""
        try:
            record = self.engine.receive_weights(sync.addr, sync.first_rank(host), sync.world,
                                                 version, sync.timeout_s)
        except Exception as e:  # noqa: BLE001 — said with the engine's name
            raise BackendError(f"the weight update of '{self.key}' must arrive, and it failed: "
                               f"{type(e).__name__}: {e}") from e
        self.version = version
        self.syncs.append(record)
        return {"bytes": record.bytes, "buckets": record.buckets}

    # an engine on a sending device: that send loads it in process (CUDA IPC on a GPU)
    def begin_local(self) -> None:
        self.engine.begin_update()

    def load_local(self, names: list[str], tensors: list) -> None:
        self.engine.load_bucket(list(zip(names, tensors, strict=True)))

    def commit_local(self, version: int) -> None:
        self.engine.commit(version)

    def loaded(self, version: int) -> dict:
        """The receive of an engine the send on its device loaded: it serves ``version``."""
        if self.engine.version != version:
            raise BackendError(f"the weight update of '{self.key}' must have loaded version "
                               f"{version} in process, and the engine serves "
                               f"{self.engine.version}")
        self.version = version
        record = self.engine.syncs[-1]
        self.syncs.append(record)
        return {"bytes": record.bytes, "buckets": record.buckets}

    # -- checkpoints --------------------------------------------------------------------

    def checkpoint(self, path: str, meta: dict) -> None:
        """Its version and partial rollouts (the weights are those of its model's replica
        at that version, which the same checkpoint holds)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "meta.json").write_text(json.dumps({**meta, "model": self.key,
                                                   "version": self.version, "engine": True},
                                                  indent=2, sort_keys=True))

    def restore(self, path: str) -> int:
        """Serve the version a checkpoint of it names, with that version's weights."""
        from backends.torch_backend.dcp import weights_of
        from backends.torch_backend.modeling import read_meta
        version = int(read_meta(Path(path) / "meta.json")["version"])
        if version:        # the model's weights: whole from its shards, or its file
            source = _weights_at(Path(path).parent, self.key, version)
            self.engine.update_weights(weights_of(source).items(), version)
        self.version = version
        return version

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def _weights_at(checkpoint: Path, key: str, version: int) -> Path:
    """The folder of a replica of ``key``'s model at ``version`` in a checkpoint."""
    from backends.torch_backend.dcp import holds_weights
    from rpeg.graph.ids import ReplicaAt
    from rpeg.runtime.lowering.instances import base_of
    base = base_of(key)
    for d in sorted(checkpoint.iterdir()):
        at = ReplicaAt.parse(d.name)
        if at is None or at.key != base or not holds_weights(d):
            continue
        if int(json.loads((d / "meta.json").read_text()).get("version", -1)) == version:
            return d
    raise BackendError(f"a checkpoint must hold '{base}' at version {version} to restore its "
                       f"vLLM engine, and {checkpoint.name} does not",
                       hint="resume from another checkpoint (an earlier cut)")


def _cuda() -> bool:
    import torch
    return bool(torch.cuda.is_available())
