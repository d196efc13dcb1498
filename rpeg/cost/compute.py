"""Compute time of transformer passes from the model's real dimensions.

    >>> from rpeg.spec.presets import PRESETS
    >>> from rpeg.cost.profiles import builtin_profile
    >>> gpu = builtin_profile("h100")
    >>> dims = PRESETS["llama3.1-8b"]
    >>> f = forward_flops(dims, tokens=4096, context=4096)     # one 4k sequence
    >>> round(f / 4096 / dims.param_count(), 2)               # ~2 FLOPs per parameter per token
    2.14
    >>> t = pass_time(dims, gpu, tokens=4096, context=2048, bytes_per_value=2)
    >>> 0.05 < t < 0.15                                       # ~7e13 FLOPs at ~790 TFLOPS
    True

Every GEMM is priced on its own: ``max((f + matmul_half) / matmul_flops,
bytes / mem_bandwidth)`` — small GEMMs do not reach the large-GEMM rate, skinny
ones (decode) are bound by reading their weights. Attention adds the sequence
term (QK^T and AV, GQA-aware), elementwise work moves activations through
memory, and every layer and call pays the profile's host-side overheads.
"""

from __future__ import annotations

import functools

import attrs

from rpeg.spec.model import GpuProfile
from rpeg.spec.presets import ModelDims

# Activation values one token moves through memory in one layer's elementwise ops
# (two RMSNorms, rotary on q/k, SiLU * up, two residual adds), per hidden / ffn unit.
_ELEM_PER_HIDDEN = 20
_ELEM_PER_FFN = 4


@attrs.frozen
class Gemm:
    m: int          # rows (tokens)
    n: int          # output features
    k: int          # input features

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k

    def nbytes(self, bpv: float) -> float:
        return bpv * (self.m * self.k + self.k * self.n + self.m * self.n)


def gemm_time(g: Gemm, gpu: GpuProfile, bpv: float) -> float:
    """Seconds for one GEMM on ``gpu``: saturating throughput, or memory-bound."""
    if g.m <= 0 or g.n <= 0 or g.k <= 0:
        return 0.0
    compute = (g.flops * (1 + gpu.matmul_m_half / g.m) + gpu.matmul_half) / gpu.matmul_flops
    memory = g.nbytes(bpv) / gpu.mem_bandwidth
    return max(compute, memory) + gpu.launch_overhead


