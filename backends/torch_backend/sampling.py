"""DAPO's dynamic sampling: groups whose rewards are all equal are refilled with new prompts.

    >>> degenerate(np.array([1.0, 1.0, 0.0, 1.0]), np.array([0, 0, 1, 1]))
    [0]

A generate stage with ``refill_rounds = R`` generates its share of the step's groups
(whole groups per device), scores them with the python rewards of the score stages
that read its responses (their weighted sum, as the estimator will see it), and
replaces every group whose scores are all equal -- it gives no gradient -- by a
group of a new prompt, in at most R extra rounds; the last round's groups stay
whatever they score. The step's chunks then stream the final responses.

A response's prompt index says where its prompt came from: ``round * batch +
position``, ``position`` in the step's responses (prompt ``position // samples``
of that round's draw), so the score stages and the estimator find its prompt,
answer and group (``index // samples``) without being told about the rounds.
"""

from __future__ import annotations

import attrs
import numpy as np

from backends.api import RolloutChunk, concat_chunks, select_chunk
from rpeg.graph.deal import dealt
from rpeg.runtime.data import Cursor, step_rows

ROUND_SEED = 1_000_003        # round r of a step draws its prompts with seed + r * ROUND_SEED


def round_rows(rows: list[dict], workload, step: int, rnd: int,
               cursor: Cursor = Cursor()) -> list[dict]:
    """The step's rows (each repeated ``samples`` times) as drawn for round ``rnd``
    (``cursor``: where the run reads its prompts from, a resume's)."""
    w = workload
    return step_rows(rows, w.prompts, w.samples, w.seed + rnd * ROUND_SEED, step, cursor)


def rows_for(rows: list[dict], workload, step: int, index,
             cursor: Cursor = Cursor()) -> list[dict]:
    """The dataset row of each response, from its prompt index (see the module doc)."""
    n = workload.prompts * workload.samples
    drawn: dict[int, list[dict]] = {}
    out = []
    for i in np.asarray(index, dtype=np.int64).tolist():
        rnd, pos = divmod(int(i), n)
        if rnd not in drawn:
            drawn[rnd] = round_rows(rows, workload, step, rnd, cursor)
        out.append(drawn[rnd][pos])
    return out


def positions(rank: int, ranks: int, workload, whole_groups: bool) -> np.ndarray:
    """The step's response positions data-parallel rank ``rank`` of ``ranks`` generates, as
    the rule deals them (:func:`rpeg.graph.deal.dealt`, which the cost model prices by):
    responses ``rank, rank + ranks, ...``, or where whole groups must stay together, prompts
    ``rank, rank + ranks, ...``, each with all its samples."""
    w = workload
    group = w.samples if whole_groups else 1
    return np.array(dealt(rank, ranks, w.prompts * w.samples, group), dtype=np.int64)


def degenerate(scores: np.ndarray, groups: np.ndarray) -> list[int]:
    """Groups whose scores are all equal (no learning signal)."""
    return [int(g) for g in np.unique(groups) if np.ptp(scores[groups == g]) == 0.0]


def select(chunk: RolloutChunk, keep: np.ndarray) -> RolloutChunk:
    return select_chunk(chunk, np.nonzero(keep)[0])


def concat(parts: list[RolloutChunk]) -> RolloutChunk:
    return concat_chunks(parts)


def split(chunk: RolloutChunk, pieces: int) -> list[RolloutChunk]:
    """``chunk`` in ``pieces`` consecutive parts (as even as can be, none empty)."""
    bounds = np.array_split(np.arange(len(chunk)), max(1, min(pieces, len(chunk))))
    return [select(chunk, np.isin(np.arange(len(chunk)), b)) for b in bounds]


@attrs.frozen
class Refilled:
    chunk: RolloutChunk
    rounds: int               # extra rounds run
    filtered: int             # groups replaced
    checked: int              # groups whose rewards were looked at (filtered / checked: the
                              # measured filter rate, against the declared filter_rate)


def refill(index: np.ndarray, generate, scores, samples: int, batch: int,
           rounds: int) -> Refilled:
    """Dynamic sampling over the responses at step positions ``index`` (whole groups).

    ``generate(index, rnd)`` -> a chunk of responses to those positions' prompts as drawn
    for round ``rnd`` (prompt_index already the positions, before the round's offset);
    ``scores(chunk)`` -> their combined scores."""
    pending = _offset(generate(index, 0), 0, batch)
    kept: list[RolloutChunk] = []
    filtered, done, checked = 0, 0, 0
    for rnd in range(1, rounds + 1):
        groups = pending.prompt_index // samples
        bad = degenerate(scores(pending), groups)
        checked += len(np.unique(groups))
        if not bad:
            break
        drop = np.isin(groups, bad)
        kept.append(select(pending, ~drop))
        filtered += len(bad)
        positions = pending.prompt_index[drop] % batch
        pending = _offset(generate(positions, rnd), rnd, batch)
        done = rnd
    return Refilled(concat(kept + [pending]) if kept else pending, done, filtered, checked)


def _offset(chunk: RolloutChunk, rnd: int, batch: int) -> RolloutChunk:
    return attrs.evolve(chunk, prompt_index=chunk.prompt_index + rnd * batch)
