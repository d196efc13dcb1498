"""Trainer parameters to vLLM: names mapped, tensors grouped into buckets.

    >>> import numpy as np
    >>> named = [("backbone.layers.0.mlp.up_proj.weight", np.zeros((4, 4), np.float32)),
    ...          ("value_head.weight", np.zeros((1, 4), np.float32)),
    ...          ("lm_head.weight", np.zeros((8, 4), np.float32))]
    >>> [[name for name, _ in b] for b in buckets(named, bucket_bytes=100)]
    [['model.layers.0.mlp.up_proj.weight'], ['lm_head.weight']]

The torch backend's policy model names its backbone ``backbone.*`` and may
carry a value head; vLLM's model classes read Hugging Face names
(``model.*``, ``lm_head.*``) and have no value head. A bucket is a list of
(name, tensor) pairs whose sizes add up to at most ``bucket_bytes`` (a single
larger tensor gets a bucket of its own): one message per bucket, not one per
tensor, and bounded memory on the receiving side. With tied embeddings
``lm_head.weight`` is sent too, although it is the input embedding again:
vLLM's layerwise reload restores the old weights of a layer that receives
nothing, and its output head is such a layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from rpeg.cost.engine_sync import SYNC_BUCKET_BYTES

DEFAULT_BUCKET_BYTES = SYNC_BUCKET_BYTES      # the bucket the cost model prices a sync by

# Parameters the generation engine has no place for.
_SKIP_PREFIXES = ("value_head.",)
_RENAMES = (("backbone.", "model."),)


def vllm_name(name: str) -> str | None:
    """The Hugging Face name vLLM loads for a trainer parameter, or None to skip it."""
    if name.startswith(_SKIP_PREFIXES):
        return None
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def nbytes(tensor: Any) -> int:
    """Size in bytes of a torch tensor or numpy array."""
    if hasattr(tensor, "nbytes"):
        return int(tensor.nbytes)
    return int(tensor.numel() * tensor.element_size())


def buckets(named_tensors: Iterable[tuple[str, Any]],
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[list[tuple[str, Any]]]:
    """Group (vLLM name, tensor) pairs into buckets of at most ``bucket_bytes`` each."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, not {bucket_bytes}")
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in named_tensors:
        target = vllm_name(name)
        if target is None:
            continue
        n = nbytes(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((target, tensor))
        size += n
    if bucket:
        yield bucket

