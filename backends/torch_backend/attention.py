"""Attention over packed sequences: one row holding several sequences, each attending only
to itself, with no padding and no row-by-row mask.

    >>> import torch
    >>> q = torch.randn(1, 2, 5, 4)                     # [batch 1, heads, 3 + 2 tokens, dim]
    >>> pos = torch.tensor([[0, 1, 2, 0, 1]])           # two sequences, positions restart
    >>> out, _ = packed_attention(None, q, q, q, None, scaling=0.5, position_ids=pos)
    >>> out.shape                                       # [batch, tokens, heads, dim]
    torch.Size([1, 5, 2, 4])

A row of packed sequences (:class:`backends.torch_backend.batching.Flat`) is run with
``attn_implementation = "rpeg_packed"``, registered with transformers'
``AttentionInterface``: transformers builds no mask for it, and each sequence — found where
the position ids restart at 0 — is attended causally on its own. On CUDA that is one
variable-length flash-attention call (``torch.nn.attention.varlen``) when the installed
torch has it; otherwise (and on a CPU) one ``scaled_dot_product_attention`` call per
sequence. Either way the work is each sequence's own length squared, as the cost model
prices packed sequences, never the row's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

NAME = "rpeg_packed"


def _bounds(position_ids: torch.Tensor) -> list[int]:
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist()
    return starts + [int(position_ids.shape[-1])]


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """transformers' attention signature: ``query`` [1, H, S, D], ``key``/``value``
    [1, KV, S, D]; returns ([1, S, H, D], None)."""
    bounds = _bounds(kwargs["position_ids"])
    gqa = query.shape[1] != key.shape[1]
    if query.is_cuda and (out := _varlen(query, key, value, bounds, scaling, gqa)) is not None:
        return out, None
    parts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                            is_causal=True, scale=scaling, enable_gqa=gqa)
             for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    return torch.cat(parts, dim=2).transpose(1, 2).contiguous(), None


def _varlen(query, key, value, bounds, scaling, gqa):
    """One flash-attention call over every sequence, or None where torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))      # [S, H, D]
    try:
        out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scaling,
                          window_size=(-1, 0), enable_gqa=gqa)
    except (TypeError, RuntimeError):
        return None
    return out[None]


def register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(NAME, packed_attention)     # no mask function: none is built


@contextlib.contextmanager
def packed(config):
    """Run the model whose ``config`` this is on packed rows inside the block."""
    register()
    saved = config._attn_implementation
    config._attn_implementation = NAME
    try:
        yield
    finally:
        config._attn_implementation = saved


__all__ = ["NAME", "packed", "packed_attention", "register"]
