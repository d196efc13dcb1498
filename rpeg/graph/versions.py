"""Which parameter version an op may read at a step: the one rule staleness means.

    >>> read_version(OpKind.GENERATE, step=5, lag=1)       # staleness 1: one update old
    4
    >>> readable(OpKind.GENERATE, step=5, lag=0, carry=1)  # synchronous, responses carried 1 step
    (4, 5)
    >>> readable(OpKind.TRAIN, step=5, lag=0)              # training reads its own step's version
    (5, 5)
    >>> carry_room(bound=1, lag=0), carry_room(bound=1, lag=1)
    (1, 0)

Version ``v`` of a model is the one ``v`` updates made: version 0 is the initial weights
and the train op of step ``s`` writes version ``s + 1``. An op that reads a trained model
with staleness ``lag`` (the plan's choice for its stage, 0 = synchronous) reads version
``max(0, s - lag)`` at step ``s``; a train op reads ``s``; a weight-sync op carries the
version its step's train op wrote, ``s + 1``.

A generate op with partial rollouts (``carry`` > 0) continues, at step ``s``, responses
it started up to ``carry`` steps earlier, so a response of step ``s`` holds tokens sampled
with versions ``max(0, s - lag - carry)`` .. ``max(0, s - lag)``: the carry spends the same
bound as the staleness. A spec's ``staleness STAGE <= K`` bounds every token:
``lag + carry <= K`` (:func:`carry_room`, :func:`bound_problem`).

The cost model and the simulator read these versions through the graph's version edges
(:func:`writer_step`), the runtime orders its op calls by :func:`read_version`, and
``rpeg verify`` checks each op's trace against :func:`readable` twice: with the plan's
staleness and carry, and with the spec's bound.
"""

from __future__ import annotations

from rpeg.spec.model import OpKind


def read_version(kind: OpKind, step: int, lag: int, first: int = 0) -> int:
    """The parameter version an op of ``kind`` with staleness ``lag`` reads at ``step``, in a
    run that started at step ``first`` with every replica at version ``first`` (a run
    extended past its end restarts so): no reader reads older than that."""
    if kind is OpKind.TRAIN:
        return step
    if kind is OpKind.SYNC_WEIGHTS:
        return step + 1
    return max(first, step - lag)


def writer_step(kind: OpKind, step: int, lag: int) -> int:
    """The step whose train op wrote the version read (-1: the initial weights)."""
    return read_version(kind, step, lag) - 1


def readable(kind: OpKind, step: int, lag: int, carry: int = 0) -> tuple[int, int]:
    """(oldest, newest) version any parameter an op's output depends on may have: for a
    generate op carrying responses over ``carry`` steps, its tokens'."""
    newest = read_version(kind, step, lag)
    if kind in (OpKind.TRAIN, OpKind.SYNC_WEIGHTS):
        return newest, newest
    return max(0, step - lag - carry), step


def carry_room(bound: int, lag: int) -> int:
    """Steps a generate stage may carry responses over when it reads weights ``lag``
    updates old and the spec bounds their age by ``bound``."""
    return max(bound - lag, 0)


def bound_problem(stage: str, lag: int, carry: int, bound: int) -> str | None:
    """Why a stage's staleness ``lag`` and ``carry`` break the spec's ``bound``, or None."""
    if lag < 0 or carry < 0:
        return f"stage '{stage}' staleness and carry must be at least 0, not {lag} and {carry}"
    if lag + carry <= bound:
        return None
    if not carry:
        return (f"stage '{stage}' must read weights at most {bound} updates old (the spec's "
                f"staleness bound), not {lag}")
    return (f"stage '{stage}' must read weights at most {bound} updates old, not "
            f"{lag + carry} (staleness {lag} + carry {carry}: a response's first tokens are "
            f"sampled {carry} steps before it is trained on)")
