"""Cost of one stage of a pipeline under one parallel configuration.

    >>> from rpeg.cost.profiles import cluster_of
    >>> from rpeg.cost.examples import ppo_pipeline
    >>> p, gh = ppo_pipeline("llama3.1-8b", prompts=512), cluster_of("gh200", 4, 2)
    >>> c = estimate_stage(p, "actor_step", Parallel(dp=2, tp=4), tuple(range(8)), gh)
    >>> c.time_s > c.compute_s > 0 and c.comm_s > 0
    True
    >>> dict(c.breakdown)["optimizer"] > 0
    True

What each op kind costs (all per step, on the op's devices):

- GENERATE: prefill, then one decode step per generated token. Finished rows leave the
  batch (the torch engine drops them from its cache; vLLM batches continuously), so the
  batch shrinks along the workload's length distribution — its long tail sets the end.
  Dynamic sampling (``refill_rounds``) adds, per extra round, the generation of the share
  of the batch its declared ``filter_rate`` expects to be filtered (round k: rate^k), and
  the python rewards that decide it.
  vLLM's per-layer and per-step host overheads are the profile's ``vllm_*`` extras.
- FORWARD: one pass over prompt + response (padded to the batch's longest).
- TRAIN: per optimizer step (minibatches x epochs), forward + backward (+ recomputation)
  over micro-batches in a 1F1B pipeline, TP all-reduces, DP gradient reduction, Adam.
- SCORE: a python reward is host work per call, per response and per response token (the
  profile's ``reward_call_overhead``, ``reward_sample_overhead``, ``reward_token_time``);
  a reward model is a FORWARD.
- COMPUTE (gae, group_norm, rloo, ...): host work per call and per response
  (``compute_call_overhead``, ``compute_sample_time``), plus per response token
  (``compute_token_time``) for a per-token estimator (gae).
- SYNC_WEIGHTS: the model's weights gathered over the op's devices.

The dispatch of a Dask task (the profile's ``dispatch_s``: measured on the CPU profile,
Dask's documented ~1 ms on GPU profiles) is not part of a stage: the runtime fuses the
consecutive ops of a device into one task and starts a new one when an input comes from
another device, so the simulator charges it per such crossing
(:func:`rpeg.plan.simulate.simulate`). Where the devices are the host's own cores (the
CPU profile's ``host_cores``), the control plane's CPU — ``control_step_s`` per device
and ``control_task_s`` per Dask task a step — competes with the ops for them; the
evaluator adds that CPU spread over the cores to the step
(:meth:`rpeg.plan.evaluate.Evaluator.control_time`).

A policy-gradient train stage reading responses sampled with older weights (staleness or
a partial rollout's carry: ``off_policy``) first runs a forward pass without gradients
over its batch, for the importance weights of the off-policy correction.

On devices that share a last-level cache and memory (the CPU profile's
``concurrency_slowdown``), a multi-device op computes that much slower.

Infeasible parallel degrees (tp not dividing the heads, pp above the layers, a device
tuple whose size is not dp x tp x pp) raise CostError with the reason. Memory capacity
is checked by the caller, which knows every model resident on a GPU: sum
``resident_memory`` and ``stage_memory`` and call ``check_fits``.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Sequence

import attrs
import numpy as np

from rpeg.cost import compute as C
from rpeg.cost.memory import (
    MemoryCost,
    Parallel,
    check_parallel,
    head_dims,
    local_params,
    model_params,
    optimizer_state_bytes,
    value_bytes,
)
from rpeg.cost.partial import Partial
from rpeg.cost.topology import Collective, Topology, collective_time
from rpeg.errors import CostError
from rpeg.spec.functions import function
from rpeg.spec.model import Cluster, Engine, Model, OpKind, Pipeline

_SEGMENTS = 32          # decode is integrated over this many segments of constant batch


@attrs.frozen
class StageCost:
    time_s: float
    compute_s: float
    comm_s: float
    breakdown: tuple[tuple[str, float], ...] = ()


# --- device groups -------------------------------------------------------------

def tp_group(devices: Sequence[int], par: Parallel) -> tuple[int, ...]:
    return tuple(devices[: par.tp])


def pp_group(devices: Sequence[int], par: Parallel) -> tuple[int, ...]:
    return tuple(devices[: par.pp * par.tp: par.tp])


def dp_group(devices: Sequence[int], par: Parallel) -> tuple[int, ...]:
    return tuple(devices[:: par.pp * par.tp])


def _check_devices(devices: Sequence[int], par: Parallel, stage: str) -> None:
    if len(devices) != par.size:
        raise CostError(f"stage '{stage}' must run on dp x tp x pp = {par.size} devices, "
                        f"not {len(devices)}")


# --- the public entry points ---------------------------------------------------------

def estimate_stage(pipeline: Pipeline, stage_name: str, par: Parallel, devices: Sequence[int],
                   cluster: Cluster, *, batch: int | None = None,
                   engine: Engine = Engine.TORCH, rows: int | None = None,
                   padded_len: float | None = None, partial: int = 0,
                   off_policy: bool = False) -> StageCost:
    """Predicted seconds of one step of ``stage_name`` on ``devices`` laid out as ``par``.
    ``rows``: at most this many sequences generated at once per replica (see
    :func:`generation_rows`); None for the whole local batch in one wave.
    ``padded_len``: the response length a forward or train batch is padded to (a streamed
    chunk's longest, see :func:`generation_chunks`); None for the batch's expected longest.
    ``partial``: a generate stage decodes at most this many tokens per response a step, the
    rest in later steps (partial rollouts, :mod:`rpeg.cost.partial`); 0: whole responses."""
    stage = pipeline.stage(stage_name)
    devices = tuple(devices)
    _check_devices(devices, par, stage_name)
    batch = pipeline.workload.batch if batch is None else batch
    topo = Topology.from_cluster(cluster)
    gpu = cluster.gpu
    cost = _estimate(pipeline, stage, par, devices, topo, cluster, batch, engine, rows,
                     padded_len, partial, off_policy)
    cost = _concurrent(cost, gpu.get("concurrency_slowdown", 1.0)) if len(devices) > 1 \
        else cost
    return cost


def is_host_stage(pipeline: Pipeline, stage) -> bool:
    """A per-sample host op: a python reward or a compute function (no model)."""
    return stage.kind is OpKind.COMPUTE or (stage.kind is OpKind.SCORE
                                            and not pipeline.has_model(stage.target or ""))


def _concurrent(cost: StageCost, slowdown: float) -> StageCost:
    """Devices that share a last-level cache and memory (CPU cores) compute slower while
    all of them are busy: scale the compute parts by the calibrated slowdown."""
    if slowdown == 1.0:
        return cost
    comm = {"tp+pp", "dp_grad_reduce", "sync", "offload"}
    return StageCost(cost.compute_s * slowdown + cost.comm_s, cost.compute_s * slowdown,
                     cost.comm_s, tuple((k, v if k in comm else v * slowdown)
                                        for k, v in cost.breakdown))


def _estimate(pipeline, stage, par, devices, topo, cluster, batch, engine, rows,
              padded_len=None, partial=0, off_policy=False) -> StageCost:
    gpu, w = cluster.gpu, pipeline.workload
    if stage.kind is OpKind.GENERATE:
        model = pipeline.model(stage.target)
        g = _generation(model, par, devices, topo, cluster, batch, w.prompt_len, w.gen_len,
                        engine, rows, partial)
        refills = refill_batches(stage, batch)
        if not refills:
            return g.cost
        # each round's responses are scored (python rewards) to find the groups to refill
        return _with_refills(g.cost, refills, lambda n: _plus_host(_generation(
            model, par, devices, topo, cluster, n, w.prompt_len, w.gen_len, engine, rows,
            partial).cost, reward_host_time(gpu, w, n)), reward_host_time(gpu, w, batch))
    if stage.kind is OpKind.SCORE and not pipeline.has_model(stage.target or ""):
        t = reward_host_time(gpu, w, batch)
        return StageCost(t, t, 0.0, (("reward", t),))
    if stage.kind is OpKind.COMPUTE:
        # per response, plus per response token for a per-token estimator (GAE's
        # recursion); a group estimator works on one score per response (the registry's
        # pricing says which)
        per_token = function(stage.function).pricing.per_token
        tokens = batch * _mean_len(w.gen_len) if per_token else 0.0
        t = gpu.get("compute_call_overhead", 0.0) \
            + batch * gpu.get("compute_sample_time", gpu.sample_overhead) \
            + tokens * gpu.get("compute_token_time", 2e-9)
        return StageCost(t, t, 0.0, (("host", t),))
    model = pipeline.model(stage.target)
    gen = _padded_gen(w.gen_len, math.ceil(batch / par.dp)) if padded_len is None \
        else float(padded_len)
    if stage.kind in (OpKind.FORWARD, OpKind.SCORE):
        return _forward(model, par, devices, topo, cluster, batch, w.prompt_len, gen)
    if stage.kind is OpKind.TRAIN:
        steps = int(stage.param("minibatches", 1) or 1) * int(stage.param("epochs", 1) or 1)
        return _train(model, par, devices, topo, cluster, batch, w.prompt_len, gen, steps,
                      off_policy)
    if stage.kind is OpKind.SYNC_WEIGHTS:
        t = weight_sync_time(model, devices[:1], Parallel(), devices, par, cluster)
        return StageCost(t, 0.0, t, (("sync", t),))
    raise CostError(f"stage kind must be one the cost model knows, not {stage.kind.value}")


def refill_batches(stage, batch: int) -> tuple[int, ...]:
    """Responses each extra round of a generate stage's dynamic sampling generates, expected
    from its declared filter rate: round k regenerates the filtered share of round k - 1."""
    rounds = int(stage.arg("refill_rounds") or 0) if stage.kind is OpKind.GENERATE else 0
    rate = float(stage.arg("filter_rate") or 0.0)
    return tuple(max(1, math.ceil(batch * rate ** k)) for k in range(1, rounds + 1)
                 if batch * rate ** k >= 0.5)


def reward_host_time(gpu, w, batch: int) -> float:
    """Seconds of a python reward over ``batch`` responses: per call, per response, and per
    response token (decoding, text)."""
    return gpu.get("reward_call_overhead", 0.0) \
        + batch * gpu.get("reward_sample_overhead", gpu.sample_overhead) \
        + batch * _mean_len(w.gen_len) * gpu.get("reward_token_time", 0.0)


def _plus_host(cost: StageCost, host: float) -> StageCost:
    return StageCost(cost.time_s + host, cost.compute_s + host, cost.comm_s, cost.breakdown)


def _with_refills(cost: StageCost, batches: tuple[int, ...], price, scoring: float
                  ) -> StageCost:
    """``cost`` plus that of the extra generation rounds of ``batches`` responses each, and
    the rewards that decide them (``scoring``: the first round's)."""
    cost = StageCost(cost.time_s + scoring, cost.compute_s + scoring, cost.comm_s,
                     cost.breakdown + (("refill_scoring", scoring),))
    for n in batches:
        extra = price(n)
        cost = StageCost(cost.time_s + extra.time_s, cost.compute_s + extra.compute_s,
                         cost.comm_s + extra.comm_s, cost.breakdown + (("refill", extra.time_s),))
    return cost


def generation_chunks(pipeline: Pipeline, stage_name: str, par: Parallel,
                      devices: Sequence[int], cluster: Cluster, chunks: int, *,
                      batch: int | None = None,
                      engine: Engine = Engine.TORCH,
                      rows: int | None = None, with_lengths: bool = False,
                      partial: int = 0) -> tuple[tuple, ...]:
    """(seconds from the stage's start until chunk i's responses are all finished, responses
    in chunk i), chunks ordered by length: the first holds the shortest responses.
    ``with_lengths``: each with a third item, the chunk's longest response (tokens), which a
    consumer processing the chunk pads to. ``partial``: as for :func:`estimate_stage`; the
    chunks hold the responses that finish in the step (as many as the batch), a carried
    one padded to its whole length."""
    stage = pipeline.stage(stage_name)
    if stage.kind is not OpKind.GENERATE:
        raise CostError(f"generation_chunks must be asked of a generate stage, not "
                        f"'{stage_name}' ({stage.kind.value})")
    if chunks < 1:
        raise CostError(f"chunks must be at least 1, not {chunks}")
    devices = tuple(devices)
    _check_devices(devices, par, stage_name)
    batch = pipeline.workload.batch if batch is None else batch
    w = pipeline.workload
    g = _generation(pipeline.model(stage.target), par, devices, Topology.from_cluster(cluster),
                    cluster, batch, w.prompt_len, w.gen_len, engine, rows, partial)
    finish, lengths = g.finish, g.lengths     # sorted, one per local response
    part = _partial(w.gen_len, partial)
    if part is not None:
        # The sequences still short of their end stop at the cap, after every one that
        # finishes: the first (responses / sequences) of them are the step's output.
        n = min(len(finish), math.ceil(batch / par.dp))
        finish = finish[:n]
        lengths = np.array([part.finished_top(x) for x in lengths[:n]])
    total = _concurrent(g.cost, cluster.gpu.get("concurrency_slowdown", 1.0)).time_s \
        if len(devices) > 1 else g.cost.time_s
    scale = total / g.cost.time_s if g.cost.time_s > 0 else 1.0
    per_chunk = np.array_split(np.arange(len(finish)), chunks)
    out = []
    for idx in per_chunk:
        if len(idx) == 0:
            continue
        out.append((min(float(finish[idx[-1]]) * scale, total), len(idx) * par.dp,
                    float(lengths[idx].max())))
    if part is not None and out:                  # the step ends when the carried ones stop
        out[-1] = (total,) + out[-1][1:]
    # The runtime sees the batch, not our per-replica rounding: fix the count to the batch.
    count = sum(n for _, n, _ in out)
    if out and count != batch:
        t, n, top = out[-1]
        out[-1] = (t, n + batch - count, top)
    if refill_batches(stage, batch):
        # dynamic sampling: the step's responses are known after its last round, all at once
        end = estimate_stage(pipeline, stage_name, par, devices, cluster, batch=batch,
                             engine=engine, rows=rows, partial=partial).time_s
        out = [(end,) + o[1:] for o in out]
    return tuple(out) if with_lengths else tuple((t, n) for t, n, _ in out)


def stage_memory(pipeline: Pipeline, stage_name: str, par: Parallel, cluster: Cluster, *,
                 batch: int | None = None, rows: int | None = None,
                 padded_len: float | None = None, partial: int = 0) -> MemoryCost:
    """Transient bytes per GPU while the stage runs (activations, KV cache, buffers);
    a generate stage holds the KV cache of ``rows`` sequences at once (None: all local ones).
    A train stage whose optimizer state is offloaded brings it back for the step."""
    stage = pipeline.stage(stage_name)
    batch = pipeline.workload.batch if batch is None else batch
    w = pipeline.workload
    gpu = cluster.gpu
    base = MemoryCost(buffers=gpu.runtime_memory)
    if stage.kind in (OpKind.COMPUTE, OpKind.SYNC_WEIGHTS) or (
            stage.kind is OpKind.SCORE and not pipeline.has_model(stage.target or "")):
        seq = w.prompt_len + w.gen_len.max_len
        return base + MemoryCost(buffers=batch * seq * 8.0 * 4)
    model = pipeline.model(stage.target)
    check_parallel(model.dims, par, model.name)
    d, bpv, hd = model.dims, value_bytes(model, gpu), head_dims(model)
    local = math.ceil(batch / par.dp)
    layers = math.ceil(d.layers / par.pp)
    if stage.kind is OpKind.GENERATE:
        kv, buf = _generation_row_bytes(model, par, w, gpu)
        local = math.ceil(decoded_batch(batch, w.gen_len, partial) / par.dp)
        n = local if rows is None else max(min(rows, local), 1)
        return base + MemoryCost(kv_cache=n * kv, buffers=n * buf)
    gen = _padded_gen(w.gen_len, local) if padded_len is None else float(padded_len)
    seq = w.prompt_len + gen
    # Output-head buffers (fp32 logits, log-softmax, probabilities) cover response positions;
    # they and a layer's intermediates are not alive at once, next to the residual stream.
    if stage.kind in (OpKind.FORWARD, OpKind.SCORE):
        rows = math.ceil(local / par.microbatches)
        stream = rows * seq * d.hidden * bpv
        return base + MemoryCost(buffers=stream + max(
            _working_set(model, par, rows * seq, bpv), rows * gen * hd.vocab / par.tp * 4 * 3))
    # TRAIN: activations of the micro-batches in flight (1F1B: up to pp on the first stage).
    minibatches = int(stage.param("minibatches", 1) or 1)
    mb_rows = math.ceil(local / minibatches / par.microbatches)
    mb_tokens = mb_rows * seq
    in_flight = min(par.pp, par.microbatches)
    per_layer = activation_bytes_per_token(model, par, seq, bpv) * gpu.act_factor
    if par.recompute:
        acts = mb_tokens * (in_flight * layers * d.hidden * bpv + per_layer)
    else:
        acts = mb_tokens * in_flight * layers * per_layer
    loss = mb_rows * gen * hd.vocab / par.tp * 4 * 3
    if gpu.get("grads_freed"):
        # Gradients are dropped after each step (zero_grad(set_to_none)) and re-created
        # while the backward pass frees activations: the two share their peak.
        grads = local_params(model, par) * bpv / (par.dp if par.zero >= 2 else 1)
        acts = max(acts - grads, 0.0)
    bucket = local_params(model, par) * bpv if par.dp > 1 else 0.0   # flat all-reduce buffer
    state = optimizer_state_bytes(model, par, gpu) if par.offload else 0.0
    return base + MemoryCost(activations=acts, optimizer=state, buffers=bucket
                             + max(loss, _working_set(model, par, mb_tokens, bpv)))


def _generation_row_bytes(model: Model, par: Parallel, w, gpu) -> tuple[float, float]:
    """(KV-cache bytes, other transient bytes) per generated sequence per GPU: the cache at
    the longest length (+ one layer being grown), and the larger of a prefill layer's
    intermediates and the fp32 logits (a layer's are freed before the head runs)."""
    d, bpv, hd = model.dims, value_bytes(model, gpu), head_dims(model)
    layers = math.ceil(d.layers / par.pp)
    seq = w.prompt_len + w.gen_len.max_len
    kv_dim = max(d.kv_dim // par.tp, d.head_dim)
    kv = seq * 2 * kv_dim * bpv * (layers + 1)
    prefill = _working_set(model, par, w.prompt_len, bpv)
    logits = hd.vocab / par.tp * 4 * 3
    return kv, max(prefill, logits)


def generation_rows(pipeline: Pipeline, stage_name: str, par: Parallel, cluster: Cluster,
                    free_bytes: float, *, batch: int | None = None, partial: int = 0) -> int:
    """How many sequences a generate stage runs at once per replica when ``free_bytes`` per
    GPU are left beside the weights resident there: the whole local batch if it fits, else
    as many as the free memory holds (at least one; the memory check then reports the
    shortfall). Engines bound their batch by free KV memory this way (vLLM's KV blocks,
    a batched generate called in waves).

        >>> from rpeg.cost.profiles import cluster_of
        >>> from rpeg.cost.examples import ppo_pipeline
        >>> p, gh = ppo_pipeline("llama3.1-8b", prompts=512), cluster_of("gh200", 8)
        >>> generation_rows(p, "rollout", Parallel(dp=8), gh, 1e12)      # all 64 fit
        64
        >>> 1 <= generation_rows(p, "rollout", Parallel(dp=8), gh, 4e9) < 64
        True
    """
    stage = pipeline.stage(stage_name)
    model = pipeline.model(stage.target)
    batch = pipeline.workload.batch if batch is None else batch
    local = math.ceil(decoded_batch(batch, pipeline.workload.gen_len, partial) / par.dp)
    kv, buf = _generation_row_bytes(model, par, pipeline.workload, cluster.gpu)
    fit = int((free_bytes - cluster.gpu.runtime_memory) // (kv + buf))
    return max(min(fit, local), 1)


def activation_bytes_per_token(model: Model, par: Parallel, seq: int, bpv: float) -> float:
    """Values autograd keeps per token per layer for the backward pass, in bytes.

    Counted for a Llama block: norm inputs/outputs (3h each of two), q/k/v and rotated
    q/k, the attention output and o_proj input, gate, up, SiLU(gate) and the product
    (4 ffn); attention itself is fused (no S x S scores kept).
    """
    d, tp = model.dims, par.tp
    kv = max(d.kv_dim // tp, d.head_dim)
    values = 6 * d.hidden + (d.hidden // tp + 2 * kv) + (d.hidden // tp + kv) \
        + 2 * d.hidden // tp + 4 * d.ffn / tp
    return values * bpv


def weight_sync_time(model: Model, src_devices: Sequence[int], src_par: Parallel,
                     dst_devices: Sequence[int], dst_par: Parallel, cluster: Cluster) -> float:
    """Seconds to bring a trainer's weights (``src`` layout) into a generator (``dst``).

    Every destination GPU needs its shard, ``bytes / (tp_d * pp_d)``; the sources send in
    parallel, each limited by its link at the level the two sets span. On the same devices:

    - identical layout (and weights not ZeRO-3 sharded): one shared copy, zero;
    - the trainer's weights ZeRO-3 sharded over DP: all-gathered over the DP group first;
    - each destination shard a slice of what the GPU holds (e.g. tp 1 -> tp 2): a local
      copy into the generator's own weights, read and written at memory bandwidth, one
      copy kernel per tensor;
    - otherwise every GPU gathers its new shard from the others (re-partition).

        >>> from rpeg.cost.profiles import cluster_of
        >>> from rpeg.spec.model import Model
        >>> from rpeg.spec.presets import PRESETS
        >>> gh, m = cluster_of("gh200", 8), Model("actor", "llama3.1-8b", PRESETS["llama3.1-8b"])
        >>> r8 = tuple(range(8))
        >>> weight_sync_time(m, r8, Parallel(dp=8), r8, Parallel(dp=8), gh)
        0.0
        >>> weight_sync_time(m, r8, Parallel(dp=8), r8, Parallel(dp=4, tp=2), gh) > 0
        True
    """
    src, dst = tuple(src_devices), tuple(dst_devices)
    gpu = cluster.gpu
    same_layout = (src_par.tp, src_par.pp) == (dst_par.tp, dst_par.pp)
    topo = Topology.from_cluster(cluster)
    wbytes = model_params(model) * value_bytes(model, gpu)
    tensors = C.param_tensors(model.dims)
    gather = 0.0
    if src_par.zero >= 3 and src_par.dp > 1:     # ZeRO-3: gather the full layer shards first
        gather = collective_time(Collective.ALL_GATHER, wbytes / (src_par.tp * src_par.pp),
                                 dp_group(src, src_par), topo)
    if set(src) == set(dst) and same_layout:
        return gather
    shard = wbytes / (dst_par.tp * dst_par.pp)
    if set(src) == set(dst) and src == dst and (
            dst_par.tp * dst_par.pp) % (src_par.tp * src_par.pp) == 0:
        # a slice of what each GPU holds: copied locally into the generator's weights
        return gather + 2 * shard / gpu.mem_bandwidth + tensors * gpu.launch_overhead
    link = topo.link(topo.level_of(src + dst))
    senders = len(set(src))
    if set(src) == set(dst):       # reshard in place: each GPU gathers what it lacks
        return gather + link.latency * math.ceil(math.log2(len(dst) + 1)) \
            + shard / link.bandwidth + tensors * gpu.launch_overhead
    t = max(shard, shard * len(dst) / senders) / link.bandwidth
    return gather + t + link.latency * math.ceil(math.log2(len(dst) + 1)) \
        + tensors * cluster.gpu.launch_overhead


# --- generation -----------------------------------------------------------------------

@attrs.frozen
class _Gen:
    cost: StageCost
    prefill: float           # seconds of prefill (with its communication)
    host: float              # per-sample host work, done before decoding
    steps: np.ndarray        # decode step numbers at segment ends
    cum_time: np.ndarray     # decode seconds elapsed at those steps
    lengths: np.ndarray      # response lengths, one per local response, in finish order
    finish: np.ndarray       # seconds from the start until each response is done, ascending


@functools.lru_cache(maxsize=256)
def _mean_len(dist) -> float:
    return dist.mean()


@functools.lru_cache(maxsize=4096)
def _padded_gen(dist, local: int) -> float:
    """Length the batch is padded to: the expected longest of ``local`` responses."""
    q = dist.quantiles(max(min(local, 4096), 1))
    return float(q.max())


def _partial(dist, cap: int) -> Partial | None:
    return Partial(dist, cap) if 0 < cap < dist.max_len else None


def decoded_batch(batch: int, dist, partial: int = 0) -> int:
    """Sequences a generate step decodes for a batch of ``batch`` responses: more than the
    batch under partial rollouts (the carried ones beside the new)."""
    part = _partial(dist, partial)
    return batch if part is None else math.ceil(batch * part.rows)


def _generation(model, par, devices, topo, cluster, batch, prompt_len, dist, engine,
                rows=None, partial=0) -> _Gen:
    part = _partial(dist, partial)
    if part is not None:
        # Carried sequences beside the new ones; each re-prefills what it has so far.
        batch, prompt_len, dist = decoded_batch(batch, dist, partial), \
            prompt_len + part.context, part
    local = math.ceil(batch / par.dp)
    if rows is None or rows >= local:
        return _generation_cached(model, par, devices, topo, cluster.gpu, local, prompt_len,
                                  dist, engine, par.dp)
    if engine is Engine.VLLM:
        # Continuous batching: ``rows`` sequences at once, a finished one's slot refilled
        # from the queue at once, so only the last sequences leave a tail.
        return _generation_cached(model, par, devices, topo, cluster.gpu, local, prompt_len,
                                  dist, engine, par.dp, max(rows, 1))
    # Waves: the local batch in ceil(local / rows) consecutive batches of at most ``rows``
    # sequences (a batched generate called in a loop). Each wave has the whole length
    # distribution, so each waits for its own longest response.
    waves = math.ceil(local / max(rows, 1))
    one = _generation_cached(model, par, devices, topo, cluster.gpu,
                             math.ceil(local / waves), prompt_len, dist, engine, par.dp * waves)
    c, span = one.cost, one.cost.time_s
    cost = StageCost(c.time_s * waves, c.compute_s * waves, c.comm_s * waves,
                     tuple((k, v * waves) for k, v in c.breakdown))
    finish = np.concatenate([one.finish + k * span for k in range(waves)])
    return _Gen(cost, one.prefill, one.host, one.steps, one.cum_time,
                np.tile(one.lengths, waves), finish)


@functools.lru_cache(maxsize=1024)
def _slowest_lengths(dist, local: int, groups: int) -> np.ndarray:
    """Sorted lengths of the slowest of ``groups`` replicas of ``local`` responses each: the
    longest of each of ``local`` equal strata of the batch's lengths (see below)."""
    n = max(min(local, 4096), 1)
    groups = max(min(groups, 65536 // n), 1)
    out = np.sort(dist.quantiles(n * groups))[groups - 1::groups]
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=4096)
def _generation_cached(model, par, devices, topo, gpu, local, prompt_len, dist, engine,
                       groups=1, slots=None) -> _Gen:
    """One wave of ``local`` sequences per replica, on the slowest of ``groups`` replicas
    (or waves) the batch is dealt to: the stage ends when the replica holding the batch's
    longest response does, so its lengths are the longest of each of ``local`` strata of
    the whole batch's lengths, not ``local`` draws of their own (whose longest would
    shrink as DP grows while the batch's does not).

    ``slots`` (continuous batching): at most this many sequences decode at once; they are
    admitted in arrival order (independent of their lengths), each into the first slot
    that frees, so a decode step's batch is every admitted, unfinished sequence."""
    check_parallel(model.dims, par, model.name)
    d, hd, bpv = model.dims, head_dims(model), value_bytes(model, gpu)
    m = min(par.microbatches, local)
    layers = math.ceil(d.layers / par.pp)
    tpg, ppg = tp_group(devices, par), pp_group(devices, par)
    lengths = _slowest_lengths(dist, local, groups)
    n = len(lengths)
    first, last = _admissions(lengths, None if slots is None else slots * n / local)
    if engine is Engine.VLLM:
        gpu = attrs.evolve(gpu, layer_overhead=gpu.get("vllm_layer_overhead", gpu.layer_overhead),
                           decode_overhead=gpu.get("vllm_decode_overhead", gpu.decode_overhead))
        gpu = C.with_work_scale(gpu, gpu.get("vllm_work_scale", 1.0))

    def stage_pass(tokens: float, context: float, kv_tokens: float, head_tokens: float) -> float:
        return C.pass_time(hd, gpu, tokens=max(int(round(tokens)), 1), context=context,
                           bytes_per_value=bpv, tp=par.tp, layers=layers, kv_tokens=kv_tokens,
                           head_tokens=max(int(round(head_tokens)), 1),
                           kv_copy=engine is not Engine.VLLM)

    def comm(tokens: float) -> float:
        nbytes = tokens * d.hidden * bpv
        tp = 2 * layers * collective_time(Collective.ALL_REDUCE, nbytes, tpg, topo)
        p2p = collective_time(Collective.P2P, nbytes, ppg[:2], topo) if par.pp > 1 else 0.0
        return tp + p2p

    pipe = (m + par.pp - 1)                      # 1F1B-style fill: m micro-batches, pp stages
    pre_tokens = local * prompt_len / m
    prefill_c = pipe * stage_pass(pre_tokens, prompt_len / 2, 0.0, local / m)
    prefill_x = pipe * comm(pre_tokens)

    # Decode, integrated over segments of constant batch size.
    done = np.sort(last)
    idx = np.unique(np.linspace(0, n - 1, min(n, _SEGMENTS)).round().astype(int))
    ends = done[idx]
    starts = np.concatenate([[0.0], ends[:-1]])
    keep = ends > starts
    ends, starts = ends[keep], starts[keep]
    comp_seg, comm_seg = [], []
    for lo, hi in zip(starts, ends, strict=True):
        mid = (lo + hi) / 2
        live = (first <= mid) & (last >= mid)
        active = local * float(live.sum()) / n
        ctx = prompt_len + (float((mid - first[live]).mean()) if live.any() else mid)
        per_mb = active / m
        step = pipe * stage_pass(per_mb, ctx, per_mb * ctx, per_mb) + gpu.decode_overhead
        comp_seg.append((hi - lo) * step)
        comm_seg.append((hi - lo) * pipe * comm(per_mb))
    comp = np.array(comp_seg)
    cx = np.array(comm_seg)
    cum = np.concatenate([[0.0], np.cumsum(comp + cx)])
    steps = np.concatenate([[0.0], ends])
    decode_c, decode_x = float(comp.sum()), float(cx.sum())
    compute = prefill_c + decode_c + local * gpu.sample_overhead
    comm_total = prefill_x + decode_x
    cost = StageCost(compute + comm_total, compute, comm_total,
                     (("prefill", prefill_c + prefill_x), ("decode", decode_c + decode_x),
                      ("host", local * gpu.sample_overhead)))
    prefill, host = prefill_c + prefill_x, local * gpu.sample_overhead
    order = np.argsort(last, kind="stable")
    finish = np.interp(last[order], steps, cum) + prefill + host
    return _Gen(cost, prefill, host, steps, cum, lengths[order], finish)


def _admissions(lengths: np.ndarray, slots: float | None) -> tuple[np.ndarray, np.ndarray]:
    """(decode step each sequence starts at, step it finishes at). Without ``slots`` all
    start at once; else arrivals in a fixed order unrelated to length (a low-discrepancy
    interleaving of the sorted lengths) fill ``slots`` slots, each taking the first free."""
    n = len(lengths)
    if slots is None or slots >= n:
        return np.zeros(n), lengths.astype(float)
    k = max(int(round(slots)), 1)
    arrival = np.argsort((np.arange(n) * 0.6180339887498949) % 1.0, kind="stable")
    free = [0.0] * k
    first = np.zeros(n)
    for j in arrival:
        t = heapq.heappop(free)
        first[j] = t
        heapq.heappush(free, t + float(lengths[j]))
    return first, first + lengths


# --- forward and train ----------------------------------------------------------------

def _working_set(model: Model, par: Parallel, tokens: float, bpv: float) -> float:
    """Largest live intermediates of one layer (gate, up, product; q, k, v) for ``tokens``."""
    d = model.dims
    return tokens * (3 * d.ffn / par.tp + 4 * d.hidden) * bpv


def _forward(model, par, devices, topo, cluster, batch, prompt_len, gen) -> StageCost:
    gpu = cluster.gpu
    check_parallel(model.dims, par, model.name)
    d, hd, bpv = model.dims, head_dims(model), value_bytes(model, gpu)
    local = math.ceil(batch / par.dp)
    m = min(par.microbatches, local)
    layers = math.ceil(d.layers / par.pp)
    seq = prompt_len + gen
    tokens = math.ceil(local / m) * seq
    stage = C.pass_time(hd, gpu, tokens=int(tokens), context=seq / 2, bytes_per_value=bpv,
                        tp=par.tp, layers=layers, head_tokens=int(math.ceil(local / m) * gen))
    compute = (m + par.pp - 1) * stage + local * gpu.sample_overhead
    comm = (m + par.pp - 1) * _layer_comm(model, par, devices, topo, tokens, bpv, layers, 2)
    return StageCost(compute + comm, compute, comm, (("forward", compute), ("tp+pp", comm)))


def _layer_comm(model, par, devices, topo, tokens, bpv, layers, per_layer) -> float:
    nbytes = tokens * model.dims.hidden * bpv
    tp = per_layer * layers * collective_time(Collective.ALL_REDUCE, nbytes,
                                              tp_group(devices, par), topo)
    pp = collective_time(Collective.P2P, nbytes, pp_group(devices, par)[:2], topo) \
        * per_layer / 2 if par.pp > 1 else 0.0
    return tp + pp


def _train(model, par, devices, topo, cluster, batch, prompt_len, gen, opt_steps,
           off_policy=False) -> StageCost:
    gpu = cluster.gpu
    check_parallel(model.dims, par, model.name)
    d, hd, bpv = model.dims, head_dims(model), value_bytes(model, gpu)
    local = math.ceil(batch / par.dp)
    per_step = max(math.ceil(local / opt_steps), 1)
    m = min(par.microbatches, per_step)
    layers = math.ceil(d.layers / par.pp)
    seq = prompt_len + gen
    tokens = math.ceil(per_step / m) * seq
    fwd = C.pass_time(hd, gpu, tokens=int(tokens), context=seq / 2, bytes_per_value=bpv,
                      tp=par.tp, layers=layers, head_tokens=int(math.ceil(per_step / m) * gen))
    passes = 1 + gpu.backward_factor + (1 if par.recompute else 0)
    fb = (m + par.pp - 1) * fwd * passes
    comm_layers = (m + par.pp - 1) * _layer_comm(model, par, devices, topo, tokens, bpv,
                                                 layers, 4)
    n_local = local_params(model, par)
    grad_bytes = n_local * bpv
    dpg = dp_group(devices, par)
    if par.zero >= 3:   # gather weights for forward and backward, reduce-scatter gradients
        dp_comm = 2 * collective_time(Collective.ALL_GATHER, grad_bytes, dpg, topo) \
            + collective_time(Collective.REDUCE_SCATTER, grad_bytes, dpg, topo)
    else:
        dp_comm = collective_time(Collective.ALL_REDUCE, grad_bytes, dpg, topo)
    shard = par.dp if par.zero >= 1 else 1
    opt = C.optimizer_time(n_local / shard, C.param_tensors(d, layers), gpu)
    host = per_step * gpu.sample_overhead
    compute = opt_steps * (fb + opt + host)
    comm = opt_steps * (comm_layers + dp_comm)
    # Offloaded optimizer state: brought in before the step, written back after it, over
    # the host link (once per train op: the state stays on the device across its steps).
    offload = offload_time(model, par, gpu)
    comm += offload
    # the off-policy correction's forward: the whole local batch once, no gradients
    prox = opt_steps * (m + par.pp - 1) * fwd if off_policy else 0.0
    prox_comm = opt_steps * comm_layers / 2 if off_policy else 0.0
    compute += prox
    comm += prox_comm
    return StageCost(compute + comm, compute, comm,
                     (("proximal_forward", prox + prox_comm),
                      ("forward+backward", opt_steps * fb), ("optimizer", opt_steps * opt),
                      ("host", opt_steps * host), ("tp+pp", opt_steps * comm_layers),
                      ("dp_grad_reduce", opt_steps * dp_comm), ("offload", offload)))


def offload_time(model: Model, par: Parallel, gpu) -> float:
    """Seconds a train op spends bringing its offloaded optimizer state in and back out."""
    return 2 * optimizer_state_bytes(model, par, gpu) / host_bandwidth(gpu) \
        if par.offload else 0.0


def host_bandwidth(gpu) -> float:
    """Bytes/s one way between a device and host memory (the profile's ``host_bandwidth``;
    PCIe Gen4 x16's achievable ~25 GB/s when a profile does not say)."""
    return gpu.get("host_bandwidth", 25e9)
