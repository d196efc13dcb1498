"""Reliability parts of benchmarks/reliability.py for what must never be lost or unbounded:
outputs over inputs, damaged tensors, a resume after a damaged checkpoint, failed starts
(``nothing_lost``), and bounded inputs and outputs (``bounds``: ``--steps``, ``rpeg verify``'s
output, ``rpeg check`` of generated specs up to 4 MB).

    $ .venv/bin/python benchmarks/reliability.py --only nothing_lost --only bounds
    $ .venv/bin/python benchmarks/reliability.py --only bounds --before-tree /path/to/old/checkout

Each attempt is ``reliability.attempt``'s (refused, accepted, hang, internal, other), and
each records whether a file it must not touch changed (the run directory, a destination it
refused, anything outside the directory under test) and whether a temporary file was left.
``--before-tree`` also times ``rpeg check`` with the code of another checkout (the commit
before), for the report's before-and-after.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _snapshot(path: Path) -> dict[str, str]:
    """Every file under ``path`` (or ``path`` itself) and a hash of its bytes; symlinks as
    their targets, never followed."""
    if path.is_file():
        return {str(path): hashlib.sha256(path.read_bytes()).hexdigest()}
    out = {}
    for p in sorted(path.rglob("*")):
        if p.name == "run.lock":
            continue
        out[str(p)] = ("-> " + os.readlink(p)) if p.is_symlink() else (
            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
    return out


def _leftovers(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*") if ".tmp" in p.name)


def _made_run(work: Path, steps: int = 4) -> tuple[Path, Path]:
    """A real run of tests/reliability/test_faults.py's pipeline (checkpoints at 2 and 4)
    and its spec."""
    import test_faults as tf

    from rpeg.runtime import RunOptions
    from rpeg.runtime.dask.runner import Resilience, run_resilient
    from rpeg.runtime.placement import split_plan
    from rpeg.spec import load
    spec = tf.micro_spec(work / "micro")
    pipeline = load(spec)
    made = work / "made"
    run_resilient(pipeline, split_plan(pipeline, 2, staleness=1),
                  RunOptions(steps=steps, run_dir=str(made), progress=False),
                  spec_path=str(spec), resilience=Resilience(checkpoint_every=2))
    return made, spec


def _case(attempt, kind: str, case: str, argv: list[str], says: str, names: tuple[str, ...],
          guarded: tuple[Path, ...], folder: Path) -> dict:
    before = [_snapshot(p) for p in guarded]
    r = attempt(argv, says, names)
    r.update(kind=kind, case=case,
             touched=sum(1 for p, b in zip(guarded, before, strict=True) if _snapshot(p) != b),
             leftovers=_leftovers(folder))
    print(f"  {kind} {case}: {r['outcome']} ({r['message'][:100]})", flush=True)
    return r


# --- nothing lost ------------------------------------------------------------------------------

def nothing_lost(work: Path, attempt) -> dict:
    """Outputs over inputs, damaged tensors, a resume after a damaged latest checkpoint,
    and failed starts retried."""
    import test_tensors as tt
    made, spec = _made_run(work)
    cases: list[dict] = []

    def copy(name: str) -> Path:
        dst = work / name / "run"
        shutil.copytree(made, dst)
        return dst

    # 1. outputs that overlap inputs, or are of the wrong kind
    run = copy("outputs")
    notes = run.parent / "notes.txt"
    notes.write_text("my notes\n")
    foreign = run.parent / "thesis"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("x\n")
    cluster = ROOT / "pipelines" / "clusters" / "local_cpu.rpeg"
    outputs = [
        ("export onto the run", ["export", str(run), "-o", str(run)], "must not name"),
        ("export onto its checkpoints", ["export", str(run), "-o", str(run / "checkpoints")],
         "must not name"),
        ("export around the run", ["export", str(run), "-o", str(run.parent)], "must not name"),
        ("export onto a file", ["export", str(run), "-o", str(notes)], "must name a folder"),
        ("export over a folder it did not write", ["export", str(run), "-o", str(foreign)],
         "an earlier export"),
        ("compile -o into the run", ["compile", str(spec), "--cluster", str(cluster), "-o",
                                     str(run / "plan.json")], "must not name"),
        ("graph -o into the run", ["graph", str(spec), "-o", str(run / "graph.dot")],
         "must not name"),
        ("run --run-dir inside the run", ["run", str(spec), "--strategy", "runtime-split",
                                          "--no-progress", "--run-dir",
                                          str(run / "checkpoints" / "x")], "inside another"),
    ]
    for case, argv, says in outputs:
        cases.append(_case(attempt, "output", case, argv, says, (str(run), "-o"),
                           (run, notes, foreign), run.parent))
    mine = run.parent / "mine"
    mine.mkdir()
    (mine / "plan.json").write_text("{}\n")
    new_run = ["run", str(spec), "--strategy", "runtime-split", "--no-progress", "--run-dir"]
    for case, where, says in (("run --run-dir the spec's folder", spec.parent, "reads"),
                              ("run --run-dir holding a plan.json", mine, "holds plan.json")):
        cases.append(_case(attempt, "output", case, [*new_run, str(where)], says,
                           (str(where), "--run-dir"), (spec.parent, mine), run.parent))

    # 2. damaged tensors, the manifest rewritten to match: export and resume refuse them
    for damage in tt.CASES:
        run = copy(f"tensor-{damage}")
        for step in ("step-000002", "step-000004"):
            path, says = tt._damage(run / "checkpoints" / step, damage)
        cases.append(_case(attempt, "tensor", damage, ["export", str(run), "-o",
                                                       str(run.parent / "hf")],
                           says, (path.name,), (run,), run.parent))
        cases.append(_case(attempt, "tensor", damage, ["run", "--resume", str(run),
                                                       "--no-progress"],
                           says, (path.name,), (run,), run.parent))

    # 3. a damaged latest checkpoint: the resume goes on from the one before, nothing lost
    resumed = []
    for damage in ("nan", "truncated"):
        run = copy(f"fallback-{damage}")
        rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
        tt._damage(run / "checkpoints" / "step-000004", damage)
        kept = _snapshot(run / "checkpoints" / "step-000004")
        r = attempt(["run", "--resume", str(run), "--no-progress"], "resuming", (str(run),))
        from rpeg.runtime import verify_run
        steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
        aside = run / "metrics.set-aside-1.jsonl"
        moved = run / "checkpoints" / "step-000004.damaged-1"
        resumed.append({
            "damage": damage, "outcome": "accepted" if r["rc"] == 0 else r["outcome"],
            "steps_once_each": steps == list(range(len(rows))),
            "earlier_rows_kept": (run / "metrics.jsonl").read_text().splitlines(
                keepends=True)[:2] == rows[:2],
            "later_rows_set_aside": aside.exists() and aside.read_text() == "".join(rows[2:]),
            "damaged_checkpoint_kept": moved.is_dir() and {
                k.replace(str(moved), ""): v for k, v in _snapshot(moved).items()} == {
                k.replace(str(run / "checkpoints" / "step-000004"), ""): v
                for k, v in kept.items()},
            "verify_ok": verify_run(run).ok if r["rc"] == 0 else False})
        print(f"  resume after damaged latest ({damage}): {resumed[-1]}", flush=True)

    # 4. failed starts: refused before anything is written, or retried with the same command
    starts = work / "starts"
    starts.mkdir()
    argv = ["run", str(spec), "--steps", "2", "--no-progress", "--strategy", "runtime-split",
            "--run-dir", str(starts / "run")]
    with_port = argv + ["--scheduler", f"tcp://127.0.0.1:{_free_port()}"]
    for case, a, says in (("unreachable scheduler", with_port, "must be reachable"),
                          ("unknown tracker", argv + ["--tracker", "neptune"], "--tracker")):
        r = _case(attempt, "start", case, a, says, ("scheduler", "tracker"), (), starts)
        r["run_dir_written"] = (starts / "run").exists()
        cases.append(r)
    retried = _failed_start_retried(attempt, argv, starts / "run")
    count = {k: sum(1 for c in cases if c["outcome"] == k)
             for k in ("refused", "accepted", "hang", "internal", "other")}
    by_kind = {k: sum(1 for c in cases if c["kind"] == k)
               for k in ("output", "tensor", "start")}
    return {"tried": len(cases), **count, "by_kind": by_kind,
            "touched": sum(c["touched"] for c in cases),
            "leftovers": sum(c["leftovers"] for c in cases),
            "run_dir_written": sum(1 for c in cases if c.get("run_dir_written")),
            "resumed": resumed, "retried": retried, "cases": cases}


def _failed_start_retried(attempt, argv: list[str], run_dir: Path) -> dict:
    """A start that fails after the cluster is reached (its workers' set-up fails), then
    the same command once the cause is gone."""
    from rpeg.errors import RuntimeFailure
    from rpeg.runtime.dask.checkpointing import Starter
    real = Starter.start

    def fail(self, number, plan):
        raise RuntimeFailure("worker set-up must succeed, and it failed (injected)")
    Starter.start = fail
    try:
        first = attempt(argv, "injected", ("set-up",))
    finally:
        Starter.start = real
    status = json.loads((run_dir / "run.json").read_text()).get("status") \
        if (run_dir / "run.json").exists() else None
    second = attempt(argv, "", ())
    from rpeg.runtime import verify_run
    out = {"first": first["outcome"], "status_after_failure": status,
           "second_rc": second["rc"],
           "verify_ok": verify_run(run_dir).ok if second["rc"] == 0 else False}
    print(f"  failed start retried: {out}", flush=True)
    return out


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- bounds ------------------------------------------------------------------------------------

STAGES = (4_000, 16_000, 40_000)
CHECK_LIMIT_S = 300.0


def bounds(work: Path, attempt, before_tree: Path | None = None) -> dict:
    """--steps of simulate, verify's output on a run whose trace lost every op, and rpeg
    check of generated specs (with this tree's code, and ``before_tree``'s)."""
    import test_bounds as tb
    out: dict = {}
    r = attempt(["simulate", str(work / "plan.json"), "--steps", "100000000"], "--steps", ())
    out["simulate_steps"] = {"rc": r["rc"], "s": r["s"], "outcome": r["outcome"]}
    made, _ = _made_run(work)
    trace = json.loads((made / "trace.json").read_text())
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("ph") != "X"]
    (made / "trace.json").write_text(json.dumps(trace))
    from rpeg.runtime import verify_run
    report = verify_run(made)
    out["verify"] = {"violations": len(report.violations),
                     "lines_printed": len(str(report).splitlines()),
                     "lines_before": 1 + len(report.violations)}
    specs = {n: tb.generated_spec(work / "specs", n) for n in STAGES}
    out["check"] = [_timed_check(ROOT, p, n) for n, p in specs.items()]
    if before_tree is not None:
        out["check_before"] = [_timed_check(before_tree, p, n) for n, p in specs.items()]
        head = subprocess.run(["git", "-C", str(before_tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True)
        out["before_commit"] = head.stdout.strip() or None
    return out


def _timed_check(tree: Path, spec: Path, stages: int) -> dict:
    """``rpeg check SPEC`` in a process of its own with ``tree``'s code: wall and CPU
    seconds, lines printed, exit status (None: still running after CHECK_LIMIT_S)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "rpeg", "check", str(spec)], env=env,
                           capture_output=True, timeout=CHECK_LIMIT_S, cwd=str(spec.parent))
        rc, lines = p.returncode, len((p.stdout + p.stderr).splitlines())
    except subprocess.TimeoutExpired:
        rc, lines = None, None
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    row = {"stages": stages, "bytes": spec.stat().st_size, "rc": rc, "wall_s": round(wall, 2),
           "cpu_s": round(cpu, 2) if rc is not None else None, "lines": lines,
           "load": round(os.getloadavg()[0], 1)}
    print(f"  check ({tree.name}): {row}", flush=True)
    return row
