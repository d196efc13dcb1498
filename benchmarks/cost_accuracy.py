"""How well the cost model predicts real ops on this machine: latency and peak memory.

    .venv/bin/python benchmarks/cost_accuracy.py            # 32 configurations, ~2-4 min
    .venv/bin/python benchmarks/cost_accuracy.py --quick    # 10 single-device configurations,
                                                            # shipped profile, < 60 s

Each configuration is a real op of the torch backend (forward log-probabilities,
sampling with a KV cache, responses ending at an end-of-sequence token as a run's do and
predicted with the lengths they had, a PPO train step, and a 2-worker data-parallel train step
over gloo between two Dask worker processes), on Llama-shaped models built from a
config with random weights. It is timed (median CPU time of repeats, round-robin across
configurations, in a Dask device worker's task thread) under glibc's default allocator
settings, as rpeg's workers run, and its
peak memory is read in a separate process whose allocator hands freed memory back (see
backends/torch_backend/measure.py); it is
predicted by rpeg.cost with the calibrated profile in
pipelines/clusters/profiles/local_cpu.rpeg. None of these shapes was used to fit the
profile: calibration used the tiny, tiny4, tiny-vllm and wide2 models at the shapes in
``measure.CALIBRATION_OPS``; here the models are small, tiny6 and mid, and tiny only at
other batch and sequence shapes (checked below). Prints a table, latency and memory
MAPE and Kendall's tau; writes benchmarks/results/cost_accuracy.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rpeg.cost.calibrate import allocator, worker_env  # noqa: E402

if __name__ == "__main__" and allocator() != "worker":
    # Ops are timed under the allocator settings rpeg's workers run with (glibc's
    # defaults): restart without malloc thresholds, before torch is imported. Peaks are
    # read in a child process with them (measure.peaks_in_child).
    os.execve(sys.executable, [sys.executable, *sys.argv], worker_env())

from backends.torch_backend import measure  # noqa: E402
from backends.torch_backend.measure_layouts import tp_rows  # noqa: E402
from benchmarks.provenance import command, profile_origin  # noqa: E402
from rpeg.cost.calibrate import cpu_cluster, fit_profile, mape, predict_op  # noqa: E402
from rpeg.cost.profiles import load_cluster, profile_text  # noqa: E402
from rpeg.graph.layout import Layout  # noqa: E402
from rpeg.spec.presets import PRESETS, ModelDims  # noqa: E402

MODELS = {
    "tiny": PRESETS["tiny"],                                           # 2 x 64, 0.1 M params
    "tiny6": ModelDims("llama", 6, 96, 4, 2, 256, 259),                # 6 x 96, 0.6 M
    "small": PRESETS["small"],                                         # 4 x 256, 3.3 M
    "mid": ModelDims("llama", 4, 384, 6, 2, 1024, 259),                # 4 x 384, 6.3 M
}

# (kind, model, global batch, prompt_len, gen_len, dp, minibatches)
CONFIGS = [
    ("forward", "tiny", 8, 48, 40, 1, 1), ("forward", "tiny", 32, 32, 32, 1, 1),
    ("forward", "tiny6", 4, 64, 32, 1, 1), ("forward", "tiny6", 16, 32, 32, 1, 1),
    ("forward", "tiny6", 8, 128, 64, 1, 1),
    ("forward", "small", 4, 64, 64, 1, 1), ("forward", "small", 8, 128, 64, 1, 1),
    ("forward", "small", 16, 64, 32, 1, 1),
    ("forward", "mid", 4, 64, 32, 1, 1), ("forward", "mid", 8, 64, 64, 1, 1),
    ("generate", "tiny", 8, 24, 40, 1, 1), ("generate", "tiny", 32, 16, 16, 1, 1),
    ("generate", "tiny6", 8, 16, 24, 1, 1),
    ("generate", "small", 4, 32, 32, 1, 1), ("generate", "small", 16, 16, 16, 1, 1),
    ("generate", "small", 8, 64, 48, 1, 1),
    ("generate", "mid", 4, 16, 24, 1, 1), ("generate", "mid", 8, 32, 16, 1, 1),
    ("train", "tiny", 8, 48, 40, 1, 1), ("train", "tiny", 32, 32, 16, 1, 1),
    ("train", "tiny6", 8, 32, 32, 1, 1),
    ("train", "small", 4, 32, 32, 1, 1), ("train", "small", 8, 64, 32, 1, 1),
    ("train", "small", 16, 32, 16, 1, 1), ("train", "small", 8, 32, 32, 1, 2),
    ("train", "mid", 4, 32, 32, 1, 1), ("train", "mid", 8, 32, 16, 1, 1),
    ("train", "tiny", 16, 32, 32, 2, 1), ("train", "tiny6", 16, 32, 32, 2, 1),
    ("train", "small", 8, 32, 32, 2, 1), ("train", "small", 16, 32, 16, 2, 1),
    ("train", "mid", 8, 32, 16, 2, 1),
]
QUICK = [0, 2, 5, 8, 10, 11, 17, 18, 20, 21]     # single-device: no worker start-up
# (kind, model, batch, prompt_len, gen_len), each split over the two workers (tp = 2, the
# runtime's DTensor layers over gloo) on the held-out models; calibration fits the
# profile's tp_layer_overhead on tiny and tiny4 (``measure.TP_OPS``). Timed as wall time
# (the ranks wait for each other at every split block), reported apart from the 32 above.
TP_CONFIGS = [
    ("forward", "tiny6", 16, 32, 32), ("forward", "small", 8, 64, 32),
    ("forward", "mid", 8, 64, 64),
    ("generate", "tiny6", 8, 16, 24), ("generate", "small", 16, 16, 16),
    ("generate", "mid", 8, 32, 16),
    ("train", "tiny6", 8, 32, 32), ("train", "small", 8, 64, 32), ("train", "mid", 8, 32, 16),
]


def held_out(cfg) -> bool:
    """True when no calibration op has this model's dimensions and this shape."""
    kind, model, b, p, g, _, _ = cfg
    return not any(k == kind and measure.CALIBRATION_DIMS[n] == MODELS[model]
                   and (bb, pp, gg) == (b, p, g) for k, n, bb, pp, gg in measure.CALIBRATION_OPS)


