"""Fit the engines' shared efficiency terms on published step times, and leave one source out.

    .venv/bin/python benchmarks/published_fit.py          # fit on every source, print the terms
    >>> loso = leave_one_source_out(results)             # doctest: +SKIP
    >>> loso["median_abs_log2"]                          # doctest: +SKIP
    0.58

The terms fitted are the ones every engine shares (:class:`rpeg.cost.engines.Efficiency`):
the host time of an eagerly launched kernel, of a Python decode step and of vLLM's
scheduler step, of a CUDA-graph replay, of a ZeRO-3 hook per parameter tensor, and the
share of data-parallel traffic hidden behind compute — the same on every engine, GPU kind
and source, each within its physical range (:data:`rpeg.cost.engines.BOUNDS`), never per
system or per row. Kernels run at the GPU profile's measured rates, which nothing fits.
The objective is the mean ``|log2(predicted / published)|`` over the rows' main figures,
with the phases a source splits (generation, training, old log-probabilities) at half
weight, by coordinate descent (in log space; the overlap in steps of its range). Rows
ReaL priced with a search keep the plan the search found with the terms as shipped.

Leave one source out: for each source, the terms fitted on every other source, then that
source's rows predicted with them; the median ``|log2 ratio|`` over all rows so predicted
is the figure that says whether the model carries over to a source it was not fitted to.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.published_rows import ROWS, Result, price  # noqa: E402
from rpeg.cost.engines import BOUNDS, EFFICIENCY, Efficiency, efficiency  # noqa: E402

# Where every fit starts: the terms as first estimated from the engines' documented
# behaviour (before any published time was looked at), so a held-out source never leaks in
# through the starting point.
PRIOR = Efficiency(launch_s=10e-6, generate_step_s=3e-3, vllm_step_s=3e-3, vllm_seq_s=30e-6,
                   graph_step_s=0.5e-3, hook_s=40e-6, grad_hook_s=40e-6, gemm=0.8,
                   overlap=0.5, call_s=0.5, controller_rate=1e9)
STEPS = (2.0, 1.41, 0.71, 0.5)      # multipliers tried per term each round (overlap: +-)
PHASE_WEIGHT = 0.5
NO_FIT_PENALTY = 3.0                 # |log2| charged for a row that does not fit (8x off)


def row_errors(results: list[Result]) -> dict[str, tuple[float, float]]:
    """Per row, (weighted sum of |log2 ratio|, weight): the main figure at weight 1, the
    phases at half weight, a row that does not fit charged :data:`NO_FIT_PENALTY`."""
    out = {}
    for r in results:
        if r.status == "unwritable":
            continue
        if r.status != "ok":
            out[r.row.id] = (NO_FIT_PENALTY, 1.0)
            continue
        total, weight = 0.0, 0.0
        for what, published in r.row.figures:
            got = r.predicted.get(what)
            if got is None or not math.isfinite(got) or got <= 0:
                continue
            w = 1.0 if what == r.row.main else PHASE_WEIGHT
            total += w * abs(math.log2(got / published))
            weight += w
        out[r.row.id] = (total, weight)
    return out


def loss(results: list[Result]) -> float:
    """Mean |log2 ratio| of the main figures, the phases at half weight."""
    errs = row_errors(results).values()
    weight = sum(w for _, w in errs)
    return sum(t for t, _ in errs) / weight if weight else 0.0


def evaluate(values: Efficiency, rows: list, plans: dict) -> list[Result]:
    """Every row priced with the shared terms ``values`` (searched rows on their plans)."""
    with efficiency(values):
        return [price(ROWS[rid], plan=plans.get(rid)) for rid in rows]


def _trial(term: str, v: float, step: float) -> float:
    lo, hi = BOUNDS[term]
    if term in ("overlap", "gemm"):             # a share: steps of its range
        return min(max(v + (step - 1) / 4, lo), hi)
    return min(max(v * step, lo), hi)


def fit(rows: list[str], plans: dict, start: Efficiency | None = None, rounds: int = 3,
        log=print) -> tuple[Efficiency, float]:
    """Coordinate descent over the shared terms on ``rows``; returns (terms, loss)."""
    values = start or PRIOR
    best = loss(evaluate(values, rows, plans))
    log(f"  start loss {best:.3f}")
    for k in range(rounds):
        improved = False
        for term in BOUNDS:
            for step in STEPS:
                v = getattr(values, term)
                trial = _trial(term, v, step)
                if trial == v:
                    continue
                cand = attrs.evolve(values, **{term: trial})
                got = loss(evaluate(cand, rows, plans))
                if got < best - 1e-4:
                    values, best, improved = cand, got, True
        log(f"  round {k + 1}: loss {best:.3f}  {_show(values)}")
        if not improved:
            break
    return values, best


def off_bound(values: Efficiency, term: str) -> Efficiency | None:
    """``values`` with ``term`` moved one step of the fit inward from the bound it sits on
    (None where it sits on neither)."""
    lo, hi = BOUNDS[term]
    v = getattr(values, term)
    if math.isclose(v, hi, rel_tol=1e-9):
        step = STEPS[2]
    elif math.isclose(v, lo, rel_tol=1e-9, abs_tol=1e-12):
        step = STEPS[1]
    else:
        return None
    if term not in ("overlap", "gemm") and v == 0.0:
        return attrs.evolve(values, **{term: lo + (hi - lo) / 100})
    return attrs.evolve(values, **{term: _trial(term, v, step)})


def pulls(values: Efficiency, term: str, rows: list[str], plans: dict,
          top: int = 3) -> list[tuple[str, float]]:
    """The rows that hold ``term`` on its bound: each row's weighted |log2| error (main
    figure and phases, as the fit counts it) with the term one step inside its range,
    less the error on the bound; the ``top`` largest rises, largest first. A term a single
    row holds on a bound is that row's missing cost, not a property of the hardware."""
    moved = off_bound(values, term)
    if moved is None:
        return []
    on, off = row_errors(evaluate(values, rows, plans)), row_errors(evaluate(moved, rows, plans))
    rises = sorted(((rid, off[rid][0] - on[rid][0]) for rid in on if rid in off),
                   key=lambda x: -x[1])
    return [(rid, round(d, 3)) for rid, d in rises[:top] if d > 1e-3]


