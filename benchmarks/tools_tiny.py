"""The tool task learned from scratch: pipelines/tiny_tools.rpeg on the local cluster, 3 seeds.

    .venv/bin/python benchmarks/tools_tiny.py                 # the spec's steps, seeds 0 1 2
    .venv/bin/python benchmarks/tools_tiny.py --steps 40      # shorter

Each prompt opens a call of a lookup tool on a key; the value is one only the tool holds
(a salted hash). ``rewards:lookup_reward`` gives nothing without an observation (nor for
no answer after it), so with no tool the reward is 0 (the no-tool ceiling); a policy that
calls the tool but ignores its result can score at most ``rewards.guess_ceiling`` of the
values (the best fixed answer). Each seed is ``rpeg run pipelines/tiny_tools.rpeg workload.seed=S`` on the local
Dask cluster, then ``rpeg verify`` (every token's version checked); from its metrics: the
reward of the first and the last tenth of the steps, the share of tool calls that came
back as errors (a call the policy did not end right), the turns per sample, and the share
of samples whose answer after the tool's result is the value (from samples.jsonl).

Writes benchmarks/results/tools_tiny.json and .md, with the machine, the load and the
command (benchmarks/provenance.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "pipelines"))

from provenance import finish, header, provenance  # noqa: E402
from real_task import rpeg  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
SPEC = ROOT / "pipelines" / "tiny_tools.rpeg"


def tenth(rows: list[dict], key: str, last: bool) -> float:
    n = max(len(rows) // 10, 1)
    part = rows[-n:] if last else rows[:n]
    return statistics.fmean(r.get(key, 0.0) for r in part)


def one_seed(seed: int, steps: int | None, work: Path) -> dict:
    run_dir = work / f"seed{seed}"
    if run_dir.exists():
        import shutil
        shutil.rmtree(run_dir)
    over = [f"workload.seed={seed}"] + ([f"workload.steps={steps}"] if steps else [])
    seconds = rpeg("run", str(SPEC), *over, "--run-dir", str(run_dir), "--no-progress",
                   "--op-timeout", "3600", cwd=ROOT)
    verified = subprocess.run([sys.executable, "-m", "rpeg", "verify", str(run_dir)],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                              capture_output=True, text=True)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    last = [s for s in samples if s["step"] >= metrics[-1]["step"] - max(len(metrics) // 10, 1)]
    right = [s for s in last if s["response"].split("</result>")[-1].startswith(s["answer"])
             and "</result>" in s["response"]]
    calls = [m.get("tool_calls", 0) for m in metrics]
    errors = [m.get("tool_errors", 0) for m in metrics]
    return {
        "seed": seed, "seconds": seconds, "steps": len(metrics),
        "verify": verified.stdout.strip() or verified.stderr.strip(),
        "verified": verified.returncode == 0,
        "reward_first": tenth(metrics, "reward", False),
        "reward_last": tenth(metrics, "reward", True),
        "error_share_first": errors[0] / max(calls[0], 1),
        "error_share_last": sum(errors[-max(len(errors) // 10, 1):])
        / max(sum(calls[-max(len(calls) // 10, 1):]), 1),
        "turns_last": tenth(metrics, "turns", True),
        "answered_right_last": len(right) / max(len(last), 1),
        "rewards": [round(m.get("reward", 0.0), 4) for m in metrics],
        "examples": [{"prompt": s["prompt"], "answer": s["answer"], "turns": s.get("turns")}
                     for s in samples[-2:]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="default: the spec's")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "tools_tiny")
    args = ap.parse_args()
    from rewards import guess_ceiling
    answers = [json.loads(x)["answer"] for x in
               (ROOT / "pipelines" / "data" / "keys.jsonl").read_text().splitlines()]
    guess = guess_ceiling(answers)
    prov = provenance()
    runs = [one_seed(s, args.steps, args.work) for s in args.seeds]
    last = [r["reward_last"] for r in runs]
    mean, spread = statistics.fmean(last), (statistics.stdev(last) if len(last) > 1 else 0.0)
    result = {"provenance": finish(prov), "spec": str(SPEC.relative_to(ROOT)),
              "spec_text": SPEC.read_text(), "no_tool_ceiling": 0.0, "guess_ceiling": guess,
              "reward_last_mean": mean, "reward_last_std": spread,
              "every_seed_above_guess": all(x > guess for x in last),
              "all_verified": all(r["verified"] for r in runs), "runs": runs}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tools_tiny.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = ["# The tool task learned from scratch (pipelines/tiny_tools.rpeg)", "",
             header(result["provenance"]), "",
             f"Ceilings: without the tool 0 (no observation, no answer credit); calling it but "
             f"ignoring its result {guess:.3f} (the best fixed answer).", "",
             "| seed | steps | reward, first tenth | reward, last tenth | tool errors, first "
             "step | tool errors, last tenth | turns | answer = value, last tenth | verify |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['seed']} | {r['steps']} | {r['reward_first']:.3f} | "
                     f"{r['reward_last']:.3f} | {r['error_share_first']:.2f} | "
                     f"{r['error_share_last']:.2f} | {r['turns_last']:.2f} | "
                     f"{r['answered_right_last']:.2f} | {'ok' if r['verified'] else 'FAILED'} |")
    lines += ["", f"Final reward (mean of the last tenth of the steps) {mean:.3f} ± {spread:.3f} "
                  f"over {len(runs)} seeds; every seed above the guess ceiling: "
                  f"{result['every_seed_above_guess']}; every run verified: "
                  f"{result['all_verified']}. Runs took "
                  + ", ".join(f"{r['seconds'] / 60:.1f}" for r in runs) + " min."]
    (RESULTS / "tools_tiny.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
