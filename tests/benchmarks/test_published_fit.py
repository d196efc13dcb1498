"""benchmarks/published_fit.py names the terms a fit left on a bound of their range (what
leave-one-source-out reports per held-out source)."""

from __future__ import annotations

import math
import sys

import attrs

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks import published_fit  # noqa: E402
from benchmarks.published_fit import (  # noqa: E402
    NO_FIT_PENALTY,
    PRIOR,
    at_bound,
    loss,
    off_bound,
    row_errors,
)
from benchmarks.published_rows import ROWS, Result  # noqa: E402
from rpeg.cost.engines import BOUNDS  # noqa: E402


def test_the_documented_estimates_sit_inside_every_range():
    assert at_bound(PRIOR) == []


def test_a_term_on_its_floor_or_ceiling_is_named_with_which():
    lo, _ = BOUNDS["gemm"]
    _, hi = BOUNDS["call_s"]
    got = at_bound(attrs.evolve(PRIOR, gemm=lo, call_s=hi))
    assert got == [f"call_s = {hi:g} (its ceiling)", f"gemm = {lo:g} (its floor)"]


def _result(rid, ratio, phases=()):
    row = ROWS[rid]
    predicted = {row.main: ratio * row.figure}
    predicted.update({w: f * p for (w, p), f in zip(
        [x for x in row.figures if x[0] != row.main], phases, strict=False)})
    return Result(row, "ok", predicted)


def test_the_loss_is_the_weighted_mean_of_the_row_errors():
    rs = [_result("NEMO-B1", 2.0), _result("ORB-4", 0.5, (1.0, 4.0)),
          Result(ROWS["NEMO-B2"], "no-fit")]
    errs = row_errors(rs)
    # NEMO-B1: 1 at weight 1; ORB-4: 1 + 0.5 * (0 + 2) at weight 2; NEMO-B2: the penalty
    assert errs == {"NEMO-B1": (1.0, 1.0), "ORB-4": (2.0, 2.0),
                    "NEMO-B2": (NO_FIT_PENALTY, 1.0)}
    assert math.isclose(loss(rs), (1.0 + 2.0 + NO_FIT_PENALTY) / 4)


def test_a_term_off_its_bound_moves_one_step_inward_and_one_inside_stays():
    _, hi = BOUNDS["call_s"]
    on = attrs.evolve(PRIOR, call_s=hi, overlap=0.0, grad_hook_s=0.0)
    assert off_bound(PRIOR, "call_s") is None
    assert BOUNDS["call_s"][0] < off_bound(on, "call_s").call_s < hi
    assert 0.0 < off_bound(on, "overlap").overlap < 1.0
    assert off_bound(on, "grad_hook_s").grad_hook_s > 0.0


def test_the_rows_that_hold_a_term_on_its_bound_are_the_ones_that_lose_off_it(monkeypatch):
    # a stand-in pricing: row A gets worse as call_s leaves its ceiling, row B better
    def fake(values, rows, plans):
        c = values.call_s
        return [_result("NEMO-B1", c / 10), _result("NEMO-B2", 5 / c)][:len(rows)]
    monkeypatch.setattr(published_fit, "evaluate", fake)
    on = attrs.evolve(PRIOR, call_s=BOUNDS["call_s"][1])
    got = published_fit.pulls(on, "call_s", ["NEMO-B1", "NEMO-B2"], {})
    assert [rid for rid, _ in got] == ["NEMO-B1"]
    assert math.isclose(got[0][1], abs(math.log2(off_bound(on, "call_s").call_s / 10)),
                        rel_tol=1e-3)
    assert published_fit.pulls(PRIOR, "call_s", ["NEMO-B1"], {}) == []


def test_held_out_rows_are_summarised_per_system_that_ran_them():
    rs = [_result("REAL-dschat-8-g128", 0.25), _result("REAL-dschat-16-g128", 0.5),
          _result("REAL-heuristic-8-g128", 2.0), Result(ROWS["NEMO-B2"], "no-fit")]
    assert published_fit.by_system(rs) == {ROWS["REAL-dschat-8-g128"].system: 1.5,
                                           ROWS["REAL-heuristic-8-g128"].system: 1.0}


def test_a_lever_puts_back_only_the_terms_the_fold_moved(monkeypatch):
    # a stand-in pricing whose error is call_s's distance from 2.8 s, in doublings
    def fake(values, rows, plans):
        return [_result(rid, values.call_s / 2.8) for rid in rows]
    monkeypatch.setattr(published_fit, "evaluate", fake)
    ref = attrs.evolve(PRIOR, call_s=2.8)
    fold = attrs.evolve(ref, call_s=5.6, hook_s=ref.hook_s * 1.01, gemm=ref.gemm + 0.01)
    got = published_fit.levers(fold, ["NEMO-B1"], {}, reference=ref)
    assert got == {"call_s": 0.0}             # hook_s and gemm moved too little to count
    assert published_fit.levers(ref, ["NEMO-B1"], {}, reference=ref) == {}


def test_a_profile_names_the_value_each_source_asks_of_a_term(monkeypatch):
    # a stand-in pricing: NeMo's row is right at call_s 2, verl's says nothing of it
    def fake(values, rows, plans):
        return [_result(rid, values.call_s / 2 if rid == "NEMO-B1" else 1.5) for rid in rows]
    monkeypatch.setattr(published_fit, "evaluate", fake)
    got = published_fit.profile("call_s", ["NEMO-B1", "VERL-14"], {}, grid=(1.0, 2.0, 4.0))
    assert got["grid"] == [1.0, 2.0, 4.0]
    assert got["by_source"]["nemo-rl-v0.4"] == [1.0, 0.0, 1.0]
    flat = round(math.log2(1.5), 3)
    assert got["by_source"]["verl-vllm07"] == [flat] * 3
    assert got["every row"] == [round((1.0 + flat) / 2, 3), round(flat / 2, 3),
                                round((1.0 + flat) / 2, 3)]
    assert list(got["by_system"]) == ["NeMo RL", "verl rollout (vLLM 0.7.0, CUDA graphs)"]