def _show(values: Efficiency) -> str:
    return ", ".join(f"{k} {getattr(values, k):.3g}" for k in BOUNDS)


def searched_plans(results: list[Result]) -> dict:
    """The plans the rows priced by a search found, to price again without searching."""
    return {r.row.id: r.plan for r in results if r.plan is not None
            and r.row.strategy.value == "search"}


def leave_one_source_out(results: list[Result], rounds: int = 4, log=print,
                         only: tuple[str, ...] = ()) -> dict:
    """For each source (or each of ``only``): the terms fitted on the others, its rows
    predicted with them."""
    plans = searched_plans(results)
    ids = [r.row.id for r in results if r.status != "unwritable"]
    sources = sorted({ROWS[i].source for i in ids} & set(only) if only
                     else {ROWS[i].source for i in ids})
    per_source, errs = {}, []
    for src in sources:
        began = time.perf_counter()
        train = [i for i in ids if ROWS[i].source != src]
        held = [i for i in ids if ROWS[i].source == src]
        log(f"leave out {src} ({len(held)} rows)")
        trail: list[str] = []
        values, _ = fit(train, plans, rounds=rounds, log=_both(trail, log))
        got = evaluate(values, held, plans)
        e = [abs(math.log2(r.ratio)) for r in got if r.ratio]
        errs += e + [NO_FIT_PENALTY] * sum(r.status == "no-fit" for r in got)
        per_source[src] = {"rows": len(held), "median_abs_log2": _median(e),
                           "no_fit": sum(r.status == "no-fit" for r in got),
                           "terms": attrs.asdict(values), "at_bound": at_bound(values),
                           "pulled_by": {t: pulls(values, t, train, plans)
                                         for t in BOUNDS if off_bound(values, t)},
                           "ratios": {r.row.id: r.ratio for r in got},
                           "fit_rounds": trail,
                           "seconds": round(time.perf_counter() - began, 1)}
        per_source[src]["by_system"] = by_system(got)
        per_source[src]["levers"] = levers(values, held, plans)
        log(f"  held-out median |log2| {per_source[src]['median_abs_log2']:.3f}")
    out = {"per_source": per_source, "median_abs_log2": _median(errs), "rounds": rounds}
    if not only:
        out["profile"] = profile("call_s", ids, plans)
    return out


