"""Generation: prefill, then one decode step per token, batched as the engine batches.

    >>> from rpeg.cost.profiles import cluster_of
    >>> from rpeg.cost.examples import ppo_pipeline
    >>> from rpeg.graph import work_of
    >>> from rpeg.graph.layout import Layout
    >>> p, gh = ppo_pipeline("llama3.1-8b", prompts=512), cluster_of("gh200", 8)
    >>> generation_rows(work_of(p, "rollout"), Layout(dp=8), gh, 1e12)      # all 64 fit
    64
    >>> 1 <= generation_rows(work_of(p, "rollout"), Layout(dp=8), gh, 2.5e9) < 64
    True

How many sequences decode at once per replica (the concurrency) is the engine's batching
bounded by memory: a pinned ``max_num_seqs`` (vLLM's, or a static batch's micro-batch),
else the engine's default, and never more than the KV cache the free memory (or, pinned,
``kv_fraction`` of the GPU less the engine's weights) holds. What a sequence holds in the
cache depends on how the engine keeps it:

- **paged** (vLLM): pages of the tokens a sequence has, so a sequence holds its prompt plus
  what it generated so far — on average its prompt plus ``E[L^2] / 2E[L]`` (a running
  sequence is, by length, more likely a long one); finished sequences' pages go to waiting
  ones at once (continuous batching), so only the last sequences leave a tail;
- **static batch** (transformers' ``generate``, DeepSpeed's Hybrid Engine, Megatron-style
  generation): a micro-batch padded to its longest prompt decodes until its longest
  response ends, every row computed and cached to the end; micro-batches follow each other;
- **rpeg's torch loop**: a batch padded to its longest prompt whose finished rows leave the
  cache, which grows by concatenation (rewritten each step).

A decode step reads the weights and the live KV cache; its host side (per-layer launches,
or a CUDA-graph replay, and the step's sampling and scheduling) is the engine's
(:mod:`rpeg.cost.engines`). Generation on ZeRO-3-sharded weights (``zero = 3``: HF
``generate`` on a DeepSpeed model) gathers every layer over the data-parallel group in every
pass, prefetching behind compute as far as the engine overlaps; the Hybrid Engine gathers
the whole model once a call (with pinned parameters, its default: not once per decode
step) and keeps its slice in inference kernels at the stage's tensor-parallel degree. An
engine whose weights wait in host memory between steps (``param_offload``: vLLM's sleep
mode in colocated systems) brings them back before it generates.
"""

from __future__ import annotations

import functools
import heapq
import math

import attrs
import numpy as np

from rpeg.cost import compute as C
from rpeg.cost.engines import EngineTerms, engine_terms, with_terms
from rpeg.cost.memory import (
    MemoryCost,
    check_parallel,
    head_dims,
    local_params,
    model_params,
    value_bytes,
    weight_bytes,
)
from rpeg.cost.partial import Partial
from rpeg.cost.topology import Collective, collective_time
from rpeg.graph.deal import busiest_share, deal_group
from rpeg.graph.layout import Layout
from rpeg.spec.model import Cluster, Engine, Model, Zero

SEGMENTS = 32          # decode is integrated over this many segments of constant batch


@attrs.frozen
class StageCost:
    time_s: float
    compute_s: float
    comm_s: float
    breakdown: tuple[tuple[str, float], ...] = ()
    roof: C.Roof = C.Roof()      # FLOPs and memory traffic on the priced device (one replica)


@attrs.frozen
class Gen:
    cost: StageCost
    prefill: float           # seconds of prefill (with its communication)
    host: float              # per-sample host work, done before decoding
    steps: np.ndarray        # decode step numbers at segment ends
    cum_time: np.ndarray     # decode seconds elapsed at those steps
    lengths: np.ndarray      # response lengths, one per local response, in finish order
    finish: np.ndarray       # seconds from the start until each response is done, ascending


# --- lengths -------------------------------------------------------------------------------

@functools.lru_cache(maxsize=256)
def mean_len(dist) -> float:
    return dist.mean()


@functools.lru_cache(maxsize=4096)
def padded_len(dist, local: int) -> float:
    """Length a batch of ``local`` is padded to: the expected longest of them."""
    q = dist.quantiles(max(min(local, 4096), 1))
    return float(q.max())


@functools.lru_cache(maxsize=256)
def running_len(dist) -> float:
    """Mean tokens a running sequence generated so far: ``E[L^2] / 2 E[L]``."""
    q = dist.quantiles(1024)
    return float((q * q).mean() / (2 * q.mean()))


