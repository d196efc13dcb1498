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


def dealt(rank: int, ranks: int, responses: int, group: int = 1) -> tuple[int, ...]:
    """The positions, among a step's ``responses``, that rank ``rank`` of ``ranks``
    generates: groups ``rank, rank + ranks, ...`` of ``group`` consecutive positions each
    (the last group whole)."""
    group = max(group, 1)
    groups = -(-responses // group)
    return tuple(g * group + j for g in range(rank, groups, max(ranks, 1))
                 for j in range(group))


__all__ = ["dealt"]