def by_system(got: list[Result]) -> dict[str, float]:
    """The held-out rows' median |log2 ratio| per system that ran them (a source such as
    ReaL's figure holds several systems' bars)."""
    out: dict[str, list[float]] = {}
    for r in got:
        if r.ratio:
            out.setdefault(r.row.system, []).append(abs(math.log2(r.ratio)))
    return {k: _median(v) for k, v in out.items()}


def levers(values: Efficiency, held: list[str], plans: dict,
           reference: Efficiency | None = None) -> dict[str, float]:
    """The held-out rows' median |log2 ratio| with each term the fold's fit moved (by more
    than 5% of itself and 1% of its range; a share by 5% of its range) put back at
    ``reference`` (the terms
    shipped, fitted on every source): a term whose return lowers the median a lot is one
    the other sources do not pin, and the held-out source's error lies there; one that
    leaves it where it is points at a cost none of the terms prices."""
    reference = reference or EFFICIENCY
    out = {}
    for term, (lo, hi) in BOUNDS.items():
        v, ref = getattr(values, term), getattr(reference, term)
        moved = abs(v - ref)
        if term in ("overlap", "gemm"):
            if moved <= 0.05 * (hi - lo):
                continue
        elif moved <= 0.05 * max(abs(v), abs(ref)) or moved <= 0.01 * (hi - lo):
            continue
        got = evaluate(attrs.evolve(values, **{term: ref}), held, plans)
        out[term] = _median([abs(math.log2(r.ratio)) for r in got if r.ratio])
    return out


# The values a profile prices a term at (:func:`profile`): call_s from a Ray actor call's
# round trip (1 ms) to its range's ceiling.
PROFILE_GRID = {"call_s": (0.001, 0.05, 0.5, 1.0, 2.0, 2.8, 4.0, 6.0, 8.0, 10.0)}


def profile(term: str, rows: list[str], plans: dict, values: Efficiency | None = None,
            grid: tuple[float, ...] | None = None) -> dict:
    """What each source, and each system, asks of ``term``: the fit's loss (the weighted
    mean |log2| of :func:`loss`) of its rows with ``term`` at each value of ``grid`` and every
    other term at ``values`` (the terms shipped). A source whose loss is flat over the grid
    says nothing of the term, so a fold that holds out the one source that pins it leaves the
    term to the others' noise; a system whose loss falls to a minimum at a value far outside
    the term's physical meaning pays a cost the term stands in for.

    Returns ``{"term", "grid": [...], "every row": [loss per value], "by_source": {source:
    [loss per value]}, "by_system": {...}}``,
    the sources and systems in the rows' order."""
    values = values or EFFICIENCY
    grid = tuple(grid or PROFILE_GRID[term])
    lo, hi = BOUNDS[term]
    priced = [evaluate(attrs.evolve(values, **{term: min(max(v, lo), hi)}), rows, plans)
              for v in grid]
    out: dict = {"term": term, "grid": list(grid),
                 "every row": [round(loss(got), 3) for got in priced],
                 "by_source": {}, "by_system": {}}
    for key, field in (("by_source", "source"), ("by_system", "system")):
        names = list(dict.fromkeys(getattr(ROWS[i], field) for i in rows))
        for name in names:
            out[key][name] = [round(loss([r for r in got if getattr(r.row, field) == name]), 3)
                              for got in priced]
    return out


def _both(trail: list[str], log):
    """A log that also keeps each line in ``trail``."""
    def out(line: str) -> None:
        trail.append(line.strip())
        log(line)
    return out


def at_bound(values: Efficiency) -> list[str]:
    """The terms of ``values`` a fit left on a bound of their range: the rows it was fitted
    to asked for more than the term can physically give (or say nothing of it)."""
    out = []
    for term, (lo, hi) in BOUNDS.items():
        v = getattr(values, term)
        if math.isclose(v, lo, rel_tol=1e-9, abs_tol=1e-12):
            out.append(f"{term} = {v:g} (its floor)")
        elif math.isclose(v, hi, rel_tol=1e-9):
            out.append(f"{term} = {v:g} (its ceiling)")
    return out


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def main() -> None:
    results = [price(row) for row in ROWS.values()]
    plans = searched_plans(results)
    ids = [r.row.id for r in results if r.status != "unwritable"]
    values, best = fit(ids, plans, rounds=6)
    print(f"fitted loss {best:.3f}")
    for term in BOUNDS:
        print(f"  {term:16s} {getattr(values, term):.4g}")


if __name__ == "__main__":
    main()
