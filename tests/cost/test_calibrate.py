"""The calibration fit recovers known coefficients; shipped profiles are well formed."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from rpeg.cost.calibrate import cpu_cluster, fit_gemm, fit_link, fit_profile, mape, predict_op
from rpeg.cost.profiles import PROFILE_DIR, builtin_profile, load_profile, profile_text
from rpeg.spec.model import GpuProfile, Level, Link
from rpeg.spec.presets import PRESETS, ModelDims

TRUE = GpuProfile("cpu", memory=8e9, peak_flops=1e11, matmul_flops=1e11, matmul_half=1e5,
                  matmul_m_half=5.0, mem_bandwidth=2e10, hbm_bandwidth=2e10,
                  elem_bandwidth=3e9, attn_flops=6e9, launch_overhead=0.0,
                  layer_overhead=1e-4, call_overhead=3e-4, decode_overhead=2e-4,
                  backward_factor=2.2, optimizer_tensor_overhead=3e-5, sample_overhead=2e-5,
                  async_launch=0.0, compute_bytes=4.0, act_factor=0.5, runtime_memory=1e6,
                  extra=(("grads_freed", 1.0),))
LINK = Link(Level.GPU, 1.5e9, 1e-4)
DIMS = {"tiny": PRESETS["tiny"], "tiny-vllm": PRESETS["tiny-vllm"],
        "tiny4": ModelDims("llama", 4, 64, 4, 2, 128, 259)}


def _synthetic() -> dict:
    """Measurements as the true profile would produce them (noise-free)."""
    shapes = [(64, 64, 64), (256, 256, 256), (1024, 1024, 1024), (8, 1024, 1024), (32, 512, 512)]
    gemm = [{"m": m, "n": n, "k": k, "seconds": (2.0 * m * n * k * (1 + 5.0 / m) + 1e5) / 1e11}
            for m, n, k in shapes]
    ar = [{"bytes": b, "seconds": 2e-4 + b / 1.5e9} for b in (2**16, 2**20, 2**24)]
    ops = []
    cluster = cpu_cluster(TRUE, LINK)
    for name, dims in DIMS.items():
        for kind, b, p, g in (("forward", 4, 32, 32), ("forward", 16, 64, 32),
                              ("generate", 4, 16, 16), ("generate", 16, 32, 24),
                              ("train", 4, 32, 32), ("train", 16, 32, 16)):
            t, mem = predict_op(kind, dims, b, p, g, cluster)
            ops.append({"kind": kind, "model": name, "dims": attrs.asdict(dims), "batch": b,
                        "prompt_len": p, "gen_len": g, "latency_s": t, "peak_bytes": mem})
    opt = []
    for dims in DIMS.values():
        n = dims.param_count()
        tensors = dims.layers * 9 + 3
        opt.append({"params": n, "tensors": tensors,
                    "seconds": n * 28 / 2e10 + tensors * 3e-5})
    return {"gemm": gemm, "allreduce": ar, "ops": ops, "optimizer": opt, "copy_bandwidth": 2e10,
            "sample_s": 2e-5, "threads": 1, "torch": "x",
            "machine": {"memory_bytes": 16e9, "cpu": "test", "cores": 2, "loadavg": [0.0]}}


def test_gemm_and_link_fits_recover_the_truth():
    m = _synthetic()
    peak, half, m_half = fit_gemm(m["gemm"])
    assert (peak, half, m_half) == pytest.approx((1e11, 1e5, 5.0), rel=1e-6)
    link = fit_link(m["allreduce"])
    assert (link.bandwidth, link.latency) == pytest.approx((1.5e9, 1e-4), rel=1e-6)


def test_profile_fit_reproduces_the_measurements():
    fit = fit_profile(_synthetic())
    assert max(abs(r) for _, r in fit.residuals) < 0.02
    p = fit.profile
    assert p.layer_overhead + p.call_overhead > 0
    assert p.backward_factor == pytest.approx(2.2, rel=0.05)
    assert p.act_factor == pytest.approx(0.5, rel=0.05)
    assert p.runtime_memory == pytest.approx(1e6, rel=0.05)


def test_mape():
    assert mape([(110, 100), (90, 100)]) == pytest.approx(10.0)
    assert np.isnan(mape([]))


def test_profile_text_reads_back(tmp_path):
    path = tmp_path / "p.rpeg"
    path.write_text(profile_text(TRUE))
    back = load_profile(path)
    for f in attrs.fields(GpuProfile):
        if "unit" in f.metadata:
            assert getattr(back, f.name) == pytest.approx(getattr(TRUE, f.name), rel=1e-3), f.name


@pytest.mark.parametrize("name", ["gh200", "h100", "h200", "a100"])
def test_gpu_profiles_cite_measured_figures(name):
    p = builtin_profile(name)
    assert "MAMF" in p.source or "Maximum Achievable Matmul" in p.source
    assert 0.6 * p.peak_flops < p.matmul_flops < p.peak_flops
    assert 0.8 * p.hbm_bandwidth < p.mem_bandwidth < p.hbm_bandwidth
    assert p.memory >= 80e9


def test_local_cpu_profile_is_calibrated():
    p = load_profile(PROFILE_DIR / "local_cpu.rpeg")
    assert "rpeg calibrate" in p.source
    assert p.compute_bytes == 4 and p.async_launch == 0
    assert p.matmul_flops > 1e9 and p.get("gloo_bandwidth") > 0
