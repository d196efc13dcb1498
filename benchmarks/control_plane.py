"""The control plane at GPU scale, measured without a cluster: the client's scheduling core on
a simulated clock, Dask's scheduler and client with many lightweight workers, the rendezvous
of process groups, and what that makes of a step of the shipped plans at 64 to 2,048 GPUs.

    .venv/bin/python benchmarks/control_plane.py                 # everything (~30 min on 2 cores)
    .venv/bin/python benchmarks/control_plane.py --only core     # one part: core, dask,
                                                                 # rendezvous, table
    .venv/bin/python benchmarks/control_plane.py --quick         # a smoke run of each part

Writes benchmarks/results/control_plane.{json,md} (each part as it ends; a part not run
keeps its last results).

1. core: the planner's plans (``rpeg compile SPEC --cluster gh200_N``, made once and kept
   in benchmarks/results/control_plane_plans/) for ppo_llama8b and grpo_qwen7b at 64, 256
   and 2,048 GPUs, and the 256-GPU plan widened to 1,024
   (``rpeg.runtime.calibrate.simulated.scaled``),
   lowered to op calls as ``rpeg run`` lowers them and driven through the scheduling core
   and the fusion on a simulated clock, each op taking the plan's predicted time
   (``rpeg.runtime.calibrate.simulated``): calls, Dask tasks and futures a step, the client's thread
   CPU per step, and the memory the calls and the core hold (tracemalloc, a run apart).
   At 64 and 256 GPUs also without joins (every rank of a gang waiting for everything),
   which the runtime did before.
2. dask: ``rpeg.runtime.calibrate.dispatch.measure_scheduler`` with 8 to 512 lightweight workers
   (``rpeg.runtime.calibrate.fleet``: the scheduler and the workers in processes of their own, no-op
   tasks pinned as rpeg pins them, futures of earlier tasks as arguments, the trace drain's
   broadcast), CPU seconds of each process; ``rpeg.cost.calibrate.fit_scheduler`` makes the
   terms of ``rpeg.cost.control`` from them, and each term is also fitted per fleet size
   (how it grows with the workers). The profiles' terms are not written here: ``rpeg
   calibrate --control-only -o PROFILE.rpeg`` measures them the same way.
3. rendezvous: torch.distributed's gloo process group over 2 to 16 processes on this
   machine (``init_process_group`` over TCP, a group of every rank, a barrier), beside
   NCCL's published initialisation times.
4. table: per plan, the calls, tasks and futures of a step (the core's run), the client's
   CPU (the core measured + Dask's client by the fitted terms) and the scheduler's (fitted),
   what ``rpeg.cost.control`` charges, and its share of the step.

CPU times are process and thread CPU seconds, which other work on the machine disturbs
less than wall time; the machine is shared, so every part records the load around it,
and the figures need a rerun on a quiet machine to be the machine's own.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import attrs
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.provenance import finish, header, provenance  # noqa: E402
from rpeg.cost.calibrate import fit_scheduler  # noqa: E402
from rpeg.cost.control import (  # noqa: E402
    SHARE_LIMIT,
    ControlTerms,
    Dispatch,
    control_time,
    heartbeats_per_s,
)
from rpeg.plan.model import Plan  # noqa: E402
from rpeg.runtime.calibrate.simulated import drive, scaled, seconds_from  # noqa: E402
from rpeg.runtime.lowering import joins  # noqa: E402
from rpeg.runtime.lowering.instances import build_calls  # noqa: E402
from rpeg.spec import load  # noqa: E402

OUT = ROOT / "benchmarks" / "results"
PLANS = OUT / "control_plane_plans"
PIPELINES = {"ppo_llama8b": "PPO 8B", "grpo_qwen7b": "GRPO 7B"}
SIZES = (64, 256, 2048)
STEPS = 6


# --- 1. the scheduling core on a simulated clock ---------------------------------------------
def plan_for(name: str, gpus: int, recompile: bool = False) -> Path:
    """The planner's plan for the shipped spec on gh200_<gpus> (made once, then kept)."""
    PLANS.mkdir(parents=True, exist_ok=True)
    path = PLANS / f"{name}_gh200_{gpus}.json"
    if recompile or not path.exists():
        subprocess.run([sys.executable, "-m", "rpeg", "compile", f"pipelines/{name}.rpeg",
                        "--cluster", f"pipelines/clusters/gh200_{gpus}.rpeg", "-o", str(path),
                        "--no-gantt"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return path


def core_row(pipeline, plan: Plan, label: str, *, with_joins: bool = True) -> dict:
    window = 1 + max((k for _, k in plan.staleness), default=0)
    old = joins.JOIN_MIN
    joins.JOIN_MIN = old if with_joins else 10 ** 9
    try:
        t = time.process_time()
        calls = build_calls(pipeline, plan, STEPS)
        lowering = time.process_time() - t
        op_times = dict(plan.predicted.op_times)
        r = drive(calls, STEPS, window, seconds_from(op_times, calls))
        tracemalloc.start()                       # the memory, in a run of its own
        held = build_calls(pipeline, plan, STEPS)
        drive(held, STEPS, window, seconds_from(op_times, held), ticks=False)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    finally:
        joins.JOIN_MIN = old
    devices = len({c.device for c in calls})
    return {"plan": label, "devices": devices, "joins": with_joins,
            "calls_per_step": r.calls_per_step, "tasks_per_step": r.tasks_per_step,
            "edges_per_step": r.edges_per_step, "futures_per_step": r.task_args_per_step,
            "client_core_cpu_per_step_s": round(r.client_cpu_per_step_s, 6),
            "core_cpu_per_call_us": round(1e6 * r.client_cpu_per_step_s
                                          / max(r.calls_per_step, 1), 2),
            "lowering_cpu_per_step_s": round(lowering / STEPS, 6),
            "memory_peak_mb": round(peak / 1e6, 1),
            "simulated_step_s": round(r.simulated_step_s, 3),
            "predicted_step_s": plan.predicted.step_time_s,
            "predicted_control_s": plan.predicted.control_s,
            "predicted_tasks_per_step": plan.predicted.tasks_per_step}


def run_core(quick: bool, recompile: bool) -> dict:
    rows = []
    for name in PIPELINES:
        pipeline = load(ROOT / "pipelines" / f"{name}.rpeg")
        for gpus in SIZES[:2] if quick else SIZES:
            plan = Plan.load(plan_for(name, gpus, recompile))
            label = f"{name} gh200_{gpus}"
            rows.append(core_row(pipeline, plan, label))
            print(f"core: {label}: {rows[-1]['client_core_cpu_per_step_s']:.3f} s a step",
                  file=sys.stderr)
            if gpus <= 256:
                rows.append(core_row(pipeline, plan, label, with_joins=False))
            if gpus == 256 and not quick:
                rows.append(core_row(pipeline, scaled(plan, 4), f"{name} gh200_256 x4"))
    return {"rows": rows}


# --- 2. Dask's scheduler and client with many lightweight workers ----------------------------
def run_dask(quick: bool, workers: tuple[int, ...], save) -> dict:
    from rpeg.runtime.calibrate.dispatch import measure_scheduler
    from rpeg.runtime.calibrate.simulated import measure_core
    m: dict = {"rows": []}
    for n in sorted(workers):                # a fleet at a time, kept as it ends
        one = measure_scheduler(workers=(n,), tasks=300 if quick else 1000, deps=4,
                                cross=n == min(workers))
        m["rows"] += one["rows"]
        m["loadavg"] = one["loadavg"]
        save({"measured": m})
        print(f"dask: {n} workers measured", file=sys.stderr)
    core = measure_core(64)
    terms = fit_scheduler(m, core)
    # how each term grows with the workers: the terms of each fleet alone, and a line
    per_fleet = [dict(workers=r["workers"], **fit_scheduler({"rows": [r]}))
                 for r in m["rows"]]
    growth = {}
    for key in ("scheduler_task_s", "scheduler_arg_s", "scheduler_worker_s",
                "scheduler_heartbeat_s", "client_task_s", "client_worker_s"):
        x = np.array([r["workers"] for r in per_fleet], float)
        y = np.array([r[key] for r in per_fleet], float)
        slope, intercept = np.polyfit(x, y, 1) if len(x) > 1 else (0.0, float(y[0]))
        growth[key] = {"at_0_s": float(intercept), "per_worker_s": float(slope)}
    return {"measured": m, "core": core, "terms": terms, "per_fleet": per_fleet,
            "growth": growth}


# --- 3. the rendezvous of process groups --------------------------------------------------------
RANK = r"""
import os, sys, time, json, resource
import torch.distributed as dist
rank, world, addr = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
t0 = time.perf_counter()
dist.init_process_group("gloo", init_method=addr, rank=rank, world_size=world)
t1 = time.perf_counter()
g = dist.new_group(list(range(world)))
t2 = time.perf_counter()
dist.barrier(group=g)
t3 = time.perf_counter()
dist.destroy_process_group()
ru = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"init_s": t1 - t0, "group_s": t2 - t1, "barrier_s": t3 - t2,
                  "cpu_s": ru.ru_utime + ru.ru_stime}))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(world: int) -> dict:
    """One gloo world of ``world`` processes: the slowest rank's times."""
    addr = f"tcp://127.0.0.1:{_free_port()}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(r), str(world), addr],
                              stdout=subprocess.PIPE, text=True, env=env)
             for r in range(world)]
    got = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
    return {"world": world, **{k: round(max(g[k] for g in got), 4)
                               for k in ("init_s", "group_s", "barrier_s")},
            "cpu_s_per_rank": round(statistics.median(g["cpu_s"] for g in got), 3)}


