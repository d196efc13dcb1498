"""The shipped local CPU profile carries vLLM's measured generation overheads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rpeg.spec import load_cluster

ROOT = Path(__file__).resolve().parents[2]


def test_local_cpu_profile_has_the_measured_vllm_overheads():
    measured = json.loads((ROOT / "benchmarks/results/generation.json").read_text())["profile"]
    gpu = load_cluster(ROOT / "pipelines/clusters/local_cpu.rpeg").gpu
    for key in ("vllm_layer_overhead", "vllm_decode_overhead"):
        assert getattr(gpu, key) == pytest.approx(measured[key], rel=1e-3), key
