"""Reliability figures: hostile files refused, faults injected and survived, resume
equality, fuzzing, and the scheduling overhead per op of a fine-grained (1,000+ ops per
step) graph on Dask.

    $ .venv/bin/python benchmarks/reliability.py                # all parts, ~30 min on 2 cores
    $ .venv/bin/python benchmarks/reliability.py --only hostile
    $ .venv/bin/python benchmarks/reliability.py --only bounds --before-tree ../old-checkout

Writes benchmarks/results/reliability.json and reliability.md; a part run alone replaces
that part's figures and keeps the others, each with the command, date, machine and load
that measured it (``benchmarks/provenance.py``). Hostile files are the catalogue of
tests/reliability/hostile.py (hand-edited plans through ``simulate``, ``run``, ``diff``
and ``show``; damaged run directories through ``verify``, ``show`` and ``run --resume``)
and a few hostile specs through ``check``: each attempt is counted as refused (exit 1, the
file and the field named), accepted, a hang (still running after 120 s), or an internal
error (exit 3 or a traceback). Fault runs use a small PPO pipeline
(tests/reliability/test_faults.py's) on a local Dask cluster of 2 worker processes; every
run's metrics are compared, value by value, with the in-process reference of the same op
calls. The fuzz figures are read from benchmarks/results/fuzz.json (``benchmarks/fuzz.py``).
What must never be lost (outputs over inputs, damaged tensors, a resume after a damaged
checkpoint, failed starts) and bounded inputs (``--steps``, verify's output, ``rpeg check`` of
specs up to 4 MB) are ``benchmarks/reliability_lost.py``'s parts.
Every sentence of the report is computed from the figures beside it.
"""

from __future__ import annotations

import argparse
import json
import os
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

from benchmarks.provenance import finish, provenance  # noqa: E402
from benchmarks.reliability_lost import _snapshot, bounds, nothing_lost  # noqa: E402
from benchmarks.reliability_report import PARTS, markdown  # noqa: E402

# --- faults ----------------------------------------------------------------------------------

def fault_runs(work: Path) -> list[dict]:
    import test_faults as tf

    from rpeg.errors import RpegError
    from rpeg.runtime import RunOptions, verify_run
    from rpeg.runtime.calibrate.inline import run_inline
    from rpeg.runtime.dask.resume import resume_run
    from rpeg.runtime.dask.runner import Resilience, run_resilient
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load

    spec = tf.micro_spec(work / "micro")
    pipeline = load(spec)
    plan = split_plan(pipeline, 2, staleness=1)
    reference = [tf._values(r) for r in run_inline(pipeline, plan, STEPS)]
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
    folder = {"kill": work / "kill", "resume": work / "resume", "ctrlc": work / "ctrlc"}

    def scenario(key: str, name: str, go, injected) -> None:
        """Run one scenario; a run that fails is recorded with its error, not a crash of
        the benchmark (the table then says it did not survive, and why)."""
        t0 = time.time()
        try:
            extra = go() or {}
        except RpegError as e:
            row = {"scenario": name, "injected": injected(), "recoveries": 0, "resumes": 0,
                   "steps_once_each": False, "metrics_equal_reference": False,
                   "verify_ok": False, "wall_s": round(time.time() - t0, 1),
                   "survived": False, "error": e.message}
            print(f"  {name}: {row}", flush=True)
            results.append(row)
            return
        results.append({**judge(name, folder[key], injected(), t0), **extra})

    # 1. two workers SIGKILLed in one run (steps 1 and 3), one frozen with SIGSTOP (step 4)
    plan_faults = [(1, signal.SIGKILL), (3, signal.SIGKILL), (4, signal.SIGSTOP)]
    done: list[int] = []

    def inject() -> None:
        for after, sig in plan_faults:
            tf._wait_for(lambda a=after: len(tf._rows(folder["kill"])) >= a
                         and len(tf._meta(folder["kill"]).get("recoveries", [])) >= len(done),
                         600, f"step {after}")
            procs = tf._worker_processes()
            procs[len(done) % len(procs)].send_signal(sig)
            done.append(after)

    def killed() -> None:
        t = threading.Thread(target=inject, daemon=True)
        t.start()
        try:
            run_resilient(pipeline, plan, RunOptions(steps=STEPS, run_dir=str(folder["kill"]),
                                                     progress=False),
                          spec_path=str(spec), resilience=res)
        finally:
            t.join(5)

    scenario("kill", "2 workers SIGKILLed + 1 frozen (SIGSTOP)", killed, lambda: len(done))

    # 2. the whole run SIGKILLed (with its workers), then resumed
    def resumed() -> None:
        proc = tf._start_run(work, spec, folder["resume"])
        tf._wait_for(lambda: len(tf._rows(folder["resume"])) >= 3, 600, "step 2")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        resume_run(folder["resume"], RunOptions(progress=False), res)

    scenario("resume", "whole run SIGKILLed, resumed", resumed, lambda: 1)

    # 3. Ctrl-C to the process group, then resumed
    def ctrl_c() -> dict:
        proc = tf._start_run(work, spec, folder["ctrlc"])
        tf._wait_for(lambda: len(tf._rows(folder["ctrlc"])) >= 2, 600, "step 1")
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=600)
        status = tf._meta(folder["ctrlc"]).get("status")
        resume_run(folder["ctrlc"], RunOptions(progress=False), res)
        return {"status_after_ctrl_c": status, "exit_code": proc.returncode}

    scenario("ctrlc", "Ctrl-C, checkpoint, resumed", ctrl_c, lambda: 1)
    return results


