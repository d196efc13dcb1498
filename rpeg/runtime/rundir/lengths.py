"""The response lengths a run generated, against the ones its workload declares.

The cost model prices a plan at the workload's ``gen_len``; a run generates what its
policy answers, and the policy learns: the toy task's untrained model rarely ends a
response (nearly every one runs to ``max_len``), and training moves the lengths up or
down (to about the answers' lengths, or back to ``max_len`` when a run settles on
answers that never end). A run whose responses are twice the declared length does
twice the decoding that was priced, and its step time says so without the plan being
wrong for the workload it was given. So the record keeps both: the measured lengths
(``measured.response_tokens``) and the same plan priced at them
(``predicted.at_measured_lengths_s``), beside the plan's one prediction.

The lengths are the steady steps' (the ones ``measured.step_time_s`` is the median of):
each generate op reports a histogram of its responses' lengths (``stats.lengths``).

    >>> dist = measured_dist({12: 3, 20: 1})
    >>> dist.kind.value, dist.max_len, dist.mean()
    ('empirical', 20, 14.0)
    >>> measured_dist({}) is None
    True

Imports no torch.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import attrs

from rpeg.spec.model import LengthDist, LengthKind


def histogram(lengths) -> dict[str, int]:
    """``{length: count}`` of a generate op's responses (JSON keys: strings)."""
    return {str(k): int(v) for k, v in sorted(Counter(int(n) for n in lengths).items())}


def measured_dist(counts: dict[int, float]) -> LengthDist | None:
    """The empirical distribution of the measured ``{length: count}`` (None: nothing)."""
    bins = tuple((int(n), float(w)) for n, w in sorted(counts.items()) if n > 0 and w > 0)
    if not bins:
        return None
    return LengthDist(LengthKind.EMPIRICAL, max_len=bins[-1][0], bins=bins)


def steady_counts(path: Path, steps: set[int]) -> dict[int, int]:
    """The lengths' histogram over ``steps``, from the generate ops' ``stats.lengths`` in
    the trace (empty for a trace without them)."""
    counts: Counter = Counter()
    for e in _generate_events(path):
        if e.get("step") in steps:
            for n, c in (e.get("stats", {}).get("lengths") or {}).items():
                counts[int(n)] += c
    return dict(counts)


def response_tokens(path: Path, pipeline, steady: list[dict]
                    ) -> tuple[dict, LengthDist | None] | None:
    """(``{"mean", "declared", "steps", "longest"}``, the measured distribution): the mean
    tokens a response over the ``steady`` rows' steps against the workload's declared
    mean, and their histogram. A trace without histograms (an older run) gives the steps'
    mean lengths (``response_len``) and no distribution: a batch decodes to its longest
    response, which a mean does not tell. None when those steps generated nothing."""
    steps = {r["step"] for r in steady if isinstance(r.get("step"), int)}
    if not steps:
        return None
    declared = round(pipeline.workload.gen_len.mean(), 3)
    span = f"{min(steps)}..{max(steps)}"
    dist = measured_dist(steady_counts(path, steps))
    if dist is not None:
        return ({"mean": round(_mean(dict(dist.bins)), 3), "declared": declared,
                 "steps": span, "longest": dist.max_len}, dist)
    means = [r["response_len"] for r in steady if isinstance(r.get("response_len"), (int, float))]
    if not means:
        return None
    return {"mean": round(sum(means) / len(means), 3), "declared": declared, "steps": span}, None


def at_lengths(pipeline, dist: LengthDist):
    """``pipeline`` with its workload's responses at ``dist`` (no longer than the longest
    the workload allows: a stage's ``max_len`` caps the declared distribution already)."""
    declared = pipeline.workload.gen_len
    if dist.max_len > declared.max_len:
        bins = tuple((min(n, declared.max_len), w) for n, w in dist.bins)
        dist = attrs.evolve(dist, max_len=declared.max_len, bins=bins)
    dist = attrs.evolve(dist, floor=declared.floor)
    return attrs.evolve(pipeline, workload=attrs.evolve(pipeline.workload, gen_len=dist))


def _mean(counts: dict[int, float]) -> float:
    total = sum(counts.values())
    return sum(n * w for n, w in counts.items()) / total if total else 0.0


def _generate_events(path: Path) -> list[dict]:
    """The trace's generate ops (``args`` with ``step`` and ``stats``); none without a trace."""
    import json
    try:
        trace = json.loads((path / "trace.json").read_text())
    except (OSError, ValueError):
        return []
    return [e.get("args", {}) for e in trace.get("traceEvents", [])
            if isinstance(e, dict) and e.get("ph") == "X" and e.get("cat") == "generate"]
