"""Execution engines: what each one is, and the few physical terms every engine shares.

    >>> from rpeg.cost.profiles import builtin_profile
    >>> t = engine_terms(Engine.HF, builtin_profile("h100"))
    >>> t.static_batch, t.paged
    (True, False)
    >>> engine_terms(Engine.VLLM, builtin_profile("a100")) == engine_terms(Engine.VLLM,
    ...                                                                  builtin_profile("h20"))
    True
    >>> all(lo <= getattr(EFFICIENCY, k) <= hi for k, (lo, hi) in BOUNDS.items())
    True

A GPU profile says what the device does: its datasheet peaks and what was measured of it
(the large-GEMM rate ``matmul_flops`` <= ``peak_flops``, the streaming bandwidth
``mem_bandwidth`` <= ``hbm_bandwidth``, how GEMMs of a shape fall short of the large-GEMM
rate). Every engine's kernels run at those rates: no engine computes faster or slower than
the device, and no op's time is below its roofline (:func:`rpeg.cost.compute.utilisation`).

What makes engines differ is what they are (:class:`EngineKind`, from how each is built,
not fitted): how many kernels one transformer block launches eagerly from Python
(transformers' modules: about 40, norms and rotary as chains of elementwise ops;
Megatron's Transformer Engine modules and vLLM's custom ops: fused, about 10-12;
DeepSpeed's inference kernels: about 8), which decode loop drives generation (a Python
``generate`` loop, or vLLM's scheduler), whether ZeRO-3 gathers tensor by tensor with a
hook on each (DeepSpeed) or layer by layer (FSDP), how it batches generation (a paged KV
cache with continuous batching; a static batch that keeps finished sequences until its
longest ends; rpeg's torch loop, which drops finished rows), and the bytes of each output
logit it holds at once (bf16 logits with a fused or chunked log-probability: 2, and the
chunk it works on; an fp32 upcast with its log-softmax: 10) and the bytes its
log-probabilities move per logit (:class:`LossTraffic`: rpeg's backend counted from its
code; one float32 pass for the others).

What they share (:class:`Efficiency`) is a handful of host and overlap terms, each with a
unit and a physical range (:data:`BOUNDS`), the same for every engine, source and GPU kind:
the host time of one eagerly launched kernel, of one step of a Python decode loop and of
vLLM's scheduler (and per running sequence of its step), of a CUDA-graph replay, of a ZeRO-3 hook per parameter tensor, of a
controller's call and the rate at which it moves a batch's tensors, and the share of
data-parallel and ZeRO traffic that hides behind compute. Their values were
fitted once, within those ranges, on the published step times of the calibration set
(``benchmarks/published_fit.py``); ``benchmarks/published.py`` reports each source
predicted with the terms fitted on the others. On a CPU profile (``async_launch = 0``: the
host runs the kernels) the terms are the ones ``rpeg calibrate`` measured on that machine.
"""

from __future__ import annotations

import contextlib
import functools
import math

import attrs

from rpeg.spec.model import Engine, GpuProfile


@attrs.frozen
class LossTraffic:
    """The memory traffic, per output logit, of what the head's logits go through after the
    head's GEMM (the log-probability of each target and the entropy), forward and backward:
    ``reads`` passes over the logits in their own dtype (2 bytes a value in bf16, 4 in
    float32) and ``f32`` bytes of float32 work. The backward's is None where it is not
    counted apart from the forward's: then the backward pass is priced as the forward's
    ``backward_factor`` times, this traffic with it.

    >>> t = TORCH_LOSS
    >>> t.forward(2), t.backward(2)             # bf16 logits, at temperature 1
    (44.0, 72.0)
    >>> FUSED_LOSS.forward(2), FUSED_LOSS.backward(2) is None
    (12.0, True)
    """

    reads: float = 0.0
    f32: float = 12.0
    bwd_reads: float = 0.0
    bwd_f32: float | None = None

    def forward(self, value_bytes: float) -> float:
        return self.reads * value_bytes + self.f32

    def backward(self, value_bytes: float) -> float | None:
        if self.bwd_f32 is None:
            return None
        return self.bwd_reads * value_bytes + self.bwd_f32