# --- hostile files -------------------------------------------------------------------------

HANG_S = 120.0       # an attempt still running after this long counts as a hang


def attempt(argv: list[str], says: str, names: tuple[str, ...]) -> dict:
    """``rpeg ARGV`` in this process, its outcome classified: refused (exit 1, the words
    ``says`` and one of ``names`` in the message) | accepted | hang | internal | other (exit 1
    without the file or the words, or a usage error)."""
    import contextlib
    import io

    from rpeg.cli import main

    out = io.StringIO()

    def alarm(signum, frame):
        raise TimeoutError
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    t0 = time.time()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            rc = main(argv)
    except TimeoutError:
        rc = None
    except BaseException as e:  # noqa: BLE001 — anything escaping main is a bug in rpeg
        rc, _ = 3, out.write(f"{type(e).__name__}: {e}")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    text = out.getvalue()
    if rc is None:
        outcome = "hang"
    elif rc == 3 or "Traceback" in text or "internal error" in text:
        outcome = "internal"
    elif rc == 0:
        outcome = "accepted"
    elif rc == 1 and says in text and any(n in text for n in names):
        outcome = "refused"
    else:
        outcome = "other"
    return {"argv": argv[0] if argv[0] != "run" or "--resume" not in argv else "run --resume",
            "outcome": outcome, "rc": rc, "s": round(time.time() - t0, 2),
            "message": text.strip().splitlines()[0][:300] if text.strip() else ""}


def hostile(work: Path) -> dict:
    import shutil

    import hostile as H
    import test_faults as tf

    from rpeg.runtime import RunOptions
    from rpeg.runtime.dask.runner import Resilience, run_resilient
    from rpeg.runtime.placement import split_plan
    from rpeg.runtime.rundir.files import FILES
    from rpeg.spec import load

    folder = work / "plans"
    folder.mkdir()
    good = H.compile_good_plan(folder)
    cases = []
    for name, (edit, says) in sorted(H.PLAN_EDITS.items()):
        bad = H.write_edited_plan(good, work / f"{name}.json", edit)
        run_dir = work / f"{name}-run"
        for argv in (["simulate", str(bad), "--steps", "2"],
                     ["run", str(bad), "--no-progress", "--steps", "1", "--run-dir",
                      str(run_dir)],
                     ["diff", str(good), str(bad)], ["show", str(bad)]):
            r = attempt(argv, says, (str(bad),))
            r.update(kind="plan", case=name, outside_touched=run_dir.exists())
            cases.append(r)
    spec = tf.micro_spec(work / "micro")
    pipeline = load(spec)
    made = work / "made"
    run_resilient(pipeline, split_plan(pipeline, 2, staleness=1),
                  RunOptions(steps=4, run_dir=str(made), progress=False), spec_path=str(spec),
                  resilience=Resilience(checkpoint_every=2))
    for name, (damage, says, commands) in sorted(H.RUN_DIR_DAMAGE.items()):
        run, outside = work / name / "run", work / name / "outside"
        shutil.copytree(made, run)
        outside.mkdir()
        damage(run, outside)
        before = _snapshot(outside)
        argvs = {"verify": ["verify", str(run)], "show": ["show", str(run)],
                 "resume": ["run", "--resume", str(run), "--no-progress"]}
        for command in commands:
            # verify's report names the file of the run directory, not its path
            r = attempt(argvs[command], says, (str(run), *FILES))
            r.update(kind="run directory", case=name,
                     outside_touched=_snapshot(outside) != before)
            cases.append(r)
    for name, text, says in _hostile_specs():
        path = work / f"{name}.rpeg"
        if text is None:
            os.mkfifo(path)
        else:
            path.write_text(text)
        shutil.copy(ROOT / "pipelines" / "rewards.py", work / "rewards.py")
        r = attempt(["check", str(path)], says, (str(path),))
        r.update(kind="spec", case=name, outside_touched=False)
        cases.append(r)
    count = {k: sum(1 for c in cases if c["outcome"] == k)
             for k in ("refused", "accepted", "hang", "internal", "other")}
    by_kind = {k: sum(1 for c in cases if c["kind"] == k)
               for k in ("plan", "run directory", "spec")}
    print(f"hostile: {count}", flush=True)
    return {"tried": len(cases), **count, "by_kind": by_kind,
            "outside_touched": sum(1 for c in cases if c["outside_touched"]),
            "slowest_s": max(c["s"] for c in cases), "cases": cases}


