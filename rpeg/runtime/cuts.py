"""Checkpoint cuts: which op calls every step before B needs, and what crosses the cut.

    >>> table = {c.id: c for c in build_calls(pipeline, plan, steps=6)}   # doctest: +SKIP
    >>> inside = closure(table, 2)                                         # doctest: +SKIP
    >>> sorted(carried(table, inside))[:1]                                 # doctest: +SKIP
    ['rollout/s2/c0']

A cut at step B holds every op of steps < B and, transitively, what they depend
on (with staleness k, generation of step B reads version B - 1 and must run
before training overwrites it: the write-after-read edges pull it in). The ops
inside a cut whose outputs an op outside it reads are *carried*: checkpointed
with the replicas, scattered back when the next segment starts.
"""

from __future__ import annotations

import attrs

from rpeg.runtime.instances import OpCall


def closure(table: dict[str, OpCall], cut: int) -> set[str]:
    """Ids of every op that ops of steps < ``cut`` depend on, transitively (and those ops)."""
    out: set[str] = set()
    stack = [i for i, c in table.items() if c.step < cut]
    while stack:
        i = stack.pop()
        if i in out:
            continue
        out.add(i)
        stack.extend(table[i].all_deps)
    return out


def carried(table: dict[str, OpCall], inside: set[str]) -> set[str]:
    """Ops inside a cut whose outputs an op outside it reads."""
    return {d for i, c in table.items() if i not in inside for d in c.deps if d in inside}


def core_view(table: dict[str, OpCall], seg: set[str], end: int) -> list[OpCall]:
    """The segment's calls as the scheduling core sees them: dependencies inside the segment
    only, and ops of steps >= end (generation pulled in by the cut) counted in step end - 1."""
    return [attrs.evolve(c, step=min(c.step, end - 1),
                         deps=tuple(d for d in c.deps if d in seg),
                         after=tuple(a for a in c.after if a in seg))
            for i, c in table.items() if i in seg]
