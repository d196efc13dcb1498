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
from tests.reliability.hostile import PLAN_EDITS, compile_good_plan, write_edited_plan
from tests.reliability.test_hostile_input import no_hang

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return compile_good_plan(tmp_path_factory.mktemp("plans"))


def _edited(good: Path, tmp_path: Path, edit) -> Path:
    return write_edited_plan(good, tmp_path / "plan.json", edit)


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


@pytest.mark.parametrize("case", sorted(PLAN_EDITS))
def test_a_hostile_plan_is_refused_alike_by_every_command(good, tmp_path, capsys, case):
    edit, says = PLAN_EDITS[case]
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


def test_a_base_the_spec_extends_is_part_of_its_hash(tmp_path, capsys):
    """A plan of a spec that extends a base is refused once the base changes (its figures
    are the spec's as much as the file's own), naming the base; the spec's own bytes alone
    would have let a stale plan run."""
    root = Path(__file__).resolve().parents[2] / "pipelines"
    (tmp_path / "data").mkdir()
    shutil.copy(root / "data" / "toy.jsonl", tmp_path / "data")
    shutil.copy(root / "rewards.py", tmp_path)
    base = tmp_path / "base.rpeg"
    base.write_text((root / "tiny_ppo.rpeg").read_text())
    (tmp_path / "child.rpeg").write_text('extend "base.rpeg"\npipeline child\n')
    plan = tmp_path / "c.json"
    cluster = root / "clusters" / "local_cpu.rpeg"
    assert main(["compile", str(tmp_path / "child.rpeg"), "--cluster", str(cluster),
                 "-o", str(plan), "--no-gantt", "--strategy", "colocated"]) == 0
    assert main(["simulate", str(plan), "--steps", "2"]) == 0
    base.write_text(base.read_text().replace("prompts    = 32", "prompts    = 512"))
    capsys.readouterr()
    assert main(["simulate", str(plan), "--steps", "2"]) == 1
    err = capsys.readouterr().err
    assert "spec_hash" in err and f"with the bases it extends ({base})" in err, err


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


@pytest.mark.parametrize("edit, says", [
    # tiny_ppo bounds rollout's staleness at 1: a carry of 2 spends past it, and only a
    # generate stage carries responses over
    (lambda d: _stage(d, "rollout").update(carry=2), "carry"),
    (lambda d: _stage(d, "ref_lp").update(carry=1), "generate stage"),
])
def test_a_carry_past_the_bound_is_refused_alike_by_every_command(good, tmp_path, capsys,
                                                                  edit, says):
    """Partial rollouts spend the staleness bound by the rule the cost model and the
    runtime read (rpeg.plan.staleness); every command that reads a plan checks it."""
    path = _edited(good, tmp_path, edit)
    _refused_by_every_command(path, good, says, capsys, tmp_path)


def _stage(d: dict, stage: str) -> dict:
    return next(p for p in d["placements"] if p["stage"] == stage)
