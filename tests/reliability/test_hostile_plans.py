"""Hand-edited plan.json files, through every command that reads a plan: ``rpeg simulate``,
``run``, ``diff`` and ``show`` refuse each one alike, with exit 1 and a message naming the
file and the field, and ``run`` refuses before anything starts (no worker, no run
directory). Each runs under a hang guard, never a speed target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from tests.reliability.test_hostile_input import no_hang

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    """A plan compiled for tiny_ppo on the local cluster, with its spec and cluster beside
    it (it records their paths)."""
    folder = tmp_path_factory.mktemp("plans")
    for name in ("tiny_ppo.rpeg", "tiny_grpo.rpeg", "rewards.py"):
        shutil.copy(ROOT / "pipelines" / name, folder / name)
    shutil.copytree(ROOT / "pipelines" / "data", folder / "data")
    shutil.copytree(ROOT / "pipelines" / "clusters", folder / "clusters")
    out = folder / "plan.json"
    assert main(["compile", str(folder / "tiny_ppo.rpeg"), "--cluster",
                 str(folder / "clusters" / "local_cpu.rpeg"), "-o", str(out), "--no-gantt",
                 "--iterations", "200", "--seed", "1"]) == 0
    return out


def _edited(good: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(good.read_text())
    text = edit(data)
    path = tmp_path / "plan.json"
    path.write_text(text if isinstance(text, str) else json.dumps(data, indent=1))
    return path


def _refused_by_every_command(path: Path, good: Path, says: str, capsys, tmp_path,
                              extra: tuple[str, ...] = ()) -> None:
    run_dir = tmp_path / "run"
    commands = (["simulate", str(path), "--steps", "2"],
                ["run", str(path), "--no-progress", "--steps", "1", "--run-dir", str(run_dir)],
                ["diff", str(good), str(path)],
                ["show", str(path)])
    for argv in commands:
        capsys.readouterr()
        with no_hang():
            rc = main([*argv, *extra])
        out, err = capsys.readouterr()
        assert rc == 1, (argv, out, err)
        assert "Traceback" not in err and "internal error" not in err, (argv, err)
        assert str(path) in err and says in err, (argv, err)
        assert not run_dir.exists(), f"{argv[0]} wrote a run directory for a refused plan"


def _placement(d: dict, stage: str) -> dict:
    return next(p for p in d["placements"] if p["stage"] == stage)


CASES = {
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


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_plan_is_refused_alike_by_every_command(good, tmp_path, capsys, case):
    edit, says = CASES[case]
    path = _edited(good, tmp_path, edit)
    _refused_by_every_command(path, good, says, capsys, tmp_path)


def test_a_plan_for_another_pipeline_is_refused_naming_both(good, tmp_path, capsys):
    grpo = good.parent / "tiny_grpo.rpeg"
    for argv in (["simulate", str(good), "--spec", str(grpo)],
                 ["run", str(good), "--spec", str(grpo), "--no-progress",
                  "--run-dir", str(tmp_path / "run")]):
        with no_hang():
            assert main(argv) == 1
        err = capsys.readouterr().err
        assert "'tiny_grpo'" in err and "'tiny_ppo'" in err and str(good) in err, err
        assert not (tmp_path / "run").exists()


def test_a_changed_spec_is_refused_naming_both_hashes_or_warned_with_force(good, tmp_path,
                                                                           capsys):
    data = json.loads(good.read_text())
    spec = Path(data["spec_path"])
    original = spec.read_text()
    try:
        spec.write_text(original + "\n# edited after the plan was compiled\n")
        assert main(["simulate", str(good), "--steps", "2"]) == 1
        err = capsys.readouterr().err
        assert data["spec_hash"] in err and "spec_hash" in err, err
        assert main(["simulate", str(good), "--steps", "2", "--force"]) == 0
        assert "warning:" in capsys.readouterr().err
    finally:
        spec.write_text(original)


def test_a_plan_beyond_the_machine_is_refused_before_any_worker_starts(good, tmp_path, capsys):
    """Without a cluster file to compare with, the embedded cluster's own limit refuses a
    plan for a million devices before a LocalCluster is built."""
    path = _edited(good, tmp_path, lambda d: d.update(num_devices=1_000_000, cluster_path=""))
    with no_hang():
        rc = main(["run", str(path), "--no-progress", "--steps", "1",
                   "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1 and "1,000,000 devices" in err and "worker processes" in err, err
    assert not (tmp_path / "run").exists()


def test_the_good_plan_passes_every_check(good, capsys):
    assert main(["simulate", str(good), "--steps", "2"]) == 0
    assert main(["show", str(good)]) == 0
    assert main(["diff", str(good), str(good)]) == 0
