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

A mixture-of-experts layer runs its router and, for each of the experts a device holds
(``experts / ep``, or all of them split ``tp`` ways without expert parallelism), a GEMM
over the tokens routed to it: ``tokens x active / experts`` rows each, so a decode step
reads every local expert's weights while computing with few rows. Latent attention
(DeepSeek-V3) projects queries and keys through their compressed widths and reads the
compressed cache. FP8 weights (``wbytes = 1``) run at the profile's ``fp8_flops``.
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

    def nbytes(self, bpv: float, wbpv: float | None = None) -> float:
        w = bpv if wbpv is None else wbpv
        return bpv * (self.m * self.k + self.m * self.n) + w * self.k * self.n


def gemm_time(g: Gemm, gpu: GpuProfile, bpv: float, wbpv: float | None = None,
              count: int = 1, touched: float | None = None) -> float:
    """Seconds for ``count`` GEMMs of this shape on ``gpu``, as one grouped GEMM (one launch,
    as a mixture of experts' kernels run its experts: vLLM's fused MoE, Megatron's grouped
    GEMM): saturating throughput, the shape's shortfall from it paid once for the whole
    group (its tiles fill the device together), or memory-bound (weights of ``wbpv``
    bytes, FP8 at the profile's FP8 rate), the weights read of only the ``touched``
    members that have rows (default: all ``count``).

    >>> from rpeg.spec.model import GpuProfile
    >>> g = GpuProfile("g", matmul_flops=1e12, mem_bandwidth=1e11, matmul_half=1e6)
    >>> one = gemm_time(Gemm(2, 1000, 1000), g, 2)
    >>> round(one * 1e6, 2), round(gemm_time(Gemm(2, 1000, 1000), g, 2, count=8) * 1e6, 2)
    (25.08, 165.64)
    >>> round(gemm_time(Gemm(2, 1000, 1000), g, 2, count=8, touched=2) * 1e6, 2)
    45.64
    """
    if g.m <= 0 or g.n <= 0 or g.k <= 0 or count <= 0:
        return 0.0
    rate = gpu.fp8_flops if wbpv == 1 and gpu.fp8_flops else gpu.matmul_flops
    compute = (count * g.flops * (1 + gpu.matmul_m_half / g.m) + gpu.matmul_half) / rate
    memory = _group_bytes(g, bpv, wbpv, count, touched) / gpu.mem_bandwidth
    return max(compute, memory) + gpu.launch_overhead


def _group_bytes(g: Gemm, bpv: float, wbpv: float | None, count: int,
                 touched: float | None) -> float:
    """Bytes a grouped GEMM of ``count`` members moves: every member's activations, the
    weights of the ``touched`` ones (default: all)."""
    w = bpv if wbpv is None else wbpv
    read = count if touched is None else touched
    return count * bpv * (g.m * g.k + g.m * g.n) + read * w * g.k * g.n


def experts_touched(dims: ModelDims, tokens: int, ep: int) -> float:
    """Expected routed experts of one device that at least one of the ``tokens`` (each
    choosing ``active_experts`` of ``experts``; ``tokens x ep`` reach a device's experts
    under expert parallelism) is routed to: a decode step of a few sequences reads few
    experts' weights, a long prefill all of them."""
    local = dims.experts // ep if ep > 1 else dims.experts
    miss = (1.0 - dims.active_experts / dims.experts) ** (tokens * ep)
    return local * (1.0 - miss)


def layer_gemms(dims: ModelDims, tokens: int, tp: int = 1) -> tuple[Gemm, ...]:
    """The attention and dense-MLP GEMMs of one transformer block on one TP rank
    (column/row parallel split)."""
    return attention_gemms(dims, tokens, tp) + mlp_gemms(dims, tokens, dims.ffn, tp)


