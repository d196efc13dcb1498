"""The torch measurements behind `rpeg calibrate` and the accuracy benchmark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from backends.torch_backend import measure  # noqa: E402
from rpeg.spec.presets import PRESETS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_peak_memory_sees_a_large_allocation():
    with measure.PeakMemory() as mem:
        x = torch.ones(10_000_000)          # 40 MB
        x += 1
        del x
    assert 30e6 < mem.peak < 80e6


def test_ops_are_measured_with_latency_and_peak():
    measure.set_threads(1)
    rows = measure.measure_ops([dict(kind=k, dims=PRESETS["tiny"], batch=2, prompt_len=8,
                                     gen_len=4) for k in ("forward", "generate", "train")],
                               repeats=2)
    for r in rows:
        assert r["latency_s"] > 0 and r["wall_s"] > 0 and len(r["times_s"]) == 2
        assert r["peak_bytes"] >= 0


def test_gemm_and_bandwidth_are_positive():
    assert measure.gemm_seconds(64, 64, 64, repeats=2) > 0
    assert measure.copy_bandwidth(8 * 2**20, repeats=2) > 1e8


def test_unknown_op_kind_is_refused():
    with pytest.raises(ValueError, match="forward, generate, train"):
        measure.op_runner("sleep", PRESETS["tiny"], 1, 1, 1)


@pytest.mark.slow
def test_calibrate_writes_a_profile_that_loads(tmp_path):
    prof, clus = tmp_path / "cpu.rpeg", tmp_path / "local.rpeg"
    r = subprocess.run([sys.executable, "-m", "rpeg", "calibrate", "-o", str(prof), "--cluster",
                        str(clus), "--repeats", "2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    from rpeg.spec import load_cluster
    c = load_cluster(clus)
    assert c.gpu.matmul_flops > 1e9 and c.num_gpus == 2 and c.links[0].bandwidth > 0


@pytest.mark.slow
def test_quick_benchmark_prints_its_mape_last():
    r = subprocess.run([sys.executable, "benchmarks/cost_accuracy.py", "--quick"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("latency MAPE") and "memory MAPE" in last
