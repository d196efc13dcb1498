"""A run reads the files its spec named where they were written, started and resumed from
folders that are neither the spec's nor its base's: a variant in one folder extends a base
two folders away, whose datasets, eval dataset, reward module (and the module beside it),
``hf(...)`` folder and ``weights`` folder are the base folder's; the variant's folder holds
decoys of the same names (tests/spec/test_paths.py)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from tests.reliability.test_hostile_input import no_hang
from tests.spec.test_paths import base_and_variant


def _save_tiny(folder: Path) -> None:
    import torch
    from transformers import LlamaForCausalLM

    from backends.torch_backend.modeling import hf_config
    from rpeg.spec.presets import PRESETS
    torch.manual_seed(3)
    LlamaForCausalLM(hf_config(PRESETS["tiny"])).save_pretrained(folder)


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The variant run for 2 steps (a checkpoint after each) from a third folder."""
    root = tmp_path_factory.mktemp("paths")
    base, spec = base_and_variant(root, models=_save_tiny)
    third = root / "third"
    third.mkdir()
    run = root / "runs" / "variant"
    with pytest.MonkeyPatch.context() as mp, no_hang(900):
        mp.chdir(third)
        rc = main(["run", str(spec), "--strategy", "runtime-split", "--steps", "2",
                   "--checkpoint-every", "1", "--run-dir", str(run), "--no-progress"])
    assert rc == 0
    return root, base, spec, run


def _rows(run: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (run / name).read_text().splitlines() if line]


def test_the_run_reads_the_base_folders_files_and_verifies(ran):
    root, base, spec, run = ran
    assert main(["verify", str(run)]) == 0
    rows = _rows(run, "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(r["reward"] == 0.25 for r in rows)          # marks.py and marks_value.py, base's
    assert _rows(run, "eval.jsonl")                          # the base's test.jsonl answered
    recorded = json.loads((run / "pipeline.json").read_text())
    assert recorded["workload"]["dataset"]["path"] == str(base / "data/train.jsonl")
    assert recorded["rewards"][0]["source"] == str(base / "marks.py")
    assert {m["name"]: m["weights"] for m in recorded["models"]} == {
        "actor": str(base / "models/actor"), "ref": str(base / "models/ref")}


def _tree(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != "run.lock"}


@pytest.mark.slow          # a second real run: the resume from a fourth folder
def test_resume_from_another_folder_reads_the_recorded_files(ran, tmp_path, monkeypatch):
    root, base, spec, made = ran
    run = tmp_path / "run"
    shutil.copytree(made, run)
    monkeypatch.chdir(tmp_path)
    with no_hang(900):
        assert main(["run", "--resume", str(run), "--steps", "3", "--no-progress"]) == 0
    assert main(["verify", str(run)]) == 0
    rows = _rows(run, "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["reward"] == 0.25 for r in rows)


def test_a_resume_whose_files_moved_says_where_the_run_read_them(ran, tmp_path, capsys,
                                                                 monkeypatch):
    root, base, spec, made = ran
    run = tmp_path / "run"
    shutil.copytree(made, run)
    before = _tree(run)
    moved = base.parent / "moved"
    shutil.move(str(base), str(moved))
    try:
        monkeypatch.chdir(tmp_path)
        assert main(["run", "--resume", str(run), "--steps", "3", "--no-progress"]) == 1
        err = capsys.readouterr().err
        assert f"dataset '{base / 'data/train.jsonl'}' must be where the run read it" in err
        assert "moved or removed since the run started" in err and "base.rpeg:9:" in err
        assert _tree(run) == before
        # the run holds what verify and show read: the spec's files are not needed
        assert main(["verify", str(run)]) == 0
        assert main(["show", str(run), "--no-verify"]) == 0
    finally:
        shutil.move(str(moved), str(base))
