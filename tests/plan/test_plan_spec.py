"""One rule for a plan's spec, in every command that reads a plan: the file the plan records,
or ``--spec``. A plan whose spec moved or vanished is refused by ``simulate``, ``run``,
``diff``, ``show`` and ``compile PLAN.json`` alike, even with a file of the pipeline's name
beside it; with ``--spec`` each of them takes it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rpeg.cli import main

ROOT = Path(__file__).resolve().parents[2]
REFUSAL = "plan must name its spec file, and the one it names is not there"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Path:
    """tiny_ppo (with its rewards and data) in specs/, and a plan of it beside specs/."""
    folder = tmp_path_factory.mktemp("compiled")
    specs = folder / "specs"
    specs.mkdir()
    shutil.copy(ROOT / "pipelines/tiny_ppo.rpeg", specs / "tiny_ppo.rpeg")
    shutil.copy(ROOT / "pipelines/rewards.py", specs / "rewards.py")
    (specs / "data").symlink_to(ROOT / "pipelines/data")
    assert main(["compile", str(specs / "tiny_ppo.rpeg"), "--cluster",
                 str(ROOT / "pipelines/clusters/local_cpu.rpeg"), "-o",
                 str(folder / "plan.json"), "--no-gantt", "--budget", "30"]) == 0
    return folder


@pytest.fixture
def moved(compiled, tmp_path) -> tuple[Path, Path]:
    """A copy of the plan whose recorded spec is gone, with spec.rpeg, tiny_ppo.rpeg and
    pipelines/tiny_ppo.rpeg beside it (what a guess would have taken); and where the spec
    went."""
    src = tmp_path / "src"
    shutil.copytree(compiled, src, symlinks=True)
    plan = src / "plan.json"
    plan.write_text(plan.read_text().replace(str(compiled), str(src)))
    shutil.move(str(src / "specs"), str(tmp_path / "away"))
    spec = tmp_path / "away" / "tiny_ppo.rpeg"
    (src / "pipelines").mkdir()
    for decoy in ("spec.rpeg", "tiny_ppo.rpeg", "pipelines/tiny_ppo.rpeg"):
        shutil.copy(spec, src / decoy)
    return plan, spec


COMMANDS = {
    "simulate": lambda plan: ["simulate", str(plan), "--steps", "2"],
    "run": lambda plan: ["run", str(plan), "--steps", "1", "--no-progress"],
    "show": lambda plan: ["show", str(plan)],
    "diff": lambda plan: ["diff", str(plan), str(plan)],
    "compile": lambda plan: ["compile", str(plan), "--no-gantt"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_plan_whose_spec_moved_is_refused_alike(moved, command, capsys, monkeypatch):
    plan, _ = moved
    monkeypatch.chdir(plan.parent)                 # ./pipelines/... is no guess either
    assert main(COMMANDS[command](plan)) == 1
    err = capsys.readouterr().err
    assert f"{plan}: error: {REFUSAL}" in err and "--spec" in err, err


@pytest.mark.parametrize("command", ["simulate", "show", "diff"])
def test_with_spec_each_command_takes_it(moved, command, capsys):
    plan, spec = moved
    assert main(COMMANDS[command](plan) + ["--spec", str(spec)]) == 0, capsys.readouterr().err


def test_run_takes_spec_too(moved):
    from rpeg.runtime.plans import plan_for_run
    plan, spec = moved
    pipeline, _, spec_path = plan_for_run(plan, spec=spec)
    assert spec_path == spec and pipeline.workload.dataset.path == str(spec.parent /
                                                                       "data/toy.jsonl")


def test_a_relative_recorded_spec_is_relative_to_the_plan_file(compiled, tmp_path, capsys,
                                                                monkeypatch):
    plan = tmp_path / "plan.json"
    text = (compiled / "plan.json").read_text()
    plan.write_text(text.replace(str(compiled / "specs/tiny_ppo.rpeg"), "near/tiny_ppo.rpeg"))
    (tmp_path / "near").mkdir()
    for name in ("tiny_ppo.rpeg", "rewards.py"):
        shutil.copy(compiled / "specs" / name, tmp_path / "near" / name)
    (tmp_path / "near/data").symlink_to(ROOT / "pipelines/data")
    monkeypatch.chdir(ROOT)                         # not the plan's folder
    assert main(["show", str(plan)]) == 0, capsys.readouterr().err
