"""A run's op calls, built a window of steps at a time.

    >>> calls = CallWindows(pipeline, plan, steps=200_000)          # doctest: +SKIP
    >>> table = calls.around(40, 50)   # steps 40 - 2r .. 50 + 2r, exactly  # doctest: +SKIP
    >>> len(table) < 1000                                            # doctest: +SKIP
    True

Building every call of a run before its first step makes start-up grow with the run's
length (200,000 steps: minutes before anything runs). A segment between two checkpoint
cuts needs only the calls near it: its own steps, those its cut pulls in from the next
few steps, and those whose outputs cross the cut. ``build_calls(first=...)`` builds the
calls of a stretch of steps; its first ``r`` steps (``r = lookback``: how far back any
dependency reaches) lack the writers of the versions they read, and its last ``r`` the
readers its writers wait for, so :meth:`CallWindows.around` builds ``r`` steps more on
each side than it keeps. What it keeps equals, call for call, what a build of the whole
run holds for those steps (tests/runtime/test_windows.py).
"""

from __future__ import annotations

from rpeg.errors import RuntimeFailure
from rpeg.runtime.core.cuts import Cuts
from rpeg.runtime.core.fusion import consumers_of
from rpeg.runtime.lowering.instances import OpCall, build_calls, lookback, placed_for

AHEAD = 64            # steps built past what a segment needs, so the next reuses the build


class CallWindows:
    """The calls of steps ``base``..``steps - 1`` of a run, a window at a time (``base``:
    the step the run (re)started from with every replica at that version, see
    ``build_calls``)."""

    def __init__(self, pipeline, plan, steps: int, base: int = 0) -> None:
        self.pipeline, self.plan, self.steps, self.base = pipeline, plan, steps, base
        self.reach = lookback(pipeline, plan)
        self._range = (0, 0)
        self._table: dict[str, OpCall] = {}
        self._fusion: tuple[tuple[str, ...], ...] | None = None

    @property
    def fusion(self) -> tuple[tuple[str, ...], ...]:
        """The fused stages the calls are packed into tasks by: those of the placed value
        they are laid out from (:attr:`rpeg.plan.lower.Placed.fusion`, :func:`placed_for`)."""
        if self._fusion is None:
            self._fusion = placed_for(self.pipeline, self.plan).fusion
        return self._fusion

    def around(self, start: int, end: int) -> dict[str, OpCall]:
        """Id -> call for every step from ``start - 2r`` to ``end + 2r`` (within the run),
        each call as the whole run's build has it; the dict is in build order."""
        r = self.reach
        lo, hi = max(self.base, start - 2 * r), min(self.steps, end + 2 * r)
        if self._range[0] <= lo and hi <= self._range[1] and self._table:
            return self._table
        first = max(self.base, lo - r)
        last = min(self.steps, max(hi, end + AHEAD) + r)
        keep_lo = first if first == self.base else first + r
        keep_hi = last if last == self.steps else last - r
        calls = build_calls(self.pipeline, self.plan, last, first=first)
        self._table = {c.id: c for c in calls if keep_lo <= c.step < keep_hi}
        self._range = (keep_lo, keep_hi)
        return self._table

    def sample(self) -> tuple[OpCall, ...]:
        """The calls of the run's first steps, enough to see every replica and layout it
        uses (the same from one step to the next once the staleness window has filled)."""
        return build_calls(self.pipeline, self.plan,
                           min(self.steps, self.base + 3 * self.reach + 2), first=self.base)


class SegmentCalls:
    """The calls around the segment a run is at: its table, cuts and consumers, built a
    window at a time (so a long run starts as fast as a short one) and kept while the
    next segment is inside the same window.

        >>> seg = SegmentCalls(CallWindows(pipeline, plan, steps=60))    # doctest: +SKIP
        >>> seg.move(0, 10, carry={})                                    # doctest: +SKIP
        >>> seg.cuts.carried(10)                                         # doctest: +SKIP
        {'rollout/s10/c0'}
    """

    def __init__(self, calls: CallWindows) -> None:
        self.calls = calls
        self.table: dict[str, OpCall] = {}
        self.cuts: Cuts | None = None
        self.consumers: dict[str, tuple[OpCall, ...]] = {}

    def move(self, start: int, end: int, carry) -> None:
        """Around the segment ``start``..``end``, which starts with the outputs ``carry``
        (op id -> value) made before its cut; each must be an op of the run."""
        table = self.calls.around(start, end)
        if table is not self.table:
            self.table = table
            self.cuts = Cuts(table)
            self.consumers = consumers_of(table.values())
        unknown = sorted(op for op in carry if op not in table)
        if unknown:
            raise RuntimeFailure(f"the checkpoint at step {start} carries outputs of op "
                                 f"'{unknown[0]}', which is not an op of this run's "
                                 f"{self.calls.steps} steps", hint="was run.json edited? "
                                 "resume with the steps the run was made with (--steps N)")
