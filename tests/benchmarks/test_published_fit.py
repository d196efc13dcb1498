"""benchmarks/published_fit.py names the terms a fit left on a bound of their range (what
leave-one-source-out reports per held-out source)."""

from __future__ import annotations

import sys

import attrs

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks.published_fit import PRIOR, at_bound  # noqa: E402
from rpeg.cost.engines import BOUNDS  # noqa: E402


def test_the_documented_estimates_sit_inside_every_range():
    assert at_bound(PRIOR) == []


def test_a_term_on_its_floor_or_ceiling_is_named_with_which():
    lo, _ = BOUNDS["gemm"]
    _, hi = BOUNDS["call_s"]
    got = at_bound(attrs.evolve(PRIOR, gemm=lo, call_s=hi))
    assert got == [f"call_s = {hi:g} (its ceiling)", f"gemm = {lo:g} (its floor)"]
