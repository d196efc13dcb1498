"""The one topological order: every node after the nodes it depends on, ties by a key.

    >>> deps = {"a": (), "b": ("a",), "c": ()}
    >>> topological(["b", "c", "a"], deps.get)
    ('c', 'a', 'b')
    >>> topological(["b", "c", "a"], deps.get, key=lambda n: n)
    ('a', 'b', 'c')

Among the nodes whose dependencies are all placed, the one with the least ``key`` goes
next (default: its position in ``nodes``), so the order is stable: a list already in
dependency order comes back unchanged. Dependencies that are not nodes are ignored. The
step graph's op order (:meth:`rpeg.graph.ir.Graph.topo_order`), the runtime's call order
(:mod:`rpeg.runtime.lowering.instances`), the scheduling core's submission order and the in-process
run's execution order are all this function.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T", bound=Hashable)


class Cycle(ValueError):
    """Some nodes wait on each other; ``stuck`` holds them (never placed), sorted."""

    def __init__(self, stuck: list) -> None:
        super().__init__(f"dependency cycle among {stuck[:5]}")
        self.stuck = stuck


def topological(nodes: Sequence[T], deps: Callable[[T], Iterable[T] | None], *,
                key: Callable[[T], object] | None = None) -> tuple[T, ...]:
    """``nodes`` in dependency order (see the module doc); :class:`Cycle` if there is none."""
    position = {n: i for i, n in enumerate(nodes)}
    rank = {n: (key(n) if key else position[n], position[n]) for n in nodes}
    waits: dict[T, int] = {}
    users: dict[T, list[T]] = defaultdict(list)
    for n in nodes:
        ds = {d for d in deps(n) or () if d in position and d != n}
        waits[n] = len(ds)
        for d in ds:
            users[d].append(n)
    ready = [(rank[n], n) for n in nodes if waits[n] == 0]
    heapq.heapify(ready)
    out: list[T] = []
    while ready:
        _, n = heapq.heappop(ready)
        out.append(n)
        for u in users[n]:
            waits[u] -= 1
            if waits[u] == 0:
                heapq.heappush(ready, (rank[u], u))
    if len(out) != len(nodes):
        raise Cycle(sorted(set(nodes) - set(out), key=str))
    return tuple(out)
