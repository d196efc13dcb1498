"""How a step's responses are dealt to a generate stage's data-parallel ranks: one rule, by
which the runtime's generate calls pick their responses
(``backends.torch_backend.sampling.positions``) and the cost model prices the busiest
rank's share (``rpeg.cost.generation.dealt_batch``).

The responses come in groups of ``group`` consecutive positions (a prompt with all its
samples where whole groups must stay together, under dynamic sampling; else one response
each); rank ``r`` of ``ranks`` gets groups ``r, r + ranks, ...``, each whole.

    >>> dealt(0, 2, 6, 1), dealt(1, 2, 6, 1)
    ((0, 2, 4), (1, 3, 5))
    >>> dealt(0, 2, 6, 2), dealt(1, 2, 6, 2)
    ((0, 1, 4, 5), (2, 3))
"""

from __future__ import annotations

import functools


def dealt(rank: int, ranks: int, responses: int, group: int = 1) -> tuple[int, ...]:
    """The positions, among a step's ``responses``, that rank ``rank`` of ``ranks``
    generates: groups ``rank, rank + ranks, ...`` of ``group`` consecutive positions each
    (the last group whole)."""
    group = max(group, 1)
    groups = -(-responses // group)
    return tuple(g * group + j for g in range(rank, groups, max(ranks, 1))
                 for j in range(group))


def deal_group(work) -> int:
    """The ``group`` a generate stage's ``work`` deals its responses in: a prompt with all
    its samples under dynamic sampling (``refill_rounds``: its refills replace whole
    groups), else one response."""
    return max(work.workload.samples, 1) if getattr(work, "refill_rounds", 0) else 1


@functools.lru_cache(maxsize=1024)
def emptiest_share(responses: int, ranks: int, group: int = 1) -> int:
    """The fewest responses :func:`dealt` gives any of ``ranks`` ranks: ``responses //
    ranks`` one at a time, fewer where whole groups go out unevenly.

        >>> emptiest_share(2048, 100), emptiest_share(2048, 100, 16)
        (20, 16)
    """
    return min(len(dealt(r, ranks, responses, group)) for r in range(max(ranks, 1)))


@functools.lru_cache(maxsize=1024)
def busiest_share(responses: int, ranks: int, group: int = 1) -> int:
    """The most responses :func:`dealt` gives any of ``ranks`` ranks: the share the step
    waits for.

        >>> busiest_share(2048, 100), busiest_share(2048, 100, 16)
        (21, 32)
    """
    return max(len(dealt(r, ranks, responses, group)) for r in range(max(ranks, 1)))


__all__ = ["busiest_share", "deal_group", "dealt", "emptiest_share"]