def kendall_tau(x, y) -> float:
    n, s = len(x), 0
    for i in range(n):
        for j in range(i + 1, n):
            s += _sign((x[i] - x[j]) * (y[i] - y[j]))
    return 2.0 * s / (n * (n - 1)) if n > 1 else float("nan")


def _sign(v: float) -> int:
    return int(v > 0) - int(v < 0)


def run(configs, repeats: int, cluster_path: Path, recalibrate: bool,
        split: list = ()) -> tuple[list, dict, list]:
    """Measure ``configs`` (and, with ``recalibrate``, the calibration ops in the same
    round-robin, so both see the same machine conditions) and the tensor-parallel ``split``
    ones (of ``TP_CONFIGS``); predict each."""
    measure.set_threads(1)
    measure.warm_up()
    single = [c for c in configs if c[5] == 1]
    multi = [c for c in configs if c[5] > 1]
    specs = [dict(kind=k, dims=MODELS[m], batch=b, prompt_len=p, gen_len=g, minibatches=mb)
             for k, m, b, p, g, _, mb in single]
    cal = measure.calibration_specs() if recalibrate else []
    micro = measure.micro_measurements(repeats) if recalibrate else {}
    if recalibrate:
        micro.update(measure.bandwidths(measure.measure_ops(measure.PROBE_SPECS, repeats,
                                                            memory=False)))
    # timed in a device worker (the workers' allocator, beside Dask's event loop, as
    # `rpeg calibrate` times them), peaks in a child with MALLOC_ENV
    every = [s for _, s in cal] + specs
    peaks = measure.peaks_in_child(every)
    ops = [dict(dims=MODELS[m], batch=b, prompt_len=p, gen_len=g)
           for _, m, b, p, g, _, _ in multi]
    with measure.TwoDevices() as two:
        measured = two.timed_ops(every, repeats)
        for row, peak in zip(measured, peaks, strict=True):
            row["peak_bytes"] = peak
        results = dict(zip(single, measured[len(cal):], strict=True))
        if recalibrate:
            micro["allreduce"] = two.allreduce(measure.ALLREDUCE_SIZES)
        if multi:
            results.update(zip(multi, two.dp_train(ops, repeats), strict=True))
            # the devices' concurrency slowdown, from a calibration op timed between rounds
            micro["concurrency"] = two.last_concurrency
        elif recalibrate:
            micro["concurrency"] = two.concurrency()
        if recalibrate:
            micro["tp_ops"] = tp_rows(two, measure.TP_OPS, repeats)
        split_measured = tp_rows(two, [(k, m, MODELS[m], b, p, g) for k, m, b, p, g in split],
                                 repeats) if split else []
    if multi:
        with measure.TwoDevices(clean=True) as two:
            for cfg, peak in zip(multi, two.dp_peaks(ops), strict=True):
                results[cfg]["peak_bytes"] = peak
    clusters = {"shipped": load_cluster(cluster_path)}
    fitted = {}
    if recalibrate:
        micro["ops"] = [{**meta, **r} for (meta, _), r in zip(cal, measured[:len(cal)],
                                                               strict=True)]
        fit = fit_profile(micro)
        clusters["in_run"] = cpu_cluster(fit.profile, fit.link)
        fitted = {"profile": profile_text(fit.profile), "calibration_ops": micro["ops"],
                  "fit_residuals": list(fit.residuals)}
    rows = []
    for cfg in configs:
        kind, model, b, p, g, dp, mb = cfg
        par = Layout(dp=dp)
        r = results[cfg]
        row = {"kind": kind, "model": model, "batch": b, "prompt_len": p, "gen_len": g,
               "dp": dp, "minibatches": mb, "held_out": held_out(cfg),
               "measured_s": r["latency_s"], "wall_s": r.get("wall_s", r["latency_s"]),
               "measured_bytes": r["peak_bytes"], "times_s": r["times_s"],
               **({"lengths": r["lengths"]} if "lengths" in r else {})}
        for key, cluster in clusters.items():
            t, mem = predict_op(kind, MODELS[model], b, p, g, cluster, par, tuple(range(dp)),
                                minibatches=mb, lengths=r.get("lengths"))
            suffix = "" if key == ("in_run" if recalibrate else "shipped") else f"_{key}"
            row[f"predicted_s{suffix}"] = t
            row[f"predicted_bytes{suffix}"] = mem
        rows.append(row)
    tp = []
    for (kind, model, b, p, g), r in zip(split, split_measured, strict=True):
        row = {"kind": kind, "model": model, "batch": b, "prompt_len": p, "gen_len": g,
               "tp": 2, "measured_s": r["latency_s"], "cpu_s": r["cpu_s"],
               **({"lengths": r["lengths"]} if "lengths" in r else {})}
        for key, cluster in clusters.items():
            t, _ = predict_op(kind, MODELS[model], b, p, g, cluster, Layout(tp=2), (0, 1),
                              lengths=r.get("lengths"))
            suffix = "" if key == ("in_run" if recalibrate else "shipped") else f"_{key}"
            row[f"predicted_s{suffix}"] = t
        tp.append(row)
    return rows, fitted, tp


