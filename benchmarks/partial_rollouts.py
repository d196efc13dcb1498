"""Partial rollouts on the local cluster: carry 1 against whole responses, real runs.

    $ .venv/bin/python benchmarks/partial_rollouts.py           # writes results/partial_rollouts.{json,md}
    $ .venv/bin/python benchmarks/partial_rollouts.py --quick   # 20 steps, one seed

For tiny_ppo and tiny_grpo, the plan ``rpeg run`` executes (the planner's for the
local 2-worker cluster) is run three ways on the same placement, each bound by the
spec's staleness 1:

* ``async``: as planned (staleness 1, whole responses);
* ``carry``: staleness 0 and carry 1 (each step also starts the next step's
  responses; they finish under the next weights);
* ``sync``: staleness 0, whole responses.

Per run: the generate op's time per step, measured and predicted (the cost
model's ``op_times``); median and mean step time (steps after the first 5; a carrying run's
steps alternate between long and short ones, so ratios compare means), final
reward (mean of the last 5 steps), the cost model's step time for the plan, whether ``rpeg verify``
accepts it; and whether the planner, allowed to carry (``runtime_limits``), picks
carry for the pipeline. Runs are what ``rpeg run`` runs (``benchmarks/runtime.py``'s
``dask_run``: the resilient runner on an embedded cluster, waiting for a quieter
machine before each run and recording the load).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import runtime as R  # noqa: E402

from benchmarks.provenance import finish, header, profile_origin, provenance  # noqa: E402
from rpeg.runtime.plans import plan_for_run, runtime_limits  # noqa: E402
from rpeg.spec import load_cluster  # noqa: E402

VARIANTS = {"async": (1, 0), "carry": (0, 1), "sync": (0, 0)}    # name -> staleness, carry


def variant(plan, staleness: int, carry: int):
    return attrs.evolve(R.capped(plan, staleness), placements=tuple(
        attrs.evolve(p, carry=carry) if p.stage == "rollout" else p for p in plan.placements))


def pipeline_runs(name: str, steps: int, seeds: list[int], root: Path) -> dict:
    pipeline, plan, _ = plan_for_run(ROOT / "pipelines" / f"{name}.rpeg", cluster=R.CLUSTER)
    out = {"planner_carry": {p.stage: p.carry for p in plan.placements if p.carry},
           "carry_allowed": sorted(e.value for e in runtime_limits().carry_engines),
           "placement": R.placements(plan), "runs": []}
    for seed in seeds:
        seeded = R.with_seed(pipeline, seed)
        for kind, (k, c) in VARIANTS.items():
            v = variant(plan, k, c)
            r = R.dask_run(seeded, v, steps, root)
            r.update(kind=kind, seed=seed, staleness=k, carry=c, mean_step_s=mean_step(r),
                     rollout_s=rollout_time(r), predicted_step_s=round(R.predicted(seeded, v), 4),
                     predicted_rollout_s=predicted_rollout(seeded, v))
            print(name, kind, seed, r["median_step_s"], r["final_reward"], r["verified"],
                  flush=True)
            out["runs"].append(r)
    out["summary"] = summary(out["runs"])
    return out


def mean_step(run: dict) -> float:
    rows = [json.loads(x) for x in
            (Path(run["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return round(statistics.mean(r["step_time_s"] for r in rows[R.WARMUP:] or rows), 4)


def rollout_time(run: dict) -> float:
    """Mean seconds a step's generate op ran (its chunks' durations summed), after warm-up."""
    trace = json.loads((Path(run["run_dir"]) / "trace.json").read_text())
    per: dict[int, float] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e.get("cat") == "generate":
            per[e["args"]["step"]] = per.get(e["args"]["step"], 0.0) + e["dur"] / 1e6
    kept = [t for s, t in per.items() if s >= R.WARMUP] or list(per.values())
    return round(statistics.mean(kept), 4)


def predicted_rollout(pipeline, plan) -> float:
    from rpeg.plan.evaluate import Evaluator
    from rpeg.spec import load_cluster
    done = Evaluator(pipeline, load_cluster(R.CLUSTER)).evaluate(plan)
    return round(dict(done.plan.predicted.op_times).get("rollout", float("nan")), 4)


def summary(runs: list[dict]) -> dict:
    by = {k: [r for r in runs if r["kind"] == k] for k in VARIANTS}

    def mean(kind, key):
        return statistics.mean(r[key] for r in by[kind])
    return {
        **{f"{k}_median_step_s": round(mean(k, "median_step_s"), 4) for k in VARIANTS},
        **{f"{k}_mean_step_s": round(mean(k, "mean_step_s"), 4) for k in VARIANTS},
        **{f"{k}_rollout_s": round(mean(k, "rollout_s"), 4) for k in VARIANTS},
        "carry_vs_sync_rollout_ratio": round(mean("carry", "rollout_s")
                                             / mean("sync", "rollout_s"), 3),
        "predicted_carry_vs_sync_rollout_ratio": round(
            mean("carry", "predicted_rollout_s") / mean("sync", "predicted_rollout_s"), 3),
        **{f"{k}_final_reward": round(mean(k, "final_reward"), 4) for k in VARIANTS},
        "carry_vs_sync_step_ratio": round(mean("carry", "mean_step_s")
                                          / mean("sync", "mean_step_s"), 3),
        "carry_vs_async_step_ratio": round(mean("carry", "mean_step_s")
                                           / mean("async", "mean_step_s"), 3),
        "all_verified": all(r["verified"] for r in runs),
    }


def table(results: dict) -> str:
    lines = ["| pipeline | kind | seed | staleness | carry | median step s | mean step s | "
             "predicted s | rollout s | predicted rollout s | final reward | verified |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, res in results["pipelines"].items():
        for r in res["runs"]:
            lines.append(f"| {name} | {r['kind']} | {r['seed']} | {r['staleness']} | "
                         f"{r['carry']} | {r['median_step_s']:.4f} | {r['mean_step_s']:.4f} | "
                         f"{r['predicted_step_s']:.4f} | {r['rollout_s']:.4f} | "
                         f"{r['predicted_rollout_s']:.4f} | {r['final_reward']:.3f} | "
                         f"{r['verified']} |")
    lines.append("")
    for name, res in results["pipelines"].items():
        s = res["summary"]
        lines.append(f"- {name}: carry/sync mean step time {s['carry_vs_sync_step_ratio']}, "
                     f"carry/async {s['carry_vs_async_step_ratio']}; carry/sync rollout time "
                     f"{s['carry_vs_sync_rollout_ratio']} (predicted "
                     f"{s['predicted_carry_vs_sync_rollout_ratio']}); final reward async "
                     f"{s['async_final_reward']}, carry {s['carry_final_reward']}, sync "
                     f"{s['sync_final_reward']}; the planner picks carry: "
                     f"{res['planner_carry'] or 'no'}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--root", default=str(ROOT / "runs" / "bench-partial"))
    ap.add_argument("--resummarize", action="store_true",
                    help="recompute the summary from the results file's run directories")
    args = ap.parse_args()
    steps, seeds = (20, [0]) if args.quick else (args.steps, list(range(args.seeds)))
    out = ROOT / "benchmarks" / "results"
    suffix = "-quick" if args.quick else ""
    if args.resummarize:
        results = json.loads((out / f"partial_rollouts{suffix}.json").read_text())
        steps, seeds = results["steps"], results["seeds"]
        for name, res in results["pipelines"].items():
            pipeline, plan, _ = plan_for_run(ROOT / "pipelines" / f"{name}.rpeg",
                                             cluster=R.CLUSTER)
            for r in res["runs"]:
                v = variant(plan, r["staleness"], r["carry"])
                seeded = R.with_seed(pipeline, r["seed"])
                r.update(mean_step_s=mean_step(r), rollout_s=rollout_time(r),
                         predicted_step_s=round(R.predicted(seeded, v), 4),
                         predicted_rollout_s=predicted_rollout(seeded, v))
            res["summary"] = summary(res["runs"])
    else:
        t = time.time()
        started = provenance()
        results = {"machine": {"platform": platform.platform(),
                               "python": platform.python_version(),
                               "load_avg_start": R.load_avg()},
                   "profile": profile_origin(load_cluster(R.CLUSTER)),
                   "steps": steps, "seeds": seeds,
                   "pipelines": {n: pipeline_runs(n, steps, seeds, Path(args.root))
                                 for n in ("tiny_ppo", "tiny_grpo")}}
        results["wall_s"] = round(time.time() - t, 1)
        results["provenance"] = finish(started)
    (out / f"partial_rollouts{suffix}.json").write_text(json.dumps(results, indent=2) + "\n")
    about = (header(results["provenance"]) + "; predictions with the profile calibrated on "
             f"{results['profile']['calibrated_on']}" if "provenance" in results else
             f"`.venv/bin/python benchmarks/partial_rollouts.py`; load average at start "
             f"{results['machine']['load_avg_start']}")
    (out / f"partial_rollouts{suffix}.md").write_text(
        f"# Partial rollouts on the local cluster ({steps} steps, seeds {seeds})\n\n"
        f"{about}.\n\n" + table(results))
    print(table(results))


if __name__ == "__main__":
    main()
