"""A check on one GPU: ``rpeg run`` of a 0.5B model on CUDA, verified, measured against the plan.

On the GPU check machine (Python 3.12 with torch and transformers; no network, no dask,
distributed or lark), from the repository root, with the wheels carried in .gpu-wheels/
(``scripts/gpu-wheels.sh download`` fetches them where PyPI is reachable):

    bash scripts/gpu-wheels.sh install
    PYTHONPATH=$PWD:$PWD/.gpu-site python3 benchmarks/gpu_check.py --out "$OUT"

Here, without a GPU, ``--cpu`` runs the same script end to end with the tiny model on
this machine's CPU workers (a check of the script, not of a GPU; nothing is written to
benchmarks/results/); CI runs it (``make test-gpu-check``). The script exits 1 when any
check's run or verify fails.

Checks (each a GRPO pipeline on Qwen2.5-0.5B's shape: 24 layers, hidden 896, vocabulary
151,936, tied embeddings; random weights from its config; a one-H200 cluster priced with
``pipelines/clusters/profiles/h200.rpeg``):

* ``train`` — the train stage pinned to FSDP2 over a world of one GPU (``zero = 3``:
  bfloat16 weights gathered from float32 master shards, gradients reduced in bfloat16),
  activation recomputation and packed sequences; the reference forward packed; the torch
  engine decoding on the device (sampling there too); the planner chooses the rest;
* ``vllm-beside`` — (where vLLM is installed) the rollout on vLLM beside the ZeRO-3 trainer
  on the same GPU: its own copy, loaded by the trainer's send through CUDA IPC handles
  (never a second rank of a process group on the GPU), sleeping while the trainer trains.

Each: ``rpeg run`` (CUDA by itself where the worker has a GPU) for a few steps (one Dask
worker, its GPU its own), ``rpeg verify``, and per op the measured time (median over the
steps after the first) and the device's peak allocated memory (recorded by the executor
for each op on CUDA) against what the plan predicted, with where the run said its ops ran.
Writes gpu_check.md and .json to ``--out`` and to benchmarks/results/ (on the GPU machine
only ``--out`` comes back). Budget: under 8 minutes on an H200. A node of several GPUs:
``benchmarks/gpu_node_check.py --gpus N``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = "qwen2.5-0.5b"
STEPS = 4

SPEC = """\
# GRPO on {model}'s shape (random weights): the GPU check, '{name}'.
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

stage rollout    = generate(actor, prompts, temperature = 1.0, max_len = {gen}{engine}) -> responses, logprobs
stage ref_lp     = forward(ref, responses) -> ref_logprobs
stage scores     = score(toy, responses)   -> scores
stage adv        = group_norm(scores)      -> advantages
stage actor_step = train(actor, responses, advantages, logprobs, ref_logprobs,
                         loss = grpo(0.2, kl = 0.01), minibatches = 2)