def tp_summary(rows, suffix: str = "") -> dict:
    """Latency MAPE and Kendall's tau of the tensor-parallel ops, and their worst errors."""
    pairs = [(r["predicted_s" + suffix], r["measured_s"]) for r in rows]
    errs = [p / m - 1 for p, m in pairs]
    return {"configs": len(rows), "latency_mape": mape(pairs),
            "kendall_tau": kendall_tau([p for p, _ in pairs], [m for _, m in pairs]),
            "error_range": [min(errs), max(errs)] if errs else None}


def summary(rows, suffix: str = "") -> dict:
    if suffix:
        rows = [{**r, "predicted_s": r["predicted_s" + suffix],
                 "predicted_bytes": r["predicted_bytes" + suffix]} for r in rows]
    lat = [(r["predicted_s"], r["measured_s"]) for r in rows]
    mem = [(r["predicted_bytes"], r["measured_bytes"]) for r in rows]
    out = {"configs": len(rows), "latency_mape": mape(lat), "memory_mape": mape(mem),
           "kendall_tau": kendall_tau([p for p, _ in lat], [m for _, m in lat])}
    for kind in ("forward", "generate", "train"):
        sel = [r for r in rows if r["kind"] == kind and r["dp"] == 1]
        out[f"latency_mape_{kind}"] = mape([(r["predicted_s"], r["measured_s"]) for r in sel])
    dp = [r for r in rows if r["dp"] > 1]
    out["latency_mape_dp2"] = mape([(r["predicted_s"], r["measured_s"]) for r in dp])
    return out