def _hostile_specs() -> list[tuple[str, str | None, str]]:
    """(name, text (None: a named pipe), words the refusal says) of hostile specs beyond
    the fuzzer's mutations: sizes of thousands of digits, brackets left open, a pipe."""
    base = (ROOT / "pipelines" / "tiny_ppo.rpeg").read_text()
    import re
    steps = re.sub(r"steps\s*=\s*\d+", "steps = " + "9" * 5000, base, count=1)
    paren = re.sub(r"stage ref_lp\s*=\s*forward\(ref, responses\)\s*->\s*ref_logprobs",
                   "stage ref_lp = forward(ref, responses", base, count=1)
    return [("steps-5000-digits", steps, "at most 10,000,000"),
            ("unclosed-paren", paren, "not closed"),
            ("spec-pipe", None, "not a regular file")]


# --- scheduling overhead ---------------------------------------------------------------------

def null_op(call, *args):
    """Stands in for an op: returns at once (cloudpickled to the workers by value)."""
    return {}


def overhead(chunks: int, steps: int) -> dict:
    """Ops per second of the scheduling core + Dask for a graph of ``chunks`` chunks per
    generation (each forward/score/advantage op runs per chunk), with null ops."""
    import logging

    import attrs
    from distributed import Client, LocalCluster, as_completed

    from rpeg.runtime.core import scheduler as C
    from rpeg.runtime.lowering.instances import build_calls
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    pipeline = load(ROOT / "pipelines" / "tiny_ppo.rpeg")
    # a chunk holds one response at least: enough prompts that none of the chunks asked for
    # is merged away (the ops are null, so the prompts cost nothing)
    pipeline = attrs.evolve(pipeline, workload=attrs.evolve(
        pipeline.workload, prompts=max(pipeline.workload.prompts, chunks)))
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


# --- the run ---------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=PARTS, action="append",
                    help="measure only this part (repeatable); the others keep their figures")
    ap.add_argument("--chunks", type=int, nargs="*", default=[16, 64, 220])
    ap.add_argument("--before-tree", type=Path, default=None,
                    help="bounds: also time rpeg check with this checkout's code (the "
                         "commit before), for the report's before-and-after")
    args = ap.parse_args(argv)
    parts = [p for p in PARTS if p in (args.only or PARTS)]
    out_json = OUT / "reliability.json"
    result = json.loads(out_json.read_text()) if out_json.exists() else {}
    for stale in ("command", "commands", "machine"):     # superseded by per-part provenance
        result.pop(stale, None)
    started = provenance(sys.argv[:1] + (argv if argv is not None else sys.argv[1:]))
    measured = {}
    with tempfile.TemporaryDirectory(prefix="rpeg-reliability-") as work:
        for part in parts:
            here = json.loads(json.dumps(started))
            here["load_average"]["start"] = round(os.getloadavg()[0], 2)
            if part == "hostile":
                (Path(work) / "hostile").mkdir()
                result["hostile"] = hostile(Path(work) / "hostile")
            elif part == "nothing_lost":
                (Path(work) / "lost").mkdir()
                result["nothing_lost"] = nothing_lost(Path(work) / "lost", attempt)
            elif part == "bounds":
                (Path(work) / "bounds").mkdir()
                result["bounds"] = bounds(Path(work) / "bounds", attempt, args.before_tree)
            elif part == "faults":
                (Path(work) / "faults").mkdir()
                result["faults"] = fault_runs(Path(work) / "faults")
            elif part == "overhead":
                result["overhead"] = []
                for c in args.chunks:
                    r = overhead(c, steps=3)
                    print(f"overhead: {r}", flush=True)
                    result["overhead"].append(r)
            elif part == "fuzz":
                fz = OUT / "fuzz.json"
                if not fz.exists():
                    continue
                d = json.loads(fz.read_text())
                result["fuzz"] = {"inputs_tried": d["inputs_tried"],
                                  "crashes_found": d["crashes_found"], "command": d["command"]}
                result.get("provenance", {}).pop("fuzz", None)    # read, not measured, here
                continue
            measured[part] = finish(here)
            result.setdefault("provenance", {}).update(measured)
            _write(result)                       # each part as it ends: a later one may fail
    print(markdown(result))
    return 0


def _write(result: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "reliability.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "reliability.md").write_text(markdown(result))


if __name__ == "__main__":
    sys.exit(main())
