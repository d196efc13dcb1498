"""The words users read when rpeg refuses to lose their work, as golden text: an export onto
a run, into it or around it, or onto a file; a checkpoint's damaged tensors and metadata
met by export; a run directory that holds what the run reads or what a run writes; an
unknown tracker; an ``extend`` through a symlink loop. Paths under the test's folder are
shown as ``$TMP``. ``RPEG_UPDATE_GOLDEN=1`` rewrites the file after a deliberate change."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rpeg.cli import main
from tests.reliability.test_faults import micro_spec
from tests.reliability.test_hostile_input import no_hang
from tests.reliability.test_tensors import _damage

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "errors" / "nothing_lost.golden"


def _said(argv: list[str], capsys, tmp: Path, rc: int = 1) -> str:
    capsys.readouterr()
    with no_hang():
        got = main(argv)
    out, err = capsys.readouterr()
    assert got == rc, (argv, out, err)
    shown = " ".join(a.replace(str(tmp), "$TMP") for a in ["rpeg", *argv])
    return f"$ {shown}\n" + (err + out).replace(str(tmp), "$TMP")


def test_the_refusals_read_as_written(run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    said = []
    for out in (run, run / "checkpoints", tmp_path):
        said.append(_said(["export", str(run), "-o", str(out)], capsys, tmp_path))
    (tmp_path / "notes.txt").write_text("my notes\n")
    said.append(_said(["export", str(run), "-o", "notes.txt"], capsys, tmp_path))
    for case in ("wrong-shape", "nan", "missing", "extra", "meta-list"):
        damaged = tmp_path / f"run-{case}"
        shutil.copytree(run, damaged)
        _damage(damaged / "checkpoints" / "step-000004", case)
        said.append(_said(["export", str(damaged), "-o", str(tmp_path / "hf")], capsys,
                          tmp_path))
    spec = micro_spec(tmp_path / "micro")
    argv = ["run", str(spec), "--steps", "1", "--no-progress", "--strategy", "runtime-split"]
    said.append(_said([*argv, "--run-dir", str(spec.parent)], capsys, tmp_path))
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "plan.json").write_text("{}")
    said.append(_said([*argv, "--run-dir", str(tmp_path / "mine")], capsys, tmp_path))
    said.append(_said([*argv, "--run-dir", str(tmp_path / "new"), "--tracker", "neptune"],
                      capsys, tmp_path))
    (tmp_path / "inc").mkdir()
    os.symlink("loop.rpeg", tmp_path / "inc" / "loop.rpeg")
    (tmp_path / "v.rpeg").write_text('pipeline v\nextend "inc/loop.rpeg"\n')
    said.append(_said(["check", "v.rpeg"], capsys, tmp_path))
    text = "\n".join(said)
    if os.environ.get("RPEG_UPDATE_GOLDEN"):
        GOLDEN.write_text(text, encoding="utf-8")
    assert text == GOLDEN.read_text(encoding="utf-8")
