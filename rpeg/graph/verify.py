"""Invariants of the RPEG IR, checked after every pass in tests.

    >>> verify(build(pipeline))           # doctest: +SKIP
    >>> verify_unrolled(unroll(graph, steps=3))          # doctest: +SKIP

A violation is a bug in a pass (or a hand-made graph), reported as a GraphError
naming the op and the broken rule.
"""

from __future__ import annotations

from collections import Counter

from rpeg.errors import GraphError
from rpeg.graph.ir import SAME_STEP, Graph
from rpeg.graph.order import Cycle, topological
from rpeg.graph.unroll import DepKind, Unrolled
from rpeg.spec.model import OpKind


def verify(g: Graph) -> Graph:
    names = Counter(o.name for o in g.ops)
    dup = [n for n, c in names.items() if c > 1]
    if dup:
        raise GraphError(f"op names must be unique; repeated: {', '.join(dup)}")
    ops = {o.name: o for o in g.ops}
    producers: dict[str, str] = {}
    for o in g.ops:
        for d in o.outputs:
            if d in producers:
                raise GraphError(f"'{d}' is written by '{producers[d]}' and '{o.name}'")
            if d in g.workload_data:
                raise GraphError(f"op '{o.name}' writes workload data '{d}'")
            producers[d] = o.name
    edges = {(e.src, e.dst, e.data) for e in g.data_edges}
    for o in g.ops:
        for d in o.inputs:
            if d in g.workload_data:
                continue
            if d not in producers:
                raise GraphError(f"op '{o.name}' reads '{d}', which no op writes")
            if (producers[d], o.name, d) not in edges:
                raise GraphError(f"missing data edge {producers[d]} -> {o.name} [{d}]")
    for e in g.data_edges:
        if e.src not in ops or e.dst not in ops:
            raise GraphError(f"data edge {e.src} -> {e.dst} names an op not in the graph")
        if e.data not in ops[e.src].outputs or e.data not in ops[e.dst].inputs:
            raise GraphError(f"data edge {e.src} -> {e.dst} [{e.data}] does not match the ops")
    try:
        g.topo_order()
    except Cycle as e:
        raise GraphError(f"data edges form a cycle inside one step: {', '.join(e.stuck)}"
                         ) from None
    _verify_versions(g, ops)
    return g


def _verify_versions(g: Graph, ops) -> None:
    writers = {o.writes_model: o for o in g.ops if o.kind is OpKind.TRAIN}
    syncs = {o.reads_model: o for o in g.ops if o.kind is OpKind.SYNC_WEIGHTS}
    readers = Counter(e.reader for e in g.version_edges)
    for e in g.version_edges:
        if e.writer not in ops or e.reader not in ops:
            raise GraphError(f"version edge {e.writer} -> {e.reader} names an op not in the graph")
        w, r = ops[e.writer], ops[e.reader]
        if w.writes_model != e.model or r.reads_model != e.model:
            raise GraphError(f"version edge {e.writer} -> {e.reader} is for '{e.model}', but "
                             f"the writer writes '{w.writes_model}' and the reader reads "
                             f"'{r.reads_model}'")
        if e.same_step and not (w.kind is OpKind.TRAIN and r.kind is OpKind.SYNC_WEIGHTS):
            raise GraphError(f"lag -1 (same step) is only for a train -> sync edge, not "
                             f"{e.writer} -> {e.reader}")
        if e.lag < SAME_STEP:
            raise GraphError(f"version edge {e.writer} -> {e.reader} has lag {e.lag} < 0")
        if r.kind is OpKind.GENERATE and w.kind is not OpKind.SYNC_WEIGHTS:
            raise GraphError(f"generate op '{r.name}' must read '{e.model}' through its "
                             "weight-sync op")
    for o in g.ops:
        m = o.reads_model
        if m is None:
            continue
        n = readers.get(o.name, 0)
        if m in writers and n != 1:
            raise GraphError(f"op '{o.name}' reads trained model '{m}' and needs exactly one "
                             f"version edge, has {n}")
        if m not in writers and n:
            raise GraphError(f"op '{o.name}' reads frozen model '{m}' yet has a version edge")
        if o.kind is OpKind.GENERATE and m in writers and m not in syncs:
            raise GraphError(f"generate op '{o.name}' reads '{m}' with no weight-sync op")
    members = {m for _, group in g.shared for m in group}
    for o in g.ops:
        if o.reads_model in members or o.writes_model in members:
            raise GraphError(f"op '{o.name}' names '{o.reads_model or o.writes_model}', which "
                             "is merged into a shared backbone")


def verify_unrolled(u: Unrolled) -> Unrolled:
    verify(u.graph)
    seen = set(u.instances)
    if len(seen) != len(u.instances):
        raise GraphError("op instances must be unique")
    lags = {(e.writer, e.reader): e.lag for e in u.graph.version_edges}
    incoming: dict = {i: [] for i in u.instances}
    for d in u.deps:
        if d.src not in seen or d.dst not in seen:
            raise GraphError(f"dependency {d.src} -> {d.dst} names an unknown instance")
        if d.kind is DepKind.DATA and d.src.step != d.dst.step:
            raise GraphError(f"data dependency {d.src} -> {d.dst} crosses steps")
        if d.kind is DepKind.VERSION:
            lag = lags[(d.src.op, d.dst.op)]
            if d.src.step != d.dst.step - 1 - lag:
                raise GraphError(f"version dependency {d.src} -> {d.dst} breaks lag {lag}")
        incoming[d.dst].append(d.src)
    try:
        topological(u.instances, incoming.get)
    except Cycle as e:
        raise GraphError(f"the unrolled graph has a dependency cycle: "
                         f"{', '.join(map(str, e.stuck[:5]))}") from None
    return u
