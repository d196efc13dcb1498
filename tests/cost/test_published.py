"""Published step times, a fast subset of benchmarks/published.py: rows of every source,
priced as they ran. A change to the cost model that loses the fidelity the calibration set
has fails here, and so does one that moves a prediction the results file (the figures
README quotes) records, until benchmarks/published.py is run again."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.published_rows import ROWS, aggregates, price  # noqa: E402

# Rows of every source and engine model, priced as pinned (no search): the ratios span the
# whole set's, its worst (ReaL's run of DeepSpeed-Chat on 64 GPUs, 6x) included.
SUBSET = ("ORB-3", "ORB-4", "ORB-7", "ORB-9", "DSC-4", "DSC-6", "DSC-7", "VERL-5", "VERL-7",
          "VERL-14", "REAL-dschat-16-g384", "REAL-dschat-64-g128", "REAL-heuristic-16-g384",
          "REAL-openrlhf-32-g896", "REAL-heuristic-64-g896", "NEMO-B1", "NEMO-B2", "NEMO-B3")
RECORDED = ROOT / "benchmarks" / "results" / "published.json"


@pytest.fixture(scope="module")
def results():
    return [price(ROWS[rid]) for rid in SUBSET]


def test_configurations_that_ran_fit_in_memory(results):
    assert [r.row.id for r in results if r.status != "ok"] == []


def test_the_subset_meets_the_calibration_targets(results):
    agg = aggregates(results)
    assert agg["median_abs_log2"] <= 0.5
    assert agg["within"]["2x"] >= 0.8
    assert agg["spearman"] >= 0.9


def test_no_op_of_a_published_row_runs_above_the_device(results):
    """Physics first, on the configurations others ran: each op's achieved share of the
    GPUs' peak compute and memory bandwidth is at most one."""
    for r in results:
        ops = r.plan.predicted.ops
        assert ops, r.row.id
        for u in ops:
            assert 0 <= u.mfu <= 1 and 0 <= u.mbu <= 1, (r.row.id, u)


@pytest.mark.slow
@pytest.mark.parametrize("rid", sorted(set(ROWS) - set(SUBSET)))
def test_no_op_of_any_published_row_runs_above_the_device(rid):
    r = price(ROWS[rid])
    if r.plan is None:                      # a row that cannot be written yet
        assert r.status == "unwritable", (rid, r.status, r.message)
        return
    for u in r.plan.predicted.ops:
        assert 0 <= u.mfu <= 1 and 0 <= u.mbu <= 1, (rid, u)


def test_predictions_are_the_ones_the_results_file_records(results):
    recorded = {r["id"]: r for r in json.loads(RECORDED.read_text())["rows"]}
    for r in results:
        want = recorded[r.row.id]["predicted"][r.row.main]
        # the same code on the same inputs: equal up to float summation order
        assert math.isclose(r.predicted[r.row.main], want, rel_tol=1e-9), (r.row.id, want)


@pytest.fixture(scope="module")
def apart():
    from benchmarks.published_apart import APART
    return [price(row) for row in APART]


def test_rows_kept_apart_fit_run_within_the_device_and_match_their_results_file(apart):
    """The rows the fit never sees (benchmarks/published_apart.py): each configuration ran,
    so each fits; no op above the device; the predictions the results file records."""
    assert [r.row.id for r in apart if r.status != "ok"] == []
    for r in apart:
        for u in r.plan.predicted.ops:
            assert 0 <= u.mfu <= 1 and 0 <= u.mbu <= 1, (r.row.id, u)
    recorded = {row["id"]: row["predicted"] for row in json.loads(
        (ROOT / "benchmarks" / "results" / "published_apart.json").read_text())["rows"]}
    for r in apart:
        assert math.isclose(r.predicted[r.row.main], recorded[r.row.id], rel_tol=1e-9), r.row.id
