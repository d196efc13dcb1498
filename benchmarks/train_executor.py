"""Training layouts on two CPU workers: measured peak memory and step time against the model.

    .venv/bin/python benchmarks/train_executor.py            # small and mid, 6 layouts each
    .venv/bin/python benchmarks/train_executor.py --quick    # small only, fewer repeats

Each configuration is one train op of the torch backend's own path on two Dask worker
processes joined by gloo (``backends/torch_backend/measure_layouts.py``): DDP (ZeRO 0),
ZeRO-2 (FSDP2, weights whole between ops), ZeRO-3 (FSDP2), and ZeRO-3 with activation
recomputation, with the optimizer state offloaded between ops, and with packed sequences;
and the model split over both workers (tp 2, DTensor layers over gloo), whose time is the
slower worker's median wall time (its ranks wait for each other at every split block).
The batch is 16 responses of 8 to 64 tokens after 32-token prompts, trained in 2
token-balanced micro-batches per rank. Peak memory is each worker's resident-set growth
over building the model and two train ops (the larger worker's), read in workers whose
allocator returns freed memory; step time is the slower worker's median CPU time per op,
timed round-robin over the configurations under the workers' allocator settings.
Both are predicted by ``rpeg.cost`` (``resident_memory`` + ``stage_memory``,
``estimate_stage``) with the calibrated profile of ``pipelines/clusters/local_cpu.rpeg``.

A last section plans ppo_llama8b on gh200_64 for the runtime as it declares itself
(``Limits.runtime()``, what ``rpeg compile`` plans by default and ``rpeg run`` executes):
the plan's predicted step, its layouts, and its speed-up over the baselines priced by the
same model. Writes benchmarks/results/train_executor.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rpeg.cost.calibrate import allocator, worker_env  # noqa: E402

if __name__ == "__main__" and allocator() != "worker":
    os.execve(sys.executable, [sys.executable, *sys.argv], worker_env())

import attrs  # noqa: E402

from backends.torch_backend import measure  # noqa: E402
from backends.torch_backend.measure_layouts import run_layouts  # noqa: E402
from benchmarks.provenance import finish, header, profile_origin, provenance  # noqa: E402
from rpeg.cost.calibrate import empirical, mape, with_dispatch  # noqa: E402
from rpeg.cost.examples import ppo_pipeline  # noqa: E402
from rpeg.cost.memory import resident_memory  # noqa: E402
from rpeg.cost.profiles import load_cluster  # noqa: E402
from rpeg.cost.stages import estimate_stage, stage_memory  # noqa: E402
from rpeg.graph.layout import Layout  # noqa: E402
from rpeg.graph.work import work_of  # noqa: E402
from rpeg.spec.model import Engine  # noqa: E402
from rpeg.spec.presets import PRESETS, ModelDims  # noqa: E402

MODELS = {
    "small": PRESETS["small"],                                    # 4 x 256, 3.3 M params
    "mid": ModelDims("llama", 4, 384, 6, 2, 1024, 259),           # 4 x 384, 6.3 M
    # a vocabulary of 32,768 on a narrow body: the logits (held once, their gradient, the
    # float32 chunk the log-softmax works on) are a third of a train op's peak
    "vocab": ModelDims("llama", 2, 64, 4, 2, 256, 32768),         # 2 x 64, 4.3 M
}
LAYOUTS = {
    "ddp": dict(zero=0, recompute=False, offload=False, packed=False),
    "zero2": dict(zero=2, recompute=False, offload=False, packed=False),
    "zero3": dict(zero=3, recompute=False, offload=False, packed=False),
    "zero3+recompute": dict(zero=3, recompute=True, offload=False, packed=False),
    "zero3+offload": dict(zero=3, recompute=False, offload=True, packed=False),
    "zero3+packed": dict(zero=3, recompute=False, offload=False, packed=True),
    # the model split over both workers (DTensor layers over gloo), one share of the batch
    "tp2": dict(zero=0, recompute=False, offload=False, packed=False, tp=2),
}
BATCH, PROMPT, LONGEST, MICRO = 16, 32, 64, 2
LENGTHS = [int(round(8 + (LONGEST - 8) * i / (BATCH - 1))) for i in range(BATCH)]


def ops(models) -> list[tuple[str, str, dict]]:
    return [(m, name, dict(dims=attrs.asdict(MODELS[m]), batch=BATCH, prompt_len=PROMPT,
                           lengths=LENGTHS, microbatches=MICRO, **layout))
            for m in models for name, layout in LAYOUTS.items()]


def predict(op: dict, cluster) -> tuple[float, float]:
    """(seconds, peak bytes per device) the cost model gives the op on two devices."""
    dims = ModelDims(**op["dims"])
    p = ppo_pipeline(dims=dims, prompts=BATCH, prompt_len=PROMPT, gen_median=LONGEST,
                     gen_max=LONGEST)
    p = attrs.evolve(p, workload=attrs.evolve(p.workload,
                                              gen_len=empirical(op["lengths"], LONGEST)))
    tp = op.get("tp", 1)
    par = Layout(dp=2 // tp, tp=tp, microbatches=op["microbatches"],
                   recompute=op["recompute"], zero=op["zero"], offload=op["offload"],
                   packing=op["packed"])
    cluster = attrs.evolve(cluster, gpu=with_dispatch(cluster.gpu, {"dispatch_s": 0.0}))
    t = estimate_stage(work_of(p, "actor_step"), par, (0, 1), cluster).time_s
    model = p.model("actor")
    mem = resident_memory(model, par, cluster, trained=True, engine=Engine.TORCH).total \
        + stage_memory(work_of(p, "actor_step"), par, cluster).total
    return t, mem


def measure_all(configs, repeats: int) -> list[dict]:
    measure.set_threads(1)
    task = [op for _, _, op in configs]
    with measure.TwoDevices(clean=True) as two:
        peaks = two.run({"ops": task, "peaks": True}, run_layouts)
    with measure.TwoDevices() as two:
        times = two.run({"ops": task, "repeats": repeats}, run_layouts)
    rows = []
    for i, (model, layout, op) in enumerate(configs):
        a, b = (r["ops"][i] for r in times)
        # a split op's ranks wait for each other at every block's all-reduce: its time is
        # the wall time (the others' is their CPU time, as the calibration's)
        key = "wall_s" if op.get("tp", 1) > 1 else "latency_s"
        rows.append({"model": model, "layout": layout,
                     "measured_bytes": max(peaks[0]["peaks"][i], peaks[1]["peaks"][i]),
                     "measured_bytes_ranks": [peaks[0]["peaks"][i], peaks[1]["peaks"][i]],
                     "measured_s": max(a[key], b[key]),
                     "wall_s": max(a["wall_s"], b["wall_s"]),
                     "times_s": [a["times_s"], b["times_s"]]})
    return rows


def ranking(rows, key_pred: str, key_meas: str, margin: float = 0.05) -> dict:
    """Whether layouts rank alike by memory: every pair the model separates by more than
    ``margin`` is ordered the same way measured; and Kendall's tau over all pairs."""
    agree, pairs, disagree = 0, 0, []
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            a, b = rows[i], rows[j]
            if a["model"] != b["model"]:
                continue
            p = a[key_pred] - b[key_pred]
            m = a[key_meas] - b[key_meas]
            if abs(p) > margin * max(a[key_pred], b[key_pred]):
                pairs += 1
                if p * m > 0:
                    agree += 1
                else:
                    disagree.append(f"{a['model']}: {a['layout']} vs {b['layout']}")
    return {"pairs": pairs, "agree": agree, "matches": agree == pairs, "disagree": disagree}


