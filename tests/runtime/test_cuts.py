"""Checkpoint cuts computed per segment (``Cuts``) are the cuts of the whole-table scans."""

from __future__ import annotations

import attrs
import pytest

from rpeg.runtime.core.cuts import Cuts, carried, closure, core_view
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan


def _carry(plan, k):
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, carry=k) if p.stage == "rollout" else p for p in plan.placements),
        staleness=tuple((s, 0) for s, _ in plan.staleness))


@pytest.mark.parametrize("devices,staleness,carry", [(1, 0, 0), (2, 0, 0), (2, 1, 0),
                                                      (2, 0, 1)])
def test_segment_cuts_equal_whole_table_cuts(ppo, devices, staleness, carry):
    plan = split_plan(ppo, devices, staleness=staleness)
    if carry:
        plan = _carry(plan, carry)
    table = {c.id: c for c in build_calls(ppo, plan, 14)}
    cuts = Cuts(table)
    before = set()
    for end in (*range(1, 15, 3), 14, 5, 9, 2):          # forward, as segments go, and back
        inside = closure(table, end)
        assert cuts.closure(end) == inside, end
        assert cuts.carried(end) == carried(table, inside), end
        seg = inside - before
        assert cuts.core_view(seg, end) == core_view(table, seg, end), end
        before = inside
    assert cuts.reach >= 1 + staleness
