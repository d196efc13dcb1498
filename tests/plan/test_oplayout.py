"""Where a plan's op instances run (``rpeg.plan.oplayout``), the one rule the runtime lays
its op calls out by and the cost model counts them with: each instance on one block, a
train op on every device, a vLLM engine's chunks on its blocks' hosts; an engine serves a
copy unless its trainer's weights are whole beside it; a reader reads in place only where
the trainer holds the same split of whole weights."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.cost.engine_sync import engine_copy, engine_sync_layout, serves_copy
from rpeg.errors import PlanError
from rpeg.graph import Op
from rpeg.plan.model import StagePlacement
from rpeg.plan.oplayout import (
    all_in_place,
    first_block,
    op_layout,
    reads_in_place,
    split_parts,
    world_of,
)
from rpeg.spec.model import Engine, OpKind

KINDS = (OpKind.GENERATE, OpKind.FORWARD, OpKind.TRAIN, OpKind.COMPUTE)


@st.composite
def placements(draw, engines=(Engine.TORCH, Engine.VLLM)):
    tp = draw(st.sampled_from((1, 2, 4)))
    dp = draw(st.integers(1, 3))
    start = draw(st.integers(0, 8))
    return StagePlacement.of("s", tuple(range(start, start + dp * tp)), dp=dp, tp=tp,
                          engine=draw(st.sampled_from(engines)),
                          zero=draw(st.sampled_from((0, 2, 3))), chunks=draw(st.integers(1, 6)))


@settings(deadline=None)
@given(placements(), st.sampled_from(KINDS), st.booleans(), st.integers(1, 12))
def test_every_instance_runs_on_one_block_and_every_train_rank_on_its_device(
        place, kind, streamed, chunks):
    op = Op("o", kind, reads_model=None if kind is OpKind.COMPUTE else "m", stages=("s",))
    lay = op_layout(op, place, streamed or kind is OpKind.GENERATE)
    calls = lay.calls(chunks)
    blocks = set(lay.blocks)
    assert {c.device for c in calls} <= set(place.devices)
    if kind is OpKind.TRAIN:
        assert [c.device for c in calls] == list(place.devices)
        assert [c.rank for c in calls] == [i // lay.tp for i in range(len(place.devices))]
        assert world_of(op, lay) == len(place.devices) // lay.tp
        return
    by_chunk: dict[int, list[int]] = {}
    for c in calls:
        by_chunk.setdefault(c.chunk, []).append(c.device)
        assert c.group == () or c.group in blocks and c.device in c.group
    for chunk, devices in by_chunk.items():
        assert tuple(devices) == lay.devices_of(chunk)
        if lay.per_block:                      # a vLLM engine: its block's host alone
            assert len(devices) == 1 and devices[0] in {b[0] for b in blocks}
        else:
            assert tuple(devices) in blocks
    assert len(by_chunk) == (chunks if lay.chunked else 1)


@settings(deadline=None)
@given(placements(engines=(Engine.TORCH,)), placements(engines=(Engine.VLLM,)))
def test_an_engine_serves_a_copy_unless_the_trained_weights_are_whole_beside_it(train, gen):
    hosts = gen.devices[::gen.tp]
    for d in hosts:
        whole = gen.tp == 1 and train.tp == 1 and train.zero == 0 and d in train.devices
        assert serves_copy(train, gen, d) is not whole
        assert serves_copy(None, gen, d)          # an untrained model: always a copy
    assert engine_copy(train, gen) == any(serves_copy(train, gen, d) for d in hosts)
    lay = engine_sync_layout(train, [gen])
    assert {b[0] for b in lay.group + lay.local} == {d for d in hosts
                                                      if serves_copy(train, gen, d)}


def _blocks(p: StagePlacement) -> list[tuple[int, ...]]:
    return [p.devices[i:i + p.tp] for i in range(0, len(p.devices), p.tp)]


@settings(deadline=None)
@given(placements(engines=(Engine.TORCH,)), placements())
def test_a_reader_reads_in_place_only_the_trainers_own_split_of_whole_weights(train, reader):
    for d in reader.devices:
        if reads_in_place(train, reader, d):
            assert d in train.devices and train.zero < 3
            assert not serves_copy(train, reader, d)
            tb = [b for b in _blocks(train) if d in b]
            rb = [b for b in _blocks(reader) if d in b]
            assert tb == rb or train.tp == reader.tp == 1
    assert all_in_place(train, reader) == all(reads_in_place(train, reader, d)
                                              for d in reader.devices)
    if reader.engine is Engine.TORCH and reader.tp == train.tp == 1 and train.zero < 3:
        assert all_in_place(train, reader) == (set(reader.devices) <= set(train.devices))
    same = StagePlacement.of("g", train.devices, dp=train.dp, tp=train.tp)
    assert all_in_place(train, same) == (train.zero < 3)


@settings(deadline=None)
@given(placements(), placements(), st.sampled_from(KINDS[:2]), st.booleans(),
       st.integers(1, 12), st.booleans())
def test_the_memoised_copy_keys_are_the_rule_applied_device_by_device(
        place, trainer, kind, streamed, chunks, trained):
    """A reader's wanted copies (memoised by the reader and its trainer) are
    :func:`copy_key` on each device it runs a call on, its members those of its layout."""
    from rpeg.graph.ids import ReplicaKey
    from rpeg.plan.copies import _wanted, copy_key
    from rpeg.plan.oplayout import OpLayout
    op = Op("o", kind, reads_model="m", stages=("s",))
    lay = op_layout(op, place, streamed or kind is OpKind.GENERATE)
    train = trainer if trained else None
    fresh = OpLayout(lay.devices, lay.tp, lay.chunked, lay.per_block, lay.everywhere,
                     lay.collective)
    assert lay.members(chunks) == fresh._members_uncached(chunks)
    whole = train is not None and all_in_place(train, place)
    assert _wanted("m", op, place, lay, train, chunks) == tuple(
        (d, g, ReplicaKey("m") if whole else copy_key(op, place, d, train, g))
        for d, g in fresh._members_uncached(chunks))


@settings(deadline=None)
@given(placements(engines=(Engine.TORCH, Engine.DEEPSPEED)), st.sampled_from(KINDS),
       st.booleans(), st.integers(1, 12), st.booleans())
def test_a_pass_at_dp_above_1_runs_split_over_its_blocks(place, kind, streamed, chunks,
                                                         grouped):
    """``split_parts`` says what ``OpLayout.calls`` lays out: a pass or per-sample host op at
    dp > 1 that a step does not stream runs a part of its batch on each block, one call per
    block's device, every device of the placement busy; a group estimator runs one call on
    its first block (``first_block``); train ranks and generate chunks spread their own
    way, whatever the engine."""
    op = Op("o", kind, reads_model=None if kind is OpKind.COMPUTE else "m", stages=("s",),
            grouped=grouped and kind is OpKind.COMPUTE)
    on = streamed or kind is OpKind.GENERATE
    parts = split_parts(op, place, None, chunks, on)
    lay = op_layout(op, place, on, parts=parts)
    calls = lay.calls(chunks)
    if place.dp <= 1 or kind in (OpKind.TRAIN, OpKind.GENERATE) or (on and chunks > 1):
        assert parts == 0
    if parts:
        assert len(lay.blocks) == parts == lay.instances(chunks) == len(
            {c.chunk for c in calls})
        assert {c.device for c in calls} == set(place.devices)
        assert all(c.device in lay.blocks[c.chunk] for c in calls)
        assert lay.members(chunks) == tuple(dict.fromkeys(
            (c.device, c.group) for c in calls))
    elif place.dp > 1 and op.kind in (OpKind.FORWARD, OpKind.COMPUTE) and not on:
        assert op.grouped and {c.device for c in calls} <= set(first_block(place).devices)


@settings(deadline=None)
@given(placements(engines=(Engine.TORCH,)), st.sampled_from((OpKind.FORWARD, OpKind.COMPUTE)),
       st.integers(1, 12))
def test_a_split_pass_never_has_more_parts_than_its_batch_has_sequences(place, kind, batch):
    """Every part of a split pass holds a sequence: given the step's batch, ``split_parts``
    splits it as before where each block gets one, and refuses the placement (a PlanError
    naming the stage) where some block would get none -- never an empty part, nor fewer
    parts than the placement's blocks, which the cost model prices it on."""
    op = Op("o", kind, reads_model=None if kind is OpKind.COMPUTE else "m", stages=("s",))
    parts = split_parts(op, place, None, 1)
    if parts <= batch:
        assert split_parts(op, place, None, 1, batch=batch) == parts
    else:
        with pytest.raises(PlanError, match=f"stage 's' must split a step's {batch} "):
            split_parts(op, place, None, 1, batch=batch)
