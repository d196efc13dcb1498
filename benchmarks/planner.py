"""Planner benchmarks: planning time, plan quality against the baselines, search ablation.

    .venv/bin/python benchmarks/planner.py            # everything (~15 minutes on 2 cores)
    .venv/bin/python benchmarks/planner.py --quick    # a smoke run of each section
    .venv/bin/python benchmarks/planner.py --only quality --no-random --out /tmp/p
                                     # the 27-configuration sweep alone, written elsewhere

Writes benchmarks/results/planner.json and benchmarks/results/planner.md (or into
``--out``). Every figure is a prediction of rpeg's cost model (rpeg/cost) and
event-driven simulator: the
search and the three baselines are priced by the same model, so the ratios compare
plans, not models. Plans are made for GPU clusters with vLLM installed (the engine
the baselines' systems use for generation), whatever this machine has.

The search starts from the best baseline, so it is never slower than that by
construction; what it adds is measured against the best baseline, and a second search
per configuration starts from a random plan and never from a baseline (``Start.RANDOM``),
which shows what the search finds on its own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance  # noqa: E402
from rpeg.cost.profiles import cluster_of  # noqa: E402
from rpeg.errors import PlanError  # noqa: E402
from rpeg.plan import Method, SearchOptions, Strategy, compile_report  # noqa: E402
from rpeg.plan.options import Start  # noqa: E402
from rpeg.plan.space import Limits  # noqa: E402
from rpeg.spec import Engine, load, load_cluster  # noqa: E402

GPU_CLUSTER = Limits(engines=frozenset({Engine.TORCH, Engine.VLLM}))
WHOLE = attrs.evolve(GPU_CLUSTER, carry_engines=frozenset())   # no partial rollouts
BASELINES = (Strategy.COLOCATED, Strategy.SPLIT, Strategy.REALLOC)
RESULTS = ROOT / "benchmarks" / "results"


# --- planning time -----------------------------------------------------------------------

def planning_time(sizes: tuple[int, ...]) -> list[dict]:
    spec = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    out = []
    for n in sizes:
        cluster = load_cluster(ROOT / f"pipelines/clusters/gh200_{n}.rpeg")
        began, cpu = time.perf_counter(), time.process_time()
        r = compile_report(spec, cluster, options=SearchOptions(seed=0, limits=GPU_CLUSTER))
        seconds = time.perf_counter() - began
        row = {"gpus": n, "seconds": round(seconds, 2),
               "cpu_seconds": round(time.process_time() - cpu, 2),
               "load_average": round(os.getloadavg()[0], 1),
               "search_iterations": r.search.iterations,
               "search_seconds": round(r.search.seconds, 2),
               "step_time_s": round(r.plan.predicted.step_time_s, 3)}
        print(f"plan ppo_llama8b on gh200_{n}: {seconds:.1f} s wall, "
              f"{row['cpu_seconds']:.1f} s CPU "
              f"({r.search.iterations} proposals), step {row['step_time_s']} s", flush=True)
        out.append(row)
    return out


# --- quality sweep -----------------------------------------------------------------------

def variants(quick: bool) -> list[tuple[str, object, object]]:
    """(name, pipeline, cluster): 8B PPO separate/shared critic and GRPO, sync and
    staleness 1-2, on 16 to 256 GH200 GPUs."""
    ppo = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    grpo = load(ROOT / "pipelines/grpo_qwen7b.rpeg")
    clusters = {16: cluster_of("gh200", 4, 4), 64: load_cluster(
        ROOT / "pipelines/clusters/gh200_64.rpeg"), 256: load_cluster(
        ROOT / "pipelines/clusters/gh200_256.rpeg")}
    sizes = (16, 64) if quick else (16, 64, 256)
    stales = (0, 1) if quick else (0, 1, 2)
    out = []
    for n in sizes:
        for k in stales:
            stale = (("rollout", k),) if k else ()
            for critic in ("separate", "shared"):
                p = attrs.evolve(ppo, name=f"ppo_{critic}", staleness=stale,
                                 shares=ppo.shares if critic == "shared" else ())
                out.append((f"PPO llama3.1-8b, {critic} critic, staleness {k}, {n} GPUs", p,
                            clusters[n]))
            g = attrs.evolve(grpo, staleness=stale)
            out.append((f"GRPO qwen2.5-7b, staleness {k}, {n} GPUs", g, clusters[n]))
    return out


def quality(quick: bool, random: bool = True) -> dict:
    rows = []
    for name, pipeline, cluster in variants(quick):
        began = time.perf_counter()
        opts = SearchOptions(seed=0, limits=GPU_CLUSTER,
                             iterations=1500 if quick else SearchOptions().iterations)
        try:
            r = compile_report(pipeline, cluster, options=opts)
        except Exception as e:  # noqa: BLE001 — a config nothing fits is a result too
            rows.append({"config": name, "error": str(e)})
            print(f"{name}: {e}", flush=True)
            continue
        best = min((ev.step_time_s, s.value) for s, ev in r.baselines if ev)
        row = {"config": name, "gpus": cluster.num_gpus,
               "search_s": round(r.plan.predicted.step_time_s, 3),
               "best_baseline": best[1], "best_baseline_s": round(best[0], 3),
               "vs_best_baseline": round(best[0] / r.plan.predicted.step_time_s, 3),
               "planning_s": round(time.perf_counter() - began, 2),
               "staleness": dict(r.plan.staleness), "shared": bool(r.plan.shared),
               "chunks": max(p.chunks for p in r.plan.placements),
               "carry": max(p.carry for p in r.plan.placements)}
        # The same search for an executor that generates whole responses each step.
        whole = r if not row["carry"] else compile_report(
            pipeline, cluster, options=attrs.evolve(opts, limits=WHOLE))
        row["whole_s"] = round(whole.plan.predicted.step_time_s, 3)
        col = dict(r.baselines).get(Strategy.COLOCATED)
        row["whole_vs_colocated"] = round(col.step_time_s / row["whole_s"], 3) if col else None
        if random:
            row.update(random_start(pipeline, cluster, opts, best[0]))
        for s, ev in r.baselines:
            row[f"{s.value}_s"] = round(ev.step_time_s, 3) if ev else None
            row[f"vs_{s.value}"] = round(r.speedup(s), 3) if ev else None
        rows.append(row)
        print(f"{name}: search {row['search_s']} s; " + ", ".join(
            f"{s.value} {row[f'vs_{s.value}']}x" for s in BASELINES), flush=True)
    return {"rows": rows, "summary": summarise(rows)}


def random_start(pipeline, cluster, opts: SearchOptions, best_baseline_s: float) -> dict:
    """The same search from a random plan, never from a baseline: what it finds alone."""
    try:
        r = compile_report(pipeline, cluster, options=attrs.evolve(opts, start=Start.RANDOM))
    except PlanError as e:
        return {"random_start_s": None, "random_start_error": e.message}
    alone = r.plan.predicted.step_time_s
    # the baselines priced in this run: the same as the sweep's, or the code changed
    here = min(ev.step_time_s for _, ev in r.baselines if ev)
    print(f"  from a random start: {alone:.3f} s ({best_baseline_s / alone:.2f}x the best "
          f"baseline; {here:.3f} s in this run)", flush=True)
    return {"random_start_s": round(alone, 3),
            "random_start_vs_best_baseline": round(best_baseline_s / alone, 3),
            "random_start_run_best_baseline_s": round(here, 3)}


def random_starts(quick: bool, q: dict) -> dict:
    """``--only random``: the random-start column for the rows of a quality sweep already
    measured (the same configurations and options)."""
    by_name = {r["config"]: r for r in q["rows"]}
    for name, pipeline, cluster in variants(quick):
        row = by_name.get(name)
        if row is None or "error" in row:
            continue
        opts = SearchOptions(seed=0, limits=GPU_CLUSTER,
                             iterations=1500 if quick else SearchOptions().iterations)
        best = min(row[f"{s.value}_s"] for s in BASELINES if row.get(f"{s.value}_s"))
        print(name, flush=True)
        row.update(random_start(pipeline, cluster, opts, best))
    return {"rows": q["rows"], "summary": summarise(q["rows"])}


def summarise(rows: list[dict]) -> dict:
    summary = {}
    for row in rows:           # rows measured before the best baseline had a column
        if "search_s" in row:
            best = min(row[f"{s.value}_s"] for s in BASELINES if row.get(f"{s.value}_s"))
            row.setdefault("vs_best_baseline", round(best / row["search_s"], 3))
            row["whole_vs_best_baseline"] = round(best / row["whole_s"], 3)
    for key, label in (("vs_best_baseline", "the best baseline (search)"),
                       ("whole_vs_best_baseline",
                        "the best baseline (search without partial rollouts)"),
                       ("random_start_vs_best_baseline",
                        "the best baseline (search from a random start)")):
        ratios = [r[key] for r in rows if r.get(key)]
        if ratios:
            summary[label] = {"min": min(ratios), "median": statistics.median(ratios),
                              "max": max(ratios), "configs": len(ratios),
                              "baseline_found_no_plan": 0,
                              "above_1.01": sum(1 for x in ratios if x > 1.01)}
    whole = [r["whole_vs_colocated"] for r in rows if r.get("whole_vs_colocated")]
    if whole:
        summary["colocated, without partial rollouts"] = {
            "min": min(whole), "median": statistics.median(whole), "max": max(whole),
            "configs": len(whole), "baseline_found_no_plan": 0}
    for s in BASELINES:
        ratios = [r[f"vs_{s.value}"] for r in rows if r.get(f"vs_{s.value}")]
        if ratios:
            summary[s.value] = {"min": min(ratios), "median": statistics.median(ratios),
                                "max": max(ratios), "configs": len(ratios),
                                "baseline_found_no_plan": sum(
                                    1 for r in rows if "search_s" in r
                                    and r.get(f"vs_{s.value}") is None)}
    return summary


# --- ablation ------------------------------------------------------------------------------

def ablation(quick: bool) -> list[dict]:
    ppo = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    grpo = load(ROOT / "pipelines/grpo_qwen7b.rpeg")
    cases = [("PPO 8B, 64 GPUs", ppo, load_cluster(ROOT / "pipelines/clusters/gh200_64.rpeg")),
             ("GRPO 7B, 64 GPUs", grpo, load_cluster(ROOT / "pipelines/clusters/gh200_64.rpeg"))]
    if not quick:
        cases.append(("PPO 8B, 256 GPUs", ppo,
                      load_cluster(ROOT / "pipelines/clusters/gh200_256.rpeg")))
    iterations = 800 if quick else 3000
    seeds = (0, 1) if quick else (0, 1, 2)
    rows = []
    for name, pipeline, cluster in cases:
        for method in Method:
            times, proposals = [], []
            for seed in seeds:
                opts = SearchOptions(seed=seed, iterations=iterations, patience=0,
                                     method=method, limits=GPU_CLUSTER)
                r = compile_report(pipeline, cluster, options=opts)
                times.append(r.plan.predicted.step_time_s)
                proposals.append(r.search.iterations)
            start = min(e.step_time_s for _, e in r.baselines if e)
            # proposals: per staleness cap the search climbs (0 up to the spec's bound)
            rows.append({"case": name, "method": method.value, "iterations": iterations,
                         "proposals_total": proposals,
                         "best_baseline_s": round(start, 3),
                         "step_s_per_seed": [round(t, 3) for t in times],
                         "mean_gain_over_best_baseline": round(
                             statistics.mean(start / t for t in times), 3)})
            print(f"ablation {name} {method.value}: {rows[-1]['step_s_per_seed']}", flush=True)
    return rows


# --- report ------------------------------------------------------------------------------------

MODEL_NOTES = [
    "What the model prices that bounds these ratios: generation ends when the replica "
    "holding the batch's longest response does (about 4,096 decode steps here, whatever "
    "the DP degree), so at 64 GPUs and more every plan is bounded below by that tail; "
    "vLLM refills freed KV slots (continuous batching) when memory bounds its batch; a "
    "streamed chunk is its own forward batch, padded to its longest response; weight "
    "sync between disjoint groups holds only the generating GPUs (the trainer stages its "
    "weights in host memory); the steady state is measured after the pipeline fills and "
    "is never below the busiest GPU's work of one step. Synchronous rows can only hide "
    "the reference/critic forwards in the generation tail; staleness beyond what "
    "balances generation against training buys nothing once generation is the "
    "bottleneck.",
    "",
    "Partial rollouts (column 'carry': steps a response is carried over, 0 for whole "
    "responses) cut that tail where the staleness bound leaves room: each step also "
    "advances the next 'carry' steps' responses, so a response is generated across "
    "carry + 1 steps and a step decodes about 1/(carry + 1) of the longest response "
    "(AReaL-style interruptible generation); the carry counts against the bound with the "
    "generate stage's own staleness, so a bound of 1 allows either one carry or one step "
    "of overlap. The baselines generate whole responses, as the systems they stand for "
    "do. 'whole (s)' is the same search for an executor without partial rollouts."]

def staleness_ladders(rows: list[dict]) -> dict[str, list[float]]:
    """Search step times of one config at staleness 0, 1, 2, ... (rows in that order)."""
    out: dict[str, list[float]] = {}
    for r in rows:
        if "search_s" in r:
            key = re.sub(r"staleness \d+, ", "", r["config"])
            out.setdefault(key, []).append(r["search_s"])
    return out


def markdown(res: dict) -> str:
    lines = ["# Planner benchmarks", "", header(res["provenance"]), ""]
    for section, p in sorted(res.get("rerun", {}).items()):
        lines += [f"Section '{section}' measured again:  ", header(p), ""]
    lines += [
             "All step times are predictions of rpeg's cost model and simulator; search and "
             "baselines are priced by the same model.", "", *MODEL_NOTES, "",
             "## Planning time (ppo_llama8b, GH200)",
             "", "Wall-clock seconds depend on what else the two cores run (the load average "
             "at the time is given); CPU seconds are this process's own.", "",
             "| GPUs | wall s | CPU s | load avg | proposals | predicted step (s) |",
             "|---|---|---|---|---|---|"]
    for r in res.get("planning_time", []):
        lines.append(f"| {r['gpus']} | {r['seconds']} | {r.get('cpu_seconds', '-')} | "
                     f"{r.get('load_average', '-')} | {r['search_iterations']} | "
                     f"{r['step_time_s']} |")
    q = res.get("quality")
    if q:
        lines += ["", "## What the search adds over the best baseline", "",
                  "The search starts from the best baseline, so it is never slower than that "
                  "by construction; 'x best' is the best baseline's step over the search's. "
                  "'random start' is the same search started from a random plan that never "
                  "restarts from a baseline: what the search finds on its own.", "",
                  "| config | best baseline | (s) | search (s) | x best | random start (s) "
                  "| x best |", "|---|---|---|---|---|---|---|"]
        for r in q["rows"]:
            if "error" in r:
                continue
            t, which = min((r[f"{s.value}_s"], s.value) for s in BASELINES
                           if r.get(f"{s.value}_s"))
            alone = r.get("random_start_s")
            alone_text = ("not measured" if "random_start_s" not in r
                          else "no plan found" if alone is None else str(alone))
            lines.append(f"| {r['config']} | {which} | {t} | {r['search_s']} | "
                         f"{t / r['search_s']:.2f} | {alone_text} | "
                         + (f"{t / alone:.2f}" if alone else "-") + " |")
        lines += ["", "## Search vs each baseline (speedup = baseline step / search step)", "",
                  "| config | search (s) | carry | whole (s) | x colocated | colocated (s) | x "
                  "| split (s) | x | realloc (s) | x |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in q["rows"]:
            if "error" in r:
                lines.append(f"| {r['config']} | no plan: {r['error'][:80]} ||||||||||")
                continue
            wc = r.get("whole_vs_colocated")
            cells = [str(r["search_s"]), str(r.get("carry", 0)), str(r.get("whole_s", "-")),
                     f"{wc:.2f}" if wc else "-"]
            for s in BASELINES:
                cells += [str(r[f"{s.value}_s"] or "no plan fits"),
                          f"{r[f'vs_{s.value}']:.2f}" if r[f"vs_{s.value}"] else "-"]
            lines.append(f"| {r['config']} | " + " | ".join(cells) + " |")
        lines += ["", "Every plan a staleness bound allows, a larger one allows too: the search "
                  "must never return a slower plan for the larger bound (it climbs the "
                  "bounds, each walk from the best of the tighter one):", "",
                  "| config | step per staleness bound (s) | never slower |", "|---|---|---|"]
        for config, steps in staleness_ladders(q["rows"]).items():
            ok = all(b <= a + 1e-9 for a, b in itertools.pairwise(steps))
            lines.append(f"| {config} | {steps} | {'yes' if ok else 'NO'} |")
        lines += ["", "| over | min | median | max | configs | above 1.01x | "
                  "baseline found no plan |", "|---|---|---|---|---|---|---|"]
        for s, v in q["summary"].items():
            lines.append(f"| {s} | {v['min']:.2f} | {v['median']:.2f} | {v['max']:.2f} | "
                         f"{v['configs']} | {v.get('above_1.01', '-')} | "
                         f"{v['baseline_found_no_plan']} |")
    if res.get("ablation"):
        lines += ["", "## Ablation: same proposals, same starts (the best baseline; above "
                  "staleness 0, the best plan of the tighter cap)", "",
                  "| case | method | proposals per staleness cap | best baseline (s) | "
                  "step per seed (s) | "
                  "mean gain |", "|---|---|---|---|---|---|"]
        for r in res["ablation"]:
            lines.append(f"| {r['case']} | {r['method']} | {r['iterations']} | "
                         f"{r['best_baseline_s']} | {r['step_s_per_seed']} | "
                         f"{r['mean_gain_over_best_baseline']} |")
    return "\n".join(lines) + "\n"


def _with_provenance(old: dict) -> dict:
    """A results file as this script writes it now: one written before it recorded its
    provenance keeps what it had (its command, date and load; no CPU model)."""
    if "provenance" in old:
        return old
    m = old.pop("machine", {})
    load = m.get("load_average") or [float("nan")]
    end = m.get("load_average_end") or [float("nan")]
    old["provenance"] = {
        "command": old.pop("command", "?"), "date": m.get("when", "?"),
        "machine": {"cpu": "CPU not recorded", "cores": m.get("cpus", "?"),
                    "platform": m.get("platform", "?"), "python": m.get("python", "?")},
        "load_average": {"start": round(load[0], 2), "end": round(end[0], 2)}}
    for key in [k for k in old if k.startswith(("command_", "machine_"))]:
        old.pop(key)
    return old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("time", "quality", "random", "ablation"),
                    help="measure one section again, keeping the others ('random': the "
                         "random-start search for the quality sweep's rows)")
    ap.add_argument("--no-random", action="store_true",
                    help="leave the quality sweep's random-start search out (half its time)")
    ap.add_argument("--out", type=Path, default=RESULTS,
                    help="the folder the results are written to (default: %(default)s)")
    args = ap.parse_args()
    out = args.out
    name = "planner_quick" if args.quick else "planner"
    here = provenance()
    res = {"provenance": here}
    if args.only and (out / f"{name}.json").exists():     # update one section in place
        previous = _with_provenance(json.loads((out / f"{name}.json").read_text()))
        res = {**previous, "rerun": {**previous.get("rerun", {}), args.only: here}}
    if args.only in (None, "time"):
        res["planning_time"] = planning_time((8, 64) if args.quick else (8, 64, 256, 2048))
    if args.only in (None, "quality"):
        res["quality"] = quality(args.quick, random=not args.no_random)
    if args.only == "random":
        res["quality"] = random_starts(args.quick, res["quality"])
    if args.only in (None, "ablation"):
        res["ablation"] = ablation(args.quick)
    finish(here)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(res, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(res))
    print(f"wrote {out / name}.json and .md")


if __name__ == "__main__":
    main()