# What the engines of other systems do with the logits is priced as one float32 pass
# written, read and exponentiated (12 bytes a logit), the backward as the forward's
# ``backward_factor`` times: their kernels differ (a fused cross-entropy, an fp32 upcast)
# and no byte count of them is read here.
FUSED_LOSS = LossTraffic()
# rpeg's torch backend, counted from its code (backends.torch_backend.distributed,
# _TokenLogProbs at temperature 1, each chunk's tensors read and written once per op):
# forward: the maximum (a read of the logits), the chunk's float32 copy (a read; 4 written),
# z - max (8), its exp in place (8), the sum (4), e * z in place (12) and its sum (4): two
# reads and 40 bytes; backward: the float32 copy (a read; 4), z - log Z (8), its exp (8),
# four in-place steps of the gradient (8 each, 12 for the product with p), and the
# gradient written over the logits (4 read; a write in their dtype): two passes and 68
# bytes. Another temperature adds a division in place, 8 bytes forward and 16 backward,
# not counted here.
TORCH_LOSS = LossTraffic(reads=2, f32=40.0, bwd_reads=2, bwd_f32=68.0)


@attrs.frozen
class EngineTerms:
    """How an engine drives a device: what the cost functions read."""

    layer_s: float = 0.0        # host seconds per layer per forward call, kernels launched eagerly
    step_s: float = 0.0         # host seconds per decode step (sampling, scheduling, stop checks)
    graph_step_s: float = 0.0   # host seconds per decode step replayed from a CUDA graph
    seq_s: float = 0.0          # host seconds per live sequence per decode step (vLLM V0)
    work: float = 1.0           # CPU only: kernel time / the profile's torch ops (measured)
    overlap: float = 0.0        # share of DP / ZeRO communication hidden behind compute
    hook_s: float = 0.0         # host seconds per parameter tensor per pass under ZeRO-3
    grad_hook_s: float = 0.0    # ... more per tensor in a backward pass (its gradient hook)
    gemm: float = 1.0           # GPU: sustained share of the profile's GEMM rates, (0, 1]
    call_s: float = 0.0         # a controller's host time per op call (Cluster.controller)
    controller_rate: float = math.inf   # bytes a second the controller moves a batch's tensors
    paged: bool = False         # generate: KV cache in pages of live tokens, continuous batching
    static_batch: bool = False  # generate: finished sequences stay in the batch until it ends
    kv_copy: bool = False       # generate: the cache grows by concatenation (rewritten each step)
    default_seqs: int = 0       # generate: sequences at once when not pinned (0: what fits)
    logits_chunk: int = 0       # forward / train: tokens whose logits exist at once (0: all)
    logits_fwd: float = 12.0    # bytes per logit value a forward holds (fp32 copies: 12)
    logits_train: float = 12.0  # ... a train step holds, with the logits' gradient
    logits_work: int = 0        # float32 logit values a chunked log-softmax works on at once
                                # (LOGIT_WORK_COPIES copies of them; 0: not chunked)
    loss: LossTraffic = FUSED_LOSS  # bytes a logit's log-probability and entropy move
    sequence_parallel: bool = False   # TP ranks split the norms' and residuals' activations
    grads_freed: bool = False   # train: gradients set to None after each step (not resident)
    own_tp: bool = False        # splits layers its own way (vLLM), not as the runtime's
                                # DTensor layers the profile's tp_layer_overhead measures


def _term(unit: str, low: float, high: float, what: str):
    return attrs.field(metadata={"unit": unit, "bounds": (low, high), "what": what})


