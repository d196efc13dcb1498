"""The simulator's prepared graph (``rpeg.plan.simulate.prepared``: the instances of a placed
graph's steps and their edges as index arrays, unrolled with each instance named by its
index) checked against the placed graph's unrolled edges (:meth:`Placed.edges`) indexed in
priority order, over random chunkings, lanes, carried streams and shared replicas; and the
task count's lighter preparation (``rpeg.plan.simulate.fed``) as the prepared graph's."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.graph import DepKind, build
from rpeg.plan.lower import Placed
from rpeg.plan.simulate import _prepare_uncached, _Prepared, fed
from rpeg.spec import load
from rpeg.spec.model import OpKind

from .conftest import ROOT

GRAPHS = {(name, lag): build(load(ROOT / f"pipelines/{name}.rpeg"),
                             staleness={"rollout": lag} if lag else None)
          for name in ("ppo_llama8b", "grpo_qwen7b", "tiny_ppo") for lag in (0, 1)}


def indexed(placed: Placed, steps: int) -> _Prepared:
    """:meth:`Placed.edges` as index arrays, the instances sorted by priority (step, graph
    order, chunk): what the prepared graph must equal."""
    u = placed.edges(steps)
    order = {name: i for i, name in enumerate(u.graph.topo_order())}
    insts = sorted(u.instances, key=lambda i: (i.step, order[i.op], i.chunk))
    index = {inst: k for k, inst in enumerate(insts)}
    waiting = [0] * len(insts)
    dependents: list[list[int]] = [[] for _ in insts]
    fed: list[list[int]] = [[] for _ in insts]
    for dep in u.deps:
        waiting[index[dep.dst]] += 1
        dependents[index[dep.src]].append(index[dep.dst])
        if dep.kind is not DepKind.ORDER or dep.data == "stream":
            fed[index[dep.src]].append(index[dep.dst])
    return _Prepared(tuple(insts), tuple(waiting), tuple(i.step for i in insts),
                     tuple(map(tuple, dependents)), tuple(map(tuple, fed)), dict(u.chunks),
                     tuple(i.op for i in insts), tuple((i.op, i.chunk) for i in insts))


@st.composite
def placed_graphs(draw) -> Placed:
    """A graph with its generate ops in random chunks and lanes, some carrying their
    streams, some readers sharing their writer's replica (on some of their blocks)."""
    graph = GRAPHS[draw(st.sampled_from(sorted(GRAPHS)))]
    chunks = draw(st.integers(1, 7))
    generate = [o.name for o in graph.ops if o.kind is OpKind.GENERATE]
    lanes = tuple((op, draw(st.integers(1, chunks))) for op in generate)
    carry = tuple((op, 1) for op in generate if draw(st.booleans()))
    behind = {e.reader: e.writer for e in graph.version_edges
              if graph.op(e.reader).kind is OpKind.SYNC_WEIGHTS}
    pairs = sorted({(e.writer, e.reader) for e in graph.version_edges}
                   | {(behind[e.writer], e.reader) for e in graph.version_edges
                      if e.writer in behind})
    in_place = frozenset(p for p in pairs if draw(st.booleans()))
    partly = []
    for pair in sorted(in_place):
        if draw(st.booleans()):
            n = draw(st.integers(2, 4))
            blocks = frozenset(draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=n - 1)))
            partly.append((pair, (n, blocks)))
    return Placed(graph, 0, chunks=chunks, lanes=lanes, carry=carry, in_place=in_place,
                  partly=tuple(partly))


@settings(deadline=None, max_examples=150)
@given(placed_graphs(), st.integers(1, 12))
def test_the_prepared_graph_is_the_placed_graphs_edges_indexed(placed, steps):
    assert _prepare_uncached(placed, steps) == indexed(placed, steps)


def test_a_chunked_stale_graph_prepares_as_its_edges():
    """One case written out: PPO at staleness 1, four chunks on two lanes, the trainer's
    replica shared with its weight sync and the sync's reader."""
    graph = GRAPHS[("ppo_llama8b", 1)]
    gen = next(o.name for o in graph.ops if o.kind is OpKind.GENERATE)
    in_place = frozenset((e.writer, e.reader) for e in graph.version_edges)
    placed = Placed(graph, 0, chunks=4, lanes=((gen, 2),), carry=((gen, 1),),
                    in_place=in_place)
    prep = _prepare_uncached(placed, 6)
    assert prep == indexed(placed, 6)
    assert sum(prep.waiting) == len(placed.edges(6).deps) > 0


@settings(deadline=None, max_examples=80)
@given(placed_graphs(), st.integers(1, 8))
def test_the_counts_preparation_is_the_prepared_graphs(placed, steps):
    """What the task count reads (:func:`fed`: no instances, waits or dependents made) is
    the prepared graph's, field for field, and cached by the same key."""
    prep, light = _prepare_uncached(placed, steps), fed(placed, steps)
    assert (light.step_of, light.fed, light.keys, light.counts) == \
        (prep.step_of, prep.fed, prep.keys, prep.counts)
    assert fed(placed, steps) is light
