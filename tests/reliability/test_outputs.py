"""Outputs never overlap inputs: every command that writes refuses, before any work, a
destination that is a run directory, lies inside one, holds the one it reads, or is of the
wrong kind; what it writes goes through a temporary sibling, so a failure leaves nothing
behind and the destination as it was."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from tests.reliability.test_run_dirs import _refused, _remanifest, _tree

ROOT = Path(__file__).resolve().parents[2]


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".tmp" in p.name)


# --- rpeg export -----------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["run", "run/checkpoints", "run/checkpoints/step-000004",
                                   "parent"], ids=["the-run", "its-checkpoints",
                                                   "a-checkpoint", "around-it"])
def test_export_onto_a_run_is_refused_and_the_run_untouched(run, capsys, where):
    out = run.parent if where == "parent" else run.parent / where
    before = _tree(run.parent)
    text = _refused(["export", str(run), "-o", str(out)], capsys, "-o must not name")
    assert "run directory" in text or "reads" in text
    assert _tree(run.parent) == before


def test_export_onto_another_run_is_refused(run, micro_run, capsys):
    before = _tree(micro_run)
    _refused(["export", str(run), "-o", str(micro_run)], capsys, "-o must not name",
             "a run directory")
    assert _tree(micro_run) == before


def test_export_onto_a_file_is_refused_and_leaves_nothing(run, tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    _refused(["export", str(run), "-o", str(notes)], capsys, "must name a folder",
             str(notes))
    assert notes.read_text() == "my notes\n" and _leftovers(tmp_path) == []


def test_export_never_replaces_a_folder_it_did_not_write(run, tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("\\section{}\n")
    _refused(["export", str(run), "-o", str(mine)], capsys, "an earlier export")
    assert (mine / "thesis.tex").read_text() == "\\section{}\n"


def test_export_writes_and_replaces_its_own_folder(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(run), "-o", str(out)]) == 0
    assert json.loads((out / "rpeg_export.json").read_text())["step"] == 4
    assert main(["export", str(run), "--step", "2", "-o", str(out)]) == 0   # an earlier export
    assert json.loads((out / "rpeg_export.json").read_text())["step"] == 2
    assert _leftovers(tmp_path) == []


def test_a_failed_export_leaves_the_earlier_one_and_no_temporary_folder(run, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", str(run), "-o", str(out)]) == 0
    before = _tree(out)
    ck = run / "checkpoints" / "step-000002"
    for meta in ck.glob("*@*/meta.json"):
        meta.write_text("[1, 2]")                     # not an object: refused as it is read
    _remanifest(ck)
    _refused(["export", str(run), "--step", "2", "-o", str(out)], capsys, "meta.json",
             "must be a JSON object")
    assert _tree(out) == before and _leftovers(tmp_path) == []


# --- the other commands that write -------------------------------------------------------------

def test_compile_graph_and_simulate_refuse_to_write_into_a_run(run, capsys):
    spec = Path(json.loads((run / "run.json").read_text())["spec"])
    cluster = ROOT / "pipelines/clusters/local_cpu.rpeg"
    before = _tree(run)
    for argv in (["compile", str(spec), "--cluster", str(cluster), "-o", str(run / "plan.json")],
                 ["compile", str(spec), "--cluster", str(cluster), "-o",
                  str(run / "checkpoints" / "p.json")],
                 ["graph", str(spec), "-o", str(run / "graph.dot")]):
        _refused(argv, capsys, "-o must not name", str(run))
    assert _tree(run) == before


def test_simulate_and_show_plots_refuse_to_write_into_a_run(run, tmp_path, capsys):
    spec = Path(json.loads((run / "run.json").read_text())["spec"])
    plan = tmp_path / "plan.json"
    assert main(["compile", str(spec), "--cluster",
                 str(ROOT / "pipelines/clusters/local_cpu.rpeg"), "-o", str(plan),
                 "--no-gantt", "--budget", "20"]) == 0
    shutil.copy(plan, run / "compiled.json")
    before = _tree(run)
    _refused(["simulate", str(plan), "-o", str(run / "gantt.png")], capsys,
             "-o must not name", str(run))
    _refused(["show", str(run / "compiled.json"), "--plots"], capsys, "--plots", str(run))
    assert _tree(run) == before


def test_run_dir_inside_a_run_or_a_file_is_refused_before_anything(run, tmp_path, capsys):
    spec = Path(json.loads((run / "run.json").read_text())["spec"])
    before = _tree(run)
    _refused(["run", str(spec), "--strategy", "runtime-split", "--no-progress", "--run-dir",
              str(run / "checkpoints" / "again")], capsys, "inside another run's directory")
    assert _tree(run) == before
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(["run", str(spec), "--strategy", "runtime-split", "--no-progress", "--run-dir",
              str(afile)], capsys, "must be a directory")
    assert afile.read_text() == "x"


def test_a_plan_written_over_an_earlier_one_is_whole_or_the_earlier(tmp_path, capsys):
    spec = ROOT / "pipelines" / "tiny_ppo.rpeg"
    out = tmp_path / "plan.json"
    out.write_text("an earlier plan")
    assert main(["compile", str(spec), "--cluster",
                 str(ROOT / "pipelines/clusters/local_cpu.rpeg"), "-o", str(out),
                 "--no-gantt", "--budget", "20"]) == 0
    assert json.loads(out.read_text())["pipeline"] == "tiny_ppo"
    assert _leftovers(tmp_path) == []
