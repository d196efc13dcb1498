"""A check on one GPU: ``rpeg run --cuda`` of a 0.5B model, verified, measured against the plan.

On the GPU check machine (Python 3.12 with torch and transformers; no network, no dask,
distributed or lark), from the repository root, with the wheels carried in .gpu-wheels/
(``scripts/gpu-wheels.sh download`` fetches them where PyPI is reachable):

    bash scripts/gpu-wheels.sh install
    PYTHONPATH=$PWD:$PWD/.gpu-site python3 benchmarks/gpu_check.py --out "$OUT"

Here, without a GPU, ``--cpu`` runs the same script end to end with the tiny model on
this machine's CPU workers (a check of the script, not of a GPU; nothing is written to
benchmarks/results/).

It writes a GRPO pipeline on Qwen2.5-0.5B's shape (24 layers, hidden 896, vocabulary
151,936, tied embeddings; random weights from its config) and a one-H200 cluster priced
with ``pipelines/clusters/profiles/h200.rpeg``, pins the train stage to FSDP2 over a world
of one GPU (``zero = 3``: bfloat16 weights gathered from float32 master shards),
activation recomputation and packed sequences, and the reference forward to packed
sequences; the planner chooses the rest. Then ``rpeg run --cuda`` for a few steps (one
Dask worker on the GPU), ``rpeg verify``, and per op the measured time (median over the
steps after the first) and the device's peak allocated memory (recorded by the executor
for each op on CUDA) against what the plan predicted. Writes gpu_check.md and .json to
``--out`` and to benchmarks/results/ (on the GPU machine only ``--out`` comes back).
Budget: under 8 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "qwen2.5-0.5b"
STEPS = 4

SPEC = """\
# GRPO on Qwen2.5-0.5B's shape (random weights) on one GPU: the GPU check.
pipeline gpu_check

workload {{
    steps      = {steps}
    prompts    = {prompts}
    samples    = 4
    prompt_len = 32
    gen_len    = uniform(min = {gen}, max = {gen})
    dataset    = "data/toy.jsonl"
    seed       = 0
}}

model actor : {model} {{ optimizer = adam(lr = 1e-6) }}
model ref   : {model} {{ frozen }}
reward toy = python("rewards:toy_reward")

stage rollout    = generate(actor, prompts, temperature = 1.0, max_len = {gen}) -> responses, logprobs
stage ref_lp     = forward(ref, responses) -> ref_logprobs
stage scores     = score(toy, responses)   -> scores
stage adv        = group_norm(scores)      -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs,
                         loss = grpo(0.2, kl = 0.01), minibatches = 2)

place actor_step on gpus 0..0 {{ zero = 3; recompute; packing; microbatches = 2 }}
place ref_lp on gpus 0..0 {{ packing }}
"""

CLUSTER = """\
# One H200 (the GPU check machine), priced with the shipped H200 profile.
cluster h200_1 {{
    gpu            = "{profile}"
    gpus_per_node  = 1
    nodes_per_rack = 1
    racks          = 1
    link gpu {{ bandwidth = 450 GB/s; latency = 2 us }}
}}
"""


def write_inputs(folder: Path, cpu: bool) -> tuple[Path, Path]:
    """The spec (with the toy reward and data beside it) and the cluster file."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "pipelines" / "rewards.py", folder / "rewards.py")
    shutil.copy(ROOT / "pipelines" / "data" / "toy.jsonl", folder / "data" / "toy.jsonl")
    spec = folder / "gpu_check.rpeg"
    spec.write_text(SPEC.format(steps=STEPS, model="tiny" if cpu else MODEL,
                                prompts=8 if cpu else 32, gen=16 if cpu else 128))
    if cpu:
        return spec, ROOT / "pipelines" / "clusters" / "local_cpu.rpeg"
    cluster = folder / "h200_1.rpeg"
    cluster.write_text(CLUSTER.format(profile=ROOT / "pipelines/clusters/profiles/h200.rpeg"))
    return spec, cluster


