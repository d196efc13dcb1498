"""Generation engines: how many sequences one decodes at once, and the weight sync into vLLM.

    >>> from rpeg.cost.profiles import cluster_of
    >>> from rpeg.cost.examples import ppo_pipeline
    >>> from rpeg.cost.memory import Parallel
    >>> from rpeg.spec.model import Engine
    >>> p, h = ppo_pipeline("llama3.1-8b", prompts=512), cluster_of("h200", 8)
    >>> engine_rows(p, "rollout", Parallel(dp=8), h, 40e9, Engine.VLLM)            # all 64 fit
    64
    >>> engine_rows(p, "rollout", Parallel(dp=8), h, 40e9, Engine.VLLM, max_seqs=16)
    16
    >>> m, r8 = p.model("actor"), tuple(range(8))
    >>> t = collective_sync_time(m, r8, Parallel(dp=8), ((8, 9), (10, 11)), cluster_of("h200", 8, 2))
    >>> round(t, 2)                 # 16 GB of bf16 in 240 buckets over a 50 GB/s node link
    0.33

**Concurrency** — a generate stage's ``max_seqs`` (how many sequences one engine replica
decodes at once, vLLM's ``max_num_seqs``) and ``kv_fraction`` (the share of a device's
memory the engine may take: its weights, KV cache and activations, vLLM's
``gpu_memory_utilization``), from the plan's placement or, where it leaves them at 0,
from the stage's own parameters (:func:`concurrency`). Below the batch, the engine
decodes in slots (vLLM: continuous batching) or waves (torch), which
``rpeg.cost.stages`` prices from the rows given. vLLM's cache is paged: a live
sequence holds the KV of its prompt and of the tokens it has made so far, so the rows
that fit are counted with the mean context of a sequence caught mid-decode (length
biased: ``E[L^2] / 2 E[L]`` tokens made), not every sequence at the maximum length as
the torch engine's dense cache needs.

**Weight sync into a vLLM engine's own copy** (``backends.vllm_backend.sync``): the
trainer's weights in their dtype, gathered whole first where the trainer splits them
(tensor parallel, or ZeRO-3), then broadcast by the trainer's first rank to every
worker of every engine, one bucket of ``SYNC_BUCKET_BYTES`` at a time over the link the
two device sets span (a pipelined tree: a latency per tree level per bucket, the bytes
once at the link's bandwidth), and copied into each worker's shard at memory bandwidth.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from rpeg.cost import compute as C
from rpeg.cost.memory import (
    MemoryCost,
    Parallel,
    head_dims,
    local_params,
    model_params,
    value_bytes,
)
from rpeg.cost.partial import Partial
from rpeg.cost.topology import Collective, Topology, collective_time
from rpeg.spec.model import Cluster, Engine, Head, Model, Pipeline

SYNC_BUCKET_BYTES = 64 << 20        # the runtime's bucket (backends.vllm_backend.weights)
_RESOLUTION = 4096


def concurrency(pipeline: Pipeline, placement) -> tuple[int, float]:
    """(max_seqs, kv_fraction) of a generate stage: the placement's where set (> 0), else
    its stage's ``max_seqs`` / ``kv_fraction`` parameters; 0 leaves the engine's default."""
    stage = pipeline.stage(placement.stage)
    seqs = int(getattr(placement, "max_seqs", 0) or stage.param("max_seqs", 0) or 0)
    frac = float(getattr(placement, "kv_fraction", 0.0) or stage.param("kv_fraction", 0.0) or 0.0)
    return seqs, frac


@functools.lru_cache(maxsize=1024)
def live_context(prompt_len: float, dist) -> float:
    """Mean tokens in the KV cache of a sequence caught mid-decode under continuous
    batching: its prompt plus half its length, length-biased (a long sequence is live
    longer): ``prompt + E[L^2] / (2 E[L])``."""
    q = np.asarray(dist.quantiles(_RESOLUTION), dtype=float)
    return float(prompt_len + (q * q).mean() / (2 * max(q.mean(), 1e-9)))


def engine_row_bytes(model: Model, par: Parallel, pipeline: Pipeline, gpu, engine: Engine,
                     partial: int = 0) -> tuple[float, float]:
    """(KV-cache bytes, other transient bytes) per sequence decoding at once per GPU."""
    from rpeg.cost.stages import _generation_row_bytes, _working_set
    w = pipeline.workload
    if engine is not Engine.VLLM:
        return _generation_row_bytes(model, par, w, gpu)
    d, bpv = model.dims, value_bytes(model, gpu)
    layers = math.ceil(d.layers / par.pp)
    prompt, dist = float(w.prompt_len), w.gen_len
    if 0 < partial < dist.max_len:            # carried sequences re-prefill what they have
        part = Partial(dist, partial)
        prompt, dist = prompt + part.context, part
    kv_dim = max(d.kv_dim // par.tp, d.head_dim)
    kv = live_context(prompt, dist) * 2 * kv_dim * bpv * layers
    buf = max(_working_set(model, par, w.prompt_len, bpv), head_dims(model).vocab / par.tp * 12)
    return kv, buf


def engine_rows(pipeline: Pipeline, stage: str, par: Parallel, cluster: Cluster, free: float,
                engine: Engine, *, max_seqs: int = 0, kv_fraction: float = 0.0,
                batch: int | None = None, partial: int = 0) -> int:
    """Sequences one replica of a generate stage decodes at once with ``free`` bytes per
    GPU left beside what stays resident there: the local batch if it fits, else as many as
    fit (at least one); at most ``max_seqs``; with ``kv_fraction`` the engine takes at most
    that share of the device, its own weights included."""
    from rpeg.cost.stages import decoded_batch
    s = pipeline.stage(stage)
    model = pipeline.model(s.target)
    gpu = cluster.gpu
    if kv_fraction > 0:
        own = local_params(model, par) * value_bytes(model, gpu)
        free = min(free, kv_fraction * gpu.memory - own)
    w = pipeline.workload
    batch = w.batch if batch is None else batch
    local = math.ceil(decoded_batch(batch, w.gen_len, partial) / par.dp)
    kv, buf = engine_row_bytes(model, par, pipeline, gpu, engine, partial)
    fit = int((free - gpu.runtime_memory) // (kv + buf))
    rows = max(min(fit, local), 1)
    return min(rows, max_seqs) if max_seqs > 0 else rows


def engine_memory(pipeline: Pipeline, stage: str, par: Parallel, cluster: Cluster,
                  rows: int | None, engine: Engine, partial: int = 0) -> MemoryCost:
    """Transient bytes per GPU of a generate stage decoding ``rows`` sequences at once."""
    from rpeg.cost.stages import decoded_batch, stage_memory
    if engine is not Engine.VLLM:
        return stage_memory(pipeline, stage, par, cluster, rows=rows, partial=partial)
    model = pipeline.model(pipeline.stage(stage).target)
    w = pipeline.workload
    local = math.ceil(decoded_batch(w.batch, w.gen_len, partial) / par.dp)
    n = local if rows is None else max(min(rows, local), 1)
    kv, buf = engine_row_bytes(model, par, pipeline, cluster.gpu, engine, partial)
    return MemoryCost(buffers=cluster.gpu.runtime_memory) + MemoryCost(kv_cache=n * kv,
                                                                       buffers=n * buf)


def engine_copy(src, dst) -> bool:
    """Whether a vLLM generate placement ``dst`` serves a copy of its own that the trainer
    (``src``) sends each version to (the runtime's rule): all but tp 1 on devices where the
    model is trained unsplit, which the engine beside it is updated from in memory."""
    return dst.engine is Engine.VLLM and not (
        dst.tp == 1 and set(dst.devices) <= set(src.devices) and src.tp == 1
        and src.pp == 1 and src.zero < 3)


def sync_bytes(model: Model, gpu) -> float:
    """Bytes one update sends: the generating model's weights (an LM head, no value head)
    in the dtype the trainer holds them."""
    lm = model if model.head is Head.LM else None
    n = model_params(lm) if lm is not None else model.dims.param_count()
    return n * value_bytes(model, gpu)


def collective_sync_time(model: Model, src_devices: Sequence[int], src_par: Parallel,
                         engines: tuple[tuple[int, ...], ...], cluster: Cluster,
                         bucket_bytes: int = SYNC_BUCKET_BYTES) -> float:
    """Seconds of one update from a trainer (``src`` layout) into the vLLM engines whose
    workers span ``engines`` (one device block each), as ``backends.vllm_backend.sync``
    moves it (see the module doc)."""
    src = tuple(src_devices)
    gpu = cluster.gpu
    topo = Topology.from_cluster(cluster)
    nbytes = sync_bytes(model, gpu)
    gather = 0.0
    split = src_par.tp * src_par.pp
    if split > 1:                            # whole tensors from the first block's pieces
        gather += collective_time(Collective.ALL_GATHER, nbytes, src[:split], topo)
    if src_par.zero >= 3 and src_par.dp > 1:
        gather += collective_time(Collective.ALL_GATHER, nbytes / split,
                                  src[::split][:src_par.dp], topo)
    workers = tuple(d for block in engines for d in block)
    world = (src[0],) + tuple(d for d in workers if d != src[0])
    link = topo.link(topo.level_of(world))
    buckets = max(math.ceil(nbytes / bucket_bytes), 1)
    levels = math.ceil(math.log2(len(world))) if len(world) > 1 else 0
    broadcast = buckets * levels * link.latency + nbytes / link.bandwidth if levels else 0.0
    tp = max(len(b) for b in engines) if engines else 1
    load = 2 * nbytes / tp / gpu.mem_bandwidth + C.param_tensors(model.dims) * gpu.launch_overhead
    return gather + broadcast + load
