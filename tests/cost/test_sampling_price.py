"""A decode step's sampling on a CPU device: every live row draws its token from the whole
vocabulary's logits, priced per logit (the profile's ``sample_logit_time``, which
``rpeg calibrate`` measures on the engine's own code path) on top of the model's layers."""

from __future__ import annotations

import attrs
import pytest

from rpeg.cost.calibrate import cpu_cluster, fit_sampling, predict_op
from rpeg.spec.model import GpuProfile, Level, Link
from rpeg.spec.presets import PRESETS

CPU = GpuProfile("cpu", memory=8e9, peak_flops=1e11, matmul_flops=1e11, hbm_bandwidth=2e10,
                 mem_bandwidth=6e9, launch_overhead=0.0, layer_overhead=3e-4,
                 call_overhead=3e-4, decode_overhead=4e-5, async_launch=0.0)
LINK = Link(Level.GPU, 1e9, 3e-4)


def _generate(profile: GpuProfile, batch: int = 8, gen_len: int = 10) -> float:
    return predict_op("generate", PRESETS["tiny"], batch, 8, gen_len, cpu_cluster(profile, LINK),
                      lengths=[gen_len] * batch)[0]


def test_every_sampled_token_pays_its_rows_logits():
    dims = PRESETS["tiny"]
    slow = attrs.evolve(CPU, sample_logit_time=2.5e-8)
    extra = _generate(slow) - _generate(CPU)
    # 8 rows, 10 tokens each, the whole vocabulary's logits each
    assert extra == pytest.approx(8 * 10 * dims.vocab * 2.5e-8, rel=0.05)


def test_a_gpu_profile_samples_in_its_step():
    assert GpuProfile("h100").sample_logit_time == 0.0


def test_the_fit_keeps_both_terms_non_negative():
    flat = [{"rows": r, "vocab": v, "seconds": 5e-5} for r in (1, 8, 64) for v in (259, 1024)]
    fit = fit_sampling(flat)
    assert fit["sample_logit_time"] == 0.0 and fit["decode_overhead"] == pytest.approx(5e-5)
    assert fit_sampling([]) == {}
