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


@pytest.mark.parametrize("staleness", [0, 1])
def test_segments_between_cuts_run_every_op_once(ppo, staleness):
    """The segments between successive cuts are disjoint and together run every op of the
    run; a segment ending at B has run, with those before it, every op of a step before B."""
    table = {c.id: c for c in build_calls(ppo, split_plan(ppo, 2, staleness=staleness), 9)}
    cuts = Cuts(table)
    ran: set[str] = set()
    ends = (2, 3, 6, 9)
    for start, end in zip((0, *ends[:-1]), ends, strict=True):
        seg, inside = cuts.segment(start, end)
        assert not seg & ran and inside == ran | seg
        ran |= seg
        assert {i for i, c in table.items() if c.step < end} <= ran
    assert ran == set(table)
