"""Graph rewrites the planner chooses: fusion of adjacent per-sample ops.

    >>> from rpeg.spec import load                                     # doctest: +SKIP
    >>> g = build(load("pipelines/ppo_llama8b.rpeg"))     # doctest: +SKIP
    >>> fusable(g)                                                       # doctest: +SKIP
    (('ref_lp', 'values'), ('ref_lp', 'scores'), ...)
    >>> fuse(g, (("ref_lp", "values"),)).op("ref_lp+values").stages      # doctest: +SKIP
    ('ref_lp', 'values')

Fusing merges two ops into one that runs both back to back on the same devices:
one dispatch instead of two, and the pair streams chunk by chunk together. Only
per-sample ops (forward, score, compute) fuse, at most one of them may read a
trained model (an op carries one version edge), and no third op may lie on a
path between them (that would make a cycle).
"""

from __future__ import annotations

import attrs

from rpeg.errors import GraphError
from rpeg.graph import DataEdge, Graph, Op
from rpeg.spec.model import OpKind


def fusable(graph: Graph) -> tuple[tuple[str, str], ...]:
    """Pairs of ops (graph order) that :func:`fuse` accepts."""
    ops = [o for o in graph.ops if o.per_sample]
    out = []
    for i, a in enumerate(ops):
        for b in ops[i + 1:]:
            if _can_fuse(graph, a, b):
                out.append((a.name, b.name))
    return tuple(out)


def fused_graph(graph: Graph, groups: tuple[tuple[str, ...], ...]) -> Graph:
    """:func:`fuse` memoised by the graph object (its ops hold their stages' work, which no
    equality compares): the plan's graph as the cost model times it
    (``rpeg.plan.structure.fused_of``) and the fused view of the plan's placed graph
    (:meth:`rpeg.plan.lower.Placed.fused`) are one object; ``graph`` itself without groups."""
    if not groups:
        return graph
    key = (id(graph), groups)
    hit = _FUSED.get(key)
    if hit is not None and hit[0] is graph:
        return hit[1]
    if len(_FUSED) > 1024:
        _FUSED.clear()
    out = fuse(graph, groups)
    _FUSED[key] = (graph, out)          # the graph kept: its id names no other meanwhile
    return out


_FUSED: dict[tuple[int, tuple], tuple[Graph, Graph]] = {}


def fuse(graph: Graph, groups: tuple[tuple[str, ...], ...]) -> Graph:
    """Merge each group of ops (named by op or by stage) into one op, in order."""
    for group in groups:
        names = [_op_of(graph, s) for s in group]
        names = list(dict.fromkeys(names))
        while len(names) > 1:
            a, b = graph.op(names[0]), graph.op(names[1])
            if not _can_fuse(graph, a, b):
                raise GraphError(f"ops '{a.name}' and '{b.name}' must be fusable (per-sample, "
                                 f"one versioned model, no op between them), not "
                                 f"{a.kind.value} and {b.kind.value}", b.span)
            graph = _fuse_pair(graph, a, b)
            names = [f"{a.name}+{b.name}"] + names[2:]
    return graph


def _op_of(graph: Graph, stage: str) -> str:
    for o in graph.ops:
        if stage == o.name or stage in o.stages:
            return o.name
    raise GraphError(f"fusion names a stage the graph must have, not '{stage}'")


def _versioned(graph: Graph, op: str) -> bool:
    return any(e.reader == op for e in graph.version_edges)


def _can_fuse(graph: Graph, a: Op, b: Op) -> bool:
    if not (a.per_sample and b.per_sample):
        return False
    if _versioned(graph, a.name) and _versioned(graph, b.name):
        return False
    return not (_reaches(graph, a.name, b.name, direct=False)
                or _reaches(graph, b.name, a.name, direct=False))


def _reaches(graph: Graph, src: str, dst: str, direct: bool) -> bool:
    """Is there a path src -> ... -> dst through at least one other op (direct=False)?"""
    frontier = [c for c in graph.consumers(src) if c != dst or direct]
    seen = set(frontier)
    while frontier:
        n = frontier.pop()
        if n == dst:
            return True
        for c in graph.consumers(n):
            if c not in seen:
                seen.add(c)
                frontier.append(c)
    return False


def _fuse_pair(graph: Graph, a: Op, b: Op) -> Graph:
    name = f"{a.name}+{b.name}"
    reads = a.reads_model if _versioned(graph, a.name) or not _versioned(graph, b.name) \
        else b.reads_model
    if reads is None:
        reads = b.reads_model
    inputs = tuple(dict.fromkeys(i for i in a.inputs + b.inputs if i not in a.outputs))
    merged = Op(name, a.kind if a.kind is b.kind else b.kind, inputs, a.outputs + b.outputs,
                reads, None, a.stages + b.stages, a.span, grouped=a.grouped or b.grouped,
                work=a.work + b.work)
    rename = {a.name: name, b.name: name}
    ops = []
    for o in graph.ops:
        if o.name == a.name:
            ops.append(merged)
        elif o.name != b.name:
            ops.append(o)
    data = tuple(dict.fromkeys(
        DataEdge(rename.get(e.src, e.src), rename.get(e.dst, e.dst), e.data)
        for e in graph.data_edges if not (e.src in rename and e.dst in rename)))
    versions = tuple(attrs.evolve(e, reader=rename.get(e.reader, e.reader),
                                  writer=rename.get(e.writer, e.writer))
                     for e in graph.version_edges)
    return attrs.evolve(graph, ops=tuple(ops), data_edges=data, version_edges=versions)


__all__ = ["fusable", "fuse", "fused_graph"]


def elide_syncs(graph: Graph, in_place: frozenset[str]) -> Graph:
    """Drop the weight-sync op of every model in ``in_place`` (its generate readers read the
    trainer's weights where they are, :func:`rpeg.plan.oplayout.all_in_place`): they read the train op's
    version directly, with the same staleness."""
    syncs = {o.name: o.reads_model for o in graph.ops
             if o.kind is OpKind.SYNC_WEIGHTS and o.reads_model in in_place}
    if not syncs:
        return graph
    writer = {o.writes_model: o.name for o in graph.ops if o.kind is OpKind.TRAIN}
    edges = tuple(attrs.evolve(e, writer=writer[e.model]) if e.writer in syncs else e
                  for e in graph.version_edges if e.reader not in syncs)
    return attrs.evolve(graph, ops=tuple(o for o in graph.ops if o.name not in syncs),
                        version_edges=edges)