NCCL_PUBLISHED = [
    {"what": "stock NCCL initialisation at 96K H100 GPUs", "seconds": 265.0,
     "source": "Si et al., Collective Communication for 100k+ GPUs (NCCLX), arXiv 2510.20171, "
               "2025: bootstrap and connection set-up grow super-linearly"},
    {"what": "ncclBuildRing's O(n^2) loops at 96K ranks (busy CPU removed by the fix)",
     "seconds": 26.0, "source": "NVIDIA/nccl pull request 1789 (NCCL fast init), 2025"},
    {"what": "initTransportsRank at 48K ranks (removed by the same fix)", "seconds": 11.0,
     "source": "NVIDIA/nccl pull request 1789"},
]


def run_rendezvous(quick: bool) -> dict:
    rows = []
    for world in (2, 4) if quick else (2, 4, 8, 16):
        rows.append(rendezvous(world))
        print(f"rendezvous: {world} ranks, init {rows[-1]['init_s']:.2f} s", file=sys.stderr)
    return {"gloo": rows, "nccl_published": NCCL_PUBLISHED}


# --- 4. the table --------------------------------------------------------------------------------
def table(core: dict, dask: dict) -> list[dict]:
    terms = ControlTerms(**{f.name: dask["terms"].get(_profile_name(f.name), 0.0)
                            for f in attrs.fields(ControlTerms)})
    out = []
    for r in core["rows"]:
        if not r["joins"]:
            continue
        d = Dispatch(r["devices"], round(r["calls_per_step"]), round(r["tasks_per_step"]),
                     round(r["futures_per_step"]))
        work = r["predicted_step_s"] - r["predicted_control_s"]
        t = control_time(terms, d, work)
        dask_client = t.client_s - terms.call_s * d.calls
        client = r["client_core_cpu_per_step_s"] + dask_client     # the core as measured
        charged = max(client, t.scheduler_s)
        out.append({"plan": r["plan"], "devices": d.devices, "calls": d.calls,
                    "tasks": d.tasks, "futures": d.args,
                    "client_core_s": r["client_core_cpu_per_step_s"],
                    "client_dask_s": round(dask_client, 4), "client_s": round(client, 4),
                    "scheduler_s": round(t.scheduler_s, 4),
                    "heartbeats_per_s": round(heartbeats_per_s(d.devices), 1),
                    "charged_s": round(charged, 4), "step_work_s": round(work, 3),
                    "share": round(charged / (work + charged), 4),
                    "predicted_control_s": r["predicted_control_s"],
                    "predicted_tasks": r["predicted_tasks_per_step"]})
    return out


