"""Joins: one call through which the ranks of a large gang wait, instead of each waiting
for everything.

    >>> ranks = [OpCall(f"train/s0/r{r}", "train", OpKind.TRAIN, 0, r, rank=r, world=8,
    ...                 deps=("gen/s0/c0", "gen/s0/c1"), after=(f"w{r}",)) for r in range(8)]
    >>> join, ranks = join_gang(ranks)
    >>> join.id, join.device, join.deps, join.after[:2]
    ('train/s0/r0/join', 0, ('gen/s0/c0', 'gen/s0/c1'), ('w0', 'w1'))
    >>> ranks[5].deps, ranks[5].after
    (('train/s0/r0/join',), ('train/s0/r0/join',))
    >>> expand((Joined(({"x": 1}, {"x": 2})), {"y": 3}))
    [{'x': 1}, {'x': 2}, {'y': 3}]

The ranks of a gang (a data-parallel train op, a tensor-parallel block, a weight
transfer) start together: each waits for the union of their dependencies and for the
gang before it on every member's device (``rpeg.runtime.lowering.ordering.order_collectives``).
Copied into every rank that is ranks x union edges — a train op of 1,024 ranks reading
512 chunks has a million a step, which the lowering, the scheduling core, the fusion and
Dask's scheduler each walk. A gang of ``JOIN_MIN`` ranks or more waits instead through
one join call on its first rank's device (:func:`rpeg.cost.control.join_of`, the rule the
cost model counts by too): the join depends on the data every rank
reads (passed on as one :class:`Joined` value) and on everything else any rank waits
for; each rank depends on the join alone. The orderings are the same, in ranks + union
edges, for one small task more per gang, which the cost model counts
(``rpeg.cost.control``).

A join runs no op and leaves no trace event: the worker hands its inputs on as one value,
and a rank's call unpacks it into the arguments it would have had (:func:`expand`).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from rpeg.cost.control import join_of
from rpeg.graph.ids import OpId
from rpeg.runtime.lowering.calls import OpCall
from rpeg.runtime.lowering.replicas import CallRole
from rpeg.spec.model import OpKind  # noqa: F401 — the examples' op kinds

JOIN = CallRole.JOIN    # the role of a join call


@attrs.frozen
class Joined:
    """A join's result: the outputs of the calls it depends on, in its dependencies' order."""

    parts: tuple


def join_gang(ranks: Sequence[OpCall]) -> tuple[OpCall, tuple[OpCall, ...]] | None:
    """The join of a gang's ranks and the ranks waiting through it, or None for a gang
    under ``JOIN_MIN`` ranks, left as it is.

    Ranks reading the same data (every rank of a train op reads the whole step) take it
    from the join; ranks reading data of their own keep it and the join waits for it too.
    """
    at = join_of([r.device for r in ranks])
    if at is None:
        return None
    first = ranks[0]
    own = {r.id for r in ranks}
    shared = first.deps if all(r.deps == first.deps for r in ranks) else ()
    waits = dict.fromkeys(d for r in ranks for d in (r.after if shared else r.deps + r.after))
    join = attrs.evolve(first, id=OpId(first.id).joined, device=at, rank=0, world=1, tp_group=(),
                        role=JOIN, gang=(), sources=(), fills=(), model=None, version=-1,
                        writes=-1, bound=0, limit=0, carry=0, inputs=(), deps=shared,
                        after=tuple(d for d in waits if d not in own and d not in shared))
    return join, tuple(attrs.evolve(r, deps=(join.id,) if shared else r.deps,
                                    after=(join.id,)) for r in ranks)


def expand(args) -> list:
    """A call's arguments with each :class:`Joined` value unpacked into its parts."""
    out: list = []
    for a in args:
        if isinstance(a, Joined):
            out.extend(a.parts)
        else:
            out.append(a)
    return out
