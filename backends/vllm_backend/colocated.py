"""vLLM serving a torch replica's policy in the same worker: ``engine = vllm`` in a run.

    >>> engine = colocated_engine(replica)        # first call: checkpoint + start  # doctest: +SKIP
    >>> chunks = engine.generate(prompts, params, chunks=2)                          # doctest: +SKIP
    >>> replica.version += 1                      # a train step on the torch model
    >>> colocated_engine(replica).version         # weights pushed in place first    # doctest: +SKIP
    1
    >>> shutdown_colocated(replica)               # in the worker, before the cluster closes  # doctest: +SKIP

The runtime's torch replica keeps training; the vLLM engine beside it is
started once from a checkpoint of the replica's weights (the only disk
write; the host's random streams are left as they were), and before each
generate call that finds the replica ahead of the engine, the replica's
parameters are copied into the engine in buckets, in memory, without a
restart. The engine reports the version it served in
every chunk, which is what the trace records.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs

from backends.vllm_backend.engine import VllmEngine, VllmOptions, engine_dtype, random_state_kept
from backends.vllm_backend.models import save_policy

# Runtime workers share the machine's cores: let the executor's thread setting stand.
COLOCATED_OPTIONS = VllmOptions(dtype="float32", cpu_cores="nobind")


def colocated_options(model_dtype: str, gpus: str = "", sleep: bool = False) -> VllmOptions:
    """How an engine beside its trainer starts: in the model's dtype on a GPU (``gpus``: the
    worker's own GPU, as its node names it; its processes see that one), float32 on a CPU;
    sleeping between generate calls where it shares that GPU with the trainer (``sleep``),
    and updated in place (through CUDA IPC handles on a GPU: ``VllmEngine.load_bucket``)."""
    return attrs.evolve(COLOCATED_OPTIONS, dtype=engine_dtype(model_dtype, bool(gpus)),
                        gpus=gpus, sleep=sleep and bool(gpus))


def colocated_engine(replica: Any, options: VllmOptions = COLOCATED_OPTIONS) -> VllmEngine:
    """The vLLM engine for ``replica.model``, serving ``replica.version`` when this returns."""
    engine: VllmEngine | None = getattr(replica, "vllm_engine", None)
    if engine is None:
        workdir = Path(tempfile.mkdtemp(prefix="rpeg-vllm-"))
        with random_state_kept():          # building the checkpoint draws random init values
            path = save_policy(replica.model, workdir / "policy")
            engine = VllmEngine.start(path, options, version=replica.version)
        replica.vllm_engine = engine
        replica.vllm_workdir = workdir
        engine.restore_carried(getattr(replica, "carried_restore", ()))   # a resumed run's
        replica.carried_restore = ()
    elif engine.version != replica.version:
        engine.update_weights(_weights(replica), replica.version)
    return engine


def shutdown_colocated(replica: Any) -> None:
    """Stop the replica's vLLM engine, if it has one, and remove its start-up checkpoint."""
    engine = getattr(replica, "vllm_engine", None)
    if engine is not None:
        engine.shutdown()
        replica.vllm_engine = None
    workdir = getattr(replica, "vllm_workdir", None)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
        replica.vllm_workdir = None


def _weights(replica: Any):
    """The replica's weights as it holds them (without re-laying out a sharded trainer)."""
    if hasattr(replica, "weights"):
        return replica.weights()
    return replica.model.state_dict().items()
