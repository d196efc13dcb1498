"""A model's ``weights`` folder is resolved from the spec file's folder, like the dataset."""

from __future__ import annotations

from pathlib import Path

from rpeg.cli import main
from rpeg.spec import load

ROOT = Path(__file__).resolve().parents[2]


def _spec(folder: Path, weights: str) -> Path:
    text = (ROOT / "pipelines/tiny_ppo.rpeg").read_text().replace(
        "model ref    : tiny { frozen }", f'model ref    : tiny {{ frozen; weights = "{weights}" }}')
    assert "weights =" in text
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    (folder / "data").symlink_to(ROOT / "pipelines/data")
    f = folder / "p.rpeg"
    f.write_text(text)
    return f


def test_relative_weights_resolve_from_the_spec_folder(tmp_path, monkeypatch):
    spec = _spec(tmp_path / "specs", "w/ref")
    (tmp_path / "specs/w/ref").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)                        # not the spec's folder
    assert load(spec).model("ref").weights == str((tmp_path / "specs/w/ref").resolve())
    assert load(_spec(tmp_path / "abs", str(tmp_path / "x"))).model("ref").weights == \
        str(tmp_path / "x")


def test_check_warns_about_a_missing_weights_folder(tmp_path, capsys):
    spec = _spec(tmp_path, "w/missing")
    assert main(["check", str(spec)]) == 0
    out, err = capsys.readouterr()
    assert "weights directory 'w/missing' does not exist (yet); a run needs it" in out + err
    (tmp_path / "w/missing").mkdir(parents=True)
    assert main(["check", str(spec)]) == 0
    assert "weights directory" not in "".join(capsys.readouterr())
