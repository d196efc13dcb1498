"""Execution engines: how each one runs a pass, as a few physical terms shared across GPU kinds.

    >>> from rpeg.cost.profiles import builtin_profile
    >>> t = engine_terms(Engine.HF, builtin_profile("h100"))
    >>> t.static_batch, t.paged
    (True, False)
    >>> engine_terms(Engine.VLLM, builtin_profile("a100")) == engine_terms(Engine.VLLM,
    ...                                                                  builtin_profile("h20"))
    True

A GPU profile says what the device does (GEMM throughput, memory bandwidth, capacity:
measured or from its datasheet). How fast an engine drives it is the engine's: the host
time each layer of a forward call costs when kernels are launched one by one from Python
(``layer_s``; nothing when decode steps replay CUDA graphs, whose replay costs the host
``graph_step_s`` a step instead), the fixed host work of a decode step (sampling, scheduling, stop checks:
``step_s``), how long its kernels take against the profile's (``work``), the bytes of each
output logit it holds at once (``logits_fwd``, ``logits_train``: bf16 logits with a fused
log-probability kernel hold 2, an fp32 upcast with its log-softmax 10), how much of its
data-parallel and ZeRO traffic hides behind compute (``overlap``), the host time of ZeRO-3's
gather and release hooks per parameter tensor and pass (``hook_s``), and how it batches
generation: a paged KV cache with continuous batching (vLLM), a static batch that keeps
finished sequences until its longest ends (transformers' ``generate``, DeepSpeed's Hybrid
Engine, Megatron-style generation), or rpeg's own torch loop, which drops finished rows.

The terms are the same on every GPU: they are the engine's, not the device's. Their values
were fitted once on the published step times of the calibration set
(``benchmarks/published_fit.py``; no term is per system, per row or per GPU), and
``benchmarks/published.py`` reports how well each source is predicted when its own rows are
left out of that fit. On a CPU profile (``async_launch = 0``: the host runs the kernels)
the torch and vLLM terms are the ones ``rpeg calibrate`` measured on that machine.
"""

from __future__ import annotations

import contextlib

import attrs

from rpeg.spec.model import Engine, GpuProfile


@attrs.frozen
class EngineTerms:
    layer_s: float = 0.0        # host seconds per layer per forward call, kernels launched eagerly
    step_s: float = 0.0         # host seconds per decode step (sampling, scheduling, stop checks)
    graph_step_s: float = 0.0   # host seconds per decode step replayed from a CUDA graph
    work: float = 1.0           # kernel time / the profile's torch kernels
    overlap: float = 0.0        # share of DP / ZeRO communication hidden behind compute
    hook_s: float = 0.0         # host seconds per parameter tensor per pass under ZeRO-3
    paged: bool = False         # generate: KV cache in pages of live tokens, continuous batching
    static_batch: bool = False  # generate: finished sequences stay in the batch until it ends
    kv_copy: bool = False       # generate: the cache grows by concatenation (rewritten each step)
    default_seqs: int = 0       # generate: sequences at once when not pinned (0: what fits)
    logits_chunk: int = 0       # forward / train: tokens whose logits exist at once (0: all)
    logits_fwd: float = 12.0    # bytes per logit value a forward holds (fp32 copies: 12)
    logits_train: float = 12.0  # ... a train step holds, with the logits' gradient
    sequence_parallel: bool = False   # TP ranks split the norms' and residuals' activations


# Fitted on the calibration set by benchmarks/published_fit.py from its PRIOR (results:
# benchmarks/results/published.md, which also reports each source predicted with the terms
# fitted on the others). Kernel speeds (``work``) are against the GPU profile's GEMMs.
ENGINES: dict[Engine, EngineTerms] = {
    Engine.TORCH: EngineTerms(layer_s=400e-6, step_s=3e-3, work=0.8, overlap=0.5,
                              kv_copy=True, logits_fwd=2, logits_train=4),
    Engine.VLLM: EngineTerms(layer_s=150e-6, step_s=6.0e-3, graph_step_s=0.5e-3, work=0.6,
                             paged=True, default_seqs=256),
    Engine.HF: EngineTerms(layer_s=606e-6, step_s=8.5e-3, work=1.0, overlap=0.3, hook_s=40e-6,
                           static_batch=True, kv_copy=True, logits_fwd=10, logits_train=14),
    Engine.HYBRID: EngineTerms(layer_s=282e-6, step_s=95e-3, work=0.6, static_batch=True),
    Engine.DEEPSPEED: EngineTerms(layer_s=400e-6, work=1.42, overlap=0.0, hook_s=2e-3,
                                  logits_fwd=10, logits_train=14),
    Engine.MEGATRON: EngineTerms(layer_s=100e-6, work=5.6, overlap=0.0, logits_fwd=6,
                                 logits_train=10, sequence_parallel=True),
}


def engine_terms(engine: Engine, gpu: GpuProfile) -> EngineTerms:
    """The terms ``engine`` runs with on ``gpu``."""
    if engine is Engine.AUTO:
        engine = Engine.TORCH
    if not gpu.async_launch:                  # a CPU rpeg calibrate measured: its own terms
        if engine is Engine.VLLM:
            layer, step = gpu.vllm_layer_overhead, gpu.vllm_decode_overhead
            return EngineTerms(layer_s=gpu.layer_overhead if layer is None else layer,
                               step_s=gpu.decode_overhead if step is None else step,
                               work=gpu.vllm_work_scale, paged=True)
        return EngineTerms(layer_s=gpu.layer_overhead, step_s=gpu.decode_overhead,
                           kv_copy=True, static_batch=engine in (Engine.HF, Engine.HYBRID))
    return ENGINES[engine]


@contextlib.contextmanager
def engine_table(table: dict[Engine, EngineTerms]):
    """Price with ``table`` instead of the fitted terms while the block runs (the fit of
    ``benchmarks/published_fit.py`` tries candidate terms this way; every cost function
    is keyed by the terms it used, so nothing cached carries over)."""
    saved = dict(ENGINES)
    ENGINES.clear()
    ENGINES.update(table)
    try:
        yield
    finally:
        ENGINES.clear()
        ENGINES.update(saved)


def with_terms(gpu: GpuProfile, t: EngineTerms, decode: bool = False,
               graph: bool = False) -> GpuProfile:
    """``gpu`` as the engine drives it: its host overheads and kernel speed. A pass replayed
    from a CUDA graph costs the host ``graph_step_s`` instead of a launch per layer and a
    call; a decode step also pays the engine's ``step_s`` (sampling, scheduling)."""
    from rpeg.cost.compute import with_work_scale
    out = attrs.evolve(gpu, layer_overhead=0.0 if graph else t.layer_s,
                       call_overhead=t.graph_step_s if graph else gpu.call_overhead,
                       decode_overhead=t.step_s if decode else gpu.decode_overhead)
    return with_work_scale(out, t.work)


__all__ = ["ENGINES", "EngineTerms", "engine_table", "engine_terms", "with_terms"]
