"""The copies a plan keeps (``rpeg.plan.copies``): the per-key bookkeeping that enters a
reader's devices whole gives what the rule gives applied device by device, op by op."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.errors import PlanError
from rpeg.graph import Graph, Op
from rpeg.graph.ids import ReplicaKey, variant_key
from rpeg.plan.copies import Copy, _held, _hosts, copies, copy_key, copy_keys
from rpeg.plan.lower import lower
from rpeg.plan.oplayout import all_in_place
from rpeg.spec.model import Engine, OpKind
from tests.plan.test_oplayout import placements


def _wanted_by_device(model, op, place, lay, trainer, chunks):
    """The rule device by device: :func:`copy_key` on each member (no memo, no shortcut)."""
    if trainer is not None and (all_in_place(trainer, place) or lay.everywhere):
        return tuple((d, g, ReplicaKey(model)) for d, g in lay.members(chunks))
    held = _held(trainer) if trainer is not None else frozenset()
    members = lay.members(chunks)
    on = tuple((d, g) for d, g in members if d in held)
    keys = dict(zip((d for d, _ in on), copy_keys(op, place, on, trainer), strict=True))
    elsewhere = copy_key(op, place, -1, trainer, ())
    return tuple((d, g, keys.get(d, elsewhere) if d in held else elsewhere)
                 for d, g in members)


def _backbone_by_device(model, train, readers, chunks):
    """The copies of one backbone, every (key, device) looked at on its own."""
    layout, first, reads = {}, {}, {}
    trainer = None
    if train is not None:
        op, trainer, lay = train
        key = ReplicaKey(model)
        at = reads[op.name] = {}
        for d, group in lay.members(chunks):
            layout.setdefault((key, d), group)
            first.setdefault((key, d), 0)
            at[d] = key
    for n, (op, place, lay) in enumerate(readers, start=1):
        members = _wanted_by_device(model, op, place, lay, trainer, chunks)
        at = {}
        for d, group, key in members:
            if layout.setdefault((key, d), group) != group:
                key = variant_key(model, group)
            at.setdefault(d, key)
        split = {key for key in set(at.values()) if key.variant}
        for d, group, _ in members if split else ():
            if group and at[d] not in split:
                other = next((at[x] for x in group if at[x] in split), None)
                if other is not None:
                    at[d] = other
        for d, key in at.items():
            first.setdefault((key, d), n)
        reads[op.name] = at
    places = (trainer,) + tuple(place for _, place, _ in readers)
    spans = ({},) + tuple(_hosts(lay) if lay.per_block else {} for _, _, lay in readers)
    devices = {}
    for (key, d), n in first.items():
        devices.setdefault((key, n), []).extend(spans[n].get(d, (d,)) if key.engine else (d,))
    return tuple(Copy(key, tuple(sorted(ds)), places[n], n == 0)
                 for (key, n), ds in devices.items()), reads


@settings(deadline=None, max_examples=300)
@given(placements(engines=(Engine.TORCH,)), placements(), placements(engines=(Engine.TORCH,)),
       placements(engines=(Engine.TORCH,)), st.booleans(), st.integers(1, 16))
def test_the_copies_are_the_rule_applied_device_by_device(train, gen, fwd, other, trained,
                                                         responses):
    ops = [Op("rollout", OpKind.GENERATE, reads_model="m", stages=("rollout",)),
           Op("old_lp", OpKind.FORWARD, reads_model="m", stages=("old_lp",)),
           Op("ref_lp", OpKind.FORWARD, reads_model="m", stages=("ref_lp",))]
    if trained:
        ops.append(Op("train", OpKind.TRAIN, reads_model="m", writes_model="m",
                      stages=("train",)))
    g = Graph("g", tuple(ops), (), (), ("m",), ("m",) if trained else ())
    place = {"rollout": gen, "old_lp": fwd, "ref_lp": other, "train": train}
    at = lambda o: place[o.name]        # noqa: E731
    try:
        placed = lower(g, None, responses, at)
    except PlanError as e:       # a pass split into more parts than a step has responses
        assert "a part would hold no sequence" in e.message
        return
    got = copies(placed, at)
    t = next((o for o in g.ops if o.kind is OpKind.TRAIN), None)
    readers = tuple((g.op(n), at(g.op(n)), placed.layout(n)) for n in g.topo_order()
                    if g.op(n).kind is not OpKind.TRAIN)
    want = _backbone_by_device("m", (t, at(t), placed.layout(t.name)) if t else None,
                               readers, placed.chunks)
    assert got.held == want[0]
    assert got.reads == want[1]
