"""A generate op in a real run pays more per decode step than its calibrated price: the
calibration measures that residual in its control-plane runs and adds it to the profile's
``decode_overhead`` (``rpeg.runtime.calibrate.runs``)."""

from __future__ import annotations

import json

import pytest

from rpeg.cost.calibrate import cpu_cluster, predict_op
from rpeg.runtime.calibrate.runs import (
    WARMUP,
    generate_rows,
    price_row,
    residual_per_step,
    with_run_decode,
)
from rpeg.spec.model import GpuProfile, Level, Link
from rpeg.spec.presets import PRESETS

CPU = GpuProfile("cpu", memory=8e9, peak_flops=1e11, matmul_flops=1e11, hbm_bandwidth=2e10,
                 mem_bandwidth=6e9, launch_overhead=0.0, layer_overhead=3e-4,
                 call_overhead=3e-4, decode_overhead=4e-5, async_launch=0.0)
LINK = Link(Level.GPU, 1e9, 3e-4)
GEN = {"stage": "rollout", "model": "tiny", "prompt_len": 8, "max_len": 20}


def _row(cpu: float, hist: dict) -> dict:
    return {"cpu_s": cpu, "lengths": {str(k): n for k, n in hist.items()},
            "prompts": sum(hist.values())}


def test_the_residual_is_per_decode_step_of_the_longest_response():
    rows = [_row(0.030, {20: 4, 3: 4}), _row(0.020, {10: 8}), _row(0.050, {20: 8})]
    # measured − priced, over the steps the op decoded (its longest response)
    assert residual_per_step(rows, lambda r: 0.010) == pytest.approx(0.001)
    assert residual_per_step([], lambda r: 0.0) is None


def test_the_profile_prices_a_runs_generate_at_what_it_measured():
    lengths = {20: 24, 3: 8}
    priced = price_row(_row(0.0, lengths), CPU, LINK, PRESETS["tiny"], 8, 20)
    control = {"generate": {**GEN, "runs": [{"run": "2x1", "rows": [
        _row(priced + 20 * 2e-4, lengths)] * 3}]}}
    p, extra = with_run_decode(CPU, LINK, control)
    assert extra == pytest.approx(2e-4, rel=1e-3)
    assert p.decode_overhead == pytest.approx(CPU.decode_overhead + 2e-4, rel=1e-3)
    again = price_row(_row(0.0, lengths), p, LINK, PRESETS["tiny"], 8, 20)
    assert again == pytest.approx(priced + 20 * 2e-4, rel=0.02)
    # and only generate ops pay it
    fwd = [predict_op("forward", PRESETS["tiny"], 32, 8, 20, cpu_cluster(q, LINK))[0]
           for q in (CPU, p)]
    assert fwd[0] == fwd[1]


def test_runs_cheaper_than_the_price_or_no_runs_leave_the_fit_as_it_is():
    cheap = {"generate": {**GEN, "runs": [{"run": "1x1", "rows": [_row(1e-6, {20: 32})]}]}}
    p, extra = with_run_decode(CPU, LINK, cheap)
    assert extra < 0 and p == CPU
    assert with_run_decode(CPU, LINK, {}) == (CPU, None)
    assert with_run_decode(CPU, LINK, {"generate": {**GEN, "runs": []}}) == (CPU, None)


def _event(step: int, cpu: float, hist: dict, op: str = "rollout", kind: str = "generate"):
    return {"ph": "X", "name": f"{op}.{step}", "cat": kind, "ts": step * 1e6, "dur": 1e4,
            "args": {"step": step, "cpu_s": cpu,
                     "stats": {"lengths": {str(k): n for k, n in hist.items()},
                               "responses": sum(hist.values())}}}


def test_the_rows_are_each_steps_rollouts_after_the_warmup(tmp_path):
    events = [_event(s, 0.03, {20: 2}) for s in range(WARMUP + 2)]
    events += [_event(WARMUP, 0.01, {5: 2}),                 # a second chunk of one step
               _event(WARMUP, 0.5, {}, op="actor_step", kind="train")]
    (tmp_path / "trace.json").write_text(json.dumps({"traceEvents": events}))
    rows = generate_rows(tmp_path)
    assert [r["step"] for r in rows] == [WARMUP, WARMUP + 1]
    assert rows[0]["cpu_s"] == pytest.approx(0.04)
    assert rows[0]["lengths"] == {"20": 2, "5": 2} and rows[0]["prompts"] == 4



def test_the_machines_fit_carries_the_runs_residual_as_measured():
    from rpeg.cost.calibrate import fit_profile
    from rpeg.runtime.calibrate.machine import RUN_DECODE, fit_machine
    from tests.cost.test_calibrate import _synthetic
    m = _synthetic()
    plain = fit_profile(m)
    lengths = {20: 24, 3: 8}
    priced = price_row(_row(0.0, lengths), plain.profile, plain.link, PRESETS["tiny"], 8, 20)
    control = {"runs": [], "generate": {**GEN, "runs": [{"run": "2x1", "rows": [
        _row(priced + 20 * 3e-4, lengths)] * 3}]}}
    fit = fit_machine({**m, "control": control})
    assert dict(fit.residuals)[RUN_DECODE] == pytest.approx(3e-4, rel=0.01)
    assert fit.profile.decode_overhead == pytest.approx(plain.profile.decode_overhead + 3e-4,
                                                        rel=0.01)
    assert "decode_overhead" in fit.measured
    assert fit_machine(m).profile == plain.profile       # no runs: the fit as it was
