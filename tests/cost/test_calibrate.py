"""The calibration fit recovers known coefficients; shipped profiles are well formed."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from rpeg.cost.calibrate import (
    MALLOC_ENV,
    Fit,
    allocator,
    clean_env,
    contention_in_range,
    cpu_cluster,
    empirical,
    fit_gemm,
    fit_host,
    fit_link,
    fit_profile,
    keep_unmeasured,
    mape,
    predict_op,
    worker_env,
)
from rpeg.cost.profiles import PROFILE_DIR, builtin_profile, load_profile, profile_text
from rpeg.errors import CostError
from rpeg.spec.model import GpuProfile, Level, Link
from rpeg.spec.presets import PRESETS, ModelDims

TRUE = GpuProfile("cpu", memory=8e9, peak_flops=1e11, matmul_flops=1e11, matmul_half=1e5,
                  matmul_m_half=5.0, mem_bandwidth=2e10, hbm_bandwidth=2e10,
                  elem_bandwidth=3e9, attn_flops=6e9, launch_overhead=0.0,
                  layer_overhead=1e-4, call_overhead=3e-4, decode_overhead=2e-4,
                  backward_factor=2.2, optimizer_tensor_overhead=3e-5, sample_overhead=2e-5,
                  async_launch=0.0, compute_bytes=4.0, act_factor=0.5, runtime_memory=1e6,
                  grads_freed=1.0)
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


def test_packed_ops_fit_the_per_sequence_attention_call():
    """Packed ops (each sequence its own attention call per layer, on a CPU) measured as a
    profile with ``packed_seq_overhead`` would produce them: the fit recovers it, and a
    calibration without packed ops leaves it unmeasured (0, the GPU profiles' value)."""
    from rpeg.graph.layout import Layout
    truth = attrs.evolve(TRUE, packed_seq_overhead=4e-5)
    m = _synthetic()
    cluster = cpu_cluster(truth, LINK)
    rng = np.random.default_rng(0)
    for name, dims in DIMS.items():
        for kind, b, p, g in (("forward", 16, 32, 32), ("train", 16, 32, 16),
                              ("train", 48, 8, 20)):
            lengths = sorted(int(n) for n in rng.integers(1, g + 1, b))
            t, mem = predict_op(kind, dims, b, p, g, cluster, Layout(packing=True),
                                lengths=lengths)
            m["ops"].append({"kind": kind, "model": name, "dims": attrs.asdict(dims),
                             "batch": b, "prompt_len": p, "gen_len": g, "packed": True,
                             "lengths": lengths, "latency_s": t, "peak_bytes": mem})
    fit = fit_profile(m)
    assert fit.profile.packed_seq_overhead == pytest.approx(4e-5, rel=0.05)
    assert "packed_seq_overhead" in fit.measured
    assert max(abs(r) for _, r in fit.residuals) < 0.02
    assert fit_profile(_synthetic()).profile.packed_seq_overhead == 0.0


def _dp_train(truth: GpuProfile, shapes) -> list[dict]:
    """``dp_train`` rows as ``truth`` would produce them: train ops of tiny and tiny4 on
    two devices at ZeRO 0, 2 and 3, in each of ``shapes`` (batch, prompt, response,
    micro-batches; those of several at ZeRO 2-3 only, as the calibration measures them)."""
    from rpeg.graph.layout import Layout
    cluster = cpu_cluster(truth, LINK)
    rows = []
    for name in ("tiny", "tiny4"):
        for zero in (0, 2, 3):
            for b, p, g, mb in shapes:
                if mb > 1 and not zero:
                    continue
                t, _ = predict_op("train", DIMS[name], b, p, g, cluster,
                                  Layout(dp=2, zero=zero, microbatches=mb), devices=(0, 1))
                rows.append({"kind": "train", "model": name, "dims": attrs.asdict(DIMS[name]),
                             "batch": b, "prompt_len": p, "gen_len": g, "dp": 2, "zero": zero,
                             **({"microbatches": mb} if mb > 1 else {}), "latency_s": t})
    return rows


def test_sharded_train_ops_fit_the_per_tensor_host_work():
    """Data-parallel train ops on two devices (DDP, FSDP2 ZeRO-2 and ZeRO-3) measured as a
    profile with ``dp_tensor_overhead`` and ``shard_tensor_overhead`` would produce them:
    the fit recovers both (the second from the sharded ones alone), and a calibration
    without such ops leaves them unmeasured (0, the GPU profiles' value)."""
    truth = attrs.evolve(TRUE, dp_tensor_overhead=1e-4, shard_tensor_overhead=5e-4)
    m = _synthetic()
    m["dp_train"] = _dp_train(truth, ((16, 32, 16, 1), (48, 8, 20, 1)))
    fit = fit_profile(m)
    assert fit.profile.dp_tensor_overhead == pytest.approx(1e-4, rel=0.05)
    assert fit.profile.shard_tensor_overhead == pytest.approx(5e-4, rel=0.05)
    assert {"dp_tensor_overhead", "shard_tensor_overhead"} <= fit.measured
    assert "shard_layer_overhead" not in fit.measured         # no op in two micro-batches
    assert max(abs(r) for _, r in fit.residuals) < 0.02
    assert len([k for k, _ in fit.residuals if "zero 0" in k]) == 4
    plain = fit_profile(_synthetic()).profile
    assert plain.dp_tensor_overhead == plain.shard_tensor_overhead == 0.0


def test_sharded_train_ops_in_two_micro_batches_fit_the_per_layer_calls():
    """FSDP2 train ops in one micro-batch and in two, measured as a profile with
    ``shard_layer_overhead`` (its calls per layer per micro-batch) would produce them: the
    fit tells it from the per-tensor terms, which are paid once a step."""
    truth = attrs.evolve(TRUE, dp_tensor_overhead=1e-4, shard_tensor_overhead=5e-4,
                         shard_layer_overhead=3e-3)
    m = _synthetic()
    m["dp_train"] = _dp_train(truth, ((16, 32, 16, 1), (48, 8, 20, 1), (16, 32, 16, 2)))
    fit = fit_profile(m)
    assert fit.profile.shard_layer_overhead == pytest.approx(3e-3, rel=0.05)
    assert fit.profile.shard_tensor_overhead == pytest.approx(5e-4, rel=0.05)
    assert "shard_layer_overhead" in fit.measured
    assert max(abs(r) for _, r in fit.residuals) < 0.02
    assert len([k for k, _ in fit.residuals if " mb2" in k]) == 4


def test_tensor_parallel_ops_fit_the_per_layer_host_work():
    """Ops split over two devices (forward, generate, train at tp = 2) measured as a
    profile with ``tp_layer_overhead`` would produce them: the fit recovers it from models
    of 2 and 4 layers, and a calibration without such ops leaves it unmeasured (0)."""
    from rpeg.graph.layout import Layout
    truth = attrs.evolve(TRUE, tp_layer_overhead=3e-3)
    m = _synthetic()
    cluster = cpu_cluster(truth, LINK)
    m["tp_ops"] = []
    for name in ("tiny", "tiny4"):
        for kind, b, p, g in (("forward", 16, 32, 32), ("generate", 48, 8, 20),
                              ("train", 16, 32, 16), ("train", 48, 8, 20)):
            t, _ = predict_op(kind, DIMS[name], b, p, g, cluster, Layout(tp=2),
                              devices=(0, 1))
            m["tp_ops"].append({"kind": kind, "model": name, "dims": attrs.asdict(DIMS[name]),
                                "batch": b, "prompt_len": p, "gen_len": g, "tp": 2,
                                "latency_s": t})
    fit = fit_profile(m)
    assert fit.profile.tp_layer_overhead == pytest.approx(3e-3, rel=0.05)
    assert "tp_layer_overhead" in fit.measured
    assert max(abs(r) for _, r in fit.residuals) < 0.02
    assert len([k for k, _ in fit.residuals if " tp2 " in k]) == 8
    assert fit_profile(_synthetic()).profile.tp_layer_overhead == 0.0


def test_mape():
    assert mape([(110, 100), (90, 100)]) == pytest.approx(10.0)
    assert np.isnan(mape([]))


@pytest.mark.parametrize("measured", [{}, {"vllm_layer_overhead": 7e-5, "dispatch_s": 2e-3,
                                          "host_cores": 2.0, "compute_token_time": 3e-7}])
def test_profile_text_reads_back(tmp_path, measured):
    p = attrs.evolve(TRUE, **measured)
    path = tmp_path / "p.rpeg"
    path.write_text(profile_text(p))
    back = load_profile(path)
    for f in attrs.fields(GpuProfile):
        want = getattr(p, f.name)
        if "unit" in f.metadata:
            assert getattr(back, f.name) == (None if want is None else
                                             pytest.approx(want, rel=1e-3)), f.name


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
    assert p.matmul_flops > 1e9 and p.gloo_bandwidth > 0


def test_host_terms_are_fitted_per_response_and_per_token():
    rows = [{"function": f, "batch": b, "tokens": b * n,
             "seconds": b * s + (b * n * t if f != "group_norm" else 0.0)}
            for f, s, t in (("reward", 3e-6, 1.5e-7), ("gae", 3e-6, 4e-7), ("group_norm", 3e-6, 0))
            for b, n in ((16, 4), (64, 20), (128, 12))]
    got = fit_host(rows)
    assert got["reward_sample_overhead"] == pytest.approx(3e-6, rel=1e-6)
    assert got["reward_token_time"] == pytest.approx(1.5e-7, rel=1e-6)
    assert got["compute_sample_time"] == pytest.approx(3e-6, rel=1e-6)
    assert got["compute_token_time"] == pytest.approx(4e-7, rel=1e-6)
    assert fit_host([]) == {}


def test_fit_uses_the_host_rows_and_the_model_ops_host_cost():
    m = _synthetic()
    m["host"] = [{"function": "reward", "batch": b, "tokens": b * 10,
                  "seconds": b * 4e-6 + b * 10 * 2e-7} for b in (16, 64)] + \
        [{"function": "reward", "batch": 64, "tokens": 64 * 2, "seconds": 64 * 4e-6
          + 128 * 2e-7}]
    p = fit_profile(m).profile
    assert p.reward_sample_overhead == pytest.approx(4e-6, rel=1e-4)
    assert p.reward_token_time == pytest.approx(2e-7, rel=1e-4)
    assert p.sample_overhead == m["sample_s"]
    assert "glibc defaults" in p.source


def test_allocator_settings_are_told_apart():
    assert allocator({}) == "worker" == allocator(worker_env(MALLOC_ENV))
    assert allocator(MALLOC_ENV) == "clean" == allocator(clean_env({}))
    assert allocator({"MALLOC_TRIM_THRESHOLD_": "65536"}) == "other"


def test_recalibrating_keeps_the_fields_it_does_not_measure():
    old = attrs.evolve(TRUE, vllm_layer_overhead=2e-5, threads=4.0, dispatch_s=0.003)
    fit = Fit(TRUE, LINK, (), frozenset({"threads", "grads_freed"}))
    new = keep_unmeasured(fit, old)
    assert new.vllm_layer_overhead == 2e-5 and new.dispatch_s == 0.003    # kept
    assert new.threads == TRUE.threads and new.grads_freed == 1.0        # measured anew


def test_a_generate_op_is_predicted_with_the_lengths_it_produced():
    cluster = cpu_cluster(TRUE, LINK)
    full, _ = predict_op("generate", PRESETS["tiny"], 16, 8, 20, cluster)
    short, _ = predict_op("generate", PRESETS["tiny"], 16, 8, 20, cluster,
                          lengths=[1] * 8 + [5] * 7 + [20])
    assert 0 < short < full
    assert empirical([3, 1, 3], 20).quantiles(3).tolist() == [1.0, 3.0, 3.0]


def test_the_devices_contention_is_fitted_within_its_physical_range():
    """An op's CPU time beside the other devices over alone: noise below 1 reads as 1, a
    ratio above the host's devices is no measurement of contention and is refused."""
    assert contention_in_range(0.97) == 1.0
    assert contention_in_range(1.12) == 1.12
    assert contention_in_range(3.5, devices=4) == 3.5
    for bad in (2.01, float("nan"), float("inf")):
        with pytest.raises(CostError, match="contention"):
            contention_in_range(bad)
    assert fit_profile({**_synthetic(), "concurrency": 0.99}).profile.concurrency_slowdown == 1.0
    assert fit_profile({**_synthetic(), "concurrency": 1.08}).profile.concurrency_slowdown \
        == 1.08
    with pytest.raises(CostError, match="contention"):
        fit_profile({**_synthetic(), "concurrency": 2.4})


@pytest.mark.parametrize("path", sorted((PROFILE_DIR.parent).glob("*.rpeg")),
                         ids=lambda p: p.stem)
def test_every_shipped_clusters_contention_is_physical(path):
    """From 1 to the devices of a node; GPUs (no host cores shared) do not contend."""
    from rpeg.spec import load_cluster
    cluster = load_cluster(path)
    p = cluster.gpu
    assert 1.0 <= p.concurrency_slowdown <= max(cluster.gpus_per_node, 1)
    if p.host_cores == 0:
        assert p.concurrency_slowdown == 1.0


def test_checkpoint_bandwidths_are_taken_as_measured(tmp_path):
    """The local calibration's checkpoint write and SHA-256 rates go into the profile as
    measured (no fit), among the fields a recalibration replaces."""
    from rpeg.runtime.calibrate.disk import measure_checkpoint_io
    io = measure_checkpoint_io(tmp_path, size=1 << 20, repeats=1)
    assert io["disk_bandwidth"] > 0 and io["hash_bandwidth"] > 0
    assert list(tmp_path.iterdir()) == []                 # its file removed
    fit = fit_profile({**_synthetic(), "checkpoint_io": io})
    assert fit.profile.disk_bandwidth == io["disk_bandwidth"]
    assert fit.profile.hash_bandwidth == io["hash_bandwidth"]
    assert {"disk_bandwidth", "hash_bandwidth"} <= fit.measured