def rpeg(*args: str, log: Path) -> tuple[int, float]:
    """Run ``python -m rpeg ARGS`` in a child (its output appended to ``log``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / ".gpu-site"), os.environ.get("PYTHONPATH", "")])}
    t0 = time.perf_counter()
    with open(log, "a") as out:
        out.write(f"$ rpeg {' '.join(args)}\n")
        out.flush()
        rc = subprocess.run([sys.executable, "-m", "rpeg", *args], stdout=out,
                            stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
    return rc, time.perf_counter() - t0


def compare(run_dir: Path) -> dict:
    """Per op: measured median seconds (steps after the first) and peak allocated bytes
    against the plan's prediction."""
    plan = json.loads((run_dir / "plan.json").read_text())
    predicted = plan.get("predicted") or {}
    op_times = dict(predicted.get("op_times", []))
    trace = json.loads((run_dir / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    per_op: dict[str, dict[int, float]] = {}
    peaks: dict[str, int] = {}
    for e in events:
        if e.get("ph") != "X":
            continue
        a = e.get("args", {})
        op, step = e["name"], int(a.get("step", 0))
        per_op.setdefault(op, {})
        per_op[op][step] = per_op[op].get(step, 0.0) + e["dur"] / 1e6
        peak = (a.get("stats") or {}).get("peak_bytes")
        if peak is not None:
            peaks[op] = max(peaks.get(op, 0), int(peak))
    # a predicted op is a plan op: fused stages ("ref_lp+scores") are traced one by one,
    # a weight sync as its export and load ("sync_actor.export")
    members = {k: k.split("+") for k in op_times}
    owner = {m: k for k, ms in members.items() for m in ms}
    grouped: dict[str, dict[int, float]] = {}
    for op, by_step in per_op.items():
        key = owner.get(op.split(".")[0], op)
        for s, t in by_step.items():
            grouped.setdefault(key, {})
            grouped[key][s] = grouped[key].get(s, 0.0) + t
        if op in peaks:
            peaks[key] = max(peaks.get(key, 0), peaks[op])
    rows = []
    for op, by_step in sorted(grouped.items()):
        later = [t for s, t in sorted(by_step.items()) if s > 0] or list(by_step.values())
        rows.append({"op": op, "measured_s": statistics.median(later),
                     "first_step_s": by_step.get(0),
                     "predicted_s": op_times.get(op), "peak_bytes": peaks.get(op)})
    measured_peak = max((r["peak_bytes"] or 0) for r in rows) if rows else 0
    predicted_peak = max(predicted.get("peak_memory") or [0])
    return {"ops": rows, "peak_bytes": measured_peak, "predicted_peak_bytes": predicted_peak,
            "predicted_step_s": predicted.get("step_time_s"),
            "placements": plan.get("placements")}


def environment() -> dict:
    import platform

    import torch
    import transformers
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "cuda": torch.cuda.is_available()}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return out


def markdown(result: dict) -> str:
    env, c = result["environment"], result.get("comparison") or {}
    out = ["# GPU check", "", f"Command: `{result['command']}`  ",
           f"Date: {result['date']}; {env.get('gpu', 'no GPU (CPU dry run)')}; python "
           f"{env['python']}, torch {env['torch']}, transformers {env['transformers']}", "",
           f"- `rpeg run --cuda`: exit {result['run_rc']} in {result['run_s']:.0f} s "
           f"({STEPS} steps of {result['model']})",
           f"- `rpeg verify`: exit {result['verify_rc']}"]
    if c:
        pk, pp = c["peak_bytes"], c["predicted_peak_bytes"]
        err = f" ({100 * (pp / pk - 1):+.0f}%)" if pk else ""
        out += [f"- peak device memory: measured {pk / 1e9:.2f} GB allocated, predicted "
                f"{pp / 1e9:.2f} GB{err}",
                f"- predicted step: {c['predicted_step_s']:.3f} s", "",
                "| op | measured s (median, steps > 0) | first step s | predicted s | err "
                "| peak GB |", "|---|---:|---:|---:|---:|---:|"]
        for r in c["ops"]:
            p = r["predicted_s"]
            err = f"{100 * (p / r['measured_s'] - 1):+.0f}%" if p and r["measured_s"] else ""
            first = f"{r['first_step_s']:.3f}" if r["first_step_s"] is not None else ""
            peak = f"{r['peak_bytes'] / 1e9:.2f}" if r["peak_bytes"] else ""
            out.append(f"| {r['op']} | {r['measured_s']:.4f} | {first} | "
                       f"{p if p is None else f'{p:.4f}'} | {err} | {peak} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the results here")
    ap.add_argument("--cpu", action="store_true",
                    help="dry run of this script with the tiny model on CPU workers")
    args = ap.parse_args(argv)
    import datetime as dt
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="rpeg-gpu-check-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    log = out / "gpu_check.log"
    spec, cluster = write_inputs(work, args.cpu)
    run_dir = work / "run"
    flags = [] if args.cpu else ["--cuda"]
    run_rc, run_s = rpeg("run", str(spec), "--cluster", str(cluster), "--steps", str(STEPS),
                         "--run-dir", str(run_dir), "--no-progress", *flags, log=log)
    verify_rc, _ = rpeg("verify", str(run_dir), log=log) if run_rc == 0 else (None, 0.0)
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "environment": environment(), "model": "tiny" if args.cpu else MODEL,
              "run_rc": run_rc, "run_s": run_s, "verify_rc": verify_rc,
              "comparison": compare(run_dir) if (run_dir / "trace.json").exists() else None,
              "seconds": round(time.perf_counter() - t0, 1)}
    for name in ("plan.json", "metrics.jsonl", "run.json"):
        if (run_dir / name).exists():
            shutil.copy(run_dir / name, out / f"gpu_check_{name}")
    text = markdown(result)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    (out / "gpu_check.md").write_text(text)
    if not args.cpu:
        results = ROOT / "benchmarks" / "results"
        (results / "gpu_check.json").write_text(json.dumps(result, indent=1))
        (results / "gpu_check.md").write_text(text)
    print(text)
    shutil.rmtree(work, ignore_errors=True)      # the run directory (its checkpoint: GBs)
    return 0 if run_rc == 0 and verify_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