@attrs.frozen
class Efficiency:
    """The terms every engine shares, each a physical quantity within its range."""

    launch_s: float = _term(
        "s", 2e-6, 50e-6, "host time of one kernel launched eagerly from Python (PyTorch's "
        "dispatcher and the CUDA launch; ~5-20 us measured per op)")
    generate_step_s: float = _term(
        "s", 0.2e-3, 20e-3, "host time of one step of a Python decode loop beyond the "
        "model's own launches: logits processors, sampling over the vocabulary, stop "
        "checks, the cache's and attention mask's bookkeeping (transformers' generate: a "
        "few dozen ops on [batch, vocab] tensors, milliseconds)")
    vllm_step_s: float = _term(
        "s", 0.2e-3, 50e-3, "host time of one step of vLLM's scheduler and sampler beyond "
        "its work per running sequence (vllm_seq_s)")
    vllm_seq_s: float = _term(
        "s", 5e-6, 100e-6, "host time per running sequence per decode step of vLLM's V0 "
        "engine beyond its fixed step: the Python each sequence group passes through every "
        "step (the scheduler's block-table and sequence-data bookkeeping, the sampler's "
        "per-sequence output objects, vllm/engine/output_processor/single_step.py appending "
        "the token, detokenizing it incrementally and checking stop conditions): tens of "
        "microseconds a sequence, so seconds over a rollout at a few hundred sequences")
    graph_step_s: float = _term(
        "s", 20e-6, 5e-3, "host time of one decode step replayed from a captured CUDA graph")
    hook_s: float = _term(
        "s", 0.0, 200e-6, "host time per parameter tensor per pass of a ZeRO-3 that gathers "
        "and releases tensor by tensor (DeepSpeed's hooks: a Python hook and a collective's "
        "launch, tens of microseconds)")
    grad_hook_s: float = _term(
        "s", 0.0, 2e-3, "host time per parameter tensor of a backward pass under such a "
        "ZeRO-3 beyond its gather: the gradient hook that copies, reduces and partitions it")
    call_s: float = _term(
        "s", 0.0, 10.0, "host time of an RL framework's controller per op call beyond the "
        "bytes it moves: the round trip to its workers (a Ray actor call: ~0.2-1 ms in "
        "Ray's own microbenchmarks) and the per-call work on the workers nothing else "
        "prices (ReaL's request/reply hooks, gc.collect and CUDA synchronisations). A fit "
        "of seconds here is far above any round trip: it stands for costs not yet modelled "
        "(charged where the cluster says a controller drives the ops: Cluster.controller)")
    controller_rate: float = _term(
        "B/s", 0.3e9, 25e9, "rate at which the controller moves an op's batch through "
        "itself: the workers' outputs gathered to the driver and the next op's inputs "
        "scattered from it, serialised and through an object store (pickle of a tensor "
        "on one core: ~1 GB/s; a 200 Gb/s NIC: 25 GB/s). The bytes are "
        ":data:`CONTROLLER_BYTES` per token of the batch's sequences")
    gemm: float = _term(
        "", 0.3, 1.0, "sustained share of the profile's measured GEMM rates (a benchmark's "
        "short bursts) that a model's passes keep up: clocks under sustained power, "
        "neighbouring kernels")
    overlap: float = _term(
        "", 0.0, 1.0, "share of data-parallel and ZeRO traffic that hides behind compute")


# What a controller moves per token of a batch's sequences on each op call: the rollout's
# int64 token ids, attention mask and position ids over prompt and response, and the
# prompt / response ids beside them (verl's DataProto after generation: 4 x 8 bytes; the
# fp32 log-probabilities, values and advantages later ops add are 4 bytes each). ReaL's
# master passes only metadata (its workers move the data among themselves), so this
# overstates it there, by milliseconds at ReaL's 2^17 tokens a step.
CONTROLLER_BYTES = 32.0

BOUNDS: dict[str, tuple[float, float]] = {
    f.name: f.metadata["bounds"] for f in attrs.fields(Efficiency)}

# Fitted on the calibration set by benchmarks/published_fit.py (results:
# benchmarks/results/published.md, which also reports each source predicted with the terms
# fitted on the others). The controller's rate is the prior's 1 GB/s (a tensor pickled on
# one core): the rows do not constrain it (0.3-25 GB/s moves their loss by under 1e-3),
# since what they move through a controller is 4 MB to 0.8 GB a call.
EFFICIENCY = Efficiency(launch_s=14.22e-6, generate_step_s=20e-3, vllm_step_s=2.132e-3,
                        vllm_seq_s=21.3e-6, graph_step_s=0.5e-3, hook_s=0.8948e-6, grad_hook_s=2e-3, gemm=0.8075,
                        overlap=0.3325, call_s=2.803, controller_rate=1e9)