def partial_of(dist, cap: int) -> Partial | None:
    return Partial(dist, cap) if 0 < cap < dist.max_len else None


def decoded_batch(batch: int, dist, partial: int = 0) -> int:
    """Sequences a generate step decodes for a batch of ``batch`` responses: more than the
    batch under partial rollouts (the carried ones beside the new)."""
    part = partial_of(dist, partial)
    return batch if part is None else math.ceil(batch * part.rows)


@functools.lru_cache(maxsize=1024)
def slowest_lengths(dist, local: int, groups: int) -> np.ndarray:
    """Sorted lengths of the slowest of ``groups`` replicas of ``local`` responses each: the
    longest of each of ``local`` equal strata of the batch's lengths. The stage ends when
    the replica holding the batch's longest response does, so its lengths are those, not
    ``local`` draws of their own (whose longest would shrink as DP grows while the batch's
    does not)."""
    n = max(min(local, 4096), 1)
    groups = max(min(groups, 65536 // n), 1)
    out = np.sort(dist.quantiles(n * groups))[groups - 1::groups]
    out.flags.writeable = False
    return out


# --- memory --------------------------------------------------------------------------------

def kv_token_bytes(model: Model, par: Layout, gpu, extra_layer: bool = False) -> float:
    """KV-cache bytes one token takes on one GPU (its layers; K and V split over TP down to
    one head each, a latent cache replicated)."""
    d = model.dims
    layers = math.ceil(d.layers / par.pp) + (1 if extra_layer else 0)
    per = d.kv_values_per_token() if d.mla else 2 * max(d.kv_dim // par.tp, d.head_dim)
    return layers * per * value_bytes(model, gpu)


def row_tokens(w, terms: EngineTerms, dist=None, prompts: int = 1) -> float:
    """Tokens one sequence slot holds in the cache at its peak: a paged cache its live
    tokens on average, a contiguous one the padded prompt plus the longest response."""
    dist = w.gen_len if dist is None else dist
    if terms.paged:
        return mean_len(w.prompt_lens) + running_len(dist)
    return padded_len(w.prompt_lens, prompts) + dist.max_len


def working_set(model: Model, par: Layout, tokens: float, bpv: float) -> float:
    """Largest live intermediates of one layer (gate, up, product; q, k, v) for ``tokens``."""
    d = model.dims
    width = d.expert_ffn * d.active_experts if d.moe and not d.ffn else d.ffn
    return tokens * (3 * width / par.tp + 4 * d.hidden) * bpv


def row_buffer(model: Model, par: Layout, w, gpu) -> float:
    """Other transient bytes per sequence: a prefill layer's intermediates, or the fp32
    logits of its next token (a layer's are freed before the head runs), whole: a
    tensor-parallel engine gathers them to sample."""
    hd = head_dims(model)
    prefill = working_set(model, par, w.prompt_len, value_bytes(model, gpu))
    return max(prefill, hd.vocab * 4 * 3)


PREFILL_CHUNK = 8192       # tokens a paged engine prefills in one scheduler step


def step_buffer(model: Model, par: Layout, gpu, n: int) -> float:
    """A paged engine's activations: one scheduler step's prefill chunk through a layer,
    and the next-token logits of its ``n`` sequences."""
    hd = head_dims(model)
    return max(working_set(model, par, PREFILL_CHUNK, value_bytes(model, gpu)),
               n * hd.vocab * 4 * 3)         # the logits gathered whole to sample


def engine_weights(model: Model, par: Layout, gpu) -> float:
    """Bytes of the weights a generating engine holds on one GPU at its tensor parallelism."""
    return local_params(model, attrs.evolve(par, zero=Zero.NONE, dp=1)) * weight_bytes(model, gpu)


def gather_buffer(model: Model, par: Layout, gpu, engine: Engine) -> float:
    """Transient weights a pass on ZeRO-3 shards gathers: two layers (the one computing and
    the one prefetched), or the Hybrid Engine's whole inference copy."""
    if not par.zero.shards_params or par.shards <= 1:
        return 0.0
    full = engine_weights(model, par, gpu)
    if engine is Engine.HYBRID:
        return full
    return 2 * full / max(math.ceil(model.dims.layers / par.pp), 1)


def concurrency(model: Model, par: Layout, w, gpu, engine: Engine, local: int,
                free_bytes: float | None, dist=None) -> int:
    """Sequences decoding at once per replica: the engine's batch (pinned ``max_num_seqs``,
    or its default), at most what the KV cache holds (None: memory not asked)."""
    t = engine_terms(engine, gpu)
    want = par.decoding.max_num_seqs or t.default_seqs or local
    want = min(want, local)
    pool = kv_pool(model, par, gpu, engine, free_bytes)
    if pool is None:
        return max(want, 1)
    kv = kv_token_bytes(model, par, gpu, t.kv_copy) * row_tokens(w, t, dist, want)
    if t.paged:
        pool -= step_buffer(model, par, gpu, want)
    per = kv + (0.0 if t.paged else row_buffer(model, par, w, gpu))
    fit = int(max(pool, 0.0) // per) if per > 0 else want
    return max(min(want, fit), 1)


def kv_pool(model: Model, par: Layout, gpu, engine: Engine,
            free_bytes: float | None) -> float | None:
    """Bytes per GPU the cache may take: a pinned ``kv_fraction`` of the GPU less the
    engine's weights, else the free memory less the runtime's own (None: not asked)."""
    if par.decoding.kv_fraction:
        return par.decoding.kv_fraction * gpu.memory - engine_weights(model, par, gpu) \
            - gpu.runtime_memory
    if free_bytes is None:
        return None
    return free_bytes - gpu.runtime_memory - gather_buffer(model, par, gpu, engine)


def generate_memory(model: Model, par: Layout, w, gpu, engine: Engine, local: int,
                    rows: int | None, dist=None) -> MemoryCost:
    """Transient bytes per GPU of a generate stage with ``rows`` sequences at once (None: all
    ``local``): their cache (a pinned ``kv_fraction``: the pool the engine takes), their
    buffers, and the weights a pass on ZeRO-3 shards gathers."""
    t = engine_terms(engine, gpu)
    n = local if rows is None else max(min(rows, local), 1)
    kv = n * kv_token_bytes(model, par, gpu, t.kv_copy) * row_tokens(w, t, dist, n)
    if t.paged:
        buf = step_buffer(model, par, gpu, n)
        if par.decoding.kv_fraction:       # the engine takes its share of the GPU, whatever it holds
            kv = max(kv, kv_pool(model, par, gpu, engine, None) - buf)
    else:
        buf = n * row_buffer(model, par, w, gpu)
    buf += gather_buffer(model, par, gpu, engine)
    # weights kept in host memory between stages (an engine put to sleep) are here now
    loaded = engine_weights(model, par, gpu) if par.param_offload else 0.0
    return MemoryCost(weights=loaded, kv_cache=kv, buffers=gpu.runtime_memory + buf)


def batching_of(work, placement) -> tuple[int, float, bool]:
    """(max_num_seqs, kv_fraction, cuda_graph) of a generate stage as it runs: a plan
    placement's where it sets them, else its stage's ``generate(..., max_num_seqs = N,
    kv_fraction = F)`` (``work``: its Work, or its Batching, :mod:`rpeg.graph.work`); 0
    leaves the engine's default (its batch, what memory is free). The torch engine takes
    no share of the memory (it decodes in waves of max_num_seqs): the stage's kv_fraction
    is not its own.
    The cost model prices these and the runtime passes the same to its engines."""
    seqs = int(placement.max_num_seqs or work.max_num_seqs)
    frac = float(placement.kv_fraction or (work.kv_fraction
                                           if placement.engine is not Engine.TORCH else 0.0))
    return seqs, frac, bool(placement.cuda_graph)


def dealt_batch(work, batch: int, dp: int) -> int:
    """The responses a generate stage's ``dp`` ranks are priced for between them, as the
    runtime deals a step's batch out (:func:`rpeg.graph.deal.dealt`): one response at a
    time (an even split: the batch), or under dynamic sampling (``refill_rounds``) whole
    groups, a prompt with all its samples, so the busiest rank holds ceil(prompts / dp)
    groups, ``dp`` times its share, and the step waits for it.

        >>> from rpeg.graph.work import Work
        >>> from rpeg.spec.model import LengthDist, OpKind, Workload
        >>> w = Workload(steps=1, prompts=128, samples=16, prompt_len=8,
        ...              gen_len=LengthDist.fixed(8))
        >>> dapo = Work(stage="rollout", kind=OpKind.GENERATE, workload=w, refill_rounds=3)
        >>> [dealt_batch(dapo, 2048, dp) for dp in (64, 68, 256)]
        [2048, 2176, 4096]
    """
    if dp <= 1:
        return batch
    group = deal_group(work)
    busiest = busiest_share(batch, dp, group)
    # one response at a time, the busiest rank holding an even split's ceil(batch / dp):
    # the batch, its carried sequences priced from its whole (decoded_batch)
    return batch if group == 1 and busiest == -(-batch // dp) else busiest * dp



def generation_rows(work, par: Layout, cluster: Cluster,
                    free_bytes: float, *, batch: int | None = None, partial: int = 0,
                    engine: Engine = Engine.TORCH) -> int:
    """How many sequences a generate stage runs at once per replica when ``free_bytes`` per
    GPU are left beside the weights resident there: the engine's batch, as much of it as
    the free memory holds (at least one; the memory check then reports the shortfall)."""
    model, w = work.model, work.workload
    batch = w.batch if batch is None else batch
    if getattr(work, "conversation", None) is not None:    # whole conversations, every cohort
        local = math.ceil(batch * (carries(work, partial) + 1) / par.dp)
        w = conversation_workload(work)
        return concurrency(model, par, w, cluster.gpu, engine, local, free_bytes)
    batch = dealt_batch(work, batch, par.dp)
    local = math.ceil(decoded_batch(batch, w.gen_len, partial) / par.dp)
    return concurrency(model, par, w, cluster.gpu, engine, local, free_bytes)


def carries(work, partial: int) -> int:
    """The plan's carry of a conversation stage, from the per-step token cap it is priced
    with (``rpeg.cost.partial.smallest_cap`` of the turn length): 0 for whole ones."""
    dist = work.workload.gen_len
    return Partial(dist, partial).carries if 0 < partial < dist.max_len else 0


def conversation_workload(work):
    """The workload of a conversation stage's whole samples (prompt, then the turns and
    observations), as its KV cache holds them at their longest."""
    from rpeg.spec.tools import trajectory_len
    return attrs.evolve(work.workload, gen_len=trajectory_len(work.workload.gen_len,
                                                              work.conversation))


# --- time ----------------------------------------------------------------------------------

def generation(model, par, devices, topo, cluster, batch, w, engine, rows=None,
               partial=0, reuse: float = 0.0) -> Gen:
    """The generate stage's cost and when each local response is finished. ``reuse``:
    tokens of each prompt already in the engine's cache (a conversation's earlier turns
    under prefix caching), attended to but not prefilled again."""
    prompt, dist, extra = w.prompt_lens, w.gen_len, 0.0
    part = partial_of(dist, partial)
    gpu = cluster.gpu
    t = engine_terms(engine, gpu)
    if part is not None:
        # Carried sequences beside the new ones; each re-prefills what it has so far: a
        # paged cache its own, a padded batch (rpeg's torch loop) every row to the longest.
        batch, dist = decoded_batch(batch, dist, partial), part
        extra = part.context if t.paged else part.longest_context
    local = math.ceil(batch / par.dp)
    n = concurrency(model, par, w, gpu, engine, local, None, dist) if rows is None \
        else max(min(rows, local), 1)
    if t.paged and n < local:
        # Continuous batching: ``n`` sequences at once, a finished one's slot refilled from
        # the queue at once, so only the last sequences leave a tail.
        return _cached(model, par, devices, topo, gpu, t, local, prompt, extra, dist, engine,
                       par.dp, n, reuse)
    if n >= local:
        return _cached(model, par, devices, topo, gpu, t, local, prompt, extra, dist, engine,
                       par.dp, None, reuse)
    # Waves: the local batch in ceil(local / n) consecutive batches of at most n sequences.
    # Each wave has the whole length distribution, so each waits for its own longest.
    waves = math.ceil(local / n)
    one = _cached(model, par, devices, topo, gpu, t, math.ceil(local / waves), prompt, extra,
                  dist, engine, par.dp * waves, None, reuse)
    c, span = one.cost, one.cost.time_s
    cost = StageCost(c.time_s * waves, c.compute_s * waves, c.comm_s * waves,
                     tuple((k, v * waves) for k, v in c.breakdown), c.roof.scaled(waves))
    finish = np.concatenate([one.finish + k * span for k in range(waves)])
    return Gen(cost, one.prefill, one.host, one.steps, one.cum_time,
               np.tile(one.lengths, waves), finish)


@functools.lru_cache(maxsize=4096)
def _cached(model, par, devices, topo, gpu, t, local, prompt, extra, dist, engine, groups=1,
            slots=None, reuse=0.0) -> Gen:
    """One wave of ``local`` sequences per replica, on the slowest of ``groups`` replicas
    (or waves) the batch is dealt to; each prompt ``extra`` tokens longer (what a carried
    sequence re-prefills). ``slots`` (continuous batching): at most this many decode at
    once, admitted in arrival order (independent of their lengths)."""
    check_parallel(model.dims, par, model.name)
    d, hd, bpv = model.dims, head_dims(model), value_bytes(model, gpu)
    m = min(par.microbatches, local)
    layers = math.ceil(d.layers / par.pp)
    tpg, ppg = tuple(devices[: par.tp]), tuple(devices[: par.pp * par.tp: par.tp])
    dpg = tuple(devices[:: par.pp * par.tp])
    lengths = slowest_lengths(dist, local, groups)
    n = len(lengths)
    first, last = admissions(lengths, None if slots is None else slots * n / local)
    if t.static_batch:
        last = np.full(n, float(lengths.max()))        # every row to the batch's end
    # A static or torch batch is padded to its longest prompt; a paged cache holds each
    # sequence's own.
    p_ctx = (mean_len(prompt) if t.paged else padded_len(prompt, n)) + extra
    dec = with_terms(gpu, t, decode=True, graph=par.decoding.cuda_graph)
    pre = with_terms(gpu, t)
    wbytes = engine_weights(model, par, gpu)
    gather = collective_time(Collective.ALL_GATHER, wbytes, dpg, topo) \
        if par.zero.shards_params and engine is not Engine.HYBRID else 0.0
    # the Hybrid Engine's weight copies each forward on ZeRO-3 (hybrid_merge_bytes)
    merged = hybrid_merge_bytes(model, par, gpu) * layers if engine is Engine.HYBRID else 0.0
    merge = merged / gpu.mem_bandwidth
    hooks = C.param_tensors(d, layers) * t.hook_s if gather else 0.0

    def stage_pass(g, tokens: float, context: float, kv_tokens: float, head: float
                   ) -> tuple[float, C.Roof]:
        pc = C.pass_cost(hd, g, tokens=max(int(round(tokens)), 1), context=context,
                         bytes_per_value=bpv, tp=par.tp, layers=layers, kv_tokens=kv_tokens,
                         head_tokens=max(int(round(head)), 1), kv_copy=t.kv_copy)
        work = pc.time_s + merge
        if gather:             # ZeRO-3: every layer gathered in every pass, prefetched
            work += max(gather - work, gather * (1 - t.overlap)) + hooks
        return work, pc.roof + C.Roof(0.0, merged) if merged else pc.roof

    def comm(tokens: float, seqs: float) -> float:
        """A pass over ``tokens`` sampling the next token of ``seqs`` sequences: two
        all-reduces a layer and one for the vocabulary-split embedding's lookup, and the
        next-token logits gathered whole to sample from (vLLM's logits processor, the torch
        engine's ``weights.whole``)."""
        nbytes = tokens * d.hidden * bpv
        tp = (2 * layers + 1) * collective_time(Collective.ALL_REDUCE, nbytes, tpg, topo)
        tp += collective_time(Collective.ALL_GATHER, seqs * hd.vocab * bpv, tpg, topo)
        p2p = collective_time(Collective.P2P, nbytes, ppg[:2], topo) if par.pp > 1 else 0.0
        return tp + p2p

    pipe = (m + par.pp - 1)                      # 1F1B-style fill: m micro-batches, pp stages
    fresh = max(p_ctx - reuse, 1.0)              # a cached prefix is attended, not recomputed
    pre_tokens = local * fresh / m
    pre_t, pre_roof = stage_pass(pre, pre_tokens, p_ctx - fresh / 2, 0.0, local / m)
    prefill_c = pipe * pre_t
    roof = pre_roof.scaled(m)
    prefill_x = pipe * comm(pre_tokens, local / m)
    if engine is Engine.HYBRID and par.zero.shards_params:
        # the shards gathered once a call into the inference kernels' layout: every rank
        # gathers each layer's whole tensors and copies its tensor-parallel slice, so the
        # whole model's bytes cross the links whatever the tp (DeepSpeed's Hybrid Engine
        # with pinned parameters, DeepSpeed-Chat's default: microsoft/DeepSpeed
        # deepspeed/runtime/hybrid_engine.py, generate(), GatheredParameters per layer group)
        prefill_x += collective_time(Collective.ALL_GATHER, sync_bytes(model, gpu),
                                     tuple(devices), topo)
    if par.param_offload:      # an engine woken up: its weights back from host memory
        prefill_x += wbytes / gpu.host_bandwidth

    # Decode, integrated over segments of constant batch size.
    done = np.sort(last)
    idx = np.unique(np.linspace(0, n - 1, min(n, SEGMENTS)).round().astype(int))
    ends = done[idx]
    starts = np.concatenate([[0.0], ends[:-1]])
    keep = ends > starts
    ends, starts = ends[keep], starts[keep]
    comp_seg, comm_seg = [], []
    for lo, hi in zip(starts, ends, strict=True):
        mid = (lo + hi) / 2
        live = (first <= mid) & (last >= mid)
        active = local * float(live.sum()) / n
        ctx = p_ctx + (float((mid - first[live]).mean()) if live.any() else mid)
        per_mb = active / m
        one, one_roof = stage_pass(dec, per_mb, ctx, per_mb * ctx, per_mb)
        # the engine's host time a step: its fixed part, vLLM's per running sequence, and
        # every live row sampling its token from the vocabulary's logits (a CPU device: the
        # profile's sample_logit_time, measured by rpeg calibrate; 0 on a GPU profile)
        step = pipe * one + dec.decode_overhead + active * (t.seq_s + d.vocab * dec.sample_logit_time)
        roof += one_roof.scaled((hi - lo) * m)
        comp_seg.append((hi - lo) * step)
        comm_seg.append((hi - lo) * pipe * comm(per_mb, per_mb))
    comp = np.array(comp_seg)
    cx = np.array(comm_seg)
    cum = np.concatenate([[0.0], np.cumsum(comp + cx)])
    steps = np.concatenate([[0.0], ends])
    decode_c, decode_x = float(comp.sum()), float(cx.sum())
    host = local * gpu.sample_overhead
    compute = prefill_c + decode_c + host
    comm_total = prefill_x + decode_x
    cost = StageCost(compute + comm_total, compute, comm_total,
                     (("prefill", prefill_c + prefill_x), ("decode", decode_c + decode_x),
                      ("host", host)), roof)
    prefill = prefill_c + prefill_x
    order = np.argsort(last, kind="stable")
    finish = np.interp(last[order], steps, cum) + prefill + host
    return Gen(cost, prefill, host, steps, cum, lengths[order], finish)


def admissions(lengths: np.ndarray, slots: float | None) -> tuple[np.ndarray, np.ndarray]:
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


def hybrid_merge_bytes(model: Model, par: Layout, gpu) -> float:
    """Bytes one layer of DeepSpeed's Hybrid Engine copies every forward on ZeRO-3 weights.

    Under ZeRO-3 the Hybrid Engine's containers keep a layer's query, key and value weights
    (and a gated MLP's gate and up weights) as the separate tensors ZeRO manages instead of
    fusing them once (microsoft/DeepSpeed ``module_inject/containers/features/split_qkv.py``
    and ``gated_mlp.py``, ``set_*_params_wo_copy(Z3_enabled=True)``: "managed by ZeRO and
    handled separately in the forward of ds_attention"); every forward of the inference
    kernels then copies them into one shared buffer before its GEMM
    (``ops/transformer/inference/ds_attention.py`` ``_merge_qkv``, ``ds_mlp.py``
    ``_merge_inter_w``): each decode step reads and writes those weights once more, beside
    the GEMMs' own read. Bytes of the rank's tensor-parallel slice, read and written.
    0 without ZeRO-3 (the containers fuse once, at the call's start)."""
    if not par.zero.shards_params:
        return 0.0
    d = model.dims
    qkv = d.hidden * (d.q_dim + 2 * d.kv_dim)
    mlp = 2 * d.hidden * d.ffn if d.gated else 0
    return 2.0 * (qkv + mlp) / par.tp * weight_bytes(model, gpu)


def sync_bytes(model: Model, gpu) -> float:
    """Bytes of a model's weights as a generating engine receives them."""
    return model_params(model) * weight_bytes(model, gpu)


__all__ = ["Gen", "StageCost", "admissions", "batching_of", "concurrency", "dealt_batch", "decoded_batch", "generate_memory",
           "generation", "hybrid_merge_bytes", "generation_rows", "kv_token_bytes", "mean_len", "padded_len",
           "slowest_lengths"]
