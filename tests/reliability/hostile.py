"""A catalogue of hostile files: hand-edited plans and damaged run directories, each with
the words its refusal must contain. The tests (test_hostile_plans.py, test_run_dirs.py)
and ``benchmarks/reliability.py`` (which counts refusals, hangs and internal errors) both
try every entry.

    >>> sorted(PLAN_EDITS)[:2]
    ['5000-digits', 'cluster-is-a-pipeline']
    >>> damage, says, commands = RUN_DIR_DAMAGE["fifo-trace"]
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path


def _placement(d: dict, stage: str) -> dict:
    return next(p for p in d["placements"] if p["stage"] == stage)


# name -> (edit of the plan's JSON value, returning text to write or None to write the value;
#          words the refusal says)
PLAN_EDITS: dict[str, tuple[Callable[[dict], object], str]] = {
    "deep-nesting": (lambda d: '{"schema_version": 1, "placements": ' + "[" * 100_000
                     + "]" * 100_000 + "}", "nest"),
    "device-half": (lambda d: d["placements"][0].update(devices=[0.5]),
                    "'placements[0].devices[0]' must be an integer"),
    "device-string": (lambda d: d["placements"][0].update(devices=["0"]),
                      "'placements[0].devices[0]' must be an integer"),
    "5000-digits": (lambda d: json.dumps(d).replace('"seed": 1', '"seed": ' + "9" * 5000),
                    "at most 20 digits"),
    "duplicate-key": (lambda d: json.dumps(d).replace('"num_devices": 2',
                                                      '"num_devices": 2, "num_devices": 1000000'),
                      "'num_devices' twice"),
    "million-devices": (lambda d: d.update(num_devices=1_000_000), "num_devices"),
    "home-device-7": (lambda d: d.update(model_homes=[["actor+critic", [7]]]),
                      "model_homes[0]"),
    "home-unknown-model": (lambda d: d.update(model_homes=[["actress", [0]]]),
                           "model_homes[0]"),
    "shared-unknown-model": (lambda d: d.update(shared=[["actor", "critter"]]), "shared[0]"),
    "unknown-stage": (lambda d: _placement(d, "scores").update(stage="scorez"),
                      "placements[3].stage"),
    "fusion-unknown-stage": (lambda d: d.update(fusion=[["ref_lp", "valuez"]]), "fusion[0]"),
    "staleness-unknown-stage": (lambda d: d.update(staleness=[["rollouts", 1]]),
                                "staleness[0]"),
    "staleness-past-bound": (lambda d: d.update(staleness=[["rollout", 5]]), "staleness[0]"),
    "missing-stage": (lambda d: d.update(placements=[p for p in d["placements"]
                                                     if p["stage"] != "adv"]),
                      "leave out 'adv'"),
    "wrong-spec-hash": (lambda d: d.update(spec_hash="0123456789abcdef"), "0123456789abcdef"),
    "infinite-time": (lambda d: json.dumps(d).replace('"step_time_s": ', '"step_time_s": 1e999, '
                                                      '"x": '), "finite"),
    "nan-time": (lambda d: json.dumps(d).replace('"step_time_s": ', '"step_time_s": NaN, "x": '),
                 "finite"),
    "negative-time": (lambda d: d["predicted"].update(step_time_s=-1.0), "step_time_s"),
    "cluster-is-a-pipeline": (lambda d: d.update(cluster_path=d["spec_path"]), "cluster_path"),
}


def compile_good_plan(folder: Path) -> Path:
    """A plan compiled for tiny_ppo on the local cluster into ``folder``, with copies of its
    spec (and tiny_grpo's), rewards, data and clusters beside it (it records their paths)."""
    from rpeg.cli import main
    root = Path(__file__).resolve().parents[2] / "pipelines"
    for name in ("tiny_ppo.rpeg", "tiny_grpo.rpeg", "rewards.py"):
        shutil.copy(root / name, folder / name)
    shutil.copytree(root / "data", folder / "data")
    shutil.copytree(root / "clusters", folder / "clusters")
    out = folder / "plan.json"
    rc = main(["compile", str(folder / "tiny_ppo.rpeg"), "--cluster",
               str(folder / "clusters" / "local_cpu.rpeg"), "-o", str(out), "--no-gantt",
               "--iterations", "200", "--seed", "1"])
    if rc != 0:
        raise RuntimeError(f"compiling the plan the hostile edits start from failed ({rc})")
    return out


def write_edited_plan(good: Path, dst: Path, edit) -> Path:
    """``good`` (a plan file) with ``edit`` applied, written to ``dst``."""
    data = json.loads(good.read_text())
    text = edit(data)
    dst.write_text(text if isinstance(text, str) else json.dumps(data, indent=1))
    return dst


# --- run directories ---------------------------------------------------------------------------

def _fifo(name: str):
    def damage(run: Path, outside: Path) -> None:
        (run / name).unlink()
        os.mkfifo(run / name)
    return damage


def _symlink(name: str):
    def damage(run: Path, outside: Path) -> None:
        shutil.move(str(run / name), str(outside / name))
        (run / name).symlink_to(outside / name)
    return damage


def _meta(**fields):
    def damage(run: Path, outside: Path) -> None:
        meta = json.loads((run / "run.json").read_text())
        meta.update(fields)
        (run / "run.json").write_text(json.dumps(meta))
    return damage


def _metrics(edit):
    def damage(run: Path, outside: Path) -> None:
        p = run / "metrics.jsonl"
        p.write_bytes(edit(p.read_bytes()))
    return damage


def _unlink(name: str):
    def damage(run: Path, outside: Path) -> None:
        (run / name).unlink()
    return damage


ALL = ("verify", "show", "resume")

# name -> (damage(run dir, a folder outside it), words the refusal says, commands that refuse)
RUN_DIR_DAMAGE: dict[str, tuple[Callable[[Path, Path], None], str, tuple[str, ...]]] = {
    **{f"fifo-{n.split('.')[0]}": (_fifo(n), "named pipe", ALL)
       for n in ("plan.json", "trace.json", "metrics.jsonl", "run.json")},
    **{f"symlink-{n.split('.')[0]}": (_symlink(n), "symlink", ALL)
       for n in ("plan.json", "metrics.jsonl", "run.json", "pipeline.json")},
    "symlink-checkpoints": (_symlink("checkpoints"), "symlink", ("resume",)),
    "symlink-events": (_symlink("events.jsonl"), "symlink", ("resume",)),
    "steps-1e12": (_meta(steps=10**12), "1..10,000,000", ALL),
    "steps-negative": (_meta(steps=-5), "1..10,000,000", ALL),
    "steps-string": (_meta(steps="many"), "'steps'", ALL),
    "history-string": (_meta(worker_history="tcp://a"), "'worker_history'", ALL),
    "recoveries-object": (_meta(recoveries={"a": 1}), "'recoveries'", ALL),
    "metrics-cut-short": (_metrics(lambda b: b[:-20]), "line 4", ("verify", "resume")),
    "metrics-garbage": (_metrics(lambda b: bytes(range(256)) * 12), "metrics.jsonl", ALL),
    "metrics-row-twice": (_metrics(lambda b: b + b.splitlines(keepends=True)[1]),
                          "step 1", ("verify", "resume")),
    "metrics-deleted": (_unlink("metrics.jsonl"), "metrics.jsonl", ("verify", "resume")),
}
