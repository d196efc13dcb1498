"""Partial rollouts: a generate step decodes at most ``cap`` tokens of each response; a
response not finished by then is carried into the next step and continued there with the
newer weights (its tokens keep the logprobs of the policy that sampled them).

    >>> from rpeg.spec.model import LengthDist, LengthKind
    >>> p = Partial(LengthDist(LengthKind.UNIFORM, max_len=4000, low=0), 2000)
    >>> p.carries, round(p.rows, 2), round(p.context, 0)      # one carry; 1.5 rows a response
    (1, 1.5, 666.0)
    >>> float(p.quantiles(4).max()) <= 2000
    True

In the steady state every step starts as many new responses as the batch holds and
finishes as many (each response finishes once), while the engine decodes, per response
started, ``rows`` = E[ceil(length / cap)] sequences: the new ones and those carried. The
decoded lengths of one step are those segments — a carried response's first ``cap``,
its next ``cap`` ... and its remainder — so the step ends at the ``cap``-th decode step,
not at the batch's longest response. A carried sequence's key/value cache is rebuilt
under the new weights: its prompt grows by the tokens it already has (``context``,
averaged over the step's sequences), prefilled again.

A response spans ``carries + 1`` steps, so the oldest of its tokens was sampled with
weights ``carries`` updates older than the step's own: the plan's staleness for the
generate stage plus ``carries`` must stay within the spec's bound (see
:func:`max_carries`).

A plan states the carry (``StagePlacement.carry``), not the cap: each step also advances
the responses of the next ``carry`` steps, and a step ends when its own responses are all
done. A response started early advances by at most ``cap`` tokens in each step before
its own (:func:`step_budget`, which the engines apply), so in the steady state a step
decodes about an equal share of the longest response — the cap :func:`smallest_cap`
gives — and the sequences it decodes are exactly the segments above.
"""

from __future__ import annotations

import functools
import math

import attrs
import numpy as np

from rpeg.graph.versions import carry_room
from rpeg.spec.model import LengthDist

RESOLUTION = 4096          # quantiles of the length distribution the segments are cut from


@attrs.frozen
class Partial:
    """The lengths one step decodes under partial rollouts of ``cap`` tokens a step; it
    answers like a :class:`LengthDist` (``quantiles``, ``mean``, ``max_len``)."""

    base: LengthDist
    cap: int

    @property
    def max_len(self) -> int:
        return min(self.cap, self.base.max_len)

    @property
    def carries(self) -> int:
        """Most steps a response is carried into after the one it starts in."""
        return max(math.ceil(self.base.max_len / self.cap) - 1, 0)

    @property
    def rows(self) -> float:
        """Sequences decoded per step for every response the step starts (1: none carried)."""
        return _segments(self)[2]

    @property
    def context(self) -> float:
        """Mean tokens a step's sequence already generated in earlier steps."""
        return _segments(self)[1]

    @property
    def longest_context(self) -> float:
        """Most tokens a step's sequence already generated in earlier steps: what an engine
        that pads a batch to its longest context (rpeg's torch loop) re-prefills every
        sequence of the step to."""
        return _segments(self)[3]

    def quantiles(self, n: int = 64) -> np.ndarray:
        seg = _segments(self)[0]
        idx = ((np.arange(n) + 0.5) / n * len(seg)).astype(int).clip(0, len(seg) - 1)
        return seg[idx]

    def mean(self) -> float:
        return float(_segments(self)[0].mean())

    def finished_top(self, segment: float) -> float:
        """Longest whole response among those finishing within ``segment`` decoded tokens of
        a step: a carried one has ``cap`` tokens per earlier step before its last segment."""
        return float(min(self.base.max_len, self.carries * self.cap + segment))


@functools.lru_cache(maxsize=256)
def _segments(p: Partial) -> tuple[np.ndarray, float, float, float]:
    """(sorted segment lengths, mean earlier tokens per segment, segments per response,
    most earlier tokens of a segment)."""
    lengths = p.base.quantiles(RESOLUTION)
    pieces = np.ceil(lengths / p.cap).astype(int).clip(1)
    seg, before = [], []
    for k in range(int(pieces.max())):
        alive = lengths[pieces > k]
        seg.append(np.minimum(alive - k * p.cap, p.cap))
        before.append(np.full(len(alive), float(k * p.cap)))
    seg_all = np.sort(np.concatenate(seg))
    seg_all.flags.writeable = False
    earlier = np.concatenate(before)
    return seg_all, float(earlier.mean()), float(pieces.mean()), float(earlier.max())


def max_carries(bound: int, staleness: int) -> int:
    """Steps a response may be carried over when the generate stage reads weights
    ``staleness`` updates old and the spec bounds the age by ``bound``: the carry spends
    the bound (:func:`rpeg.graph.versions.carry_room`, the rule every layer uses)."""
    return carry_room(bound, staleness)


def smallest_cap(max_len: int, carries: int) -> int:
    """The fewest tokens a step may decode per response so that no response spans more than
    ``carries + 1`` steps (0: whole responses, no carry allowed)."""
    return 0 if carries <= 0 else math.ceil(max_len / (carries + 1))


def step_budget(max_len: int, carries: int, ahead: int) -> int:
    """Tokens each response of the cohort ``ahead`` steps after the current one may have
    when the current step's generate op ends (0: no limit, the step's own responses).

    The engines pace the cohorts they start early by this rule, so that a step decodes
    the share :func:`smallest_cap` prices: a response gets at most ``cap`` tokens in each
    step before its own. Without it a step that decodes to its own longest response
    carries the next cohort along as far, which then has nothing left for its own step:
    the steps alternate between whole responses and none.

        >>> [step_budget(20, 1, a) for a in (0, 1)]
        [0, 10]
        >>> [step_budget(20, 2, a) for a in (0, 1, 2)]
        [0, 14, 7]
    """
    if carries <= 0 or ahead <= 0:
        return 0
    return (carries + 1 - ahead) * smallest_cap(max_len, carries)
