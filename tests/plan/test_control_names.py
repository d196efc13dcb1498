"""The control plane's count is memoised by the layouts relabelled
(``rpeg.plan.tasks.relabelled``); where the first op's devices are 0 .. n - 1 and every
other op's lie among them it skips the renaming, which would change nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.plan.control import _named_in_order
from rpeg.plan.oplayout import OpLayout
from rpeg.plan.tasks import relabelled

devices = st.lists(st.integers(0, 12), max_size=8, unique=True).map(tuple)


@settings(deadline=None, max_examples=300)
@given(st.dictionaries(st.sampled_from("abcdef"), devices, min_size=1, max_size=5),
       st.integers(0, 12))
def test_skipping_the_renaming_changes_no_layout(named, first):
    layouts = {op: OpLayout(ds) for op, ds in named.items()}
    layouts["0"] = OpLayout(tuple(range(first)))          # first in name order
    ordered = tuple(sorted(layouts.items()))
    if _named_in_order(ordered):
        assert relabelled(layouts) == ordered
