"""rpeg's GPU cost model against step times other systems published.

    .venv/bin/python benchmarks/published.py            # every row, and leave-one-source-out
    .venv/bin/python benchmarks/published.py --quick    # the rows priced without a search
    .venv/bin/python benchmarks/published.py --only ORB  # rows whose id starts so
    .venv/bin/python benchmarks/published.py --hold-out real-weak-scaling
                                    # every row, then that source left out alone
                                    # (results/published_holdout.json and .md)
    .venv/bin/python benchmarks/published.py --folds-from a.json --folds-from b.json
                                    # every row; the leave-one-source-out folds taken from
                                    # hold-out runs' JSON (folds are independent of each
                                    # other, so runs that split the sources add up to one)

Writes benchmarks/results/published.json and benchmarks/results/published.md: per row the
published figure and rpeg's prediction (and per phase where the source splits the step),
then the aggregates over the rows (:func:`benchmarks.published_rows.aggregates`) and,
where the cost model has fitted engine terms, the leave-one-source-out figure: the terms
fitted on every source but one, that source's rows predicted with them
(:mod:`benchmarks.published_fit`). The rows, their specs and every assumption they make
are in ``benchmarks/published/`` (see :mod:`benchmarks.published_rows`).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance  # noqa: E402
from benchmarks.published_rows import ROWS, Result, aggregates, log2_error, price  # noqa: E402
from rpeg.cost.engines import EFFICIENCY, Efficiency  # noqa: E402
from rpeg.plan.model import Strategy  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def run(ids: list[str]) -> list[Result]:
    out = []
    for rid in ids:
        began = time.perf_counter()
        r = price(ROWS[rid])
        out.append(r)
        print(f"{rid:<24} {_line(r)}  ({time.perf_counter() - began:.1f} s)", flush=True)
    return out


def _line(r: Result) -> str:
    if r.status != "ok":
        return f"{r.status}: {r.message}"
    parts = []
    for what, published in r.row.figures:
        got = r.predicted.get(what)
        if got is not None:
            parts.append(f"{what} {published:.1f} -> {got:.1f} ({got / published:.2f}x)")
    return "; ".join(parts)


def _fmt(x: float) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def markdown(results: list[Result], agg: dict, loso: dict | None, prov: dict) -> str:
    lines = ["# rpeg's cost model against published step times", "", header(prov), "",
             "Each row: a configuration another system ran and published a time for "
             "(`/work/shared/published-calibration.md`), written as a spec with the placement "
             "it used (`benchmarks/published/`, every assumption the source leaves open "
             "stated in the file) and priced by rpeg as it ran (`rpeg compile --strategy "
             "pinned`; ReaL's own bars, whose plans are not published, by rpeg's search over "
             "the space ReaL searched). Ratio = predicted / published.", "",
             "## Aggregates", "",
             f"- rows: {agg['rows']}, priced: {agg['priced']}, cannot be written yet: "
             f"{agg['unwritable']}, false 'no plan fits': {agg['false_no_fit']}, errors: "
             f"{agg['errors']}",
             f"- median |log2 ratio| (priced rows): {_fmt(agg['median_abs_log2'])} "
             f"({2 ** agg['median_abs_log2']:.2f}x)" if not math.isnan(agg["median_abs_log2"])
             else "- median |log2 ratio|: n/a",
             "- within 1.25x / 1.5x / 2x, of all rows: "
             + " / ".join(f"{100 * agg['within'][k]:.0f}%" for k in ("1.25x", "1.5x", "2x")),
             "- within 1.25x / 1.5x / 2x, of the priced rows: "
             + " / ".join(f"{100 * agg['within_of_priced'][k]:.0f}%"
                          for k in ("1.25x", "1.5x", "2x")),
             f"- Spearman rank correlation (priced rows): {_fmt(agg['spearman'])}",
             _time_only_line(agg["time_only"]), ""]
    lines += ["## The shared terms", "",
              "Kernels run at the GPU profiles' measured rates (`pipelines/clusters/profiles/`); "
              "what is fitted on these rows is one set of terms every engine, source and GPU "
              "kind shares (`rpeg/cost/engines.py`), each within its physical range. The "
              "controller's call is charged to the systems that have one (Ray-based OpenRLHF, "
              "verl, NeMo RL, ReaL), not to DeepSpeed-Chat's single program.", "",
              "| term | value | range | unit | what it is |", "|---|---|---|---|---|"]
    for f in attrs.fields(Efficiency):
        lo, hi = f.metadata["bounds"]
        lines.append(f"| {f.name} | {getattr(EFFICIENCY, f.name):.4g} | {lo:g} .. {hi:g} | "
                     f"{f.metadata['unit'] or 'share'} | {f.metadata['what']} |")
    lines.append("")
    if loso:
        lines += ["## Leave one source out", "",
                  "The engine terms fitted on every source but one; that source's rows "
                  "predicted with them. A term the fit left on a bound of its range is one "
                  "the other sources asked more of than it can physically give, or said "
                  "nothing about. The rows that hold it there: each training row's error "
                  "(main figure and phases, as the fit weighs them) rises by the amount shown "
                  "when the term moves one step of the fit inside its range; the largest "
                  "rises name the rows whose missing cost the term stands in for.", "",
                  "| held out | rows | median abs log2 | terms on a bound | rows that hold it "
                  "there |", "|---|---|---|---|---|"]
        for src, v in loso["per_source"].items():
            bound = "; ".join(v.get("at_bound", [])) or "none"
            held = "; ".join(f"{t}: " + (", ".join(f"{rid} +{d:.2f}" for rid, d in rows)
                                          or "none")
                             for t, rows in v.get("pulled_by", {}).items()) or ""
            lines.append(f"| {src} | {v['rows']} | {_fmt(v['median_abs_log2'])} | {bound} "
                         f"| {held} |")
        lines += ["", f"Median |log2 ratio| over every held-out row: "
                      f"{_fmt(loso['median_abs_log2'])}"
                      + (f" (the folds from the hold-out runs {', '.join(loso['from'])})"
                         if loso.get("from") else ""), "",
                  "Where each held-out source's error lies: its rows' median per system that "
                  "ran them, and the median with each term its fold moved put back at the "
                  "value shipped (fitted on every source). A term whose return lowers the "
                  "median is one the other sources do not pin; a system whose rows stay far "
                  "off whatever the terms pays a cost none of them prices.", "",
                  "| held out | median by system | with one term at its shipped value |",
                  "|---|---|---|"]
        for src, v in loso["per_source"].items():
            systems = "; ".join(f"{k} {_fmt(m)}" for k, m in v.get("by_system", {}).items())
            back = "; ".join(f"{t} -> {_fmt(m)}" for t, m in v.get("levers", {}).items())
            lines.append(f"| {src} | {systems} | {back or 'none moved'} |")
        lines.append("")
        if loso.get("profile"):
            lines += _profile_lines(loso["profile"])
    lines += ["## Rows", "", "| row | system | GPUs | figure | published s | predicted s | "
              "ratio | phases (published -> predicted) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        row = r.row
        gpus = row.cluster.rsplit("_", 1)[-1].removesuffix(".rpeg")
        if r.status != "ok":
            t = r.time_ratio
            got = f" (time alone {r.predicted[row.main]:.1f} s, {t:.2f}x)" if t else ""
            lines.append(f"| {row.id} | {row.system} | {gpus} | {row.main} | {row.figure:.1f} "
                         f"| {r.status} | | {r.message}{got} |")
            continue
        phases = ", ".join(f"{w} {p:.0f} -> {r.predicted[w]:.0f}" for w, p in row.figures
                           if w != row.main and w in r.predicted)
        how = " (search)" if row.strategy is Strategy.SEARCH else ""
        lines.append(f"| {row.id} | {row.system}{how} | {gpus} | {row.main} | {row.figure:.1f} "
                     f"| {r.predicted[row.main]:.1f} | {r.ratio:.2f} | {phases} |")
    return "\n".join(lines) + "\n"


def _profile_lines(prof: dict) -> list[str]:
    """The table of :func:`benchmarks.published_fit.profile`: each source's and system's
    loss with the term at each value, every other term as shipped; its best value marked."""
    term, grid = prof["term"], prof["grid"]
    out = [f"## What each source asks of {term}", "",
           f"Each source's and each system's loss (the fit's weighted mean |log2 ratio|, "
           f"phases at half weight) with {term} at each value and every other term as "
           f"shipped; its lowest in bold. A row that does not change along the line says "
           f"nothing of {term}: a fold that holds out the sources that pin it leaves it to "
           f"the others' noise.", "",
           "| source or system | " + " | ".join(f"{v:g}" for v in grid) + " |",
           "|---|" + "---|" * len(grid)]
    rows = [("every row", prof["every row"])] + list(prof["by_source"].items()) \
        + [(f"system: {k}", v) for k, v in prof["by_system"].items()]
    for name, losses in rows:
        best = min(losses)
        cells = [f"**{x:.2f}**" if x == best and max(losses) - best > 0.005 else f"{x:.2f}"
                 for x in losses]
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out + [""]


def _time_only_line(t: dict) -> str:
    if not t.get("rows"):
        return "- step time alone: no row priced"
    return (f"- step time alone, the rows that do not fit included (their plans priced "
            f"regardless of memory; {t['rows']} rows): median |log2 ratio| "
            f"{_fmt(t['median_abs_log2'])}, within 2x {100 * t['within_2x']:.0f}%, "
            f"Spearman {_fmt(t['spearman'])}")


def to_json(results: list[Result], agg: dict, loso: dict | None, prov: dict) -> dict:
    rows = []
    for r in results:
        rows.append({"id": r.row.id, "source": r.row.source, "system": r.row.system,
                     "spec": r.row.spec, "cluster": r.row.cluster, "status": r.status,
                     "strategy": r.row.strategy.value, "main": r.row.main,
                     "published": dict(r.row.figures), "predicted": r.predicted,
                     "ratio": r.ratio, "abs_log2": log2_error(r), "message": r.message})
    return {"provenance": prov, "aggregates": agg, "leave_one_source_out": loso, "rows": rows}


def folds_from(paths: list[Path]) -> dict:
    """The leave-one-source-out figure of hold-out runs' results put together: each fold
    (a source, the terms fitted on the others, its rows so predicted) as its run found it,
    the median over every held-out row; a source held out twice keeps its last run."""
    from benchmarks.published_fit import NO_FIT_PENALTY, _median
    per_source, rounds = {}, set()
    for path in paths:
        loso = json.loads(path.read_text())["leave_one_source_out"]
        per_source.update(loso["per_source"])
        rounds.add(loso["rounds"])
    errs = []
    for v in per_source.values():
        errs += [abs(math.log2(x)) for x in v["ratios"].values() if x]
        errs += [NO_FIT_PENALTY] * v["no_fit"]
    return {"per_source": dict(sorted(per_source.items())), "median_abs_log2": _median(errs),
            "rounds": rounds.pop() if len(rounds) == 1 else sorted(rounds),
            "from": [str(p) for p in paths]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the rows priced as pinned")
    ap.add_argument("--only", action="append", default=[], help="row ids starting so")
    ap.add_argument("--no-loso", action="store_true", help="skip leave-one-source-out")
    ap.add_argument("--hold-out", action="append", default=[], metavar="SOURCE",
                    help="leave out only this source (repeatable); writes "
                         "results/published_holdout.json and .md")
    ap.add_argument("--folds-from", action="append", default=[], metavar="JSON",
                    help="take the leave-one-source-out folds from these hold-out runs' "
                         "results (repeatable) instead of fitting them here")
    args = ap.parse_args(argv)
    prov = provenance()
    ids = [rid for rid, row in ROWS.items()
           if (not args.only or any(rid.startswith(p) for p in args.only))
           and not (args.quick and row.strategy is Strategy.SEARCH)]
    results = run(ids)
    agg = aggregates(results)
    loso = None
    if args.folds_from:
        loso = folds_from([Path(f) for f in args.folds_from])
    elif not (args.quick or args.only or args.no_loso):
        from benchmarks.published_fit import leave_one_source_out
        loso = leave_one_source_out(results, only=tuple(args.hold_out))
    finish(prov)
    print(json.dumps(agg, indent=2))
    if args.hold_out:
        print(json.dumps(loso, indent=2))
    if args.only:
        return
    RESULTS.mkdir(exist_ok=True)
    stem = "published_holdout" if args.hold_out else \
        "published_quick" if args.quick else "published"
    (RESULTS / f"{stem}.json").write_text(
        json.dumps(to_json(results, agg, loso, prov), indent=2) + "\n")
    (RESULTS / f"{stem}.md").write_text(markdown(results, agg, loso, prov))


if __name__ == "__main__":
    main()