# rpeg's torch backend computes log-probabilities and entropies over chunks of this many
# logit values, in float32, with two copies of a chunk alive at once (each step in place)
LOGIT_CHUNK = 1 << 24
LOGIT_WORK_COPIES = 2


class Loop:
    """Which decode loop drives an engine's generation."""

    NONE = "none"
    PYTHON = "python"       # a generate loop in Python (transformers, DeepSpeed, rpeg's own)
    VLLM = "vllm"           # vLLM's scheduler


@attrs.frozen
class EngineKind:
    """What an engine is, from how it is built (nothing here is fitted)."""

    kernels: int                # kernels one transformer block's forward launches
    loop: str = Loop.NONE
    per_tensor_hooks: bool = False     # ZeRO-3 gathers tensor by tensor, a hook on each
    paged: bool = False
    static_batch: bool = False
    kv_copy: bool = False
    default_seqs: int = 0
    logits_fwd: float = 12.0
    logits_train: float = 12.0
    logits_work: int = 0
    loss: LossTraffic = FUSED_LOSS
    sequence_parallel: bool = False
    grads_freed: bool = False          # gradients set to None after each step


KINDS: dict[Engine, EngineKind] = {
    # rpeg's torch backend: transformers' modules, eager; its own loop drops finished rows;
    # it keeps the logits once in bf16 (training writes their gradient over them) and
    # computes the log-probabilities over chunks of them in float32
    # (backends.torch_backend.distributed.token_log_probs)
    Engine.TORCH: EngineKind(kernels=40, loop=Loop.PYTHON, kv_copy=True, logits_fwd=2,
                             logits_train=2, logits_work=LOGIT_CHUNK, loss=TORCH_LOSS,
                             grads_freed=True),
    Engine.VLLM: EngineKind(kernels=10, loop=Loop.VLLM, paged=True, default_seqs=256),
    Engine.HF: EngineKind(kernels=40, loop=Loop.PYTHON, per_tensor_hooks=True,
                          static_batch=True, kv_copy=True, logits_fwd=10, logits_train=14),
    Engine.HYBRID: EngineKind(kernels=8, loop=Loop.PYTHON, static_batch=True),
    Engine.DEEPSPEED: EngineKind(kernels=40, per_tensor_hooks=True, logits_fwd=10,
                                 logits_train=14),
    Engine.MEGATRON: EngineKind(kernels=12, logits_fwd=6, logits_train=10,
                                sequence_parallel=True),
}


def terms_of(kind: EngineKind, eff: Efficiency) -> EngineTerms:
    """The terms an engine of ``kind`` runs with under the shared ``eff``."""
    step = {Loop.PYTHON: eff.generate_step_s, Loop.VLLM: eff.vllm_step_s}.get(kind.loop, 0.0)
    return EngineTerms(layer_s=kind.kernels * eff.launch_s, step_s=step,
                       seq_s=eff.vllm_seq_s if kind.loop == Loop.VLLM else 0.0,
                       graph_step_s=eff.graph_step_s if kind.loop == Loop.VLLM else 0.0,
                       overlap=eff.overlap, hook_s=eff.hook_s if kind.per_tensor_hooks else 0.0,
                       grad_hook_s=eff.grad_hook_s if kind.per_tensor_hooks else 0.0,
                       gemm=eff.gemm, call_s=eff.call_s,
                       controller_rate=eff.controller_rate,
                       paged=kind.paged, static_batch=kind.static_batch, kv_copy=kind.kv_copy,
                       default_seqs=kind.default_seqs, own_tp=kind.loop == Loop.VLLM,
                       logits_fwd=kind.logits_fwd,
                       logits_train=kind.logits_train, logits_work=kind.logits_work,
                       loss=kind.loss, sequence_parallel=kind.sequence_parallel,
                       grads_freed=kind.grads_freed)


ENGINES: dict[Engine, EngineTerms] = {e: terms_of(k, EFFICIENCY) for e, k in KINDS.items()}