def attention_gemms(dims: ModelDims, tokens: int, tp: int = 1) -> tuple[Gemm, ...]:
    h, kv, q = dims.hidden, dims.kv_dim, dims.heads * dims.head_dim
    if dims.mla:
        heads = max(dims.heads // tp, 1)
        nope = dims.head_dim - dims.rope_dim
        qs = (Gemm(tokens, dims.q_lora, h), Gemm(tokens, heads * dims.head_dim, dims.q_lora)) \
            if dims.q_lora else (Gemm(tokens, heads * dims.head_dim, h),)
        return qs + (Gemm(tokens, dims.kv_lora + dims.rope_dim, h),          # latent kv
                     Gemm(tokens, heads * (nope + dims.v_head), dims.kv_lora),  # k, v up
                     Gemm(tokens, h, heads * dims.v_head))                  # o
    return (
        Gemm(tokens, q // tp, h),                                # q
        Gemm(tokens, max(kv // tp, dims.head_dim), h),           # k (replicated when tp > kv_heads)
        Gemm(tokens, max(kv // tp, dims.head_dim), h),           # v
        Gemm(tokens, h, q // tp),                                # o
    )


def mlp_gemms(dims: ModelDims, tokens: int, width: int, tp: int = 1) -> tuple[Gemm, ...]:
    """A (gated) MLP of ``width``: gate, up, down (a plain MLP: up, down)."""
    h = dims.hidden
    up = (Gemm(tokens, width // tp, h),) * (2 if dims.gated else 1)
    return up + (Gemm(tokens, h, width // tp),)


def moe_time(dims: ModelDims, gpu: GpuProfile, tokens: int, bpv: float, tp: int, ep: int,
             wbpv: float | None = None) -> float:
    """Seconds of one MoE block's MLP on one device: the router, the routed tokens through
    each local expert, the shared experts."""
    local = dims.experts // ep if ep > 1 else dims.experts
    split = 1 if ep > 1 else tp
    rows = max(int(round(tokens * ep * dims.active_experts / dims.experts)), 1)
    t = gemm_time(Gemm(tokens, dims.experts, dims.hidden), gpu, bpv, wbpv)
    touched = experts_touched(dims, tokens, ep)
    t += sum(gemm_time(g, gpu, bpv, wbpv, count=local, touched=touched)
             for g in mlp_gemms(dims, rows, dims.expert_ffn, split))
    if dims.shared_experts:
        t += sum(gemm_time(g, gpu, bpv, wbpv)
                 for g in mlp_gemms(dims, tokens, dims.expert_ffn * dims.shared_experts, tp))
    return t


def moe_flops(dims: ModelDims, tokens: int, tp: int = 1) -> float:
    """FLOPs of one MoE block's MLP over ``tokens`` (the active experts)."""
    width = dims.expert_ffn * (dims.active_experts + dims.shared_experts)
    return sum(g.flops for g in mlp_gemms(dims, tokens, width, tp)) \
        + 2.0 * tokens * dims.experts * dims.hidden


def head_gemm(dims: ModelDims, tokens: int, tp: int = 1) -> Gemm:
    return Gemm(tokens, dims.vocab // tp, dims.hidden)


def attention_flops(dims: ModelDims, tokens: int, context: float, tp: int = 1) -> float:
    """QK^T and AV for ``tokens`` queries against ``context`` keys each (causal average
    handled by the caller passing the mean context)."""
    v = dims.v_head or dims.head_dim
    return 2.0 * tokens * context * (dims.head_dim + v) * max(dims.heads // tp, 1)


def forward_flops(dims: ModelDims, tokens: int, context: float, tp: int = 1,
                  layers: int | None = None, head: bool = True) -> float:
    """FLOPs of one forward pass over ``tokens`` new tokens with ``context`` keys per query
    (a mixture of experts: its active experts)."""
    layers = dims.layers if layers is None else layers
    attn = sum(g.flops for g in attention_gemms(dims, tokens, tp)) \
        + attention_flops(dims, tokens, context, tp)
    dense = sum(g.flops for g in mlp_gemms(dims, tokens, dims.ffn, tp))
    share = dims.moe_layers / dims.layers
    mlp = (1 - share) * dense + (share * moe_flops(dims, tokens, tp) if share else 0.0)
    return layers * (attn + mlp) + (head_gemm(dims, tokens, tp).flops if head else 0.0)


@attrs.frozen
class Roof:
    """What device work computes and moves: its FLOPs (GEMMs and attention) and the bytes
    it reads and writes in device memory (weights, activations, KV cache). Its time is
    at least ``flops / peak_flops`` and ``bytes / hbm_bandwidth`` (the roofline);
    :func:`utilisation` says how close an op comes.

    >>> (Roof(2.0, 4.0) + Roof(1.0, 1.0)).scaled(2)
    Roof(flops=6.0, bytes=10.0)
    """

    flops: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: Roof) -> Roof:
        return Roof(self.flops + other.flops, self.bytes + other.bytes)

    def scaled(self, k: float) -> Roof:
        return Roof(self.flops * k, self.bytes * k)


@attrs.frozen
class PassCost:
    time_s: float
    roof: Roof


def pass_time(dims: ModelDims, gpu: GpuProfile, **kw) -> float:
    """Seconds of one forward pass on one device (:func:`pass_cost`)."""
    return pass_cost(dims, gpu, **kw).time_s


@functools.lru_cache(maxsize=1 << 16)       # pure; the planner asks the same pass many times
def pass_cost(dims: ModelDims, gpu: GpuProfile, *, tokens: int, context: float,
              bytes_per_value: float, tp: int = 1, layers: int | None = None,
              head: bool = True, kv_tokens: float = 0.0, head_tokens: int | None = None,
              kv_copy: bool = False, ep: int = 1, weight_bytes: float | None = None,
              logit_bytes: float = 12.0) -> PassCost:
    """Seconds of one forward pass on one device (its ``layers`` and TP shard), and its
    FLOPs and memory traffic.

    ``tokens``: new tokens in the pass (batch x sequence); ``context``: keys each query
    attends to on average (S/2 for a causal prefill, the cache length when decoding);
    ``kv_tokens``: cached tokens read from memory (decode), across the batch;
    ``head_tokens``: positions the output head is applied to (default: all ``tokens``);
    ``kv_copy``: the cache grows by concatenation (transformers' DynamicCache), so every
    decode step also rewrites it. ``ep``: the expert-parallel degree of a mixture of
    experts; ``weight_bytes``: bytes per weight when not ``bytes_per_value`` (FP8: 1);
    ``logit_bytes``: the memory traffic per output logit of what follows the head's GEMM
    (:class:`rpeg.cost.engines.LossTraffic`; 12: one float32 pass written, read and
    exponentiated).
    """
    layers = dims.layers if layers is None else layers
    bpv, wbpv = bytes_per_value, weight_bytes
    wb = bpv if wbpv is None else wbpv
    att = attention_gemms(dims, tokens, tp)
    gemms = sum(gemm_time(g, gpu, bpv, wbpv) for g in att)
    roof = _roof(att, bpv, wb)
    if dims.moe:
        share = dims.moe_layers / dims.layers
        dense_g = mlp_gemms(dims, tokens, dims.ffn, tp) if dims.ffn else ()
        dense = sum(gemm_time(g, gpu, bpv, wbpv) for g in dense_g)
        gemms += share * moe_time(dims, gpu, tokens, bpv, tp, ep, wbpv) + (1 - share) * dense
        roof += moe_roof(dims, tokens, bpv, tp, ep, wb).scaled(share) \
            + _roof(dense_g, bpv, wb).scaled(1 - share)
    else:
        mlp = mlp_gemms(dims, tokens, dims.ffn, tp)
        gemms += sum(gemm_time(g, gpu, bpv, wbpv) for g in mlp)
        roof += _roof(mlp, bpv, wb)
    attn_f = attention_flops(dims, tokens, context, tp)
    per_token = dims.kv_values_per_token() if dims.mla else \
        2 * max(dims.kv_dim // tp, dims.head_dim)
    kv_read = kv_tokens * per_token * bpv
    attn_rate = gpu.attn_flops or 0.6 * gpu.matmul_flops
    elem_bw = gpu.elem_bandwidth or gpu.mem_bandwidth
    attn = max(attn_f / attn_rate, kv_read / gpu.mem_bandwidth) if attn_f > 0 else 0.0
    width = dims.expert_ffn * (dims.active_experts + dims.shared_experts) if dims.moe \
        else dims.ffn
    elem_bytes = tokens * (_ELEM_PER_HIDDEN * dims.hidden + _ELEM_PER_FFN * width / tp) * bpv
    if kv_copy:
        elem_bytes += 2 * kv_read
    elem = elem_bytes / elem_bw
    roof += Roof(attn_f, (kv_read if attn_f > 0 else 0.0) + elem_bytes)
    work = layers * (gemms + attn + elem)
    roof = roof.scaled(layers)
    # a tensor-parallel layer's host work beyond its own: DTensor's dispatch of the split
    # projections, the ranks' waits at the all-reduces (a CPU profile's measured term)
    host = layers * (gpu.layer_overhead + (gpu.tp_layer_overhead if tp > 1 else 0.0)) \
        + gpu.call_overhead
    if head:
        ht = tokens if head_tokens is None else head_tokens
        hg = head_gemm(dims, ht, tp)
        logits = ht * dims.vocab / tp * logit_bytes
        work += gemm_time(hg, gpu, bpv, wbpv) + logits / elem_bw
        roof += _roof((hg,), bpv, wb) + Roof(0.0, logits)
    return PassCost(max(work, host) if gpu.async_launch else work + host, roof)


def _roof(gemms, bpv: float, wb: float, count: int = 1) -> Roof:
    return Roof(count * sum(g.flops for g in gemms),
                count * sum(g.nbytes(bpv, wb) for g in gemms))


def moe_roof(dims: ModelDims, tokens: int, bpv: float, tp: int, ep: int, wb: float) -> Roof:
    """FLOPs and bytes of one MoE block's MLP on one device, as :func:`moe_time` prices it."""
    local = dims.experts // ep if ep > 1 else dims.experts
    split = 1 if ep > 1 else tp
    rows = max(int(round(tokens * ep * dims.active_experts / dims.experts)), 1)
    touched = experts_touched(dims, tokens, ep)
    experts = mlp_gemms(dims, rows, dims.expert_ffn, split)
    out = _roof((Gemm(tokens, dims.experts, dims.hidden),), bpv, wb) \
        + Roof(local * sum(g.flops for g in experts),
               sum(_group_bytes(g, bpv, wb, local, touched) for g in experts))
    if dims.shared_experts:
        out += _roof(mlp_gemms(dims, tokens, dims.expert_ffn * dims.shared_experts, tp),
                     bpv, wb)
    return out


def utilisation(roof: Roof, seconds: float, devices: int, gpu: GpuProfile,
                fp8: bool = False) -> tuple[float, float]:
    """(MFU, MBU) of ``roof`` done in ``seconds`` on ``devices`` devices: the achieved
    fraction of the datasheet's dense peak compute (``peak_flops``; an FP8 model's against
    twice it, the dense FP8 peak of the GPUs that have one) and of its memory bandwidth
    (``hbm_bandwidth``). Each is at most 1 for any op the cost model prices.

    >>> g = GpuProfile("g", peak_flops=1e12, hbm_bandwidth=1e11)
    >>> utilisation(Roof(5e11, 2e10), 1.0, 1, g)
    (0.5, 0.2)
    """
    if seconds <= 0 or devices <= 0:
        return 0.0, 0.0
    peak = gpu.peak_flops * (2 if fp8 else 1)
    mfu = roof.flops / (seconds * devices * peak) if peak > 0 else 0.0
    mbu = roof.bytes / (seconds * devices * gpu.hbm_bandwidth) if gpu.hbm_bandwidth > 0 \
        else 0.0
    return mfu, mbu


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
    return optimizer_bytes(params) / gpu.mem_bandwidth + tensors * gpu.optimizer_tensor_overhead


def optimizer_bytes(params: float) -> float:
    """Bytes Adam streams through device memory for ``params`` parameters."""
    return params * 7 * 4


def param_tensors(dims: ModelDims, layers: int | None = None) -> int:
    """Parameter tensors (for per-tensor overheads): 9 per block plus embeddings and norm
    (and each expert's, the QK norms', the latent projections')."""
    layers = dims.layers if layers is None else layers
    per_layer = (9 if dims.gated else 8) + (3 if dims.qkv_bias else 0) \
        + (2 if dims.qk_norm else 0) + (4 if dims.mla else 0)
    if dims.moe:
        per_layer += round(dims.moe_layers / dims.layers
                           * (1 + 3 * (dims.experts + dims.shared_experts)))
    return layers * per_layer + (2 if dims.tied_embeddings else 3)
