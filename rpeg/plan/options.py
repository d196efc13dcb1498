"""What a search is asked to do, and what it did: values a plan records so it can be remade.

    >>> opts = SearchOptions(seed=1, iterations=300)
    >>> opts.iterations, opts.time_cap_s
    (300, 600.0)
    >>> SearchRecord(opts, proposals=420, time_capped=False).reproducible
    True

The search's budget is a count of proposals (``iterations`` per walk, ``patience``
proposals without a better plan end a walk early), never a time: the same inputs,
options and seed give the same plan on any machine under any load. ``time_cap_s`` is
a safety limit on the wall-clock seconds of the whole search; a search that reaches
it stops where the machine's speed put it, and its :class:`SearchRecord` says so
(``time_capped``), as ``rpeg compile`` does.

These are the only defaults of the search: ``rpeg compile``, ``rpeg diff --cluster``
and the plan ``rpeg run`` compiles all read them from here.
"""

from __future__ import annotations

import enum

import attrs

from rpeg.plan.space import Limits

__all__ = ["MAX_SEED", "MAX_ITERATIONS", "Method", "Start", "SearchOptions", "SearchRecord"]

# The most proposals a walk may be given (``--budget``). A walk remembers every plan it
# proposed (a repeat is not priced again) and the evaluator every step graph and op it
# priced, so a search's memory grows with its budget: about 17 KB a proposal for
# ppo_llama8b on gh200_64 (peak RSS at 200 and 1,000 proposals a walk, patience off, three
# walks: 84 and 124 MB), so 1.7 GB a walk at this bound, 22x the default's.
MAX_ITERATIONS = 100_000


class Method(enum.Enum):
    ANNEAL = "anneal"       # simulated annealing (the default)
    RANDOM = "random"       # random sampling: every proposal from the start plan, keep the best
    GREEDY = "greedy"       # hill climbing: accept improvements only


class Start(enum.Enum):
    BASELINES = "baselines"  # from the best baseline; a stalled walk restarts from the others
    RANDOM = "random"        # from a random plan, no baseline as a start or a restart: what
                             # the search finds on its own (benchmarks/planner.py)


MAX_SEED = 2**63 - 1        # a seed a plan file holds (19 digits; its reader takes 20)


@attrs.frozen
class SearchOptions:
    seed: int = 0
    iterations: int = 4500           # the budget: proposals evaluated per walk
    patience: int = 1000             # stop after this many proposals without a better plan
    stall: int = 700                 # a walk this long without bettering itself starts afresh
    t_start: float = 0.05            # initial temperature, as a fraction of the start step time
    t_end: float = 0.0005
    restart_every: int = 600
    chains: int = 1                  # independent walks from the start, sharing the budget
    method: Method = Method.ANNEAL
    start: Start = Start.BASELINES
    limits: Limits = attrs.field(factory=Limits.runtime)   # rpeg's runtime, as declared
    steps: int | None = None         # simulated steps (None: simulate.steps_for the staleness)
    time_cap_s: float = 600.0        # safety cap on the whole search's wall-clock seconds
    staleness_cap: int | None = None  # plan under every staleness bound capped at this
                                      # (`rpeg run --staleness K`); None: the spec's bounds


@attrs.frozen
class SearchRecord:
    """The options a plan was searched with and how the search ended (in plan.json)."""

    options: SearchOptions
    proposals: int = 0               # proposals made over every walk
    time_capped: bool = False        # stopped by ``options.time_cap_s``, not by its budget

    @property
    def reproducible(self) -> bool:
        """Whether the same inputs give this plan again anywhere (the budget ended it)."""
        return not self.time_capped
