"""Tensor parallelism on the local CPU cluster: the same tiny PPO run at tp = 1 and tp = 2.

    $ .venv/bin/python benchmarks/tensor_parallel.py           # writes results/tensor_parallel.{json,md}
    $ .venv/bin/python benchmarks/tensor_parallel.py --steps 8  # shorter
    $ .venv/bin/python benchmarks/tensor_parallel.py --profile calibrate  # calibrate first

Actor, critic and reference run every op (generate, forward, train) on device 0
(tp = 1) or split over devices 0-1 (tp = 2, DTensor over gloo); scores and
advantages stay on device 0. Both runs use one 2-worker Dask cluster, the same
seed and synchronous PPO, so their metrics must agree step for step (the
largest relative difference is recorded) while the step times show what the
collectives cost: a tiny model on CPU does a few microseconds of work per
all-reduce, so tp = 2 is expected to be slower here; it pays off only where
a model does not fit one device or its matmuls dominate. Step times are
medians after the first 5 steps (as ``benchmarks/runtime.py`` takes them); the
machine's load average is recorded. Each run's step time and each stage's op
time are set against what the cost model predicts for its plan, priced with
the CPU profile ``--profile`` names (as ``rpeg run --profile``): the
profile's ``tp_layer_overhead`` is what a split layer adds per pass.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "runtime"))

from test_tp_run import COMPARED, plan_with  # noqa: E402

from benchmarks import runtime as rt  # noqa: E402
from benchmarks.provenance import finish, header, provenance  # noqa: E402
from rpeg.runtime import RunOptions, run_pipeline, verify_run  # noqa: E402
from rpeg.spec import load  # noqa: E402

OUT = ROOT / "benchmarks" / "results"


def _op_times(run: Path, steps: int) -> dict[str, float]:
    """Seconds per step that device 0 spent in each stage (after the first step)."""
    trace = json.loads((run / "trace.json").read_text())
    out: dict[str, float] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["tid"] == 0 and e["args"].get("step", 0) > 0:
            out[e["name"]] = out.get(e["name"], 0.0) + e["dur"] / 1e6
    return {k: round(v / max(steps - 1, 1), 4) for k, v in sorted(out.items())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--profile", choices=("auto", "calibrate", "shipped"), default="auto",
                    help="the CPU profile predictions price with (as rpeg run --profile)")
    args = ap.parse_args(argv)
    started = provenance(sys.argv[:1] + (argv if argv is not None else sys.argv[1:]))
    rt.use_profile(args.profile)
    from rpeg.spec import load_cluster
    profile = load_cluster(rt.CLUSTER).gpu
    from distributed import LocalCluster

    ppo = load(ROOT / "pipelines" / "tiny_ppo.rpeg")
    runs = {}
    cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                           resources={"GPU": 1}, host="127.0.0.1",
                           dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR)
    try:
        for tp, devs in ((1, (0,)), (2, (0, 1))):
            load_before = os.getloadavg()[0]
            t0 = time.time()
            plan = plan_with(ppo, devs, tp)
            result = run_pipeline(ppo, plan,
                                  RunOptions(steps=args.steps, scheduler=cluster.scheduler_address,
                                             root=str(ROOT / "runs" / "bench-tp"), progress=False),
                                  spec_path=ppo.path)
            report = verify_run(result.path)
            step = rt.median_step(list(result.metrics))
            pred = rt.predicted(ppo, plan)
            runs[tp] = {"verified": report.ok, "wall_s": round(time.time() - t0, 2),
                        "median_step_s": round(step, 4), "predicted_step_s": round(pred, 4),
                        "measured_over_predicted": round(step / pred, 3),
                        "stages": rt.op_times(str(result.path))["stages"],
                        "op_s_per_step": _op_times(result.path, args.steps),
                        "load_before": round(load_before, 2),
                        "metrics": [{k: m[k] for k in COMPARED} for m in result.metrics]}
    finally:
        cluster.close()
    diff = max(abs(a[k] - b[k]) / max(abs(b[k]), 1e-3)
               for a, b in zip(runs[2]["metrics"], runs[1]["metrics"], strict=True)
               for k in COMPARED)
    out = {"provenance": finish(started), "steps": args.steps,
           "profile": {"cluster": str(rt.CLUSTER),
                       "tp_layer_overhead_s": profile.tp_layer_overhead},
           "runs": {str(k): v for k, v in runs.items()},
           "step_time_ratio_tp2_over_tp1": round(runs[2]["median_step_s"]
                                                 / runs[1]["median_step_s"], 3),
           "max_rel_metric_diff": diff}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "tensor_parallel.json").write_text(json.dumps(out, indent=1) + "\n")
    md = ["# Tensor parallelism on the local cluster", "", header(out["provenance"]), "",
          f"Predictions price with `{rt.shown(rt.CLUSTER)}`: a tensor-parallel layer's host "
          f"work and waits {profile.tp_layer_overhead * 1e6:.0f} us per pass "
          f"(`tp_layer_overhead`).", "",
          "| tp | median step (s) | predicted (s) | measured / predicted | wall (s) | verified "
          "| load before |", "|---|---|---|---|---|---|---|"]
    md += [f"| {tp} | {r['median_step_s']} | {r['predicted_step_s']} | "
           f"**{r['measured_over_predicted']}** | {r['wall_s']} | {r['verified']} | "
           f"{r['load_before']} |" for tp, r in runs.items()]
    md += ["", "Per stage (the median per step of its ops' wall time, per device; predicted "
           "without dispatch gaps, as `benchmarks/runtime.py` compares them):", "",
           "| stage | " + " | ".join(f"tp={tp} measured / predicted s" for tp in runs) + " |",
           "|---|" + "---|" * len(runs)]
    md += [f"| {st} | " + " | ".join(
        f"{r['stages'][st]['measured_s']} / {r['stages'][st]['predicted_s']}"
        if st in r["stages"] else "" for r in runs.values()) + " |"
        for st in runs[2]["stages"]]
    md += ["", "Device 0's time per stage a step, after the first step:", "",
           "| stage | " + " | ".join(f"tp={tp} s/step" for tp in runs) + " |",
           "|---|" + "---|" * len(runs)]
    md += [f"| {op} | " + " | ".join(str(r["op_s_per_step"].get(op, "")) for r in runs.values())
           + " |" for op in runs[2]["op_s_per_step"]]
    md += ["", f"tp=2 / tp=1 step time: {out['step_time_ratio_tp2_over_tp1']}; largest relative "
           f"metric difference over {args.steps} steps: {diff:.2e}", ""]
    (OUT / "tensor_parallel.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0 if all(r["verified"] for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
