"""The checkpoints a run writes, priced as it writes them.

    >>> from rpeg.spec.model import GpuProfile
    >>> gpu = GpuProfile("g", disk_bandwidth=2e9, hash_bandwidth=1e9)
    >>> save_time(((10e9, (0, 1, 2, 3)),), gpu, 2)   # 10 GB by 4 ranks on 2 nodes
    5.0
    >>> save_time(((10e9, (0, 1, 2, 3)),), gpu, 4)   # ... on one node: its disk, twice
    7.5
    >>> cuts(25, 10, None), cuts(25, 10, 4), cuts(5, 10, None)
    (3, 8, 1)

``rpeg run`` cuts the run at step boundaries (``rpeg.runtime.core.choices.next_cut``):
every ``checkpoint_every`` steps (the workload's key, :data:`CHECKPOINT_EVERY` unless set;
``--checkpoint-every`` overrides it; 0: none between), at every eval
step and at the end, and at each cut writes a checkpoint
(``rpeg.runtime.dask.checkpointing.Checkpointer``) before the next step starts: the run
waits for it. What it writes is what a resume cannot rebuild: each trained model's
weights and optimizer state, once (every rank of its world its own shard at once,
``backends.torch_backend.checkpoints``; a LoRA model its adapters), a frozen model and a
copy as new as its trainer not at all. The workers write in parallel, the devices of one
node on its disk (``disk_bandwidth``, with its fsync), and each writer then hashes the
files it wrote (``rpeg.runtime.rundir.checkpoints.save_replicas``: their SHA-256 for the
manifest, read back from its page cache at ``hash_bandwidth`` a process, every rank of a
node at once); the driver commits the manifest from the writers' hashes without reading
their files (``commit``), hashing only its own small files (state, carried outputs: not
priced). So a node takes its bytes at its disk's speed, then its largest rank's share at
one core's hashing speed, and the save the slowest node. A step carries ``cuts / steps`` of one save
(:func:`per_step`), and ``op_times`` the whole save (``checkpoint``), as the eval op.

Not priced: a copy that lags its trainer at a cut (a staleness > 0 step's vLLM engine
copy, written by its worker), the trace and outputs carried over the cut (small).
"""

from __future__ import annotations

from rpeg.cost.memory import (
    lora_params,
    model_params,
    optimizer_state_bytes,
    value_bytes,
)
from rpeg.graph.layout import Layout
from rpeg.spec.model import CHECKPOINT_EVERY, GpuProfile, Model

CHECKPOINT_OP = "checkpoint"


def checkpoint_bytes(model: Model, gpu: GpuProfile) -> float:
    """Bytes a cut writes of a trained model: its optimizer state
    (:func:`rpeg.cost.memory.optimizer_state_bytes`, unsharded: the shards of all ranks
    together) and its weights as trained (a LoRA model's adapters alone) -- but for
    16-bit weights with float32 masters, whose masters are the weights it writes
    (``backends.torch_backend.dcp.flat_state``): 12 bytes a parameter under Adam with
    float32 masters or float32 weights.
    """
    bpv = value_bytes(model, gpu)
    state = optimizer_state_bytes(model, Layout(), gpu)
    master = model.optimizer is None or model.optimizer.master
    if bpv < 4 and master:
        return state
    weights = lora_params(model) if model.lora is not None else model_params(model)
    return state + weights * bpv


def save_time(saves, gpu: GpuProfile, per_node: int) -> float:
    """Seconds of one checkpoint: ``saves``, (bytes, the devices of its writers) of each
    trained model, written at once, each model's bytes spread evenly over its writers
    (every rank its shard); a node writes its writers' bytes at ``disk_bandwidth``, then
    each writer hashes its own at ``hash_bandwidth``, all of them at once; the slowest
    node (``per_node``: devices a node)."""
    node: dict[int, float] = {}
    rank: dict[int, float] = {}
    for nbytes, devices in saves:
        if not devices:
            continue
        for d in devices:
            node[d // per_node] = node.get(d // per_node, 0.0) + nbytes / len(devices)
            rank[d] = rank.get(d, 0.0) + nbytes / len(devices)
    if not any(node.values()):
        return 0.0
    hashed: dict[int, float] = {}
    for d, b in rank.items():
        hashed[d // per_node] = max(hashed.get(d // per_node, 0.0), b)
    return max(b / gpu.disk_bandwidth + hashed[n] / gpu.hash_bandwidth
               for n, b in node.items())


def cuts(steps: int, every: int, eval_every: int | None) -> int:
    """The checkpoints a run of ``steps`` steps writes: at each multiple of ``every`` and of
    ``eval_every``, and at its end (the cuts of ``rpeg.runtime.core.choices.next_cut``)."""
    at = {steps}
    for k in (every, eval_every):
        if k:
            at.update(range(k, steps + 1, k))
    return len(at)


def cadence(pipeline) -> tuple[int, int, int | None]:
    """(steps, ``checkpoint_every``, eval steps apart or None) of ``pipeline``'s run: what
    :func:`cuts` and :func:`per_step` take after the save."""
    e, w = pipeline.evaluation, pipeline.workload
    return w.steps, w.checkpoint_every, e.every if e is not None else None


def per_step(one: float, steps: int, every: int, eval_every: int | None) -> float:
    """Seconds of checkpointing a step carries: ``one`` save, ``cuts / steps`` times."""
    return one * cuts(steps, every, eval_every) / max(steps, 1) if one else 0.0


__all__ = ["CHECKPOINT_EVERY", "CHECKPOINT_OP", "cadence", "checkpoint_bytes", "cuts",
           "per_step", "save_time"]