{pins}
"""

CLUSTER = """\
# {what}, priced with the shipped {kind} profile.
cluster {name} {{
    gpu            = "{profile}"
    gpus_per_node  = {gpus}
    nodes_per_rack = 1
    racks          = 1
    link gpu {{ bandwidth = 450 GB/s; latency = 2 us }}
}}
"""


@attrs.frozen
class Check:
    """One pipeline the check runs: its name, its pins, its engine, what it needs."""

    name: str
    pins: tuple[str, ...]
    engine: str = "torch"
    needs: str = ""               # a module that must be importable, else it is skipped
    steps: int = STEPS
    extra: tuple[str, ...] = ()   # more rpeg run arguments


ONE_GPU = (
    Check("train", ("place actor_step on gpus 0..0 { zero = 3; recompute; packing; "
                    "microbatches = 2 }", "place ref_lp on gpus 0..0 { packing }")),
    Check("vllm-beside", ("place actor_step on gpus 0..0 { zero = 3; recompute; packing }",
                          "place rollout on gpus 0..0 { tp = 1 }"), engine="vllm",
          needs="vllm"),
)


def write_inputs(folder: Path, cpu: bool, check: Check = ONE_GPU[0], gpus: int = 1,
                 kind: str = "h200") -> tuple[Path, Path]:
    """The spec (with the toy reward and data beside it) and the cluster file."""
    (folder / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "pipelines" / "rewards.py", folder / "rewards.py")
    shutil.copy(ROOT / "pipelines" / "data" / "toy.jsonl", folder / "data" / "toy.jsonl")
    spec = folder / f"gpu_check_{check.name}.rpeg"
    model = ("tiny-vllm" if check.engine == "vllm" else "tiny") if cpu else MODEL
    spec.write_text(SPEC.format(steps=check.steps, model=model, name=check.name,
                                prompts=8 if cpu else 32, gen=16 if cpu else 128,
                                engine=", engine = vllm" if check.engine == "vllm" else "",
                                pins="\n".join(check.pins)))
    cluster = folder / "cluster.rpeg"
    if cpu:
        cluster.write_text(CLUSTER.format(
            what=f"{gpus} CPU device(s) standing for GPUs", kind="local_cpu", name="cpu_check",
            profile=ROOT / "pipelines/clusters/profiles/local_cpu.rpeg", gpus=gpus)
            .replace("450 GB/s; latency = 2 us", "887.2 MB/s; latency = 149.1 us"))
    else:
        cluster.write_text(CLUSTER.format(
            what=f"{gpus} {kind.upper()} GPU(s) on one node", kind=kind, name=f"{kind}_{gpus}",
            profile=ROOT / f"pipelines/clusters/profiles/{kind}.rpeg", gpus=gpus))
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
           "transformers": transformers.__version__, "cuda": torch.cuda.is_available(),
           "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
           "vllm": importlib.util.find_spec("vllm") is not None}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return out


def run_check(check: Check, work: Path, log: Path, cpu: bool, gpus: int = 1,
              kind: str = "h200") -> dict:
    """One check: its inputs written, compiled (pins as written, the rest searched) and run,
    then verified; what ran where and the comparison with the plan."""
    if check.needs and importlib.util.find_spec(check.needs) is None:
        return {"check": check.name, "skipped": f"{check.needs} is not installed here"}
    folder = work / check.name
    spec, cluster = write_inputs(folder, cpu, check, gpus, kind)
    run_dir = folder / "run"
    run_rc, run_s = rpeg("run", str(spec), "--cluster", str(cluster), "--steps",
                         str(check.steps), "--run-dir", str(run_dir), "--no-progress",
                         *(["--cpu"] if cpu else ["--cuda"]), *check.extra, log=log)
    verify_rc, _ = rpeg("verify", str(run_dir), log=log) if run_rc == 0 else (None, 0.0)
    meta = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() \
        else {}
    gpus = meta.get("gpus") or {}
    # on GPUs: the ops ran on CUDA, each device on a GPU of its own
    placed = cpu or (meta.get("cuda") is True and len(set(gpus.values())) == len(gpus) > 0)
    return {"check": check.name, "run_rc": run_rc, "run_s": run_s, "verify_rc": verify_rc,
            "steps": check.steps, "cuda": meta.get("cuda"), "gpus": gpus, "placed": placed,
            "comparison": compare(run_dir) if (run_dir / "trace.json").exists() else None,
            "run_dir": run_dir}


def ok(result: dict) -> bool:
    return "skipped" in result or (result["run_rc"] == 0 and result["verify_rc"] == 0
                                   and result["placed"])


def markdown(result: dict, title: str = "GPU check") -> str:
    env = result["environment"]
    count = f" x {env['gpus']}" if env.get("gpus", 0) > 1 else ""
    out = [f"# {title}", "", f"Command: `{result['command']}`  ",
           f"Date: {result['date']}; {env.get('gpu', 'no GPU (CPU dry run)')}{count}; python "
           f"{env['python']}, torch {env['torch']}, transformers {env['transformers']}, vllm "
           f"{'installed' if env.get('vllm') else 'not installed'}", ""]
    for r in result["checks"]:
        out.append(f"## {r['check']}")
        out.append("")
        if "skipped" in r:
            out += [f"- skipped: {r['skipped']}", ""]
            continue
        where = f"CUDA ({', '.join(f'{d}: {g}' for d, g in (r['gpus'] or {}).items())})" \
            if r["cuda"] else "CPU"
        out += [f"- `rpeg run`: exit {r['run_rc']} in {r['run_s']:.0f} s ({r['steps']} steps "
                f"of {result['model']}; ops on {where})",
                f"- `rpeg verify`: exit {r['verify_rc']}"]
        if not r["placed"]:
            out.append("- FAILED: the ops did not run on CUDA, one GPU per device")
        c = r.get("comparison") or {}
        if c:
            pk, pp = c["peak_bytes"], c["predicted_peak_bytes"]
            err = f" ({100 * (pp / pk - 1):+.0f}%)" if pk else ""
            out += [f"- peak device memory: measured {pk / 1e9:.2f} GB allocated, predicted "
                    f"{pp / 1e9:.2f} GB{err}",
                    f"- predicted step: {c['predicted_step_s']:.3f} s", "",
                    "| op | measured s (median, steps > 0) | first step s | predicted s | err "
                    "| peak GB |", "|---|---:|---:|---:|---:|---:|"]
            for row in c["ops"]:
                p = row["predicted_s"]
                err = f"{100 * (p / row['measured_s'] - 1):+.0f}%" \
                    if p and row["measured_s"] else ""
                first = f"{row['first_step_s']:.3f}" if row["first_step_s"] is not None else ""
                peak = f"{row['peak_bytes'] / 1e9:.2f}" if row["peak_bytes"] else ""
                out.append(f"| {row['op']} | {row['measured_s']:.4f} | {first} | "
                           f"{p if p is None else f'{p:.4f}'} | {err} | {peak} |")
        out.append("")
    out.append(f"Result: {'ok' if all(ok(r) for r in result['checks']) else 'FAILED'}")
    return "\n".join(out) + "\n"


def run_all(checks, args, name: str, gpus: int = 1, kind: str = "h200",
            title: str = "GPU check") -> int:
    """Run ``checks``, write ``name``.md/.json (and the runs' plan, metrics and run.json)
    to ``--out``; 1 when any check's run or verify failed."""
    import datetime as dt
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="rpeg-gpu-check-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    log = out / f"{name}.log"
    checks = [c for c in checks if not args.only or c.name in args.only]
    results = [run_check(c, work, log, args.cpu, gpus, kind) for c in checks]
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]),
              "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "environment": environment(), "model": "tiny" if args.cpu else MODEL,
              "checks": results, "seconds": round(time.perf_counter() - t0, 1)}
    for r in results:
        run_dir = r.pop("run_dir", None)
        for f in ("plan.json", "metrics.jsonl", "run.json"):
            if run_dir is not None and (run_dir / f).exists():
                shutil.copy(run_dir / f, out / f"{name}_{r['check']}_{f}")
    text = markdown(result, title)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text(text)
    if not args.cpu:
        results_dir = ROOT / "benchmarks" / "results"
        (results_dir / f"{name}.json").write_text(json.dumps(result, indent=1))
        (results_dir / f"{name}.md").write_text(text)
    print(text)
    shutil.rmtree(work, ignore_errors=True)      # the run directories (their checkpoints: GBs)
    return 0 if all(ok(r) for r in results) else 1


def arguments(doc: str, argv=None, gpus: bool = False):
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="also write the results here")
    ap.add_argument("--cpu", action="store_true",
                    help="dry run of this script with the tiny model on CPU workers")
    ap.add_argument("--only", action="append", default=[], help="run only this check")
    if gpus:
        ap.add_argument("--gpus", type=int, required=True, help="GPUs of the node (>= 2)")
        ap.add_argument("--kind", default="h100", help="the GPUs' profile (h100, h200, ...)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = arguments(__doc__, argv)
    return run_all(ONE_GPU, args, "gpu_check")


if __name__ == "__main__":
    sys.exit(main())