def table(rows) -> str:
    head = (f"{'op':<9}{'model':<7}{'b':>4}{'p':>5}{'g':>5}{'dp':>3}  {'measured':>10}"
            f"{'predicted':>10}{'err':>7}  {'mem MB':>8}{'pred MB':>8}{'err':>7}")
    lines = [head, "-" * len(head)]
    for r in rows:
        el = 100 * (r["predicted_s"] / r["measured_s"] - 1)
        em = 100 * (r["predicted_bytes"] / r["measured_bytes"] - 1) if r["measured_bytes"] \
            else float("nan")
        lines.append(f"{r['kind']:<9}{r['model']:<7}{r['batch']:>4}{r['prompt_len']:>5}"
                     f"{r['gen_len']:>5}{r['dp']:>3}  {r['measured_s'] * 1e3:>8.1f}ms"
                     f"{r['predicted_s'] * 1e3:>8.1f}ms{el:>+6.0f}%  "
                     f"{r['measured_bytes'] / 1e6:>8.1f}{r['predicted_bytes'] / 1e6:>8.1f}"
                     f"{em:>+6.0f}%")
    return "\n".join(lines)


def markdown(rows, s: dict, info: dict, command: str, extra: dict) -> str:
    m = info["machine"]
    shipped = extra.get("summary_shipped_profile")
    out = [
        "# Cost model accuracy on this machine", "",
        f"`{command}` — {info['date']}; {m['cpu']}, {m['cores']} cores shared with other "
        f"work (load average {m['loadavg'][0]:.1f} at the start, "
        f"{info.get('loadavg_end', float('nan')):.1f} at the end), torch {m['torch']}, one "
        f"compute thread per device; {info['repeats']} repeats, {info['seconds']:.0f} s.", "",
        f"Shipped profile ({info['cluster']}): calibrated on "
        f"{info['shipped_profile']['calibrated_on']}.", "",
        f"Profile: {info['profile']}.", "",
        f"- configurations: {s['configs']}, none of them a calibration shape",
        f"- latency MAPE: **{s['latency_mape']:.1f}%** (forward {s['latency_mape_forward']:.1f}%, "
        f"generate {s['latency_mape_generate']:.1f}%, train {s['latency_mape_train']:.1f}%, "
        f"2-worker data-parallel train {s['latency_mape_dp2']:.1f}%)",
        f"- peak-memory MAPE: **{s['memory_mape']:.1f}%**",
        f"- Kendall's tau, predicted vs measured latency: {s['kendall_tau']:.3f}",
    ]
    if shipped:
        out.append(f"- with the shipped profile (`{info['cluster']}`, calibrated earlier under "
                   f"other load): latency MAPE {shipped['latency_mape']:.1f}%, memory MAPE "
                   f"{shipped['memory_mape']:.1f}%, tau {shipped['kendall_tau']:.3f}")
    out += ["", f"Latency: {info['latency']}. Memory: {info['memory']}.", "",
            "Calibration shapes (never evaluated here): "
            + ", ".join(f"{k} {n} b{b} p{p} g{g}" for k, n, b, p, g in measure.CALIBRATION_OPS)
            + ". Held-out models: tiny6 (6 x 96), small (4 x 256), mid (4 x 384); tiny only at "
              "other batch and sequence shapes.", "",
            "## For README: Cost model", "",
            "Before anything runs, rpeg predicts each op's time and every GPU's memory "
            "(`rpeg/cost`): FLOPs of each GEMM from the model's real dimensions over a "
            "size-dependent throughput curve (small and skinny GEMMs do not reach peak), "
            "attention with GQA and the sequence term, decode bound by streaming weights and "
            "KV cache while the batch shrinks along the length distribution, TP/PP/DP "
            "collectives and weight sync costed alpha-beta per level of the cluster tree "
            "(hierarchical when cheaper), and memory as weights, gradients and Adam state "
            "(16 B/parameter), activations, KV cache and buffers. The GH200, H100, H200 and "
            "A100 profiles carry published measured GEMM throughput and sustained bandwidth "
            "(sources in each file); `rpeg calibrate` measures this machine's CPU devices "
            "(GEMM sweep, bandwidth, small-model forward/generate/train, gloo all-reduce "
            "between two Dask workers) into `pipelines/clusters/profiles/local_cpu.rpeg`.", "",
            f"On this machine, over {s['configs']} real ops held out from calibration "
            f"(forward, generate, train and 2-worker data-parallel train of Llama-shaped "
            f"models), latency MAPE is {s['latency_mape']:.1f}% and peak-memory MAPE "
            f"{s['memory_mape']:.1f}%, with Kendall's tau {s['kendall_tau']:.2f} between "
            f"predicted and measured latencies (the RPEG preprint reports 15.5% and 15.1%). "
            "Reproduce with `.venv/bin/python benchmarks/cost_accuracy.py` "
            "(`--quick`: 10 configurations in under a minute); results in "
            "`benchmarks/results/cost_accuracy.json`.", "",
            "## All configurations", "",
            "| op | model | batch | prompt | gen | dp | measured ms | predicted ms | err "
            "| measured MB | predicted MB | err |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        el = 100 * (r["predicted_s"] / r["measured_s"] - 1)
        em = 100 * (r["predicted_bytes"] / r["measured_bytes"] - 1) if r["measured_bytes"] else 0
        out.append(f"| {r['kind']} | {r['model']} | {r['batch']} | {r['prompt_len']} | "
                   f"{r['gen_len']} | {r['dp']} | {r['measured_s'] * 1e3:.1f} | "
                   f"{r['predicted_s'] * 1e3:.1f} | {el:+.0f}% | {r['measured_bytes'] / 1e6:.1f} "
                   f"| {r['predicted_bytes'] / 1e6:.1f} | {em:+.0f}% |")
    split = extra.get("tensor_parallel")
    if split:
        t, ts = split["summary"], split.get("summary_shipped_profile")
        lo, hi = t["error_range"]
        out += ["", "## Tensor-parallel ops (tp = 2 over the two workers, held-out models)", "",
                f"Each op split over the two workers as the runtime splits a model (DTensor "
                f"layers over gloo); latency is the slower rank's median wall time (the ranks "
                f"wait for each other at every split block's all-reduce). The profile's "
                f"`tp_layer_overhead` is fitted on tiny and tiny4 only "
                f"(`measure.TP_OPS`). Over {t['configs']} ops: latency MAPE "
                f"**{t['latency_mape']:.1f}%** (errors {100 * lo:+.0f}% to {100 * hi:+.0f}%), "
                f"Kendall's tau {t['kendall_tau']:.3f}"
                + (f"; with the shipped profile {ts['latency_mape']:.1f}%." if ts else "."), "",
                "| op | model | batch | prompt | gen | measured ms | CPU ms | predicted ms "
                "| err |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in split["rows"]:
            el = 100 * (r["predicted_s"] / r["measured_s"] - 1)
            out.append(f"| {r['kind']} | {r['model']} | {r['batch']} | {r['prompt_len']} | "
                       f"{r['gen_len']} | {r['measured_s'] * 1e3:.1f} | {r['cpu_s'] * 1e3:.1f} "
                       f"| {r['predicted_s'] * 1e3:.1f} | {el:+.0f}% |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 configurations, under 60 s")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--recalibrate", action="store_true",
                    help="fit the profile in this run even with --quick")
    ap.add_argument("--shipped-profile", action="store_true",
                    help="predict with the cluster file's profile only (no in-run calibration)")
    ap.add_argument("--cluster", type=Path, default=ROOT / "pipelines/clusters/local_cpu.rpeg")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cost_accuracy.json")
    args = ap.parse_args(argv)
    configs = [CONFIGS[i] for i in QUICK] if args.quick else CONFIGS
    assert all(held_out(c) for c in configs), "a benchmark shape was used for calibration"
    repeats = args.repeats or (2 if args.quick else 5)
    t0 = time.perf_counter()
    info = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": measure.machine_info(), "repeats": repeats, "quick": args.quick,
            "command": command(), "shipped_profile": profile_origin(load_cluster(args.cluster)),
            "cluster": str(args.cluster.relative_to(ROOT)) if args.cluster.is_relative_to(ROOT)
            else str(args.cluster),
            "latency": "median CPU time of the process per call (1 compute thread; on an idle "
                       "machine equal to wall time, wall time is recorded too), under glibc's "
                       "default allocator settings, as rpeg's workers run; 2-worker DP: the "
                       "slower rank's median",
            "memory": "peak resident-set growth (VmHWM after clear_refs) over model build "
                      "and the first two calls (the second is the steady state), read in a "
                      "separate process with MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ "
                      "at 64 KiB so freed memory goes back and each reading starts clean; DP: "
                      "the larger rank"}
    recalibrate = (args.recalibrate or not args.quick) and not args.shipped_profile
    split = [] if args.quick else TP_CONFIGS
    rows, fitted, tp = run(configs, repeats, args.cluster, recalibrate, split)
    s = summary(rows)
    info["profile"] = ("fitted in this run on the calibration ops, measured round-robin with "
                       "the benchmark's; the devices' concurrency slowdown from a calibration "
                       "op timed alone and on both workers between the data-parallel rounds"
                       if recalibrate else f"shipped: {info['cluster']}")
    extra = {"summary_shipped_profile": summary(rows, "_shipped")} if recalibrate else {}
    if tp:
        extra["tensor_parallel"] = {"summary": tp_summary(tp), "rows": tp,
                                    **({"summary_shipped_profile": tp_summary(tp, "_shipped")}
                                       if recalibrate else {})}
    info["seconds"] = time.perf_counter() - t0
    info["loadavg_end"] = os.getloadavg()[0]
    print(table(rows))
    print(f"\n{s['configs']} configurations, {info['seconds']:.0f} s; Kendall tau "
          f"{s['kendall_tau']:.3f}; memory MAPE {s['memory_mape']:.1f}%")
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"info": info, "summary": s, **extra, "rows": rows,
                                        **fitted}, indent=1))
        args.out.with_suffix(".md").write_text(markdown(rows, s, info, info["command"], extra))
    if tp:
        t = extra["tensor_parallel"]["summary"]
        print(f"tensor-parallel (tp 2) ops: latency MAPE {t['latency_mape']:.1f}% over "
              f"{t['configs']}, tau {t['kendall_tau']:.3f}")
    print(f"latency MAPE {s['latency_mape']:.1f}%  memory MAPE {s['memory_mape']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
