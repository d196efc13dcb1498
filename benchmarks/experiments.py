"""What the experiment record costs, and how far a run's prediction is from its measurement.

    .venv/bin/python benchmarks/experiments.py RUN_DIR [RUN_DIR ...]    # existing runs
    .venv/bin/python benchmarks/experiments.py --make 2 --steps 8       # make runs first

For each run directory: the time to write its record (rpeg.runtime.rundir.record.write_record:
hashes, the cost model's prediction for its plan, TensorBoard events), to draw its
pictures (rpeg show --plots) and to verify its trace; its predicted and measured
steady-state step time and their ratio. ``--make N`` first runs tiny_ppo N times with
the runtime's split placement on a local Dask cluster (staleness 1, then 0, ...).
Writes benchmarks/results/experiments.json and .md.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance  # noqa: E402


def make_runs(n: int, steps: int, root: Path) -> list[Path]:
    from distributed import LocalCluster

    from rpeg.runtime import RunOptions, run_pipeline
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load

    spec = ROOT / "pipelines" / "tiny_ppo.rpeg"
    pipeline = load(spec)
    out = []
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
                      host="127.0.0.1", dashboard_address=None,
                      silence_logs=logging.ERROR) as cluster:
        for i in range(n):
            plan = split_plan(pipeline, 2, staleness=1 - i % 2, cluster="local_cpu")
            res = run_pipeline(pipeline, plan, RunOptions(
                steps=steps, scheduler=cluster.scheduler_address, root=str(root),
                run_dir=str(root / f"bench-{i}"), progress=False), spec_path=str(spec))
            out.append(res.path)
    return out


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(path: Path, repeats: int) -> dict:
    from rpeg.experiments import Run, verification, write_plots
    from rpeg.runtime.rundir.record import write_record

    rec = write_record(path)
    run = Run.open(path)
    pred, meas = rec["predicted"].get("step_time_s"), rec["measured"].get("step_time_s")
    return {
        "run": str(path), "steps": rec["measured"]["steps_done"],
        "plan": rec["inputs"]["plan"]["strategy"],
        "record_s": timed(lambda: write_record(path), repeats),
        "plots_s": timed(lambda: write_plots(run), max(1, repeats // 2)),
        "verify_s": timed(lambda: verification(run), repeats),
        "predicted_step_s": pred, "measured_step_s": meas,
        "measured_over_predicted": (meas / pred) if pred and meas else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="*", type=Path)
    ap.add_argument("--make", type=int, default=0)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--root", type=Path, default=Path("runs") / "bench-experiments")
    args = ap.parse_args()
    here = provenance()
    runs = list(args.runs) + (make_runs(args.make, args.steps, args.root) if args.make else [])
    rows = [measure(p, args.repeats) for p in runs]
    result = {"provenance": finish(here), "runs": rows}
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "experiments.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# Experiment records", "", header(result["provenance"]), "",
             "| run | plan | steps | record (s) | plots (s) | verify (s) | predicted step (s) "
             "| measured step (s) | measured / predicted |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['measured_over_predicted']:.2f}" if r["measured_over_predicted"] else "-"
        lines.append(f"| {Path(r['run']).name} | {r['plan']} | {r['steps']} | {r['record_s']:.3f} "
                     f"| {r['plots_s']:.2f} | {r['verify_s']:.3f} | {r['predicted_step_s']:.4f} "
                     f"| {r['measured_step_s']:.3f} | {ratio} |")
    (out / "experiments.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
