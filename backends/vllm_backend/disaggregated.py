"""A vLLM engine serving a model's copy of its own: on devices no trainer uses, or at tp > 1.

    >>> replica = EngineReplica.start(spec, pipeline, device=0, use_cuda=False)   # doctest: +SKIP
    >>> replica.receive(sync, version=1, host=0)     # the trainer's rank 0 sends meanwhile  # doctest: +SKIP
    {'bytes': 1867776, 'buckets': 1}
    >>> chunks = replica.ready().generate(prompts, params, chunks=2)              # doctest: +SKIP
    >>> replica.shutdown()                                                        # doctest: +SKIP

The runtime gives such a copy (``actor~vllm``, ``rpeg.runtime.instances``) to the Dask
worker of the first device of the engine's tensor-parallel block; vLLM's own workers
span the block (child processes when tp > 1; on GPU they see the block's devices). No
torch model stays beside it: the engine starts from the model's weights folder, or from
a checkpoint of the model built as the trainer builds it (version 0, the only disk
write), and every later version arrives through collectives from the trainer
(``receive``; ``backends.vllm_backend.sync``). A receive whose host also sends (the
engine shares a device with the trainer's first rank) runs in a thread, and the next use
of the engine waits for it.

A checkpoint of the copy holds its version and its partial rollouts, not weights: a
restore loads the weights of that version from the replica of the model the same
checkpoint holds (the trainer's, at a cut they agree).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path

from backends.vllm_backend.engine import (
    SyncRecord,
    VllmEngine,
    VllmOptions,
    random_state_kept,
    with_concurrency,
)
from rpeg.errors import BackendError


class EngineReplica:
    """The runtime's replica for an engine copy: its engine, version and pending receive."""

    engine_copy = True        # what the executor asks (it keeps torch replicas beside these)

    def __init__(self, key: str, engine: VllmEngine, workdir: Path | None) -> None:
        # Use EngineReplica.start.
        self.key = key
        self.engine = engine
        self.workdir = workdir
        self.version = 0
        self.syncs: list[SyncRecord] = []
        self._pending: tuple[threading.Thread, dict] | None = None

    @classmethod
    def start(cls, spec, pipeline, device: int, use_cuda: bool = False, max_num_seqs: int = 0,
              kv_fraction: float = 0.0, devices: int = 1,
              cuda_graph: bool = False) -> EngineReplica:
        """Start the engine of ``spec`` (a ``rpeg.runtime.context.Replica`` with ``engine``
        set) serving version 0 of its model."""
        from rpeg.runtime.instances import base_of
        members = [pipeline.model(m) for m in base_of(spec.model).split("+")]
        weights = next((m.weights for m in members if m.weights), None)
        gpu = use_cuda and _cuda()
        workdir = None
        if weights and (Path(weights) / "config.json").exists():
            path = Path(weights)
        else:
            from backends.torch_backend.modeling import build_model
            from backends.vllm_backend.models import save_policy
            workdir = Path(tempfile.mkdtemp(prefix="rpeg-vllm-"))
            with random_state_kept():        # built as the trainer builds version 0
                model = build_model(members[0].dims, spec.heads, seed=pipeline.workload.seed,
                                    weights=weights)
                path = save_policy(model, workdir / "policy")
            del model
        tp = len(spec.engine)
        if gpu:
            _gpu_block(spec.engine)
        options = VllmOptions(dtype="bfloat16" if gpu else "float32", tensor_parallel=tp,
                              cpu_cores="nobind",
                              isolate=True if gpu else None)     # its GPUs: CUDA_VISIBLE_DEVICES
        options = with_concurrency(options, max_num_seqs, kv_fraction, devices, cuda_graph)
        return cls(spec.model, VllmEngine.start(path, options), workdir)

    def ready(self) -> VllmEngine:
        """The engine, once any receive in flight finished."""
        self._settle()
        return self.engine

    # -- weights ------------------------------------------------------------------------

    def receive(self, sync, version: int, host: int, background: bool = False) -> dict:
        """One update through ``sync`` (a ``WeightSync``) for the engine on ``host``;
        ``background``: start it in a thread and return (the next use waits for it)."""
        self._settle()

        def work(box: dict) -> None:
            try:
                box["record"] = self.engine.receive_weights(sync.addr, sync.first_rank(host),
                                                            sync.world, version)
            except BaseException as e:  # noqa: BLE001 — raised again where it is waited for
                box["error"] = e
        self.version = version
        if background:
            box: dict = {}
            thread = threading.Thread(target=work, args=(box,), daemon=True,
                                      name=f"rpeg-receive-{self.key}")
            thread.start()
            self._pending = (thread, box)
            return {}
        box = {}
        work(box)
        return self._done(box)

    def _settle(self) -> None:
        if self._pending is not None:
            thread, box = self._pending
            self._pending = None
            thread.join()
            self._done(box)

    def _done(self, box: dict) -> dict:
        if "error" in box:
            raise BackendError(f"the weight update of '{self.key}' must arrive, and it failed: "
                               f"{type(box['error']).__name__}: {box['error']}")
        record = box["record"]
        self.syncs.append(record)
        return {"bytes": record.bytes, "buckets": record.buckets}

    # -- checkpoints --------------------------------------------------------------------

    def checkpoint(self, path: str, meta: dict) -> None:
        """Its version and partial rollouts (the weights are those of its model's replica
        at that version, which the same checkpoint holds)."""
        self._settle()
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        (out / "meta.json").write_text(json.dumps({**meta, "model": self.key,
                                                   "version": self.version, "engine": True},
                                                  indent=2, sort_keys=True))

    def restore(self, path: str) -> int:
        """Serve the version a checkpoint of it names, with that version's weights."""
        from backends.torch_backend.modeling import read_meta, read_tensors
        self._settle()
        version = int(read_meta(Path(path) / "meta.json")["version"])
        if version:        # the model's files, checked with its replica's before the resume
            source = _weights_at(Path(path).parent, self.key, version)
            self.engine.update_weights(read_tensors(source / "model.safetensors").items(),
                                       version)
        self.version = version
        return version

    def shutdown(self) -> None:
        try:
            self._settle()
        finally:
            self.engine.shutdown()
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
                self.workdir = None


def _weights_at(checkpoint: Path, key: str, version: int) -> Path:
    """The folder of a replica of ``key``'s model at ``version`` in a checkpoint."""
    from rpeg.runtime.instances import base_of, is_engine_key
    base = base_of(key)
    for d in sorted(checkpoint.iterdir()):
        model, _, _ = d.name.rpartition("@")
        if model != base or is_engine_key(model) or not (d / "model.safetensors").exists():
            continue
        if int(json.loads((d / "meta.json").read_text()).get("version", -1)) == version:
            return d
    raise BackendError(f"a checkpoint must hold '{base}' at version {version} to restore its "
                       f"vLLM engine, and {checkpoint.name} does not",
                       hint="resume from another checkpoint (an earlier cut)")


def _cuda() -> bool:
    import torch
    return bool(torch.cuda.is_available())


def _gpu_block(block: tuple[int, ...]) -> None:
    """Show the engine the GPUs of its block: its worker processes inherit the variable;
    in this process (tp 1) the current device is the block's."""
    import torch
    count = torch.cuda.device_count()
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d % count) for d in block)
    if len(block) == 1:
        torch.cuda.set_device(block[0] % count)

