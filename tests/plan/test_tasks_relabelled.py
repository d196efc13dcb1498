"""What the evaluator reads instead of packing a step's calls, checked against the packing
over random layouts: a step's count reads a device only as a name (layouts renamed device
for device count the same calls, tasks and futures: ``rpeg.plan.tasks.relabelled``, the
key the count is memoised by across proposals that differ only in the devices they use),
the floor (``rpeg.plan.dispatchfloor.dispatch_floor``) is no more than the packed count,
and the steady step packed alone counts as the replay of every step before it."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.graph import build
from rpeg.plan.dispatchfloor import dispatch_floor
from rpeg.plan.oplayout import OpLayout, streamed_ops
from rpeg.plan.tasks import _cycled, _reading, devices_used, dispatch_per_step, relabelled
from rpeg.plan.tasks import laid_out as tasks_laid_out
from rpeg.spec import load
from rpeg.spec.model import OpKind

from .conftest import ROOT

GRAPHS = {(name, lag): build(load(ROOT / f"pipelines/{name}.rpeg"),
                             staleness={"rollout": lag} if lag else None)
          for name in ("ppo_llama8b", "grpo_qwen7b") for lag in (0, 1)}
DEVICES = 12


@st.composite
def laid_out(draw):
    """(graph, op -> a random layout of it on up to ``DEVICES`` devices, chunks)."""
    graph = GRAPHS[draw(st.sampled_from(sorted(GRAPHS)))]
    chunks = draw(st.integers(1, 4))
    streamed = streamed_ops(graph) if chunks > 1 else frozenset()
    out = {}
    for op in graph.ops:
        tp = draw(st.sampled_from((1, 2, 3)))
        n = tp * draw(st.integers(1, 3))
        devices = tuple(draw(st.permutations(range(DEVICES)))[:n])
        train = op.kind is OpKind.TRAIN
        everywhere = train or op.kind is OpKind.SYNC_WEIGHTS and draw(st.booleans())
        per_block = op.kind is OpKind.GENERATE and draw(st.booleans())
        out[op.name] = OpLayout(
            devices if op.kind is not OpKind.COMPUTE or draw(st.booleans()) else (), tp,
            chunked=op.name in streamed, per_block=per_block, everywhere=everywhere,
            collective=not per_block and (tp > 1 or everywhere and n > 1))
    fused = tuple(tuple(o.name for o in graph.ops if o.kind is OpKind.FORWARD)[:2]
                  for _ in range(draw(st.integers(0, 1))))
    return graph, out, chunks, fused


@settings(deadline=None, max_examples=60)
@given(laid_out(), st.permutations(range(40)))
def test_layouts_renamed_device_for_device_count_the_same(case, names):
    graph, layouts, chunks, fused = case
    renamed = {op: attrs.evolve(lay, devices=tuple(names[d] for d in lay.devices))
               for op, lay in layouts.items()}
    d = dispatch_per_step(graph, layouts, chunks, 6, fused)
    assert dispatch_per_step(graph, renamed, chunks, 6, fused) == d
    # and the key says so: both relabel to one layout set, counted the same
    assert relabelled(renamed) == relabelled(layouts)
    assert dispatch_per_step(graph, dict(relabelled(layouts)), chunks, 6, fused) == d


@settings(deadline=None, max_examples=80)
@given(laid_out(), st.sampled_from((6, 10)))
def test_the_floor_is_no_more_than_the_packed_count(case, steps):
    """What a bounded evaluation prices before packing: count by count no more than the
    packing's (the same calls)."""
    graph, layouts, chunks, fused = case
    d = dispatch_per_step(graph, layouts, chunks, steps, fused)
    low = dispatch_floor(graph, layouts, chunks, steps)
    assert (low.devices, low.calls) == (d.devices, d.calls)
    assert low.tasks <= d.tasks and low.args <= d.args, (low, d)


@settings(deadline=None, max_examples=120)
@given(laid_out(), st.sampled_from((6, 10)))
def test_the_steady_step_packed_alone_counts_as_the_replay(case, steps):
    """Where the steady step reads the steps before only through gangs, it is packed alone:
    the same calls, tasks and futures as packing every step before it first."""
    graph, layouts, chunks, fused = case
    assert dispatch_per_step(graph, layouts, chunks, steps, fused) \
        == dispatch_per_step(graph, layouts, chunks, steps, fused, replay=True)


@settings(deadline=None, max_examples=60)
@given(laid_out())
def test_what_the_count_reads_per_layout_is_what_it_stands_for(case):
    """The per-layout memos the count reads instead of the layouts' devices: the one device
    reading an instance's inputs (None where two do), and the devices used together."""
    _, layouts, _, _ = case
    for lay in layouts.values():
        assert _reading(lay) == tuple(two[0] if two[0] == two[-1] else None
                                      for _, two, _, _, _ in tasks_laid_out(lay))
    assert devices_used(tuple(layouts.values())) \
        == len({d for lay in layouts.values() for d in lay.devices})
    # each chunk's layout and reading device at its own index, as at its modulo
    for lay in layouts.values():
        for per_chunk in (tasks_laid_out(lay), _reading(lay)):
            for n in (1, 3, len(per_chunk), 7):
                cycled = _cycled(per_chunk, n)
                assert _cycled(per_chunk, n) is cycled           # memoised by identity
                assert all(cycled[c] == per_chunk[c % len(per_chunk)]
                           for c in range(max(n, len(per_chunk))))
