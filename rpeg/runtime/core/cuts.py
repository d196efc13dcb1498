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

from collections import defaultdict

import attrs

from rpeg.runtime.lowering.instances import OpCall


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


class Cuts:
    """:func:`closure`, :func:`carried` and :func:`core_view` of one run's table, each in
    time proportional to the steps it concerns (the functions above scan the whole run's
    table, so a long run's checkpoints would cost more and more). Same answers. The table
    may be a window of the run's calls (``rpeg.runtime.core.windows``): a dependency on a call
    before it is one on a call done before the window's cuts.

        >>> cuts = Cuts(table)                                       # doctest: +SKIP
        >>> cuts.closure(20) == closure(table, 20)                   # doctest: +SKIP
        True
    """

    def __init__(self, table: dict[str, OpCall]) -> None:
        self.table = table
        self.order = {i: k for k, i in enumerate(table)}
        self.by_step: dict[int, list[str]] = defaultdict(list)
        self.reach = 0                              # the most steps any dependency reaches back
        for i, c in table.items():
            self.by_step[c.step].append(i)
            for d in c.all_deps:
                if d in table:
                    self.reach = max(self.reach, c.step - table[d].step)
        self._done: dict[int, tuple[frozenset[str], int]] = {}   # cut -> (closure, top step)

    def _closure(self, cut: int) -> tuple[frozenset[str], int]:
        if cut in self._done:
            return self._done[cut]
        base = max((b for b in self._done if b <= cut), default=None)
        out, top = (set(self._done[base][0]), self._done[base][1]) if base is not None \
            else (set(), -1)
        stack = [i for s in range(base or 0, cut) for i in self.by_step.get(s, ())]
        while stack:
            i = stack.pop()
            if i in out or i not in self.table:     # a call before a window: done already
                continue
            out.add(i)
            top = max(top, self.table[i].step)
            stack.extend(self.table[i].all_deps)
        if len(self._done) >= 4:
            self._done.pop(min(self._done))
        self._done[cut] = (frozenset(out), top)
        return self._done[cut]

    def closure(self, cut: int) -> set[str]:
        return set(self._closure(cut)[0])

    def carried(self, cut: int) -> set[str]:
        """:func:`carried` of ``closure(cut)``: every op of a step below the cut is inside, so
        a reader outside is at the cut or later, and no more than ``reach`` steps after the
        latest op inside."""
        inside, top = self._closure(cut)
        out = set()
        for s in range(cut, top + self.reach + 1):
            for r in self.by_step.get(s, ()):
                if r not in inside:
                    out.update(d for d in self.table[r].deps if d in inside)
        return out

    def segment(self, start: int, end: int) -> tuple[set[str], set[str]]:
        """(the ops a segment from the cut at ``start`` to the cut at ``end`` runs, every op
        inside the cut at ``end``): those inside it and not inside the one at ``start``."""
        inside = self.closure(end)
        return inside - (self.closure(start) if start else set()), inside

    def core_view(self, seg: set[str], end: int) -> list[OpCall]:
        return core_view({i: self.table[i] for i in sorted(seg, key=self.order.__getitem__)},
                         seg, end)
