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
  vLLM's per-layer and per-step host overheads are the profile's ``vllm_*`` extras.
- FORWARD: one pass over prompt + response (padded to the batch's longest).
- TRAIN: per optimizer step (minibatches x epochs), forward + backward (+ recomputation)
  over micro-batches in a 1F1B pipeline, TP all-reduces, DP gradient reduction, Adam.
- SCORE: a python reward is a host-side per-sample cost; a reward model is a FORWARD.
- COMPUTE (gae, group_norm, rloo, ...): per-sample host cost plus a per-token term.
- SYNC_WEIGHTS: the model's weights gathered over the op's devices.

On devices that share a last-level cache and memory (the CPU profile's
``concurrency_slowdown``), a multi-device op computes that much slower.

Infeasible parallel degrees (tp not dividing the heads, pp above the layers, a device
tuple whose size is not dp x tp x pp) raise CostError with the reason. Memory capacity
is checked by the caller, which knows every model resident on a GPU: sum
``resident_memory`` and ``stage_memory`` and call ``check_fits``.
"""

from __future__ import annotations

import functools
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
    value_bytes,
)
from rpeg.cost.topology import Collective, Topology, collective_time
from rpeg.errors import CostError
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
                   engine: Engine = Engine.TORCH) -> StageCost:
    """Predicted seconds of one step of ``stage_name`` on ``devices`` laid out as ``par``."""
    stage = pipeline.stage(stage_name)
    devices = tuple(devices)
    _check_devices(devices, par, stage_name)
    batch = pipeline.workload.batch if batch is None else batch
    topo = Topology.from_cluster(cluster)
    gpu = cluster.gpu
    cost = _estimate(pipeline, stage, par, devices, topo, cluster, batch, engine)
    return _concurrent(cost, gpu.get("concurrency_slowdown", 1.0)) if len(devices) > 1 \
        else cost


def _concurrent(cost: StageCost, slowdown: float) -> StageCost:
    """Devices that share a last-level cache and memory (CPU cores) compute slower while
    all of them are busy: scale the compute parts by the calibrated slowdown."""
    if slowdown == 1.0:
        return cost
    comm = {"tp+pp", "dp_grad_reduce", "sync"}
    return StageCost(cost.compute_s * slowdown + cost.comm_s, cost.compute_s * slowdown,
                     cost.comm_s, tuple((k, v if k in comm else v * slowdown)
                                        for k, v in cost.breakdown))


def _estimate(pipeline, stage, par, devices, topo, cluster, batch, engine) -> StageCost:
    gpu, w = cluster.gpu, pipeline.workload
    if stage.kind is OpKind.GENERATE:
        model = pipeline.model(stage.target)
        g = _generation(model, par, devices, topo, cluster, batch, w.prompt_len, w.gen_len,
                        engine)
        return g.cost
    if stage.kind is OpKind.SCORE and not pipeline.has_model(stage.target or ""):
        t = batch * gpu.get("reward_sample_overhead", gpu.sample_overhead)
        return StageCost(t, t, 0.0, (("reward", t),))
    if stage.kind is OpKind.COMPUTE:
        tokens = batch * (w.prompt_len + w.gen_len.mean())
        t = batch * gpu.sample_overhead + tokens * gpu.get("compute_token_time", 2e-9)
        return StageCost(t, t, 0.0, (("host", t),))
    model = pipeline.model(stage.target)
    gen = _padded_gen(w.gen_len, math.ceil(batch / par.dp))
    if stage.kind in (OpKind.FORWARD, OpKind.SCORE):
        return _forward(model, par, devices, topo, cluster, batch, w.prompt_len, gen)
    if stage.kind is OpKind.TRAIN:
        steps = int(stage.param("minibatches", 1) or 1) * int(stage.param("epochs", 1) or 1)
        return _train(model, par, devices, topo, cluster, batch, w.prompt_len, gen, steps)
    if stage.kind is OpKind.SYNC_WEIGHTS:
        t = weight_sync_time(model, devices[:1], Parallel(), devices, par, cluster)
        return StageCost(t, 0.0, t, (("sync", t),))
    raise CostError(f"stage kind must be one the cost model knows, not {stage.kind.value}")


def generation_chunks(pipeline: Pipeline, stage_name: str, par: Parallel,
                      devices: Sequence[int], cluster: Cluster, chunks: int, *,
                      batch: int | None = None,
                      engine: Engine = Engine.TORCH) -> tuple[tuple[float, int], ...]:
    """(seconds from the stage's start until chunk i's responses are all finished, responses
    in chunk i), chunks ordered by length: the first holds the shortest responses."""
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
                    cluster, batch, w.prompt_len, w.gen_len, engine)
    lengths = g.lengths                       # sorted, one per local response
    total = _concurrent(g.cost, cluster.gpu.get("concurrency_slowdown", 1.0)).time_s \
        if len(devices) > 1 else g.cost.time_s
    scale = total / g.cost.time_s if g.cost.time_s > 0 else 1.0
    per_chunk = np.array_split(np.arange(len(lengths)), chunks)
    out = []
    for idx in per_chunk:
        if len(idx) == 0:
            continue
        done = float(np.interp(lengths[idx[-1]], g.steps, g.cum_time)) + g.prefill + g.host
        out.append((min(done * scale, total), len(idx) * par.dp))
    # The runtime sees the batch, not our per-replica rounding: fix the count to the batch.
    count = sum(n for _, n in out)
    if out and count != batch:
        t, n = out[-1]
        out[-1] = (t, n + batch - count)
    return tuple(out)


def stage_memory(pipeline: Pipeline, stage_name: str, par: Parallel, cluster: Cluster, *,
                 batch: int | None = None) -> MemoryCost:
    """Transient bytes per GPU while the stage runs (activations, KV cache, buffers)."""
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
        seq = w.prompt_len + w.gen_len.max_len
        kv_dim = max(d.kv_dim // par.tp, d.head_dim)
        kv = local * seq * 2 * kv_dim * bpv * (layers + 1)      # + one layer being grown
        prefill = _working_set(model, par, local * w.prompt_len, bpv)
        logits = local * hd.vocab / par.tp * 4 * 3
        # A layer's intermediates are freed before the head runs: the larger one counts.
        return base + MemoryCost(kv_cache=kv, buffers=max(prefill, logits))
    gen = _padded_gen(w.gen_len, local)
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
    return base + MemoryCost(activations=acts, buffers=bucket
                             + max(loss, _working_set(model, par, mb_tokens, bpv)))


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
    parallel, each limited by its link at the level the two sets span. Zero when the
    layouts are identical on the same devices, or when each destination shard is a slice
    of what that GPU already holds.
    """
    src, dst = tuple(src_devices), tuple(dst_devices)
    same_layout = (src_par.tp, src_par.pp) == (dst_par.tp, dst_par.pp)
    if set(src) == set(dst) and (same_layout or (
            dst_par.tp * dst_par.pp) % (src_par.tp * src_par.pp) == 0 and src == dst):
        return 0.0
    topo = Topology.from_cluster(cluster)
    link = topo.link(topo.level_of(src + dst))
    wbytes = model_params(model) * value_bytes(model, cluster.gpu)
    shard = wbytes / (dst_par.tp * dst_par.pp)
    senders = len(set(src))
    if set(src) == set(dst):       # reshard in place: each GPU gathers what it lacks
        move = shard
        return link.latency * math.ceil(math.log2(len(dst) + 1)) + move / link.bandwidth
    t = max(shard, shard * len(dst) / senders) / link.bandwidth
    tensors = C.param_tensors(model.dims)
    return t + link.latency * math.ceil(math.log2(len(dst) + 1)) \
        + tensors * cluster.gpu.launch_overhead


# --- generation -----------------------------------------------------------------------

@attrs.frozen
class _Gen:
    cost: StageCost
    prefill: float           # seconds of prefill (with its communication)
    host: float              # per-sample host work, done before decoding
    steps: np.ndarray        # decode step numbers at segment ends
    cum_time: np.ndarray     # decode seconds elapsed at those steps
    lengths: np.ndarray      # sorted response lengths, one per local response


def _padded_gen(dist, local: int) -> float:
    """Length the batch is padded to: the expected longest of ``local`` responses."""
    q = dist.quantiles(max(min(local, 4096), 1))
    return float(q.max())


def _generation(model, par, devices, topo, cluster, batch, prompt_len, dist, engine) -> _Gen:
    return _generation_cached(model, par, devices, topo, cluster.gpu, batch, prompt_len, dist,
                              engine)


@functools.lru_cache(maxsize=4096)
def _generation_cached(model, par, devices, topo, gpu, batch, prompt_len, dist, engine) -> _Gen:
    check_parallel(model.dims, par, model.name)
    d, hd, bpv = model.dims, head_dims(model), value_bytes(model, gpu)
    local = math.ceil(batch / par.dp)
    m = min(par.microbatches, local)
    layers = math.ceil(d.layers / par.pp)
    tpg, ppg = tp_group(devices, par), pp_group(devices, par)
    lengths = np.sort(dist.quantiles(max(min(local, 4096), 1)))
    n = len(lengths)
    if engine is Engine.VLLM:
        gpu = attrs.evolve(gpu, layer_overhead=gpu.get("vllm_layer_overhead", gpu.layer_overhead),
                           decode_overhead=gpu.get("vllm_decode_overhead", gpu.decode_overhead))

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
    idx = np.unique(np.linspace(0, n - 1, min(n, _SEGMENTS)).round().astype(int))
    ends = lengths[idx]
    starts = np.concatenate([[0.0], ends[:-1]])
    keep = ends > starts
    ends, starts = ends[keep], starts[keep]
    comp_seg, comm_seg = [], []
    for lo, hi in zip(starts, ends, strict=True):
        mid = (lo + hi) / 2
        active = local * float((lengths >= mid).sum()) / n
        ctx = prompt_len + mid
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
    return _Gen(cost, prefill_c + prefill_x, local * gpu.sample_overhead, steps, cum, lengths)


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


def _train(model, par, devices, topo, cluster, batch, prompt_len, gen, opt_steps) -> StageCost:
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
    return StageCost(compute + comm, compute, comm,
                     (("forward+backward", opt_steps * fb), ("optimizer", opt_steps * opt),
                      ("host", opt_steps * host), ("tp+pp", opt_steps * comm_layers),
                      ("dp_grad_reduce", opt_steps * dp_comm)))