def engine_terms(engine: Engine, gpu: GpuProfile) -> EngineTerms:
    """The terms ``engine`` runs with on ``gpu``."""
    if engine is Engine.AUTO:
        engine = Engine.TORCH
    if not gpu.async_launch:                  # a CPU rpeg calibrate measured: its own terms
        if engine is Engine.VLLM:
            layer, step = gpu.vllm_layer_overhead, gpu.vllm_decode_overhead
            return EngineTerms(layer_s=gpu.layer_overhead if layer is None else layer,
                               step_s=gpu.decode_overhead if step is None else step,
                               work=gpu.vllm_work_scale, paged=True, own_tp=True)
        own = engine is Engine.TORCH       # logits as rpeg's backend holds them
        cb = gpu.compute_bytes or 4.0
        return EngineTerms(layer_s=gpu.layer_overhead, step_s=gpu.decode_overhead,
                           kv_copy=True, static_batch=engine in (Engine.HF, Engine.HYBRID),
                           grads_freed=bool(gpu.grads_freed),
                           **({"logits_fwd": cb, "logits_train": cb,
                               "logits_work": LOGIT_CHUNK, "loss": TORCH_LOSS}
                              if own else {}))
    return ENGINES[engine]


@contextlib.contextmanager
def efficiency(eff: Efficiency):
    """Price with the shared terms ``eff`` instead of the fitted ones while the block runs
    (the fit of ``benchmarks/published_fit.py`` tries candidates this way; every cost
    function is keyed by the terms it used, so nothing cached carries over)."""
    global EFFICIENCY
    saved = EFFICIENCY
    EFFICIENCY = eff
    ENGINES.update({e: terms_of(k, eff) for e, k in KINDS.items()})
    try:
        yield
    finally:
        EFFICIENCY = saved
        ENGINES.update({e: terms_of(k, saved) for e, k in KINDS.items()})


def out_of_range(eff: Efficiency) -> list[str]:
    """The terms of ``eff`` outside their physical range (none for a model that prices)."""
    return [f"{k} = {getattr(eff, k):g} not in [{lo:g}, {hi:g}]"
            for k, (lo, hi) in BOUNDS.items() if not lo <= getattr(eff, k) <= hi]


# pure: one profile per answer, which pass_cost's memo then finds by identity
@functools.lru_cache(maxsize=1024)
def with_terms(gpu: GpuProfile, t: EngineTerms, decode: bool = False,
               graph: bool = False) -> GpuProfile:
    """``gpu`` as the engine drives it: its host overheads, and the GEMM rates it sustains
    (on a CPU, the kernel speed ``rpeg calibrate`` measured). A pass replayed from a CUDA
    graph costs the host ``graph_step_s`` instead of a launch per layer and a call; a
    decode step also pays the engine's ``step_s`` (sampling, scheduling). An engine that
    splits layers its own way (``own_tp``: vLLM) pays no ``tp_layer_overhead``, which
    measures the runtime's DTensor layers."""
    from rpeg.cost.compute import with_work_scale
    out = attrs.evolve(gpu, layer_overhead=0.0 if graph else t.layer_s,
                       call_overhead=t.graph_step_s if graph else gpu.call_overhead,
                       decode_overhead=t.step_s if decode else gpu.decode_overhead,
                       tp_layer_overhead=0.0 if graph or t.own_tp else gpu.tp_layer_overhead)
    if not gpu.async_launch:
        return with_work_scale(out, t.work)
    if t.gemm >= 1.0:
        return out
    return attrs.evolve(out, matmul_flops=gpu.matmul_flops * t.gemm,
                        fp8_flops=gpu.fp8_flops * t.gemm,
                        attn_flops=(gpu.attn_flops or 0.6 * gpu.matmul_flops) * t.gemm)


__all__ = ["BOUNDS", "EFFICIENCY", "ENGINES", "FUSED_LOSS", "KINDS", "TORCH_LOSS",
           "Efficiency", "EngineKind", "EngineTerms", "LossTraffic", "efficiency",
           "engine_terms", "out_of_range", "terms_of", "with_terms"]
