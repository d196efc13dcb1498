"""Whether another device reads an output (``rpeg.plan.packing.is_read_elsewhere``): one
rule, which ends the task writing the output so that its reader can start, called by the
runtime's fusion (a call at a time, its consumers' devices) and by the cost model's count
(an instance at a time, the devices its readers and the writers ordered after it read on).
Its invariants, and that both sides say "read elsewhere" by it and by nothing else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpeg.plan import packing, tasks
from rpeg.plan.packing import is_read_elsewhere
from rpeg.resources import shipped
from rpeg.runtime.core import fusion
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

from .conftest import counted_and_fused

DEVICES = st.integers(0, 3)
READERS = st.lists(st.one_of(DEVICES, st.none()), max_size=6)


@given(DEVICES, READERS)
def test_read_elsewhere_where_a_reader_is_on_another_device(device, readers):
    """Read elsewhere exactly where a reader runs on a device not the writer's; a reader
    on several devices at once (None) is on another; no reader, nowhere else."""
    assert is_read_elsewhere(device, readers) == bool(set(readers) - {device})
    assert not is_read_elsewhere(device, [])
    assert not is_read_elsewhere(device, [device] * len(readers))
    assert is_read_elsewhere(device, [*readers, None])


@given(DEVICES, READERS, READERS)
def test_readers_count_as_a_set(device, some, more):
    """Neither their order nor repeats matter, and readers put together are read elsewhere
    where either part is (how the count adds the writers ordered after an instance to its
    data readers), read one at a time or all at once (a generator is read lazily)."""
    both = some + more
    assert is_read_elsewhere(device, both) == is_read_elsewhere(device, reversed(both)) \
        == is_read_elsewhere(device, both + some) == is_read_elsewhere(device, iter(both))
    assert is_read_elsewhere(device, both) == (is_read_elsewhere(device, some)
                                               or is_read_elsewhere(device, more))


def _both(pipeline, plan):
    """(the count's (calls, tasks) of a steady step, the runtime's fusion's)."""
    return counted_and_fused(pipeline, plan)[:2]


@pytest.fixture(scope="module")
def split():
    pipeline = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    return pipeline, split_plan(pipeline, 2, chunks=2, dp=2, staleness=1)


def test_both_sides_say_read_elsewhere_by_the_one_rule(split, monkeypatch):
    """The runtime's fusion asks the rule once a call, with the devices of the call's
    consumers; the count once an instance (a weight sync: once, for its first gang), with
    devices among the plan's, or None; each side's answer is the rule's."""
    assert fusion.is_read_elsewhere is tasks.is_read_elsewhere is packing.is_read_elsewhere
    asked: list[tuple] = []

    def spy(device, readers):
        readers = list(readers)
        asked.append((device, readers))
        return is_read_elsewhere(device, readers)

    pipeline, plan = split
    before = _both(pipeline, plan)
    monkeypatch.setattr(fusion, "is_read_elsewhere", spy)
    calls = build_calls(pipeline, plan, 10)
    step = [c for c in calls if c.step == 6]
    consumers = fusion.consumers_of(calls)
    fusion.fuse(step, consumers, lambda _: False, together=plan.fusion)
    assert asked == [(c.device, [r.device for r in consumers.get(c.id, ())]) for c in step]
    assert any(is_read_elsewhere(*a) for a in asked) and not all(
        is_read_elsewhere(*a) for a in asked)
    asked.clear()
    monkeypatch.setattr(tasks, "is_read_elsewhere", spy)
    assert _both(pipeline, plan) == before
    devices = set(range(plan.num_devices)) | {None}
    assert asked and all(set(readers) <= devices for _, readers in asked)
    assert any(is_read_elsewhere(*a) for a in asked)


def test_one_edit_changes_the_rule_on_both_sides(split, monkeypatch):
    """The rule changed in the one place both sides call it changes both alike: where no
    output ends its task, the count still packs a steady step into the tasks the runtime's
    fusion does, and fewer than before. (The count reads a reader on several devices as
    None, enough to tell whether a reader is elsewhere, not which devices: a rule that
    needs more is more than one edit.)"""
    pipeline, plan = split
    usual = _both(pipeline, plan)
    never = lambda device, readers: False                 # noqa: E731
    for side in (packing, fusion, tasks):
        monkeypatch.setattr(side, "is_read_elsewhere", never)
    count, runtime = _both(pipeline, plan)
    assert count == runtime
    assert count[1] < usual[0][1]
