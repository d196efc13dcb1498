"""Shipped files are found through the package (rpeg.resources), not the working directory."""

import subprocess
import sys
from pathlib import Path

from rpeg import __version__
from rpeg.cli import main
from rpeg.resources import clusters_dir, grammar_path, profiles_dir, shipped
from rpeg.spec import load


def test_every_shipped_pipeline_loads_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    specs = sorted(shipped("pipelines").glob("*.rpeg"))
    assert len(specs) >= 5
    for spec in specs:
        assert load(spec).name == spec.stem


def test_the_grammar_clusters_and_profiles_are_package_data():
    assert grammar_path().read_text(encoding="utf-8").lstrip().startswith("//")
    assert (clusters_dir() / "local_cpu.rpeg").is_file()
    assert {p.stem for p in profiles_dir().glob("*.rpeg")} >= {"local_cpu", "gh200", "h100"}


def test_package_data_links_point_at_the_source_folders():
    root = Path(__file__).resolve().parents[1]
    assert grammar_path().resolve() == root / "grammar" / "rpeg.lark"
    assert clusters_dir().resolve() == root / "pipelines" / "clusters"


def test_version_flag(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"rpeg {__version__}"


def test_check_runs_from_outside_the_source_tree(tmp_path):
    spec = shipped("pipelines", "tiny_ppo.rpeg")
    r = subprocess.run([sys.executable, "-m", "rpeg", "check", str(spec)], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pipeline tiny_ppo" in r.stdout
