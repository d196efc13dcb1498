"""Do the estimators and losses learn? tiny_grpo's toy task, six algorithms, 3 seeds each.

    .venv/bin/python benchmarks/algorithms.py                    # 6 algorithms x 3 seeds x 60 steps
    .venv/bin/python benchmarks/algorithms.py --steps 20 --seeds 0

Each variant is pipelines/tiny_grpo.rpeg (4 samples per prompt, the toy reward, a frozen
reference) with its estimator and loss replaced, everything else the same:

* grpo     -- group_norm; grpo(0.2, kl = 0.01), as shipped
* dr_grpo  -- group_norm(std = false); grpo(0.2, kl = 0.01, agg = seq_mean_token_sum)
* dapo     -- dynamic sampling (refill_rounds = 2, filter_rate = 0.5); group_norm;
              grpo(clip_low = 0.2, clip_high = 0.28, agg = token_mean), no KL
* gspo     -- group_norm; gspo(clip_low = 3e-4, clip_high = 4e-4)
* rloo     -- rloo; ppo_clip(0.2, kl = 0.01)
* reinforce_pp -- reinforce with the KL in the reward (kl = 0.01); ppo_clip(0.2)
* dr_grpo_no_kl -- dr_grpo without the KL term (``--only dr_grpo_no_kl``: why Dr. GRPO is
  slower here -- its unscaled advantages make a policy gradient tens of times smaller than
  GRPO's, next to the same KL coefficient)

``--only NAME`` (repeatable) runs those algorithms and merges them into the results file
already written (replacing their earlier runs; the command of each part is recorded).

Every run is the runtime's (a local 2-worker Dask cluster shared by the runs, the same
hand-built split plan for all: rollout on device 0, the rest on device 1, staleness 1 as
the spec allows) and is checked with ``rpeg verify``. Reported per algorithm: the untrained
reward (the steps that read weight version 0), the final reward (mean over the last 10
steps) as mean and standard deviation over seeds, and the median step time.

Writes benchmarks/results/algorithms.json and algorithms.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance  # noqa: E402

PIPELINES = ROOT / "pipelines"
RESULTS = ROOT / "benchmarks" / "results"
FINAL = 10            # final reward: mean over this many last steps

ADV = "stage adv        = group_norm(scores)      -> advantages"
LOSS = "loss = grpo(0.2, kl = 0.01)"
GEN = "generate(actor, prompts, temperature = 1.0, max_len = 20)"
# algorithm -> the edits of tiny_grpo.rpeg that make it: (old, new) pairs
VARIANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "grpo": (),
    "dr_grpo": ((ADV, ADV.replace("group_norm(scores)", "group_norm(scores, std = false)")),
                (LOSS, "loss = grpo(0.2, kl = 0.01, agg = seq_mean_token_sum)")),
    "dapo": ((GEN, GEN.replace(")", ", refill_rounds = 2, filter_rate = 0.5)")),
             (LOSS, "loss = grpo(clip_low = 0.2, clip_high = 0.28, agg = token_mean)")),
    "gspo": ((LOSS, "loss = gspo(clip_low = 3e-4, clip_high = 4e-4)"),),
    "rloo": ((ADV, ADV.replace("group_norm(scores)", "rloo(scores)")),
             (LOSS, "loss = ppo_clip(0.2, kl = 0.01)")),
    "reinforce_pp": ((ADV, "stage adv = reinforce(scores, logprobs, ref_logprobs, kl = 0.01) "
                           "-> advantages"),
                     (LOSS, "loss = ppo_clip(0.2)")),
    "dr_grpo_no_kl": ((ADV, ADV.replace("group_norm(scores)", "group_norm(scores, std = false)")),
                      (LOSS, "loss = grpo(0.2, agg = seq_mean_token_sum)")),
}
DEFAULT = ("grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp")


def variant(name: str, seed: int, steps: int) -> str:
    text = (PIPELINES / "tiny_grpo.rpeg").read_text()
    for old, new in VARIANTS[name]:
        if old not in text:
            raise SystemExit(f"pipelines/tiny_grpo.rpeg changed shape ({old!r}): update "
                             "benchmarks/algorithms.py")
        text = text.replace(old, new)
    text = re.sub(r"(seed\s*=\s*)\d+", rf"\g<1>{seed}", text)
    text = re.sub(r"(steps\s*=\s*)\d+", rf"\g<1>{steps}", text)
    return text.replace("pipeline tiny_grpo", f"pipeline tiny_{name}")


def run_one(name: str, seed: int, steps: int, workdir: Path, scheduler: str) -> dict:
    from rpeg.runtime import RunOptions, run_pipeline, verify_run
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    d = workdir / f"{name}-{seed}"
    d.mkdir()
    shutil.copy(PIPELINES / "rewards.py", d / "rewards.py")
    (d / "data").symlink_to(PIPELINES / "data")
    spec = d / f"{name}.rpeg"
    spec.write_text(variant(name, seed, steps))
    p = load(spec)
    t0 = time.perf_counter()
    result = run_pipeline(p, split_plan(p, 2), RunOptions(steps=steps, scheduler=scheduler,
                                                            root=str(d), progress=False),
                          spec_path=str(spec))
    wall = time.perf_counter() - t0
    rows = list(result.metrics)
    rewards = [r["reward"] for r in rows]
    untrained = [r["reward"] for r in rows if r.get("gen_version", 0) == 0]
    out = {"algorithm": name, "seed": seed, "steps": len(rows),
           "untrained_reward": statistics.fmean(untrained),
           "final_reward": statistics.fmean(rewards[-FINAL:]), "rewards": rewards,
           "median_step_s": statistics.median(r["step_time_s"] for r in rows[2:] or rows),
           "grad_norm": statistics.fmean(r["grad_norm.actor_step"] for r in rows),
           "wall_s": round(wall, 2), "verified": verify_run(result.path).ok}
    if "filtered" in rows[0]:
        out["filtered"] = statistics.fmean(r["filtered"] for r in rows)
    return out


def summarise(runs: list[dict]) -> dict:
    out = {}
    for name in VARIANTS:
        mine = [r for r in runs if r["algorithm"] == name]
        if not mine:
            continue
        finals = [r["final_reward"] for r in mine]
        untrained = statistics.fmean(r["untrained_reward"] for r in mine)
        spread = statistics.stdev(finals) if len(finals) > 1 else 0.0
        out[name] = {"untrained": untrained, "final_mean": statistics.fmean(finals),
                     "final_std": spread, "finals": finals,
                     "gain": statistics.fmean(finals) - untrained,
                     "median_step_s": statistics.median(r["median_step_s"] for r in mine),
                     "learns": min(finals) > untrained + max(2 * spread, 0.05),
                     "verified": all(r["verified"] for r in mine)}
        if "filtered" in mine[0]:
            out[name]["filtered"] = statistics.fmean(r["filtered"] for r in mine)
        if all("grad_norm" in r for r in mine):
            out[name]["grad_norm"] = statistics.fmean(r["grad_norm"] for r in mine)
    return out


def markdown(doc: dict) -> str:
    lines = ["# Estimators and losses on tiny_grpo's toy task", "", header(doc["provenance"]), ""]
    for part in doc.get("added", []):
        lines += ["Added: " + header(part["provenance"]) + f" ({', '.join(part['algorithms'])})",
                  ""]
    lines += [
             f"{doc['steps']} steps, seeds {doc['seeds']}; final reward = mean over the last "
             f"{FINAL} steps; untrained = the steps that read weight version 0. 'Learns': every "
             "seed's final reward above the untrained one by more than twice the seeds' spread "
             "(and at least 0.05).", "",
             "| algorithm | untrained | final (mean ± sd) | per seed | gain | mean grad norm | "
             "median step | learns | verified |", "|---|---:|---:|---|---:|---:|---:|---|---|"]
    for name, s in doc["summary"].items():
        grad = f"{s['grad_norm']:.3f}" if "grad_norm" in s else "—"
        lines.append(f"| {name} | {s['untrained']:.3f} | {s['final_mean']:.3f} ± "
                     f"{s['final_std']:.3f} | {', '.join(f'{x:.3f}' for x in s['finals'])} | "
                     f"{s['gain']:+.3f} | {grad} | {s['median_step_s']:.3f} s | "
                     f"{'yes' if s['learns'] else 'no'} | {s['verified']} |")
    sm = doc["summary"]
    if all(n in sm and "grad_norm" in sm[n] for n in ("grpo", "dr_grpo", "dr_grpo_no_kl")):
        g, d, n = sm["grpo"], sm["dr_grpo"], sm["dr_grpo_no_kl"]
        lines += ["", f"Dr. GRPO's policy gradient is {g['grad_norm'] / d['grad_norm']:.0f}x "
                  f"smaller than GRPO's (mean norm {d['grad_norm']:.3f} vs {g['grad_norm']:.3f}): "
                  "its advantages are not divided by the group's spread of the toy reward, and "
                  "its loss divides token sums by the generation budget. Next to the same KL "
                  f"coefficient (0.01) it learns to {d['final_mean']:.3f}; without the KL term "
                  f"it reaches {n['final_mean']:.3f} ± {n['final_std']:.3f} (GRPO: "
                  f"{g['final_mean']:.3f})."]
    loads = [doc["provenance"]["load_average"]] + [a["provenance"]["load_average"]
                                                   for a in doc.get("added", [])]
    low = min(x["start"] for x in loads)
    high = max(x.get("end", x["start"]) for x in loads)
    lines += ["", f"The step times were measured at load averages {low}–{high} on {doc['provenance']['machine']['cores']} cores "
              "(other work on the same cores): they tell the load of the moment more than the "
              "algorithm."]
    if "dapo" in doc["summary"] and "filtered" in doc["summary"]["dapo"]:
        lines += ["", f"DAPO's dynamic sampling filtered {doc['summary']['dapo']['filtered']:.1%} "
                  "of the groups it checked (declared: 50%); its reward is over the batch it "
                  "kept."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--only", action="append", choices=sorted(VARIANTS))
    ap.add_argument("--out", default=str(RESULTS / "algorithms"))
    ap.add_argument("--markdown-only", action="store_true",
                    help="rewrite the .md from the .json already written; run nothing")
    args = ap.parse_args(argv)
    if args.markdown_only:
        doc = json.loads(Path(args.out).with_suffix(".json").read_text())
        Path(args.out).with_suffix(".md").write_text(markdown(doc))
        return 0
    started = provenance(sys.argv[:1] + (argv if argv is not None else sys.argv[1:]))
    from distributed import LocalCluster
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.only or list(DEFAULT)
    runs = []
    with tempfile.TemporaryDirectory() as tmp, LocalCluster(
            n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
            host="127.0.0.1", dashboard_address="127.0.0.1:0",
            silence_logs=logging.ERROR) as cluster:
        for seed in seeds:
            for name in names:
                print(f"{name} seed {seed} ...", flush=True)
                r = run_one(name, seed, args.steps, Path(tmp), cluster.scheduler_address)
                print(f"  untrained {r['untrained_reward']:.3f} final {r['final_reward']:.3f} "
                      f"step {r['median_step_s']:.3f} s verified {r['verified']}", flush=True)
                runs.append(r)
    out = Path(args.out)
    doc = {"provenance": finish(started), "steps": args.steps, "seeds": seeds, "runs": runs}
    if args.only and out.with_suffix(".json").exists():
        old = json.loads(out.with_suffix(".json").read_text())
        if (old["steps"], old["seeds"]) != (args.steps, seeds):
            raise SystemExit("--only adds runs of the same steps and seeds as the file's")
        doc = {**old, "runs": [r for r in old["runs"] if r["algorithm"] not in names] + runs,
               "added": old.get("added", []) + [{"provenance": doc["provenance"],
                                                 "algorithms": names}]}
    doc["summary"] = summarise(doc["runs"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))
    return 0 if all(s["verified"] for s in doc["summary"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