def _profile_name(field: str) -> str:
    return {"call_s": "control_call_s", "heartbeat_s": "scheduler_heartbeat_s"}.get(field, field)


# --- the results ---------------------------------------------------------------------------------
def markdown(res: dict) -> str:
    lines = ["# The control plane at 2,048 GPUs", ""]
    for part, title in (("core", "1. The scheduling core on a simulated clock"),
                        ("dask", "2. Dask's scheduler and client, many lightweight workers"),
                        ("rendezvous", "3. Rendezvous of process groups"),
                        ("table", "4. A step of the shipped plans")):
        if part not in res:
            continue
        p = res[part]
        lines += [f"## {title}", "", header(p["provenance"]), ""]
        lines += getattr(sys.modules[__name__], f"_md_{part}")(p)
        lines.append("")
    return "\n".join(lines)


def _md_core(p: dict) -> list[str]:
    rows = ["| plan | devices | joins | calls a step | tasks | futures | edges | client CPU a "
            "step (s) | per call (us) | lowering a step (s) | memory peak (MB) |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        rows.append(f"| {r['plan']} | {r['devices']} | {'yes' if r['joins'] else 'no'} | "
                    f"{r['calls_per_step']:.0f} | {r['tasks_per_step']:.0f} | "
                    f"{r['futures_per_step']:.0f} | {r['edges_per_step']:.0f} | "
                    f"{r['client_core_cpu_per_step_s']:.4f} | {r['core_cpu_per_call_us']} | "
                    f"{r['lowering_cpu_per_step_s']:.4f} | {r['memory_peak_mb']} |")
    return rows


