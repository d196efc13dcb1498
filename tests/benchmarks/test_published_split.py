"""benchmarks/published_split.py: a line through a system's bars at the three answer lengths
recovers a decode step's cost and the length-independent rest."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.published_split import LENGTHS, line  # noqa: E402


@given(st.floats(1e-3, 1.0), st.floats(0.0, 500.0))
def test_a_step_linear_in_the_answer_length_splits_exactly(per_token, fixed):
    steps = [fixed + per_token * n for n in LENGTHS]
    slope, intercept = line(list(LENGTHS), steps)
    assert slope == pytest.approx(per_token, rel=1e-6, abs=1e-9)
    assert intercept == pytest.approx(fixed, rel=1e-6, abs=1e-6)


def test_the_lengths_are_the_figures_three():
    assert LENGTHS == (128, 384, 896)
