"""The front-end commands: check, fmt, graph, diff -- exit codes, output, and no torch import."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rpeg.cli import main

ROOT = Path(__file__).resolve().parents[2]
P = ROOT / "pipelines"


def rpeg(capsys, *args: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def work(tmp_path) -> Path:
    """A folder with the PPO pipeline and its rewards, to edit freely."""
    for name in ("ppo_llama8b.rpeg", "ppo_async.rpeg", "rewards.py"):
        shutil.copy(P / name, tmp_path / name)
    return tmp_path


def test_help_on_every_front_command(capsys):
    for cmd in ("check", "fmt", "graph", "diff"):
        rc, out, _ = rpeg(capsys, cmd, "--help")
        assert rc == 0 and "Usage:" in out, cmd


def test_check_ok_and_error(capsys, work):
    rc, out, _ = rpeg(capsys, "check", work / "ppo_llama8b.rpeg", P / "clusters" / "gh200_64.rpeg")
    assert rc == 0
    assert "pipeline ppo_llama8b: 3 models, 7 stages" in out and "cluster gh200_64" in out
    bad = work / "bad.rpeg"
    bad.write_text((work / "ppo_llama8b.rpeg").read_text().replace("forward(ref,", "forward(reff,"))
    rc, out, err = rpeg(capsys, "check", bad)
    assert rc == 1
    assert f"{bad}:19:" in err and "unknown model 'reff'" in err and "did you mean 'ref'?" in err


def test_check_usage_error_exits_2(capsys):
    rc, _, _ = rpeg(capsys, "check")
    assert rc == 2


def test_fmt_prints_checks_and_writes(capsys, work):
    messy = work / "messy.rpeg"
    messy.write_text("pipeline   p\nshare a,b   # x\n")
    rc, out, _ = rpeg(capsys, "fmt", messy)
    assert rc == 0 and out == "pipeline p\nshare a, b  # x\n"
    rc, _, err = rpeg(capsys, "fmt", "--check", messy)
    assert rc == 1 and f"{messy}: not in canonical form" in err
    rc, _, _ = rpeg(capsys, "fmt", "-w", messy)
    assert rc == 0 and messy.read_text() == "pipeline p\nshare a, b  # x\n"
    rc, out, err = rpeg(capsys, "fmt", "--check", messy)
    assert rc == 0 and out == "" and err == ""
    rc, _, _ = rpeg(capsys, "fmt", "--check", "--write", messy)
    assert rc == 2


def test_fmt_check_passes_on_every_shipped_file(capsys):
    files = sorted(P.rglob("*.rpeg"))
    rc, _, err = rpeg(capsys, "fmt", "--check", *files)
    assert rc == 0, err


def test_fmt_reads_stdin(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"pipeline   p\nshare a,b\n")))
    assert rpeg(capsys, "fmt", "-")[:2] == (0, "pipeline p\nshare a, b\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"pipeline\n")))
    rc, _, err = rpeg(capsys, "fmt", "-")
    assert rc == 1
    assert err.splitlines()[:3] == [
        "<stdin>:1:9: error: expected a name after 'pipeline', not end of line",
        "    pipeline", "            ^"]


def test_fmt_check_and_write_of_stdin(capsys, monkeypatch):
    """--check reads standard input as it reads a file: nothing printed, exit 1 unless
    canonical; --write has no file to rewrite there (a usage error)."""
    def given(text: bytes):
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(text)))
    given(b"pipeline   p\nshare a,b\n")
    rc, out, err = rpeg(capsys, "fmt", "--check", "-")
    assert (rc, out) == (1, "") and "<stdin>: not in canonical form" in err
    given(b"pipeline p\nshare a, b\n")
    assert rpeg(capsys, "fmt", "--check", "-")[:2] == (0, "")
    given(b"pipeline p\n")
    assert rpeg(capsys, "fmt", "-w", "-")[0] == 2


def test_fmt_syntax_error(capsys, work):
    bad = work / "bad.rpeg"
    bad.write_text("pipeline\n")
    rc, _, err = rpeg(capsys, "fmt", bad)
    assert rc == 1 and f"{bad}:1:9: error: expected a name after 'pipeline'" in err


def test_graph_text_and_pictures(capsys, work, tmp_path):
    rc, out, _ = rpeg(capsys, "graph", work / "ppo_llama8b.rpeg")
    assert rc == 0 and out.startswith("graph ppo_llama8b\n") and "version actor" in out
    rc, out, _ = rpeg(capsys, "graph", work / "ppo_llama8b.rpeg", "--steps", "2", "--share")
    assert rc == 0 and out.startswith("unrolled ppo_llama8b steps 2")
    rc, _, err = rpeg(capsys, "graph", work / "ppo_llama8b.rpeg", "--steps", "3",
                      "-o", tmp_path / "g.dot")
    assert rc == 0 and "wrote" in err
    assert (tmp_path / "g.dot").read_text().count("cluster_step") == 3
    if shutil.which("dot"):
        rc, _, _ = rpeg(capsys, "graph", work / "ppo_llama8b.rpeg", "--steps", "3",
                        "-o", tmp_path / "g.svg")
        assert rc == 0 and (tmp_path / "g.svg").read_text().lstrip().startswith("<?xml")
    rc, _, err = rpeg(capsys, "graph", work / "ppo_llama8b.rpeg", "-o", tmp_path / "g.txt")
    assert rc == 2 and "must end in .dot, .svg, .png, .pdf, not '.txt'" in err
    rc, _, err = rpeg(capsys, "graph", work / "ppo_llama8b.rpeg", "--chunks", "nope=2",
                      "--steps", "1")
    assert rc == 1 and "unknown stage 'nope'" in err


def test_diff_unchanged_is_silent(capsys, work):
    rc, out, err = rpeg(capsys, "diff", work / "ppo_llama8b.rpeg", work / "ppo_llama8b.rpeg")
    assert (rc, out) == (0, "")


def test_diff_changed_exits_1(capsys, work):
    rc, out, _ = rpeg(capsys, "diff", work / "ppo_llama8b.rpeg", work / "ppo_async.rpeg")
    assert rc == 1
    assert "staleness\n  ~ rollout: 1 -> 2" in out
    assert "values: 0 -> 1" in out


def test_diff_json(capsys, work):
    rc, out, _ = rpeg(capsys, "diff", "--json", work / "ppo_llama8b.rpeg", work / "ppo_async.rpeg")
    data = json.loads(out)
    assert rc == 1 and data["changed"] is True
    assert {c["name"] for c in data["changes"]} == {"rollout", "values"}


def test_diff_renames_are_not_changes(capsys, work):
    text = (work / "ppo_llama8b.rpeg").read_text()
    renamed = (text.replace("stage values", "stage critic_values")
               .replace("-> values", "-> v").replace("gae(scores, values,", "gae(scores, v,"))
    assert renamed != text
    (work / "renamed.rpeg").write_text(renamed)
    rc, out, _ = rpeg(capsys, "diff", work / "ppo_llama8b.rpeg", work / "renamed.rpeg")
    assert (rc, out) == (0, "")
    rc, out, _ = rpeg(capsys, "diff", "--json", work / "ppo_llama8b.rpeg", work / "renamed.rpeg")
    renames = {(r["what"], r["before"], r["after"]) for r in json.loads(out)["renames"]}
    assert renames == {("stage", "values", "critic_values"), ("data", "values", "v")}


def test_diff_of_two_clusters(capsys):
    rc, out, _ = rpeg(capsys, "diff", P / "clusters" / "gh200_64.rpeg",
                      P / "clusters" / "gh200_256.rpeg")
    assert rc == 1 and "~ num_gpus: 64 -> 256" in out
    rc, _, err = rpeg(capsys, "diff", P / "clusters" / "gh200_64.rpeg", P / "ppo_llama8b.rpeg")
    assert rc == 2 and "A describes a cluster and B a pipeline" in err


def test_diff_kinds_must_match(capsys, work, tmp_path):
    rc, _, err = rpeg(capsys, "diff", work / "ppo_llama8b.rpeg", tmp_path)
    assert rc == 2 and "A is a spec and B is a run" in err
    rc, _, err = rpeg(capsys, "diff", work / "ppo_llama8b.rpeg", work / "missing.rpeg")
    assert rc == 1 and "no such file" in err


@pytest.fixture
def tiny(tmp_path) -> tuple[Path, Path]:
    """tiny_ppo and a copy with twice the prompts, next to their rewards and data."""
    for name in ("tiny_ppo.rpeg", "rewards.py"):
        shutil.copy(P / name, tmp_path / name)
    shutil.copytree(P / "data", tmp_path / "data")
    text = (tmp_path / "tiny_ppo.rpeg").read_text()
    assert "prompts    = 32" in text
    (tmp_path / "tiny_big.rpeg").write_text(text.replace("prompts    = 32", "prompts    = 64"))
    return tmp_path / "tiny_ppo.rpeg", tmp_path / "tiny_big.rpeg"


def test_diff_with_cluster_reports_predicted_deltas(capsys, tiny):
    a, b = tiny
    cluster = P / "clusters" / "local_cpu.rpeg"
    rc, out, _ = rpeg(capsys, "diff", a, b, "--cluster", cluster, "--budget", "100")
    assert rc == 1
    assert "~ prompts: 32 -> 64" in out
    assert "predicted on local_cpu" in out and "step time:" in out and "peak memory" in out
    rc, out, _ = rpeg(capsys, "diff", a, b, "--cluster", cluster, "--budget", "100", "--json")
    predicted = json.loads(out)["predicted"]
    assert predicted["a"]["step_time_s"] > 0 and predicted["b"]["step_time_s"] > 0
    rc, out, _ = rpeg(capsys, "diff", a, a, "--cluster", cluster)
    assert (rc, out) == (0, "")                     # unchanged: nothing compiled, nothing said


def test_diff_of_two_plans(capsys, tiny, tmp_path):
    a, b = tiny
    cluster = P / "clusters" / "local_cpu.rpeg"
    # a baseline and the search: the plans differ whatever the profile makes the search pick
    for spec, out, strategy in ((a, "a.json", "colocated"), (b, "b.json", "search")):
        rc, _, err = rpeg(capsys, "compile", spec, "-c", cluster, "-o", tmp_path / out,
                          "--no-gantt", "--budget", "100", "--strategy", strategy)
        assert rc == 0, err
    rc, out, _ = rpeg(capsys, "diff", tmp_path / "a.json", tmp_path / "b.json")
    assert rc == 1 and out.startswith("plans differ")
    rc, out, _ = rpeg(capsys, "diff", tmp_path / "a.json", tmp_path / "a.json")
    assert (rc, out) == (0, "")


def test_check_imports_no_torch():
    """The compile path imports no torch: `python -X importtime -m rpeg check` shows none."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "rpeg", "check",
                           str(P / "ppo_llama8b.rpeg")], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    assert "rpeg.spec" in imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}
    assert "transformers" not in imported