def runnable_plan() -> dict:
    """ppo_llama8b on gh200_64, planned for the runtime's declared capabilities."""
    from rpeg.plan import SearchOptions, compile_report
    from rpeg.plan.space import Limits
    from rpeg.spec import load, load_cluster
    spec = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    cluster = load_cluster(ROOT / "pipelines/clusters/gh200_64.rpeg")
    began = time.perf_counter()
    r = compile_report(spec, cluster, options=SearchOptions(seed=0, limits=Limits.runtime()))
    step = r.plan.predicted.step_time_s
    base = {s.value: ev.step_time_s for s, ev in r.baselines if ev}
    return {"pipeline": "ppo_llama8b", "cluster": "gh200_64", "step_time_s": round(step, 3),
            "baselines_s": {k: round(v, 3) for k, v in base.items()},
            "speedup": {k: round(v / step, 3) for k, v in base.items()},
            "placements": [{"stage": p.stage, "devices": f"{p.devices[0]}-{p.devices[-1]}",
                            "dp": p.dp, "tp": p.tp, "zero": p.zero, "recompute": p.recompute,
                            "offload": p.offload, "packed": p.packing,
                            "engine": p.engine.value} for p in r.plan.placements],
            "planning_s": round(time.perf_counter() - began, 1)}


def markdown(rows, summary: dict, prov: dict) -> str:
    out = ["# Training layouts: measured against the cost model", "", header(prov), "",
           f"Profile: {summary['profile']}; {summary['repeats']} timed repeats per layout.", "",
           f"Batch: {BATCH} responses of {LENGTHS[0]}-{LENGTHS[-1]} tokens (mean "
           f"{sum(LENGTHS) / len(LENGTHS):.0f}) after {PROMPT}-token prompts; 2 workers "
           f"(gloo), {MICRO} token-balanced micro-batches per rank, float32, Adam.", "",
           f"- peak-memory MAPE: **{summary['memory_mape']:.1f}%** over {len(rows)} "
           f"configurations",
           f"- step-time MAPE: **{summary['time_mape']:.1f}%**",
           f"- ranking by memory: {summary['ranking']['agree']} of "
           f"{summary['ranking']['pairs']} pairs the model separates by more than 5% "
           f"ordered alike" + ("" if summary["ranking"]["matches"] else
                               " (not: " + "; ".join(summary["ranking"]["disagree"]) + ")"),
           "", "| model | layout | measured MB | predicted MB | err | measured ms "
           "| predicted ms | err |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        em = 100 * (r["predicted_bytes"] / r["measured_bytes"] - 1)
        et = 100 * (r["predicted_s"] / r["measured_s"] - 1)
        out.append(f"| {r['model']} | {r['layout']} | {r['measured_bytes'] / 1e6:.1f} | "
                   f"{r['predicted_bytes'] / 1e6:.1f} | {em:+.0f}% | "
                   f"{r['measured_s'] * 1e3:.1f} | {r['predicted_s'] * 1e3:.1f} | {et:+.0f}% |")
    plan = summary.get("runnable_plan")
    if plan:
        sp = plan["speedup"]
        out += ["", "## A plan rpeg run executes: ppo_llama8b on gh200_64", "",
                f"Planned for the runtime's declared capabilities (`rpeg compile` without "
                f"flags) in {plan['planning_s']:.0f} s: predicted step "
                f"**{plan['step_time_s']:.2f} s**, "
                + ", ".join(f"{v:.2f}x over {k} ({plan['baselines_s'][k]:.2f} s)"
                            for k, v in sp.items()) + ".", "",
                "| stage | GPUs | dp | tp | zero | recompute | offload | packed | engine |",
                "|---|---|---:|---:|---:|---|---|---|---|"]
        for p in plan["placements"]:
            out.append(f"| {p['stage']} | {p['devices']} | {p['dp']} | {p['tp']} | "
                       f"{p['zero']} | {p['recompute']} | {p['offload']} | {p['packed']} | "
                       f"{p['engine']} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small model only, 2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--cluster", type=Path, default=ROOT / "pipelines/clusters/local_cpu.rpeg")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/train_executor.json")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    t0 = time.perf_counter()
    cluster = load_cluster(args.cluster)
    configs = ops(["small"] if args.quick else list(MODELS))
    repeats = args.repeats or (2 if args.quick else 5)
    rows = measure_all(configs, repeats)
    for row, (_, _, op) in zip(rows, configs, strict=True):
        row["predicted_s"], row["predicted_bytes"] = predict(op, cluster)
    summary = {"memory_mape": mape([(r["predicted_bytes"], r["measured_bytes"]) for r in rows]),
               "time_mape": mape([(r["predicted_s"], r["measured_s"]) for r in rows]),
               "ranking": ranking(rows, "predicted_bytes", "measured_bytes"),
               "repeats": repeats, "seconds": round(time.perf_counter() - t0, 1),
               "profile": f"{args.cluster.name} ({profile_origin(cluster)['calibrated_on']})"}
    if not args.quick:
        summary["runnable_plan"] = runnable_plan()
    prov = finish(prov)
    for r in rows:
        print(f"{r['model']:<6}{r['layout']:<17}{r['measured_bytes'] / 1e6:8.1f} MB "
              f"{r['predicted_bytes'] / 1e6:8.1f} MB {r['measured_s'] * 1e3:8.1f} ms "
              f"{r['predicted_s'] * 1e3:8.1f} ms")
    print(f"memory MAPE {summary['memory_mape']:.1f}%  time MAPE {summary['time_mape']:.1f}%  "
          f"ranking {summary['ranking']['agree']}/{summary['ranking']['pairs']}")
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"provenance": prov, "summary": summary, "rows": rows},
                                       indent=1))
        args.out.with_suffix(".md").write_text(markdown(rows, summary, prov))
    return 0


if __name__ == "__main__":
    sys.exit(main())
