"""Published step times, a fast subset of benchmarks/published.py: one or two rows of each
source, priced as they ran. A change to the cost model that loses the fidelity these rows
have (benchmarks/results/published.md) fails here."""

from __future__ import annotations

import math
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.published_rows import ROWS, aggregates, price  # noqa: E402

# One or two rows per source, each priced as pinned (no search): every engine model appears.
SUBSET = ("ORB-4", "ORB-9", "ORB-3", "DSC-4", "VERL-5", "VERL-14",
          "REAL-heuristic-16-g384", "REAL-openrlhf-32-g896", "NEMO-B2", "NEMO-B3")


@pytest.fixture(scope="module")
def results():
    return [price(ROWS[rid]) for rid in SUBSET]


def test_configurations_that_ran_fit_in_memory(results):
    assert [r.row.id for r in results if r.status != "ok"] == []


def test_every_row_is_within_2x_of_its_published_step(results):
    # 2x: the target for rows of the calibration set (|log2 ratio| <= 1)
    off = {r.row.id: round(r.ratio, 2) for r in results if abs(math.log2(r.ratio)) > 1}
    assert off == {}


def test_the_subset_ranks_and_scores_as_the_whole_set_must(results):
    agg = aggregates(results)
    assert agg["median_abs_log2"] <= 0.5
    assert agg["spearman"] >= 0.9
