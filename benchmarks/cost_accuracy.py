"""How well the cost model predicts real ops on this machine: latency and peak memory.

    .venv/bin/python benchmarks/cost_accuracy.py            # 32 configurations, ~2-4 min
    .venv/bin/python benchmarks/cost_accuracy.py --quick    # 10 configurations, < 60 s

Each configuration is a real op of the torch backend (forward log-probabilities,
sampling with a KV cache, a PPO train step, and a 2-worker data-parallel train step
over gloo between two Dask worker processes), on Llama-shaped models built from a
config with random weights. It is measured (median of repeats, round-robin across
configurations; peak resident-set growth, see backends/torch_backend/measure.py) and
predicted by rpeg.cost with the calibrated profile in
pipelines/clusters/profiles/local_cpu.rpeg. None of these shapes was used to fit the
profile: calibration used the tiny, tiny4 and tiny-vllm models at the shapes in
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

from backends.torch_backend import measure  # noqa: E402
from rpeg.cost.calibrate import mape, predict_op  # noqa: E402
from rpeg.cost.memory import Parallel  # noqa: E402
from rpeg.cost.profiles import load_cluster  # noqa: E402
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
QUICK = [0, 2, 5, 10, 12, 13, 18, 20, 21, 27]


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
    return (v > 0) - (v < 0)


def run(configs, repeats: int, cluster_path: Path) -> list[dict]:
    measure.set_threads(1)
    measure.warm_up()
    single = [c for c in configs if c[5] == 1]
    multi = [c for c in configs if c[5] > 1]
    specs = [dict(kind=k, dims=MODELS[m], batch=b, prompt_len=p, gen_len=g, minibatches=mb)
             for k, m, b, p, g, _, mb in single]
    results = dict(zip(single, measure.measure_ops(specs, repeats), strict=True))
    if multi:
        with measure.TwoDevices() as two:
            ops = [dict(dims=MODELS[m], batch=b, prompt_len=p, gen_len=g)
                   for _, m, b, p, g, _, _ in multi]
            results.update(zip(multi, two.dp_train(ops, repeats), strict=True))
    cluster = load_cluster(cluster_path)
    rows = []
    for cfg in configs:
        kind, model, b, p, g, dp, mb = cfg
        par = Parallel(dp=dp)
        t_pred, m_pred = predict_op(kind, MODELS[model], b, p, g, cluster, par,
                                    tuple(range(dp)), minibatches=mb)
        r = results[cfg]
        rows.append({"kind": kind, "model": model, "batch": b, "prompt_len": p, "gen_len": g,
                     "dp": dp, "minibatches": mb, "held_out": held_out(cfg),
                     "measured_s": r["latency_s"], "predicted_s": t_pred,
                     "wall_s": r.get("wall_s", r["latency_s"]),
                     "measured_bytes": r["peak_bytes"], "predicted_bytes": m_pred,
                     "times_s": r["times_s"]})
    return rows


def summary(rows) -> dict:
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


def markdown(rows, s: dict, info: dict, command: str) -> str:
    out = ["# Cost model accuracy on this machine", "",
           f"`{command}` — {info['date']}, {info['machine']['cpu']} "
           f"({info['machine']['cores']} cores, load {info['machine']['loadavg'][0]:.1f} at start, "
           f"shared with other work), torch {info['machine']['torch']}, 1 thread per device.", "",
           f"- configurations: {s['configs']} (all held out from calibration)",
           f"- latency MAPE: {s['latency_mape']:.1f}%  (forward {s['latency_mape_forward']:.1f}%, "
           f"generate {s['latency_mape_generate']:.1f}%, train {s['latency_mape_train']:.1f}%, "
           f"2-worker DP train {s['latency_mape_dp2']:.1f}%)",
           f"- peak-memory MAPE: {s['memory_mape']:.1f}%",
           f"- Kendall's tau, predicted vs measured latency: {s['kendall_tau']:.3f}", "",
           "| op | model | batch | prompt | gen | dp | measured ms | predicted ms | measured MB "
           "| predicted MB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['kind']} | {r['model']} | {r['batch']} | {r['prompt_len']} | "
                   f"{r['gen_len']} | {r['dp']} | {r['measured_s'] * 1e3:.1f} | "
                   f"{r['predicted_s'] * 1e3:.1f} | {r['measured_bytes'] / 1e6:.1f} | "
                   f"{r['predicted_bytes'] / 1e6:.1f} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 configurations, under 60 s")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--cluster", type=Path, default=ROOT / "pipelines/clusters/local_cpu.rpeg")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/cost_accuracy.json")
    args = ap.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in measure.MALLOC_ENV.items()):
        # Peak-memory readings need glibc to hand freed tensors back: restart with it set.
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **measure.MALLOC_ENV})
    configs = [CONFIGS[i] for i in QUICK] if args.quick else CONFIGS
    assert all(held_out(c) for c in configs), "a benchmark shape was used for calibration"
    repeats = args.repeats or (3 if args.quick else 5)
    t0 = time.perf_counter()
    info = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": measure.machine_info(), "repeats": repeats, "quick": args.quick,
            "cluster": str(args.cluster.relative_to(ROOT)) if args.cluster.is_relative_to(ROOT)
            else str(args.cluster),
            "latency": "median CPU time of the process per call (1 compute thread; on an idle "
                       "machine equal to wall time, wall time is recorded too); 2-worker DP: "
                       "the slower rank's median",
            "memory": "peak resident-set growth (VmHWM after clear_refs) over model build "
                      "and first call; DP: the larger rank"}
    rows = run(configs, repeats, args.cluster)
    s = summary(rows)
    info["seconds"] = time.perf_counter() - t0
    print(table(rows))
    print(f"\n{s['configs']} configurations, {info['seconds']:.0f} s; Kendall tau "
          f"{s['kendall_tau']:.3f}; memory MAPE {s['memory_mape']:.1f}%")
    if not args.quick:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"info": info, "summary": s, "rows": rows}, indent=1))
        cmd = ".venv/bin/python benchmarks/cost_accuracy.py"
        args.out.with_suffix(".md").write_text(markdown(rows, s, info, cmd))
    print(f"latency MAPE {s['latency_mape']:.1f}%  memory MAPE {s['memory_mape']:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
