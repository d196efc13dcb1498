"""Reliability figures: faults injected and survived, resume equality, fuzzing, and the
scheduling overhead per op of a fine-grained (1,000+ ops per step) graph on Dask.

    $ .venv/bin/python benchmarks/reliability.py                # all parts, ~10 min on 2 cores
    $ .venv/bin/python benchmarks/reliability.py --only overhead

Writes benchmarks/results/reliability.json and reliability.md. Fault runs use a
small PPO pipeline (tests/reliability/test_faults.py's) on a local Dask
cluster of 2 worker processes; every run's metrics are compared, value by value,
with the in-process reference of the same op calls. The fuzz figures are read
from benchmarks/results/fuzz.json (``benchmarks/fuzz.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "reliability"))
OUT = ROOT / "benchmarks" / "results"
STEPS = 6


# --- faults ----------------------------------------------------------------------------------

def fault_runs(work: Path) -> list[dict]:
    import test_faults as tf

    from rpeg.runtime import RunOptions, verify_run
    from rpeg.runtime.inline import run_inline
    from rpeg.runtime.placement import split_plan
    from rpeg.runtime.recovery import Resilience, resume_run, run_resilient
    from rpeg.spec import load

    spec = tf.micro_spec(work / "micro")
    pipeline = load(spec)
    plan = split_plan(pipeline, 2, staleness=1)
    reference = [tf._values(r) for r in run_inline(pipeline, plan, STEPS, str(spec.parent))]
    results = []

    def judge(name: str, run_dir: Path, injected: int, t0: float) -> dict:
        rows = tf._rows(run_dir)
        meta = tf._meta(run_dir)
        report = verify_run(run_dir)
        steps = [r["step"] for r in rows]
        row = {"scenario": name, "injected": injected,
               "recoveries": len(meta.get("recoveries", [])),
               "resumes": len(meta.get("resumes", [])),
               "steps_once_each": steps == list(range(STEPS)),
               "metrics_equal_reference": [tf._values(r) for r in rows] == reference,
               "verify_ok": report.ok, "wall_s": round(time.time() - t0, 1),
               "reasons": [r["reason"] for r in meta.get("recoveries", [])]}
        row["survived"] = row["steps_once_each"] and row["metrics_equal_reference"]
        trace = json.loads((run_dir / "trace.json").read_text())
        durs = sorted(e["dur"] / 1e3 for e in trace["traceEvents"] if e.get("ph") == "X")
        row["op_ms_median"] = round(durs[len(durs) // 2], 2) if durs else None
        print(f"  {name}: {row}", flush=True)
        return row

    res = Resilience(checkpoint_every=2, timeout_floor_s=20.0, timeout_factor=1.0)

    # 1. two workers SIGKILLed in one run (steps 1 and 3), one frozen with SIGSTOP (step 4)
    run_dir = work / "kill"
    t0 = time.time()
    plan_faults = [(1, signal.SIGKILL), (3, signal.SIGKILL), (4, signal.SIGSTOP)]
    done: list[int] = []

    def inject() -> None:
        for after, sig in plan_faults:
            tf._wait_for(lambda a=after: len(tf._rows(run_dir)) >= a
                         and len(tf._meta(run_dir).get("recoveries", [])) >= len(done),
                         600, f"step {after}")
            procs = tf._worker_processes()
            procs[len(done) % len(procs)].send_signal(sig)
            done.append(after)

    t = threading.Thread(target=inject, daemon=True)
    t.start()
    run_resilient(pipeline, plan, RunOptions(steps=STEPS, run_dir=str(run_dir), progress=False),
                  spec_path=str(spec), resilience=res)
    t.join(5)
    results.append(judge("2 workers SIGKILLed + 1 frozen (SIGSTOP)", run_dir, len(done), t0))

    # 2. the whole run SIGKILLed (with its workers), then resumed
    run_dir = work / "resume"
    t0 = time.time()
    proc = tf._start_run(work, spec, run_dir)
    tf._wait_for(lambda: len(tf._rows(run_dir)) >= 3, 600, "step 2")
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    resume_run(run_dir, RunOptions(progress=False), res)
    results.append(judge("whole run SIGKILLed, resumed", run_dir, 1, t0))

    # 3. Ctrl-C to the process group, then resumed
    run_dir = work / "ctrlc"
    t0 = time.time()
    proc = tf._start_run(work, spec, run_dir)
    tf._wait_for(lambda: len(tf._rows(run_dir)) >= 2, 600, "step 1")
    os.killpg(proc.pid, signal.SIGINT)
    proc.communicate(timeout=600)
    row_status = tf._meta(run_dir).get("status")
    resume_run(run_dir, RunOptions(progress=False), res)
    r = judge("Ctrl-C, checkpoint, resumed", run_dir, 1, t0)
    r["status_after_ctrl_c"] = row_status
    r["exit_code"] = proc.returncode
    results.append(r)
    return results


# --- scheduling overhead ---------------------------------------------------------------------

def null_op(call, *args):
    """Stands in for an op: returns at once (cloudpickled to the workers by value)."""
    return {}


def overhead(chunks: int, steps: int) -> dict:
    """Ops per second of the scheduling core + Dask for a graph of ``chunks`` chunks per
    generation (each forward/score/advantage op runs per chunk), with null ops."""
    import logging

    from distributed import Client, LocalCluster, as_completed

    from rpeg.runtime import core as C
    from rpeg.runtime.instances import build_calls
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load

    pipeline = load(ROOT / "pipelines" / "tiny_ppo.rpeg")
    plan = split_plan(pipeline, 2, staleness=1, chunks=chunks)
    calls = build_calls(pipeline, plan, steps)
    per_step = len(calls) / steps
    table = {c.id: c for c in calls}

    # the core alone (no Dask): how long its bookkeeping takes per op
    t = time.perf_counter()
    core = C.Core.create(calls, steps, 2)
    queue = [i.call.id for i in core.handle(C.Started()) if isinstance(i, C.Submit)]
    while queue:
        op = queue.pop(0)
        queue += [i.call.id for i in core.handle(C.OpDone(op)) if isinstance(i, C.Submit)]
    core_s = time.perf_counter() - t

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, resources={"GPU": 1},
                      host="127.0.0.1", dashboard_address=None,
                      silence_logs=logging.ERROR) as cluster, Client(cluster) as client:
        workers = sorted(client.scheduler_info()["workers"])
        client.submit(null_op, None).result()                      # warm the function cache
        t = time.perf_counter()
        core = C.Core.create(calls, steps, 2)
        futures: dict[str, object] = {}
        key_of: dict[object, str] = {}
        pending = core.handle(C.Started())
        done_iter = as_completed()
        step_times = []
        last = t
        while True:
            finished = False
            for ins in pending:
                if isinstance(ins, C.Submit):
                    c = ins.call
                    args = [futures[d] for d in c.all_deps]
                    f = client.submit(null_op, c, *args, key=f"{c.id}-x", pure=False,
                                      workers=[workers[c.device]], resources={"GPU": 1})
                    futures[c.id] = f
                    key_of[f.key] = c.id
                    done_iter.add(f)
                elif isinstance(ins, C.Release):
                    futures.pop(ins.op_id, None)
                elif isinstance(ins, C.StepDone):
                    now = time.perf_counter()
                    step_times.append(now - last)
                    last = now
                elif isinstance(ins, C.Finish):
                    finished = True
            if finished:
                break
            pending = []
            for f in done_iter.next_batch(block=True):     # as the runtime's driver does
                pending += core.handle(C.OpDone(key_of.pop(f.key)))
        dask_s = time.perf_counter() - t
    n = len(calls)
    return {"chunks": chunks, "steps": steps, "ops": n, "ops_per_step": round(per_step),
            "core_only_ms_per_op": round(1e3 * core_s / n, 3),
            "dask_ms_per_op": round(1e3 * dask_s / n, 3),
            "dask_ops_per_s": round(n / dask_s, 1),
            "step_s_median": round(sorted(step_times)[len(step_times) // 2], 3),
            "devices": 2, "ops_per_device_per_step": round(per_step / 2),
            "stages": sorted({table[i].op for i in table})}


# --- report ------------------------------------------------------------------------------------

def markdown(result: dict) -> str:
    lines = ["## Reliability", "", f"Measured on {result['machine']}:", ""]
    for part, cmd in sorted(result.get("commands", {}).items()):
        lines.append(f"- {part}: `{cmd}`")
    lines.append("")
    faults = result.get("faults")
    if faults:
        inj = sum(r["injected"] for r in faults)
        ok = sum(r["injected"] for r in faults if r["survived"])
        lines += [f"**Faults:** {inj} injected, {ok} survived with nothing lost (every step "
                  "once in the metrics, every value equal to the uninterrupted in-process "
                  "reference, exactly, on CPU).", "",
                  "| scenario | injected | recoveries | resumes | steps once each | "
                  "metrics = reference | rpeg verify | wall s |", "|---|---|---|---|---|---|---|---|"]
        for r in faults:
            lines.append(f"| {r['scenario']} | {r['injected']} | {r['recoveries']} | "
                         f"{r['resumes']} | {r['steps_once_each']} | "
                         f"{r['metrics_equal_reference']} | {r['verify_ok']} | {r['wall_s']} |")
        lines.append("")
    fz = result.get("fuzz")
    if fz:
        lines += [f"**Fuzzing:** {fz['inputs_tried']:,} inputs (half coverage-guided with "
                  "atheris, half structure-aware mutations: pipelines, clusters, profiles "
                  f"through the parser and checker, and plan.json), {fz['crashes_found']} "
                  f"crashes or hangs; `{fz['command']}`.", ""]
    oh = result.get("overhead")
    if oh and faults:
        med = sorted(r["op_ms_median"] for r in faults if r.get("op_ms_median"))
        if med:
            lines += [f"Real ops of the small PPO runs above take {med[len(med) // 2]} ms "
                      "(median, from their traces).", ""]
    if oh:
        lines += ["**Scheduling overhead** (scheduling core + Dask, null ops, 2 worker "
                  "processes):", "",
                  "| chunks | ops per step | core only ms/op | core + Dask ms/op | ops/s |",
                  "|---|---|---|---|---|"]
        for r in oh:
            lines.append(f"| {r['chunks']} | {r['ops_per_step']} | {r['core_only_ms_per_op']} | "
                         f"{r['dask_ms_per_op']} | {r['dask_ops_per_s']} |")
        big = max(oh, key=lambda r: r["ops_per_step"])
        lines += ["", f"At {big['ops_per_step']:,} ops per step, scheduling alone costs "
                  f"{big['ops_per_step'] * big['dask_ms_per_op'] / 1e3:.1f} s per step "
                  f"({big['dask_ms_per_op']} ms per op, of which the scheduling core is "
                  f"{big['core_only_ms_per_op']} ms); the per-op cost stays flat from "
                  f"{min(r['ops_per_step'] for r in oh)} to {big['ops_per_step']:,} ops per "
                  "step, so the core and Dask scale with the graph. Dask is not the "
                  f"bottleneck while an op takes well over {big['dask_ms_per_op']:.0f} ms "
                  f"(10x that, {10 * big['dask_ms_per_op']:.0f} ms, keeps it under 10%): "
                  "true of GPU-sized chunks, not of this tiny CPU model, whose ops take "
                  "about 2 ms — chunk it coarsely.", ""]
    return "\n".join(lines) + "\n" + SECURITY


SECURITY = """## Security

