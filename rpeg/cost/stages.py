"""Cost of one stage of a pipeline under one parallel configuration.

    >>> from rpeg.cost.profiles import cluster_of
    >>> from rpeg.cost.examples import ppo_pipeline
    >>> from rpeg.graph import work_of
    >>> p, gh = ppo_pipeline("llama3.1-8b", prompts=512), cluster_of("gh200", 4, 2)
    >>> c = estimate_stage(work_of(p, "actor_step"), Layout(dp=2, tp=4), tuple(range(8)), gh)
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
  vLLM's per-layer and per-step host overheads are the profile's ``vllm_*`` fields.
- FORWARD: one pass over prompt + response (padded to the batch's longest, or packed:
  each response at its own length, ``Layout.packing``).
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
``concurrency_slowdown``), a multi-device op computes that much slower; an op on one of
them computes slower while the others compute too, which the simulator prices where the
ops overlap (:class:`rpeg.plan.simulate.Contention`).

Infeasible parallel degrees (tp not dividing the heads, pp above the layers, a device
tuple whose size is not dp x tp x pp) raise CostError with the reason. Memory capacity
is checked by the caller, which knows every model resident on a GPU: sum
``resident_memory`` and ``stage_memory`` and call ``check_fits``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from rpeg.cost import compute as C
from rpeg.cost.engines import CONTROLLER_BYTES, engine_terms
from rpeg.cost.generation import (
    StageCost,
    admissions,
    dealt_batch,
    decoded_batch,
    generate_memory,
    generation,
    generation_rows,
    mean_len,
    padded_len,
    partial_of,
    slowest_lengths,
)
from rpeg.cost.memory import (
    MemoryCost,
    check_parallel,
    model_params,
    value_bytes,
)
from rpeg.cost.passes import (
    activation_bytes_per_token,
    dp_group,
    forward_cost,
    forward_memory,
    host_bandwidth,
    offload_time,
    pp_group,
    tp_group,
    train_cost,
    train_memory,
)
from rpeg.cost.topology import Collective, Topology, collective_time
from rpeg.cost.turns import carries, conversation_gen, conversation_workload
from rpeg.errors import CostError
from rpeg.graph.layout import Layout
from rpeg.graph.work import Work
from rpeg.spec.model import Cluster, Engine, Model, OpKind

# names the tests and other modules read from here
_slowest_lengths, _admissions = slowest_lengths, admissions


def _check_devices(devices: Sequence[int], par: Layout, stage: str) -> None:
    if len(devices) != par.size:
        degrees = "dp x tp x pp" + (" x cp" if par.cp > 1 else "")
        raise CostError(f"stage '{stage}' must run on {degrees} = {par.size} devices, "
                        f"not {len(devices)}")


# --- the public entry points ---------------------------------------------------------

def estimate_stage(work: Work, par: Layout, devices: Sequence[int],
                   cluster: Cluster, *, batch: int | None = None,
                   engine: Engine = Engine.TORCH, rows: int | None = None,
                   padded_len: float | None = None, partial: int = 0,
                   off_policy: bool = False, mean_len: float | None = None) -> StageCost:
    """Predicted seconds of one step of a stage (its ``work``: :func:`rpeg.graph.work_of`, or an
    op's) on ``devices`` laid out as ``par``.
    ``rows``: at most this many sequences generated at once per replica (see
    :func:`generation_rows`); None for the whole local batch in one wave.
    ``padded_len``: the response length a forward or train batch is padded to (a streamed
    chunk's longest, see :func:`generation_chunks`); None for the batch's expected longest.
    ``mean_len``: the same chunk's mean response length, which a packed op computes.
    ``partial``: a generate stage decodes at most this many tokens per response a step, the
    rest in later steps (partial rollouts, :mod:`rpeg.cost.partial`); 0: whole responses."""
    devices = tuple(devices)
    _check_devices(devices, par, work.stage)
    batch = work.workload.batch if batch is None else batch
    topo = Topology.from_cluster(cluster)
    gpu = cluster.gpu
    cost = _estimate(work, par, devices, topo, cluster, batch, engine, rows,
                     padded_len, partial, off_policy, mean_len)
    if cluster.controller and (work.kind in (OpKind.GENERATE, OpKind.FORWARD, OpKind.TRAIN)
                               or work.kind is OpKind.SCORE and not work.on_host):
        c = controller_time(engine_terms(engine, gpu), work, batch, mean_len)
        cost = StageCost(cost.time_s + c, cost.compute_s + c, cost.comm_s,
                         cost.breakdown + (("control", c),), cost.roof)
    cost = _concurrent(cost, gpu.concurrency_slowdown) if len(devices) > 1 \
        else cost
    return cost


def controller_time(terms, work: Work, batch: int, mean_len: float | None) -> float:
    """Seconds a controller spends on one op call: its host time per call, and the batch's
    sequences (:data:`CONTROLLER_BYTES` a token) through it at its rate."""
    w = work.workload
    response = float(w.gen_len.quantiles().mean()) if mean_len is None else mean_len
    tokens = batch * (float(w.prompt_lens.quantiles().mean()) + response)
    return terms.call_s + tokens * CONTROLLER_BYTES / terms.controller_rate


def _concurrent(cost: StageCost, slowdown: float) -> StageCost:
    """Devices that share a last-level cache and memory (CPU cores) compute slower while
    all of them are busy: scale the compute parts by the calibrated slowdown."""
    if slowdown == 1.0:
        return cost
    comm = {"tp+pp", "dp_grad_reduce", "sync", "offload"}
    return StageCost(cost.compute_s * slowdown + cost.comm_s, cost.compute_s * slowdown,
                     cost.comm_s, tuple((k, v if k in comm else v * slowdown)
                                        for k, v in cost.breakdown), cost.roof)


def _estimate(work, par, devices, topo, cluster, batch, engine, rows,
              padded_len_=None, partial=0, off_policy=False, mean_len_=None) -> StageCost:
    gpu, w, model = cluster.gpu, work.workload, work.model
    if work.kind is OpKind.GENERATE and work.conversation is not None:
        return conversation_gen(work, par, devices, topo, cluster, batch, engine, rows,
                                partial).cost
    if work.kind is OpKind.GENERATE:
        # the ranks' shares as the runtime deals them (whole groups under dynamic sampling)
        dealt = dealt_batch(work, batch, par.dp)
        g = generation(model, par, devices, topo, cluster, dealt, w, engine, rows, partial)
        refills = refill_batches(work, dealt)
        if not refills:
            return g.cost
        # each round's responses are scored (python rewards) to find the groups to refill:
        # the responses there are, not the shares' rounding up
        return _with_refills(g.cost, refills, lambda n: _plus_host(generation(
            model, par, devices, topo, cluster, n, w, engine, rows, partial).cost,
            reward_host_time(gpu, w, n * batch // dealt)), reward_host_time(gpu, w, batch))
    # a host op at dp > 1 runs split, each device's call on its share of the batch
    # (rpeg.plan.oplayout.split_parts); a group estimator, one call on its first block over
    # the whole batch, is priced there at dp 1
    share = math.ceil(batch / max(par.dp, 1))
    if work.kind is OpKind.SCORE and work.on_host:
        t = reward_host_time(gpu, w, share)
        return StageCost(t, t, 0.0, (("reward", t),))
    if work.kind is OpKind.COMPUTE:
        # per response, plus per response token for a per-token estimator (GAE's
        # recursion); a group estimator works on one score per response (the registry's
        # pricing says which)
        tokens = share * mean_len(w.gen_len) if work.per_token else 0.0
        per_sample = gpu.compute_sample_time
        t = gpu.compute_call_overhead \
            + share * (gpu.sample_overhead if per_sample is None else per_sample) \
            + tokens * gpu.compute_token_time
        return StageCost(t, t, 0.0, (("host", t),))
    gen = response_len(w.gen_len, math.ceil(batch / par.dp), par, padded_len_, mean_len_)
    if work.kind in (OpKind.FORWARD, OpKind.SCORE):
        return forward_cost(model, par, devices, topo, gpu, engine, w, batch, gen)
    if work.kind is OpKind.TRAIN:
        steps = work.minibatches * work.epochs
        return train_cost(model, par, devices, topo, gpu, engine, w, batch, gen, steps,
                          off_policy)
    if work.kind is OpKind.SYNC_WEIGHTS:
        t = weight_sync_time(model, devices[:1], Layout(), devices, par, cluster)
        return StageCost(t, 0.0, t, (("sync", t),))
    raise CostError(f"stage kind must be one the cost model knows, not {work.kind.value}")


def refill_batches(work: Work, batch: int) -> tuple[int, ...]:
    """Responses each extra round of a generate stage's dynamic sampling generates, expected
    from its declared filter rate: round k regenerates the filtered share of round k - 1."""
    rounds = work.refill_rounds if work.kind is OpKind.GENERATE else 0
    rate = work.filter_rate
    return tuple(max(1, math.ceil(batch * rate ** k)) for k in range(1, rounds + 1)
                 if batch * rate ** k >= 0.5)


def reward_host_time(gpu, w, batch: int) -> float:
    """Seconds of a python reward over ``batch`` responses: per call, per response, and per
    response token (decoding, text)."""
    per_sample = gpu.reward_sample_overhead
    return gpu.reward_call_overhead \
        + batch * (gpu.sample_overhead if per_sample is None else per_sample) \
        + batch * mean_len(w.gen_len) * gpu.reward_token_time


def _plus_host(cost: StageCost, host: float) -> StageCost:
    return StageCost(cost.time_s + host, cost.compute_s + host, cost.comm_s, cost.breakdown,
                     cost.roof)


def _with_refills(cost: StageCost, batches: tuple[int, ...], price, scoring: float
                  ) -> StageCost:
    """``cost`` plus that of the extra generation rounds of ``batches`` responses each, and
    the rewards that decide them (``scoring``: the first round's)."""
    cost = StageCost(cost.time_s + scoring, cost.compute_s + scoring, cost.comm_s,
                     cost.breakdown + (("refill_scoring", scoring),), cost.roof)
    for n in batches:
        extra = price(n)
        cost = StageCost(cost.time_s + extra.time_s, cost.compute_s + extra.compute_s,
                         cost.comm_s + extra.comm_s, cost.breakdown + (("refill", extra.time_s),),
                         cost.roof + extra.roof)
    return cost


def generation_chunks(work: Work, par: Layout,
                      devices: Sequence[int], cluster: Cluster, chunks: int, *,
                      batch: int | None = None,
                      engine: Engine = Engine.TORCH,
                      rows: int | None = None, with_lengths: bool = False,
                      partial: int = 0) -> tuple[tuple, ...]:
    """(seconds from the stage's start until chunk i's responses are all finished, responses
    in chunk i), chunks ordered by length: the first holds the shortest responses.
    ``with_lengths``: each with a third and fourth item, the chunk's longest response
    (tokens), which a consumer processing the chunk pads to, and their mean, which a packed
    one computes. ``partial``: as for :func:`estimate_stage`; the chunks hold the responses
    that finish in the step (as many as the batch), a carried one padded to its whole
    length."""
    if work.kind is not OpKind.GENERATE:
        raise CostError(f"generation_chunks must be asked of a generate stage, not "
                        f"'{work.stage}' ({work.kind.value})")
    if chunks < 1:
        raise CostError(f"chunks must be at least 1, not {chunks}")
    devices = tuple(devices)
    _check_devices(devices, par, work.stage)
    batch = work.workload.batch if batch is None else batch
    w = work.workload
    if work.conversation is not None:        # a step's own conversations, as they end
        g = conversation_gen(work, par, devices, Topology.from_cluster(cluster), cluster,
                             batch, engine, rows, partial)
        partial = 0
    else:
        g = generation(work.model, par, devices, Topology.from_cluster(cluster),
                       cluster, batch, w, engine, rows, partial)
    finish, lengths = g.finish, g.lengths     # sorted, one per local response
    part = partial_of(w.gen_len, partial)
    if part is not None:
        # The sequences still short of their end stop at the cap, after every one that
        # finishes: the first (responses / sequences) of them are the step's output.
        n = min(len(finish), math.ceil(batch / par.dp))
        finish = finish[:n]
        lengths = np.array([part.finished_top(x) for x in lengths[:n]])
    total = _concurrent(g.cost, cluster.gpu.concurrency_slowdown).time_s \
        if len(devices) > 1 else g.cost.time_s
    scale = total / g.cost.time_s if g.cost.time_s > 0 else 1.0
    per_chunk = np.array_split(np.arange(len(finish)), chunks)
    out = []
    for idx in per_chunk:
        if len(idx) == 0:
            continue
        out.append((min(float(finish[idx[-1]]) * scale, total), len(idx) * par.dp,
                    float(lengths[idx].max()), float(lengths[idx].mean())))
    if part is not None and out:                  # the step ends when the carried ones stop
        out[-1] = (total,) + out[-1][1:]
    # The runtime sees the batch, not our per-replica rounding: fix the count to the batch.
    count = sum(x[1] for x in out)
    if out and count != batch:
        t, n, top, mean = out[-1]
        out[-1] = (t, n + batch - count, top, mean)
    if refill_batches(work, batch):
        # dynamic sampling: the step's responses are known after its last round, all at once
        end = estimate_stage(work, par, devices, cluster, batch=batch,
                             engine=engine, rows=rows, partial=partial).time_s
        out = [(end,) + o[1:] for o in out]
    return tuple(out) if with_lengths else tuple((t, n) for t, n, _, _ in out)


def stage_memory(work: Work, par: Layout, cluster: Cluster, *,
                 batch: int | None = None, rows: int | None = None,
                 padded_len: float | None = None, partial: int = 0,
                 engine: Engine = Engine.TORCH, mean_len: float | None = None) -> MemoryCost:
    """Transient bytes per GPU while the stage runs (activations, KV cache, buffers);
    a generate stage holds the KV cache of ``rows`` sequences at once (None: all local ones).
    A train stage whose optimizer state is offloaded brings it back for the step."""
    batch = work.workload.batch if batch is None else batch
    w = work.workload
    gpu = cluster.gpu
    if work.kind in (OpKind.COMPUTE, OpKind.SYNC_WEIGHTS) or (
            work.kind is OpKind.SCORE and work.on_host):
        seq = w.prompt_len + w.gen_len.max_len
        return MemoryCost(buffers=gpu.runtime_memory + batch * seq * 8.0 * 4)
    model = work.model
    check_parallel(model.dims, par, model.name)
    local = math.ceil(batch / par.dp)
    if work.kind is OpKind.GENERATE and work.conversation is not None:
        # every cohort's conversations at once, each holding up to its whole length
        local = math.ceil(batch * (carries(work, partial) + 1) / par.dp)
        return generate_memory(model, par, conversation_workload(work), gpu, engine, local,
                               rows)
    if work.kind is OpKind.GENERATE:
        # carried sequences beside the new ones, each holding up to its whole length
        batch = dealt_batch(work, batch, par.dp)
        local = math.ceil(decoded_batch(batch, w.gen_len, partial) / par.dp)
        return generate_memory(model, par, w, gpu, engine, local, rows)
    gen = response_len(w.gen_len, local, par, padded_len, mean_len)
    if work.kind in (OpKind.FORWARD, OpKind.SCORE):
        return forward_memory(model, par, gpu, engine, w, batch, gen)
    return train_memory(model, par, gpu, engine, w, batch, gen, work.minibatches)


def weight_sync_time(model: Model, src_devices: Sequence[int], src_par: Layout,
                     dst_devices: Sequence[int], dst_par: Layout, cluster: Cluster) -> float:
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
        >>> weight_sync_time(m, r8, Layout(dp=8), r8, Layout(dp=8), gh)
        0.0
        >>> weight_sync_time(m, r8, Layout(dp=8), r8, Layout(dp=4, tp=2), gh) > 0
        True
    """
    src, dst = tuple(src_devices), tuple(dst_devices)
    gpu = cluster.gpu
    same_layout = (src_par.tp, src_par.pp) == (dst_par.tp, dst_par.pp)
    topo = Topology.from_cluster(cluster)
    wbytes = model_params(model) * value_bytes(model, gpu)
    tensors = C.param_tensors(model.dims)
    if model.lora is not None:                 # only the adapters move to the generator
        wbytes = model.lora.params(model.dims) * value_bytes(model, gpu)
        tensors = 2 * model.lora.linears(model.dims)
    gather = 0.0
    if src_par.zero.shards_params and src_par.dp > 1:     # ZeRO-3: gather the full layer shards first
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


def response_len(dist, local: int, par: Layout, padded: float | None = None,
                 mean: float | None = None) -> float:
    """Tokens per response a forward or train op computes. Padded: the longest of its batch
    (``padded``, a streamed chunk's longest, or the expected longest of ``local``
    responses). Packed (``par.packing``): each response at its own length, their mean
    (``mean``, a streamed chunk's, or the distribution's, at most the padded length)."""
    top = padded_len(dist, local) if padded is None else float(padded)
    if not par.packing:
        return top
    return float(mean) if mean is not None else min(mean_len(dist), top)


__all__ = ["StageCost", "activation_bytes_per_token", "decoded_batch", "dp_group",
           "estimate_stage", "generation_chunks", "generation_rows", "host_bandwidth",
           "offload_time", "pp_group", "response_len", "stage_memory",
           "tp_group", "weight_sync_time"]
