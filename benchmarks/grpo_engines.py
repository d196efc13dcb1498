"""Does GRPO train as well with vLLM generating as with the torch engine? tiny_grpo, 3 seeds each.

    .venv-vllm/bin/python benchmarks/grpo_engines.py                  # 2 engines x 3 seeds x 60 steps
    .venv-vllm/bin/python benchmarks/grpo_engines.py --steps 20       # shorter

Run it in the vLLM venv (scripts/setup-vllm-venv.sh). Both variants are
pipelines/tiny_grpo.rpeg with its models on the ``tiny-vllm`` preset (vLLM needs a
head dimension of at least 64) and the rollout stage's ``engine`` set to ``torch`` or
``vllm``; everything else — data, reward, optimizer, placement (``--strategy runtime-split``:
rollout on one device, reference, reward and training on the other, the actor's
weights synced to the generating device after every update) — is the same. Each
run is a real ``rpeg run`` (local Dask cluster, non-daemon workers) followed by
``rpeg verify``; the torch runs use the project's main venv (.venv) when it exists. The figure compared is the mean reward over the last quarter of the
steps: per engine, the mean and standard deviation over seeds, and the difference of
the means against the seed-to-seed spread.

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


def run_one(engine: str, seed: int, steps: int, workdir: Path) -> dict:
    spec_dir = workdir / f"{engine}-{seed}"
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
    done = subprocess.run([*rpeg, "run", str(spec), "--run-dir", str(run_dir),
                           "--strategy", STRATEGY], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"rpeg run failed ({engine}, seed {seed}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    verify = subprocess.run([*rpeg, "verify", str(run_dir)], env=env, capture_output=True, text=True)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    rewards = [m["reward"] for m in metrics if "reward" in m]
    tail = rewards[-max(1, len(rewards) // 4):]
    steady = [m["step_time_s"] for m in metrics[1:] if "step_time_s" in m]
    return {"engine": engine, "seed": seed, "steps": len(rewards), "rewards": rewards,
            "final_reward": statistics.fmean(tail), "first_reward": rewards[0],
            "wall_s": wall, "median_step_s": statistics.median(steady) if steady else None,
            "verified": verify.returncode == 0, "verify": verify.stdout.strip()[-300:]}


def summarise(runs: list[dict]) -> dict:
    out = {}
    for engine in ("torch", "vllm"):
        finals = [r["final_reward"] for r in runs if r["engine"] == engine]
        out[engine] = {"final_mean": statistics.fmean(finals),
                       "final_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
                       "finals": finals,
                       "first_mean": statistics.fmean(r["first_reward"] for r in runs
                                                      if r["engine"] == engine),
                       "median_step_s": statistics.median(r["median_step_s"] for r in runs
                                                          if r["engine"] == engine)}
    diff = out["vllm"]["final_mean"] - out["torch"]["final_mean"]
    spread = max(out["vllm"]["final_std"], out["torch"]["final_std"], 1e-9)
    out["difference"] = diff
    out["difference_in_seed_stds"] = diff / spread
    out["within_noise"] = abs(diff) <= 2 * spread
    return out


def markdown(doc: dict) -> str:
    s = doc["summary"]
    lines = ["# tiny_grpo: torch engine vs vLLM engine", "",
             header(doc["provenance"]) if "provenance" in doc
             else f"Command: `{doc['command']}`  ", "",
             f"{doc['steps']} steps, seeds {doc['seeds']}, model tiny-vllm; final reward = mean "
             f"over the last quarter of the steps.", "",
             "| engine | first reward | final reward (mean ± sd over seeds) | per seed | "
             "median step |", "|---|---:|---:|---|---:|"]
    for engine in ("torch", "vllm"):
        e = s[engine]
        lines.append(f"| {engine} | {e['first_mean']:.3f} | {e['final_mean']:.3f} ± "
                     f"{e['final_std']:.3f} | {', '.join(f'{x:.3f}' for x in e['finals'])} | "
                     f"{e['median_step_s']:.2f} s |")
    lines += ["", f"Difference (vLLM − torch): {s['difference']:+.3f} = "
              f"{s['difference_in_seed_stds']:+.1f} seed standard deviations: "
              f"{'within' if s['within_noise'] else 'outside'} noise (|Δ| ≤ 2 sd). "
              f"All runs verified: {all(r['verified'] for r in doc['runs'])}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--out", default=str(RESULTS / "grpo_engines"))
    args = ap.parse_args(argv)
    started = provenance(sys.argv[:1] + (argv if argv is not None else sys.argv[1:]))
    from backends.vllm_backend import require

    require()
    seeds = [int(s) for s in args.seeds.split(",")]
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for engine in ("torch", "vllm"):
                print(f"tiny_grpo seed {seed} on {engine} ...", flush=True)
                runs.append(run_one(engine, seed, args.steps, Path(tmp)))
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
