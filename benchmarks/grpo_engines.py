"""GRPO with vLLM generating: synchronous against disaggregated asynchronous, and against the
torch engine. tiny_grpo, 3 seeds each.

    .venv-vllm/bin/python benchmarks/grpo_engines.py                  # 3 variants x 3 seeds x 60 steps
    .venv-vllm/bin/python benchmarks/grpo_engines.py --steps 20       # shorter

Run it in the vLLM venv (scripts/setup-vllm-venv.sh). Every variant is
pipelines/tiny_grpo.rpeg with its models on the ``tiny-vllm`` preset (vLLM needs a
head dimension of at least 64) and the same data, reward, optimizer and placement
(``--strategy runtime-split``: the rollout alone on device 0, reference, reward and
training on device 1 — disaggregated). The variants:

- ``vllm-sync``: vLLM generates, ``--staleness 0`` (generation of step s waits for the
  update of step s - 1);
- ``vllm-async``: vLLM generates with the spec's bound (staleness 1: generation of step
  s overlaps the update of step s - 1);
- ``torch-async``: the torch engine generates, staleness 1.

With vLLM the engine serves its own copy of the actor, and each version reaches it
through collectives from the trainer (a send and a receive, no weights through Dask).
Each run is a real ``rpeg run`` (local Dask cluster, non-daemon workers) followed by
``rpeg verify``; the torch runs use the project's main venv (.venv) when it exists. The
figures compared are the mean reward over the last quarter of the steps (per variant,
the mean and standard deviation over seeds, and the difference of the means against the
seed-to-seed spread) and the median step time.

Writes benchmarks/results/grpo_engines.json and grpo_engines.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance  # noqa: E402

PIPELINES = ROOT / "pipelines"
RESULTS = ROOT / "benchmarks" / "results"
# The same placement for both engines: rollout on device 0, the rest on device 1, weights
# synced from the trainer to the generator after every step.
STRATEGY = "runtime-split"
# label -> (engine, staleness cap: None keeps the spec's bound of 1)
VARIANTS = {"vllm-sync": ("vllm", 0), "vllm-async": ("vllm", None), "torch-async": ("torch", None)}


def variant(engine: str, seed: int, steps: int) -> str:
    """tiny_grpo.rpeg on tiny-vllm with the rollout on ``engine``."""
    text = (PIPELINES / "tiny_grpo.rpeg").read_text()
    text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", text)
    text = re.sub(r"(seed\s*=\s*)\d+", rf"\g<1>{seed}", text)
    text = re.sub(r"(steps\s*=\s*)\d+", rf"\g<1>{steps}", text)
    text = re.sub(r"(stage rollout\s*=\s*generate\([^)]*)\)", rf"\1, engine = {engine})", text)
    if "tiny-vllm" not in text or f"engine = {engine}" not in text:
        raise SystemExit("pipelines/tiny_grpo.rpeg changed shape: update benchmarks/grpo_engines.py")
    return text.replace("pipeline tiny_grpo", f"pipeline tiny_grpo_{engine}")


def python_for(engine: str) -> Path:
    """vLLM runs need this venv; the torch engine runs where rpeg normally runs (.venv), since
    vLLM pins an older transformers under which the torch engine's cache handling fails."""
    main = ROOT / ".venv" / "bin" / "python"
    return main if engine == "torch" and main.exists() else Path(sys.executable)


