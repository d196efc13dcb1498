"""What pricing memory by the runtime's copies changed: each shipped GPU pipeline compiled
on each GPU cluster by the tree at ``--before`` (a git revision) and by this tree, and the
plan the first chose priced again by this tree.

    .venv/bin/python benchmarks/copies_change.py --before main                 # every pair
    .venv/bin/python benchmarks/copies_change.py --before main --clusters gh200_8 a100_16
    .venv/bin/python benchmarks/copies_change.py --before main --stored     # no compiling

Writes benchmarks/results/copies_change.json and .md (``--stored``: copies_change_stored):
the plans stored in benchmarks/results/control_plane_plans priced by both trees, and per
(pipeline, cluster) the
predicted step time and peak memory per device of each side's compiled plan, and the
peak of the earlier plan as this tree prices it (the same plan: what the change alone
moves). Every figure is a prediction of the cost model; compiling is deterministic for a
seed and budget, so the figures do not depend on the machine or its load (the planning
seconds do).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance, save  # noqa: E402

GPU_PIPELINES = ("ppo_llama8b", "ppo_shared", "ppo_async", "grpo_qwen7b", "grpo_qwen7b_tools",
                 "dapo_qwen7b", "gspo_qwen7b")
CLUSTERS = ("gh200_8", "a100_16", "gh200_64", "a100_64", "h100_64", "gh200_256", "gh200_2048")
GB = 1e9


def checkout(revision: str, into: Path) -> Path:
    """The tree of ``revision``, unpacked into ``into`` (no git state changes)."""
    data = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True,
                          capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    return into


def compile_with(tree: Path, pipeline: str, cluster: str, out: Path) -> dict | None:
    """``rpeg compile --json`` of the shipped ``pipeline`` on ``cluster`` by ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-m", "rpeg", "compile",
                        str(ROOT / "pipelines" / f"{pipeline}.rpeg"), "--cluster",
                        str(ROOT / "pipelines" / "clusters" / f"{cluster}.rpeg"), "--json",
                        "--no-gantt", "-o", str(out)], env=env, capture_output=True,
                       text=True, cwd=tree)
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr).strip().splitlines()[-1:]}
    return json.loads(r.stdout)


def summary(js: dict | None) -> dict:
    if js is None or "error" in js:
        return {"error": (js or {}).get("error")}
    pr = js["predicted"]
    return {"step_s": round(pr["step_time_s"], 4),
            "peak_gb": round(max(pr["peak_memory"]) / GB, 3),
            "layout": [(p["stage"], len(p["devices"]), p.get("tp", 1), p.get("zero", 0),
                        p.get("engine", "torch")) for p in js["placements"]]}


PRICE = """
import json, sys
from rpeg.plan.evaluate import Evaluator
from rpeg.plan.model import Plan
from rpeg.spec import load, load_cluster
plan = Plan.load(sys.argv[1])
spec, cluster = sys.argv[2:4]
e = Evaluator(load(spec), load_cluster(cluster)).evaluate(plan)
print(json.dumps({"step_s": round(e.step_time_s, 4), "feasible": e.feasible,
                  "peak_gb": round(max(e.plan.predicted.peak_memory) / 1e9, 3)}))
"""


def price_with(tree: Path, plan_path: Path, pipeline: str, cluster: str) -> dict:
    """The plan at ``plan_path`` priced by ``tree``: its step time and peak memory."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    r = subprocess.run([sys.executable, "-c", PRICE, str(plan_path),
                        str(ROOT / "pipelines" / f"{pipeline}.rpeg"),
                        str(ROOT / "pipelines" / "clusters" / f"{cluster}.rpeg")],
                       env=env, capture_output=True, text=True, cwd=tree)
    if r.returncode != 0:
        return {"error": (r.stdout + r.stderr).strip().splitlines()[-1:]}
    return json.loads(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default="main", help="the git revision compared against")
    ap.add_argument("--pipelines", nargs="*", default=list(GPU_PIPELINES))
    ap.add_argument("--clusters", nargs="*", default=list(CLUSTERS))
    ap.add_argument("--stored", action="store_true",
                    help="only price the plans stored in benchmarks/results/"
                         "control_plane_plans by both trees (no compiling)")
    ap.add_argument("--render", type=Path, help="only write the markdown of a results file again")
    args = ap.parse_args()
    if args.render:
        args.render.with_suffix(".md").write_text(render(json.loads(args.render.read_text())))
        return
    prov = provenance()
    rows, stored = [], []
    with tempfile.TemporaryDirectory() as tmp:
        before = checkout(args.before, Path(tmp) / "before")
        for path in sorted((ROOT / "benchmarks/results/control_plane_plans").glob("*.json")):
            named = json.loads(path.read_text())
            pipeline, cluster = named["pipeline"], named["cluster"]
            stored.append({"plan": path.name,
                           "before": price_with(before, path, pipeline, cluster),
                           "after": price_with(ROOT, path, pipeline, cluster)})
            print(json.dumps(stored[-1]), flush=True)
        for pipeline in [] if args.stored else args.pipelines:
            for cluster in args.clusters:
                a, b = Path(tmp) / f"{pipeline}-{cluster}-a.json", \
                    Path(tmp) / f"{pipeline}-{cluster}-b.json"
                old = summary(compile_with(before, pipeline, cluster, a))
                new = summary(compile_with(ROOT, pipeline, cluster, b))
                again = price_with(ROOT, a, pipeline, cluster) if a.exists() else None
                rows.append({"pipeline": pipeline, "cluster": cluster, "before": old,
                             "after": new, "before_plan_now": again})
                print(json.dumps(rows[-1]), flush=True)
    res = {"provenance": finish(prov), "before": args.before, "stored": stored, "rows": rows}
    save("copies_change" + ("_stored" if args.stored else ""), res, render(res))


def _peak(r: dict) -> str:
    """A priced plan's peak, marked where it no longer fits."""
    return f"{r.get('peak_gb', '-')}" + ("" if r.get("feasible", True) else " (does not fit)")


def render(res: dict) -> str:
    """The results file's markdown."""
    lines = [f"# Memory priced by the runtime's copies: before ({res['before']}) and after", "",
             header(res["provenance"]), "",
             "| pipeline | cluster | step s before | after | peak GB before | after | "
             "earlier plan's peak GB now | same layout |", "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        o, n, g = r["before"], r["after"], r["before_plan_now"] or {}
        lines.append(f"| {r['pipeline']} | {r['cluster']} | {o.get('step_s', o.get('error'))} | "
                     f"{n.get('step_s', n.get('error'))} | {o.get('peak_gb', '-')} | "
                     f"{n.get('peak_gb', '-')} | {_peak(g)} | "
                     f"{o.get('layout') == n.get('layout')} |")
    lines += ["", "Stored plans (benchmarks/results/control_plane_plans) priced by each tree:", "",
              "| plan | step s before | after | peak GB before | after |", "|---|---|---|---|---|"]
    for r in res["stored"]:
        o, n = r["before"], r["after"]
        lines.append(f"| {r['plan']} | {o.get('step_s', o.get('error'))} | "
                     f"{n.get('step_s', n.get('error'))} | {_peak(o)} | {_peak(n)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