- **What runs code.** A spec runs no code of its own except the rewards it names as
  `python("module:function")`. `rpeg check` and `rpeg compile` find the module (next to
  the spec, then on the Python path) and the function in it by reading its source,
  without importing or running it, and report a missing one at the line of the spec.
  `rpeg run` imports and calls those functions inside the workers: a spec with such a
  reference runs that code, with the permissions of the workers. Review a spec's
  `python(...)` references as you would review the module itself.
- **Nothing read from disk is unpickled.** Plans, traces, run records and the pipeline
  in a run directory are JSON; checkpoints are safetensors plus JSON (carried data may
  name only rpeg's own value types); a test searches `rpeg/` and `backends/` for pickle,
  `torch.load` without `weights_only=True`, `eval` and `exec`. Hostile files (huge, binary,
  truncated, a pipe, a device) are refused with a message naming the file.
- **What listens where.** The embedded cluster (no `--scheduler`) binds its scheduler,
  workers and nannies to 127.0.0.1 only; nothing on another machine can reach it.
- **TLS.** A remote scheduler is reached over `tls://` with mutual authentication:
  `rpeg run --scheduler tls://HOST:8786 --tls-ca ca.pem --tls-cert me.pem --tls-key me.key`
  (or `RPEG_TLS_CA`, `RPEG_TLS_CERT`, `RPEG_TLS_KEY`, or Dask's `distributed.comm.tls.*`
  configuration). Encryption is then required; the key file must be readable by its owner
  only. Start the scheduler and workers with the same CA (`dask scheduler --tls-ca-file ...
  --tls-cert ... --tls-key ...`); it refuses clients without a certificate the CA signed
  (tested with certificates made in the test: no certificate, a certificate from another
  CA, and plain TCP are all refused).
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("faults", "overhead", "fuzz"), action="append")
    ap.add_argument("--chunks", type=int, nargs="*", default=[16, 64, 220])
    args = ap.parse_args()
    parts = set(args.only or ("faults", "overhead", "fuzz"))
    out_json = OUT / "reliability.json"
    result = json.loads(out_json.read_text()) if out_json.exists() else {}
    result["command"] = "python benchmarks/reliability.py " + " ".join(sys.argv[1:])
    commands = result.setdefault("commands", {})
    for part in parts:
        commands[part] = result["command"] + f" (load average {os.getloadavg()[0]:.1f})"
    result["machine"] = (f"{platform.machine()}, {os.cpu_count()} cores shared with other "
                         "work, python " + platform.python_version())
    if "overhead" in parts:
        result["overhead"] = []
        for c in args.chunks:
            r = overhead(c, steps=3)
            print(f"overhead: {r}", flush=True)
            result["overhead"].append(r)
    if "fuzz" in parts:
        fz = OUT / "fuzz.json"
        if fz.exists():
            d = json.loads(fz.read_text())
            result["fuzz"] = {"inputs_tried": d["inputs_tried"],
                              "crashes_found": d["crashes_found"], "command": d["command"]}
    if "faults" in parts:
        with tempfile.TemporaryDirectory(prefix="rpeg-faults-") as work:
            result["faults"] = fault_runs(Path(work))
    OUT.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "reliability.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
