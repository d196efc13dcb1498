"""One record per experiment: what a run directory ran, named by content hash (record.json).

    >>> rec = write_record("runs/tiny_ppo-20261130-011500")          # doctest: +SKIP
    >>> rec["id"], rec["inputs"]["plan"]["sha256"][:12]                # doctest: +SKIP
    ('e3b0c44298fc', '9f2a61c0d4b7')
    >>> read_record("runs/tiny_ppo-20261130-011500")["predicted"]["step_time_s"]  # doctest: +SKIP
    0.054

The runtime calls :func:`write_record` once, when a run ends (however it ends).
The record names every input by the SHA-256 of its bytes: the spec as written
(``spec.rpeg``), the resolved pipeline (``pipeline.json``), the plan
(``plan.json``), the cluster the plan was priced on (``cluster.json``, written
here from the cluster file the plan names) and the code (rpeg version, git
commit, whether the tree had uncommitted changes). Its ``id`` hashes the
pipeline, plan, cluster and code hashes together: two runs with the same id ran
the same experiment. It also keeps what ``rpeg show`` and ``rpeg diff`` print
without re-reading everything: the predicted step time and per-device memory
(the plan's own prediction, or the cost model's on the recorded cluster), the
measured step time and the final metrics. Reading a directory without a record
(a run that was killed) builds one on the fly and does not write it.

Imports no torch: versions of installed packages come from their metadata.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import subprocess
import time
from importlib import metadata
from pathlib import Path

import attrs

import rpeg
from rpeg.errors import RpegError
from rpeg.resources import clusters_dir

SCHEMA = 1
RECORD = "record.json"
ROOT = Path(rpeg.__file__).resolve().parents[1]
SHIPPED_CLUSTERS = clusters_dir()
FINAL_WINDOW = 5        # final metrics: mean over this many last steps


def sha256_file(path: Path) -> str | None:
    from rpeg.runtime.rundir.files import read_bytes
    try:
        return hashlib.sha256(read_bytes(Path(path), "file")).hexdigest()
    except RpegError:
        return None


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def code_version() -> dict:
    """rpeg's version, the git commit of the tree it runs from (and whether it was dirty)."""
    out: dict = {"rpeg": rpeg.__version__, "python": platform.python_version()}
    for pkg in ("torch", "transformers", "distributed"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    commit = _git("rev-parse", "HEAD")
    if commit:
        out["git_commit"] = commit
        out["git_dirty"] = bool(_git("status", "--porcelain", "--untracked-files=no",
                                     "--", "rpeg", "backends", "grammar"))
    return out


def _git(*args: str) -> str:
    try:
        r = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                           timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return r.stdout.strip() if r.returncode == 0 else ""


# --- the cluster a run was priced on --------------------------------------------------

def find_cluster_file(plan) -> Path | None:
    """The cluster file a plan names: its recorded path (``rpeg compile`` records it
    absolute), else a shipped cluster of that name."""
    candidates = [Path(plan.cluster_path)] if plan.cluster_path else []
    candidates.append(SHIPPED_CLUSTERS / f"{plan.cluster}.rpeg")
    return next((c for c in candidates if c.is_file()), None)


def _canonical_cluster(cluster) -> str:
    from rpeg.runtime.rundir.serial import to_data

    def strip(v):
        if isinstance(v, dict):
            return {k: strip(x) for k, x in v.items() if k not in ("span", "path", "source")}
        if isinstance(v, list):
            return [strip(x) for x in v]
        return v
    return json.dumps(strip(to_data(cluster)), sort_keys=True)


def load_run_cluster(run_dir: Path):
    """The recorded cluster value of a run (cluster.json), or None."""
    p = Path(run_dir) / "cluster.json"
    if not p.exists():
        return None
    from rpeg.runtime.rundir.files import read_parsed
    from rpeg.runtime.rundir.serial import loads
    return read_parsed(p, "cluster.json", loads)


# --- measured and predicted figures ---------------------------------------------------

def steady_rows(rows: list[dict]) -> list[dict]:
    """The steps that measure the steady state: the second half (the first fill the pipeline)."""
    if len(rows) < 2:
        return rows
    return rows[max(1, len(rows) // 2):]


def measured(rows: list[dict], meta: dict) -> dict:
    times = [r["step_time_s"] for r in steady_rows(rows) if "step_time_s" in r]
    out: dict = {"steps_done": len(rows), "wall_s": meta.get("wall_s"),
                 "setup_s": meta.get("setup_s")}
    if times:
        out["step_time_s"] = statistics.median(times)
        out["step_time_of"] = f"median of steps {len(rows) - len(times)}..{len(rows) - 1}"
    if meta.get("host"):
        out["host"] = meta["host"]
    return out


def final_metrics(rows: list[dict]) -> dict:
    """Mean of each numeric metric over the last few steps (one step is too noisy to quote)."""
    last = rows[-FINAL_WINDOW:]
    keys = sorted({k for r in last for k, v in r.items()
                   if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)})
    out = {}
    for k in keys:
        vals = [r[k] for r in last if isinstance(r.get(k), (int, float))]
        if vals:
            out[k] = sum(vals) / len(vals)
    return out


def predicted(pipeline, plan, cluster) -> dict:
    """The plan's own prediction, or the cost model's for it on ``cluster``."""
    pr = plan.predicted
    source = "plan"
    if pr is None or pr.step_time_s == float("inf"):
        if cluster is None:
            return {"error": "no cluster to price the plan on"}
        if cluster.num_gpus < plan.num_devices:
            return {"error": f"cluster {cluster.name} has {cluster.num_gpus} devices, the plan "
                             f"uses {plan.num_devices}"}
        from rpeg.plan.evaluate import Evaluator
        try:
            pr = Evaluator(pipeline, cluster).evaluate(plan, simulate_infeasible=True).plan.predicted
        except RpegError as e:
            return {"error": e.message}
        source = f"cost model on {cluster.name}"
    return {"step_time_s": pr.step_time_s, "peak_memory": [float(x) for x in pr.peak_memory],
            "memory_capacity": pr.memory_capacity, "memory_reserve": pr.memory_reserve,
            "memory": [attrs.asdict(m) for m in pr.memory],
            "ops": [attrs.asdict(u) for u in pr.ops], "tokens_per_s": pr.tokens_per_s,
            "op_times": dict(pr.op_times), "control_s": pr.control_s,
            "tasks_per_step": pr.tasks_per_step, "source": source}


def at_measured_lengths(pipeline, plan, cluster, dist) -> float | None:
    """The plan priced again with its responses at the measured lengths ``dist`` (see
    :mod:`rpeg.runtime.rundir.lengths`), on ``cluster``; None where it cannot be priced."""
    if cluster is None or cluster.num_gpus < plan.num_devices:
        return None
    from rpeg.plan.evaluate import Evaluator
    from rpeg.runtime.rundir.lengths import at_lengths
    try:
        ev = Evaluator(at_lengths(pipeline, dist), cluster).evaluate(plan,
                                                                     simulate_infeasible=True)
    except RpegError:
        return None
    t = ev.plan.predicted.step_time_s
    return t if t != float("inf") else None


def _with_lengths(path: Path, pipeline, plan, cluster, rows: list[dict], pr: dict,
                  me: dict) -> dict:
    """``predicted`` and ``measured``, with the steady steps' response lengths against the
    declared ones (``measured.response_tokens``) and the plan priced at them
    (``predicted.at_measured_lengths_s``)."""
    from rpeg.runtime.rundir.lengths import response_tokens
    found = response_tokens(path, pipeline, steady_rows(rows))
    if found is not None:
        me = {**me, "response_tokens": found[0]}
        if "step_time_s" in pr and found[1] is not None:
            t = at_measured_lengths(pipeline, plan, cluster, found[1])
            if t is not None:
                pr = {**pr, "at_measured_lengths_s": t}
    return {"predicted": pr, "measured": me}


# --- the record -------------------------------------------------------------------------

STOPPED = "stopped"         # the record says running, and no process holds the run's lock


def _status(path: Path, meta: dict) -> str:
    """run.json's status, or :data:`STOPPED` for a run whose process ended without closing
    its record (``rpeg run --resume`` continues it from its last checkpoint)."""
    from rpeg.runtime.rundir.files import held
    status = meta.get("status", "unknown")
    return STOPPED if status == "running" and not held(path) else status


def build_record(run_dir: str | Path, spec_path: str | None = None) -> dict:
    """The record of ``run_dir`` as it is now (writes cluster.json if it can find the cluster)."""
    from rpeg.runtime.rundir.directory import RunDir
    from rpeg.runtime.rundir.files import read_metrics, read_parsed
    from rpeg.runtime.rundir.serial import dumps, loads, plan_from_json

    rd = RunDir(Path(run_dir))
    path = rd.path
    meta = _read_json(path / "run.json")
    meta = meta if isinstance(meta, dict) else {}
    pipeline = read_parsed(path / "pipeline.json", "pipeline.json", loads)
    plan = read_parsed(path / "plan.json", "plan.json", plan_from_json)
    cluster = load_run_cluster(path)
    cluster_source = None
    if cluster is None:
        found = find_cluster_file(plan)
        if found is not None:
            from rpeg.spec import load_cluster
            try:
                cluster = load_cluster(found)
                cluster_source = str(found)
                rd.write_text("cluster.json", dumps(cluster))
            except RpegError:
                cluster = None
    rows, damaged = read_metrics(path)             # damaged lines are left out, and counted
    before = _read_json(path / RECORD)
    before = before.get("inputs", {}) if isinstance(before, dict) else {}
    inputs = {
        "spec": {**_entry(path, "spec.rpeg",
                          source=spec_path or before.get("spec", {}).get("source")),
                 "overrides": list(meta.get("overrides", []))},
        "pipeline": _entry(path, "pipeline.json"),
        "plan": {**_entry(path, "plan.json"), "strategy": plan.strategy.value,
                 "cluster": plan.cluster},
        "cluster": None if cluster is None else {
            "name": cluster.name, "file": "cluster.json", "source": cluster_source or cluster.path,
            "sha256": sha256_text(_canonical_cluster(cluster)), "gpu": cluster.gpu.name,
            "devices": cluster.num_gpus},
        "code": before.get("code") or code_version(),
    }
    ident = [inputs["pipeline"]["sha256"], inputs["plan"]["sha256"],
             (inputs["cluster"] or {}).get("sha256"), inputs["code"].get("rpeg"),
             inputs["code"].get("git_commit")]
    return {
        "schema": SCHEMA,
        "id": sha256_text(json.dumps(ident))[:12],
        "pipeline": pipeline.name,
        "status": _status(path, meta),
        **({"error": meta["error"]} if meta.get("error") else {}),
        "steps": meta.get("steps"),
        "started": _iso(meta.get("started")),
        "inputs": inputs,
        "where": {"scheduler": meta.get("scheduler", "local"), "workers": _workers(meta),
                  "homes": meta.get("homes") or {m: list(d) for m, d in plan.model_homes}},
        **_with_lengths(path, pipeline, plan, cluster, rows,
                        predicted(pipeline, plan, cluster), measured(rows, meta)),
        "final": final_metrics(rows),
        "eval": _evals(path),
        "files": _files(path),
        **({"damaged_metrics_lines": [n for n, _ in damaged]} if damaged else {}),
    }


def _evals(path: Path) -> list[dict]:
    """The run's evaluations (eval.jsonl), without their timings."""
    from rpeg.runtime.rundir.outputs import EVALS, read_rows
    return [{k: v for k, v in r.items() if k != "eval_s"} for r in read_rows(path, EVALS)]


def write_record(run_dir: str | Path, spec_path: str | None = None) -> dict:
    """Write ``record.json`` (and TensorBoard events when available); never raises for a bad
    run directory, since it runs while a run is ending: a failure is recorded instead."""
    path = Path(run_dir)
    try:
        rec = build_record(path, spec_path)
    except (OSError, ValueError, KeyError, RpegError) as e:
        rec = {"schema": SCHEMA, "error": f"{type(e).__name__}: {e}"}
    try:
        from rpeg.runtime.rundir.tensorboard import write_events
        tb = write_events(path)
        if tb is not None and "files" in rec:
            rec["files"]["tensorboard"] = str(tb.relative_to(path))
    except Exception as e:  # noqa: BLE001 — optional extra; a broken install must not fail a run
        rec.setdefault("warnings", []).append(f"tensorboard events not written: {e}")
    from rpeg.runtime.rundir.files import write_atomic
    write_atomic(path / RECORD, json.dumps(rec, indent=1, sort_keys=True) + "\n")
    return rec


def read_record(run_dir: str | Path) -> dict:
    """``record.json`` if the run wrote one, else the record built now (not written)."""
    rec = _read_json(Path(run_dir) / RECORD)
    shaped = isinstance(rec, dict) and rec.get("schema") == SCHEMA and "error" not in rec \
        and all(isinstance(rec.get(k, {}), dict)
                for k in ("inputs", "where", "predicted", "measured", "final", "files"))
    return rec if shaped else build_record(run_dir)


def _workers(meta: dict) -> dict:
    """Device -> the worker that ran it last (a resilient run keeps each device's history)."""
    if isinstance(meta.get("workers"), dict) and meta["workers"]:
        return dict(meta["workers"])
    history = meta.get("worker_history")
    if not isinstance(history, dict):
        return {}
    return {d: hist[-1] for d, hist in history.items() if isinstance(hist, list) and hist}


def _entry(path: Path, name: str, source: str | None = None) -> dict:
    out = {"file": name, "sha256": sha256_file(path / name)}
    if source:
        out["source"] = str(source)
    return out


def _files(path: Path) -> dict:
    out = {name: name for name in ("trace.json", "metrics.jsonl", "plan.json", "spec.rpeg")
           if (path / name).exists()}
    ck = path / "checkpoints"
    if ck.is_dir():
        out["checkpoints"] = sorted(f"checkpoints/{p.name}" for p in ck.iterdir() if p.is_dir())
    return out


def _read_json(p: Path):
    """A JSON record, or None when it is missing or unusable (never a pipe waited on)."""
    from rpeg.runtime.rundir.files import read_json
    try:
        return read_json(p, p.name, 64 << 20)
    except RpegError:
        return None


def _iso(t) -> str | None:
    return None if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


# --- where to look while a run is going -------------------------------------------------

def dashboard_line(client) -> str | None:
    """``dask dashboard: http://...`` when the scheduler serves its dashboard, else None.

    The dashboard needs bokeh on the scheduler's side; a local cluster serves it only
    when bokeh is importable here (``pip install 'rpeg[dashboard]'``).
    """
    import importlib.util
    try:
        info = client.scheduler_info(n_workers=0)
    except TypeError:
        info = client.scheduler_info()
    except Exception:  # noqa: BLE001 — an address to print is a nicety, never a failure
        return None
    if "dashboard" not in info.get("services", {}):
        return None
    if getattr(client, "cluster", None) is not None and importlib.util.find_spec("bokeh") is None:
        return None
    # Dask's own link names this machine's outward address even when the server listens on
    # loopback only; the scheduler's address is the one the dashboard shares.
    address = getattr(client.scheduler, "address", "") or ""
    host = address.split("://", 1)[1].rsplit(":", 1)[0] \
        if address.startswith(("tcp://", "tls://")) else "127.0.0.1"
    return f"dask dashboard: http://{host}:{info['services']['dashboard']}/status"