def layer_gemms(dims: ModelDims, tokens: int, tp: int = 1) -> tuple[Gemm, ...]:
    """The GEMMs of one transformer block on one TP rank (column/row parallel split)."""
    h, kv, f = dims.hidden, dims.kv_dim, dims.ffn
    return (
        Gemm(tokens, h // tp, h),                     # q
        Gemm(tokens, max(kv // tp, dims.head_dim), h),  # k (replicated when tp > kv_heads)
        Gemm(tokens, max(kv // tp, dims.head_dim), h),  # v
        Gemm(tokens, h, h // tp),                     # o
        Gemm(tokens, f // tp, h),                     # gate
        Gemm(tokens, f // tp, h),                     # up
        Gemm(tokens, h, f // tp),                     # down
    )


def head_gemm(dims: ModelDims, tokens: int, tp: int = 1) -> Gemm:
    return Gemm(tokens, dims.vocab // tp, dims.hidden)


def attention_flops(dims: ModelDims, tokens: int, context: float, tp: int = 1) -> float:
    """QK^T and AV for ``tokens`` queries against ``context`` keys each (causal average
    handled by the caller passing the mean context)."""
    return 4.0 * tokens * context * dims.head_dim * max(dims.heads // tp, 1)


def forward_flops(dims: ModelDims, tokens: int, context: float, tp: int = 1,
                  layers: int | None = None, head: bool = True) -> float:
    """FLOPs of one forward pass over ``tokens`` new tokens with ``context`` keys per query."""
    layers = dims.layers if layers is None else layers
    per_layer = sum(g.flops for g in layer_gemms(dims, tokens, tp)) \
        + attention_flops(dims, tokens, context, tp)
    return layers * per_layer + (head_gemm(dims, tokens, tp).flops if head else 0.0)


@functools.lru_cache(maxsize=1 << 16)       # pure; the planner asks the same pass many times
def pass_time(dims: ModelDims, gpu: GpuProfile, *, tokens: int, context: float,
              bytes_per_value: float, tp: int = 1, layers: int | None = None,
              head: bool = True, kv_tokens: float = 0.0, head_tokens: int | None = None,
              kv_copy: bool = False) -> float:
    """Seconds of one forward pass on one device (its ``layers`` and TP shard).

    ``tokens``: new tokens in the pass (batch x sequence); ``context``: keys each query
    attends to on average (S/2 for a causal prefill, the cache length when decoding);
    ``kv_tokens``: cached tokens read from memory (decode), across the batch;
    ``head_tokens``: positions the output head is applied to (default: all ``tokens``);
    ``kv_copy``: the cache grows by concatenation (transformers' DynamicCache), so every
    decode step also rewrites it.
    """
    layers = dims.layers if layers is None else layers
    bpv = bytes_per_value
    gemms = sum(gemm_time(g, gpu, bpv) for g in layer_gemms(dims, tokens, tp))
    attn_f = attention_flops(dims, tokens, context, tp)
    kv_read = kv_tokens * 2 * max(dims.kv_dim // tp, dims.head_dim) * bpv
    attn_rate = gpu.attn_flops or 0.6 * gpu.matmul_flops
    elem_bw = gpu.elem_bandwidth or gpu.mem_bandwidth
    attn = max(attn_f / attn_rate, kv_read / gpu.mem_bandwidth) if attn_f > 0 else 0.0
    elem = tokens * (_ELEM_PER_HIDDEN * dims.hidden + _ELEM_PER_FFN * dims.ffn / tp) \
        * bpv / elem_bw
    if kv_copy:
        elem += 2 * kv_read / elem_bw
    work = layers * (gemms + attn + elem)
    host = layers * gpu.layer_overhead + gpu.call_overhead
    if head:
        ht = tokens if head_tokens is None else head_tokens
        work += gemm_time(head_gemm(dims, ht, tp), gpu, bpv)
        work += 3 * ht * dims.vocab / tp * 4 / elem_bw      # fp32 logits, log-softmax, exp
    return max(work, host) if gpu.async_launch else work + host


def with_work_scale(gpu: GpuProfile, scale: float) -> GpuProfile:
    """``gpu`` on which a pass's compute and memory work takes ``scale`` times as long (an
    engine's own kernels: vLLM's decode against the profile's torch ops); host overheads
    are unchanged.

    >>> g = GpuProfile("cpu", matmul_flops=1e11, mem_bandwidth=1e10, layer_overhead=1e-4)
    >>> h = with_work_scale(g, 0.5)
    >>> h.matmul_flops, h.mem_bandwidth, h.layer_overhead
    (200000000000.0, 20000000000.0, 0.0001)
    """
    if scale <= 0 or scale == 1.0:
        return gpu
    rates = ("peak_flops", "matmul_flops", "attn_flops", "hbm_bandwidth", "mem_bandwidth",
             "elem_bandwidth")
    return attrs.evolve(gpu, **{r: getattr(gpu, r) / scale for r in rates if getattr(gpu, r)})


def optimizer_time(params: float, tensors: int, gpu: GpuProfile) -> float:
    """Adam over ``params`` local parameters in ``tensors`` tensors: stream 7 values each
    (read p, g, m, v; write p, m, v) in fp32, plus a per-tensor host cost."""
    return params * 7 * 4 / gpu.mem_bandwidth + tensors * gpu.optimizer_tensor_overhead


def param_tensors(dims: ModelDims, layers: int | None = None) -> int:
    """Parameter tensors (for per-tensor overheads): 9 per block plus embeddings and norm."""
    layers = dims.layers if layers is None else layers
    per_layer = 9 + (3 if dims.qkv_bias else 0)
    return layers * per_layer + (2 if dims.tied_embeddings else 3)
