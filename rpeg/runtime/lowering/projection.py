"""The op calls a run executes, seen as the instance graph the cost model priced.

    >>> seen = project(build_calls(pipeline, plan, steps=4), graph)        # doctest: +SKIP
    >>> seen.instances == set(priced.instances)                            # doctest: +SKIP
    True

A call is one device's share of an instance (op, step, chunk): the ranks of a train op
or a tensor-parallel block, a weight sync's export and loads (or send and receives) are
one instance; a fused op's stages, run as calls of their own, are the fused instance. Its
data dependencies are the instance's data edges; its ordering ones (``after``) realise the
version and ordering edges, except those between collectives that share devices
(``collective``): gloo/NCCL need one order of them on every device, which the graph
leaves to the simulator's device exclusivity. A gang's join (``rpeg.runtime.lowering.joins``) is a
share of the gang's instance too.
"""

from __future__ import annotations

import attrs

from rpeg.graph import Graph, Instance
from rpeg.runtime.lowering.instances import base_of
from rpeg.runtime.lowering.joins import JOIN
from rpeg.spec.model import OpKind

Edge = tuple[Instance, Instance]


@attrs.frozen
class Projected:
    instances: frozenset[Instance]
    data: frozenset[Edge]            # from the calls' data dependencies
    order: frozenset[Edge]           # from their ordering dependencies
    collective: frozenset[Edge]      # ordering between collectives on common devices
    waits: dict                      # instance -> instances it waits for, transitively


def instance_of(call, op_of: dict[str, str]) -> Instance:
    """The instance a call is a share of (``op_of``: stage or op -> the graph's op)."""
    if call.kind is OpKind.SYNC_WEIGHTS:
        return Instance("sync_" + base_of(call.op.removeprefix("sync_")), call.step)
    return Instance(op_of.get(call.op, call.op), call.step, call.chunk)


def project(calls, graph: Graph) -> Projected:
    op_of = {s: o.name for o in graph.ops for s in (o.name,) + o.stages}
    table = {c.id: c for c in calls}
    of = {c.id: instance_of(c, op_of) for c in calls}
    data, order, collective = set(), set(), set()
    for c in calls:
        for d in c.deps:
            if of[d] != of[c.id]:
                data.add((of[d], of[c.id]))
        for d in c.after:
            if d not in table or of[d] == of[c.id]:
                continue
            both = _gang(table[d]) and _gang(c)
            (collective if both and (of[d], of[c.id]) not in data else order).add(
                (of[d], of[c.id]))
    return Projected(frozenset(of.values()), frozenset(data), frozenset(order - data),
                     frozenset(collective), closure(data | order | collective))


def _gang(call) -> bool:
    """A rank of a collective, or the join its gang waits through
    (``rpeg.runtime.lowering.joins``)."""
    return call.collective or call.role == JOIN


def closure(edges) -> dict:
    """Instance -> every instance it waits for through ``edges`` (pairs before -> after)."""
    before: dict = {}
    for a, b in edges:
        before.setdefault(b, set()).add(a)
    memo: dict = {}

    def up(i):
        if i not in memo:
            memo[i] = set()
            for a in before.get(i, ()):
                memo[i] |= {a} | up(a)
        return memo[i]

    return {i: frozenset(up(i)) for i in {e[1] for e in edges}}