def run_one(label: str, seed: int, steps: int, workdir: Path) -> dict:
    engine, staleness = VARIANTS[label]
    spec_dir = workdir / f"{label}-{seed}"
    spec_dir.mkdir()
    shutil.copy(PIPELINES / "rewards.py", spec_dir / "rewards.py")
    (spec_dir / "data").symlink_to(PIPELINES / "data")
    spec = spec_dir / "tiny_grpo.rpeg"
    spec.write_text(variant(engine, seed, steps))
    run_dir = spec_dir / "run"
    env = {**os.environ, "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
           "VLLM_LOGGING_LEVEL": "ERROR"}
    rpeg = [str(python_for(engine)), "-m", "rpeg"]
    t0 = time.perf_counter()
    cap = [] if staleness is None else ["--staleness", str(staleness)]
    done = subprocess.run([*rpeg, "run", str(spec), "--run-dir", str(run_dir),
                           "--strategy", STRATEGY, *cap], env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"rpeg run failed ({label}, seed {seed}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    verify = subprocess.run([*rpeg, "verify", str(run_dir)], env=env, capture_output=True, text=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    rewards = [m["reward"] for m in metrics if "reward" in m]
    tail = rewards[-max(1, len(rewards) // 4):]
    steady = [m["step_time_s"] for m in metrics[1:] if "step_time_s" in m]
    syncs = [e for e in json.loads((run_dir / "trace.json").read_text())["traceEvents"]
             if e.get("ph") == "X" and e["name"].startswith("sync_")]
    return {"variant": label, "engine": engine, "staleness": 1 if staleness is None else 0,
            "seed": seed, "steps": len(rewards), "rewards": rewards,
            "sync_ops": sorted({e["name"] for e in syncs}),
            "sync_bytes": max((e["args"].get("stats", {}).get("bytes", 0) for e in syncs),
                              default=0),
            "final_reward": statistics.fmean(tail), "first_reward": rewards[0],
            "wall_s": wall, "median_step_s": statistics.median(steady) if steady else None,
            "verified": verify.returncode == 0, "verify": verify.stdout.strip()[-300:]}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for label in VARIANTS:
        mine = [r for r in runs if r["variant"] == label]
        if not mine:
            continue
        finals = [r["final_reward"] for r in mine]
        out[label] = {"final_mean": statistics.fmean(finals),
                      "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                      "finals": finals,
                      "first_mean": statistics.fmean(r["first_reward"] for r in mine),
                      "median_step_s": statistics.median(r["median_step_s"] for r in mine)}
    for a, b in (("vllm-async", "vllm-sync"), ("vllm-async", "torch-async")):
        if a in out and b in out:
            diff = out[a]["final_mean"] - out[b]["final_mean"]
            spread = max(out[a]["final_std"], out[b]["final_std"], 1e-9)
            out[f"{a} vs {b}"] = {
                "difference": diff, "difference_in_seed_stds": diff / spread,
                "within_noise": abs(diff) <= 2 * spread,
                "relative": diff / out[b]["final_mean"] if out[b]["final_mean"] else None,
                "step_ratio": out[a]["median_step_s"] / out[b]["median_step_s"]}
    return out


def markdown(doc: dict) -> str:
    s = doc["summary"]
    lines = ["# tiny_grpo with vLLM: synchronous vs disaggregated asynchronous (and the torch "
             "engine)", "",
             header(doc["provenance"]) if "provenance" in doc
             else f"Command: `{doc['command']}`  ", "",
             f"{doc['steps']} steps, seeds {doc['seeds']}, model tiny-vllm, placement "
             f"{STRATEGY} (rollout alone on device 0, the trainer on device 1); final reward = "
             f"mean over the last quarter of the steps.", "",
             "| variant | engine | staleness | first reward | final reward (mean ± sd over "
             "seeds) | per seed | median step | weight sync |",
             "|---|---|---:|---:|---:|---|---:|---|"]
    for label, (engine, cap) in VARIANTS.items():
        if label not in s:
            continue
        e = s[label]
        mine = [r for r in doc["runs"] if r["variant"] == label]
        ops = ", ".join(sorted({o for r in mine for o in r.get("sync_ops", [])})) or "-"
        lines.append(f"| {label} | {engine} | {1 if cap is None else cap} | "
                     f"{e['first_mean']:.3f} | {e['final_mean']:.3f} ± {e['final_std']:.3f} | "
                     f"{', '.join(f'{x:.3f}' for x in e['finals'])} | "
                     f"{e['median_step_s']:.2f} s | {ops} |")
    lines.append("")
    for key, c in s.items():
        if " vs " not in key:
            continue
        lines.append(f"{key}: final reward {c['difference']:+.3f}"
                     + (f" ({c['relative']:+.1%})" if c["relative"] is not None else "")
                     + f" = {c['difference_in_seed_stds']:+.1f} seed standard deviations, "
                     f"{'within' if c['within_noise'] else 'outside'} noise (|Δ| ≤ 2 sd); "
                     f"median step time ratio {c['step_ratio']:.2f}.")
    lines += ["", f"All runs verified: {all(r['verified'] for r in doc['runs'])}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=str(RESULTS / "grpo_engines"))
    args = ap.parse_args(argv)
    started = provenance(sys.argv[:1] + (argv if argv is not None else sys.argv[1:]))
    from backends.vllm_backend import require

    require()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for label in args.variants.split(","):
                print(f"tiny_grpo seed {seed}, {label} ...", flush=True)
                runs.append(run_one(label, seed, args.steps, Path(tmp)))
                print(f"  final reward {runs[-1]['final_reward']:.3f} in {runs[-1]['wall_s']:.0f} s",
                      flush=True)
    doc = {"benchmark": "grpo_engines", "date": dt.datetime.now(dt.timezone.utc).isoformat(),
           "command": " ".join([".venv-vllm/bin/python", "benchmarks/grpo_engines.py",
                                *(argv if argv is not None else sys.argv[1:])]),
           "steps": args.steps, "seeds": seeds, "loadavg": list(os.getloadavg()), "runs": runs,
           "provenance": finish(started)}
    doc["summary"] = summarise(runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    text = markdown(doc)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