def _md_dask(p: dict) -> list[str]:
    t = p["terms"]
    rows = ["Terms (the largest fleet's; a future's cost the larger of one fetched from another "
            "worker, on the smallest fleet, and one on the same worker):", "",
            "| term | us |", "|---|---|"]
    rows += [f"| {k} | {1e6 * v:.1f} |" for k, v in sorted(t.items())]
    rows += ["", "Per fleet size (how they grow with the workers):", "",
             "| workers | scheduler per task (us) | per future (us) | per worker a step (us) | "
             "per heartbeat (us) | client per task (us) | client per worker (us) |",
             "|---|---|---|---|---|---|---|"]
    for r in p["per_fleet"]:
        rows.append(f"| {r['workers']} | {1e6 * r['scheduler_task_s']:.0f} | "
                    f"{1e6 * r['scheduler_arg_s']:.0f} | {1e6 * r['scheduler_worker_s']:.0f} | "
                    f"{1e6 * r['scheduler_heartbeat_s']:.0f} | {1e6 * r['client_task_s']:.0f} | "
                    f"{1e6 * r['client_worker_s']:.0f} |")
    g = p["growth"]
    rows += ["", "Fitted lines (term = a + b x workers): " + "; ".join(
        f"{k} {1e6 * v['at_0_s']:.0f} us + {1e9 * v['per_worker_s']:.1f} ns x workers"
        for k, v in g.items())]
    return rows


def _md_rendezvous(p: dict) -> list[str]:
    rows = ["| gloo ranks | init_process_group (s) | group of all (s) | barrier (s) | CPU a rank "
            "(s) |", "|---|---|---|---|---|"]
    rows += [f"| {r['world']} | {r['init_s']} | {r['group_s']} | {r['barrier_s']} | "
             f"{r['cpu_s_per_rank']} |" for r in p["gloo"]]
    rows += ["", "NCCL, published:", ""]
    rows += [f"- {r['what']}: {r['seconds']:g} s ({r['source']})" for r in p["nccl_published"]]
    return rows


def _md_table(p: dict) -> list[str]:
    rows = ["| plan | devices | calls | tasks | futures | client core (s) | client Dask (s) | "
            "scheduler (s) | charged (s) | step's work (s) | share | planner's control (s) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in p["rows"]:
        rows.append(f"| {r['plan']} | {r['devices']} | {r['calls']} | {r['tasks']} | "
                    f"{r['futures']} | {r['client_core_s']:.3f} | {r['client_dask_s']:.3f} | "
                    f"{r['scheduler_s']:.3f} | {r['charged_s']:.3f} | {r['step_work_s']:.2f} | "
                    f"{100 * r['share']:.1f}% | {r['predicted_control_s']:.3f} |")
    over = [r["plan"] for r in p["rows"] if r["share"] > SHARE_LIMIT]
    rows += ["", f"Above {100 * SHARE_LIMIT:.0f}% of the step: " + (", ".join(over) or "none")]
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="core,dask,rendezvous,table")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--recompile", action="store_true", help="make the plans again")
    ap.add_argument("--workers", default="8,32,128,512", help="fleet sizes of the dask part")
    args = ap.parse_args(argv)
    parts = args.only.split(",")
    path = OUT / ("control_plane_quick.json" if args.quick else "control_plane.json")
    res = json.loads(path.read_text()) if path.exists() else {}
    for part in ("core", "dask", "rendezvous", "table"):
        if part not in parts:
            continue
        prov = provenance(sys.argv[:1] + (argv if argv is not None else sys.argv[1:]))
        if part == "core":
            res["core"] = run_core(args.quick, args.recompile)
        elif part == "dask":
            def save(partial):
                path.write_text(json.dumps({**res, "dask_partial": partial}, indent=1) + "\n")
            workers = tuple(int(w) for w in args.workers.split(","))
            res["dask"] = run_dask(args.quick, (8, 32) if args.quick else workers, save)
            res.pop("dask_partial", None)
        elif part == "rendezvous":
            res["rendezvous"] = run_rendezvous(args.quick)
        else:
            if "core" not in res or "dask" not in res:
                print("table: needs the core and dask parts first", file=sys.stderr)
                return 1
            res["table"] = {"rows": table(res["core"], res["dask"])}
        res[part]["provenance"] = finish(prov)
        path.write_text(json.dumps(res, indent=1) + "\n")
        path.with_suffix(".md").write_text(markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
