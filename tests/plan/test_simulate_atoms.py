"""The simulator's device masks (``rpeg.plan.simulate._needs``): each op's devices as
bits of atoms, runs between the ends of the ops' runs. Two ops' masks meet exactly where
their devices do, are equal exactly where their devices are, and the busiest atom's
load is the busiest device's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.plan.simulate import _floor, _needs

devices = st.lists(st.integers(0, 40), max_size=12).map(lambda xs: tuple(sorted(set(xs))))


@settings(deadline=None, max_examples=300)
@given(st.lists(devices, min_size=1, max_size=6),
       st.lists(st.floats(0.0, 10.0), min_size=6, max_size=6))
def test_masks_meet_where_devices_do_and_loads_are_the_devices(sets, times):
    named = tuple((f"op{i}", ds) for i, ds in enumerate(sets))
    needs = _needs(named)
    for a, da in named:
        for b, db in named:
            assert bool(needs[a] & needs[b]) == bool(set(da) & set(db))
            assert (needs[a] == needs[b]) == (set(da) == set(db))
    durations = {(op, 0): t for (op, _), t in zip(named, times, strict=False)}
    load: dict[int, float] = {}
    for (_, ds), t in zip(named, times, strict=False):
        for d in ds:
            load[d] = load.get(d, 0.0) + t
    assert _floor(durations, needs) == max(load.values(), default=0.0)
