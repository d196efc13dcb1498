"""The exit status contract, on every command: 0 success, 1 invalid input or a failed
check (with a message, never a traceback), 2 a usage error; nothing is "a bug in rpeg"
(exit 3) for a path or a flag a user gives."""

from __future__ import annotations

from pathlib import Path

import pytest

import rpeg
from rpeg.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "pipelines" / "tiny_ppo.rpeg")
GRPO = str(ROOT / "pipelines" / "tiny_grpo.rpeg")
LOCAL = str(ROOT / "pipelines" / "clusters" / "local_cpu.rpeg")
COMPILE = ["compile", TINY, "--cluster", LOCAL, "--strategy", "colocated"]
BUDGET = "Invalid value for --budget: must be a count of proposals a walk from 1 to 100,000"


def _run(capsys, args) -> tuple[int, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "internal error" not in err, err
    return rc, out + err


@pytest.mark.parametrize("where, words", [
    ("/nonexistent/plan.json", "-o must name a file in an existing directory, not "
                               "'/nonexistent/plan.json' ('/nonexistent' does not exist)"),
    (".", "-o must name a file to write, not the directory '.'"),
])
def test_compile_to_a_place_it_cannot_write_is_an_input_error(capsys, where, words):
    rc, text = _run(capsys, [*COMPILE, "-o", where])
    assert rc == 1 and words in text


def test_every_output_option_is_checked_before_the_work(capsys, tmp_path):
    plan = tmp_path / "c.json"
    assert _run(capsys, [*COMPILE, "-o", plan, "--no-gantt"])[0] == 0
    missing = tmp_path / "no" / "such" / "dir"
    cases = [
        (["simulate", plan, "-o", missing / "g.png"], 1, "does not exist"),
        (["simulate", plan, "-o", tmp_path], 1, "not the directory"),
        (["simulate", plan, "-o", tmp_path / "g.txt"], 2, "must end in .png, .svg, .pdf"),
        (["graph", TINY, "-o", missing / "g.dot"], 1, "does not exist"),
        (["graph", TINY, "-o", tmp_path / "g.txt"], 2, "must end in .dot, .svg, .png, .pdf"),
        (["calibrate", "-o", missing / "p.rpeg"], 1, "--out must name a file in an existing"),
        (["calibrate", "--cluster", tmp_path], 1, "--cluster must name a file to write"),
        (["calibrate", "--control-only", "-o", tmp_path / "p.rpeg"], 1,
         "--control-only updates an existing profile"),
        (["compile", plan, "-o", missing / "again.json"], 1, "does not exist"),
    ]
    for args, code, words in cases:
        rc, text = _run(capsys, args)
        assert (rc, words in text) == (code, True), (args, text)


def test_compile_never_writes_over_a_file_it_reads(capsys, tmp_path, monkeypatch):
    """``-o`` naming the spec, the base it extends, its dataset, its reward module, the
    cluster or the cluster's profile file is refused before the search, the file left as
    it was."""
    import shutil
    shutil.copytree(ROOT / "pipelines", tmp_path / "p")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p" / "child.rpeg").write_text('extend "tiny_ppo.rpeg"\npipeline child\n')
    (tmp_path / "p" / "clusters" / "mine.rpeg").write_text(
        'cluster mine {\n    gpu = "profiles/local_cpu.rpeg"\n    gpus_per_node = 2\n'
        '    link gpu { bandwidth = 5 GB/s; latency = 50 us }\n}\n')
    spec, cluster = "p/child.rpeg", "p/clusters/mine.rpeg"
    for target in (spec, "p/tiny_ppo.rpeg", "p/data/toy.jsonl", "p/rewards.py", cluster,
                   "p/clusters/profiles/local_cpu.rpeg"):
        before = (tmp_path / target).read_bytes()
        rc, text = _run(capsys, ["compile", spec, "--cluster", cluster, "-o", target,
                                 "--no-gantt"])
        assert rc == 1 and f"-o must not name '{target}', a file this command reads" in text
        assert (tmp_path / target).read_bytes() == before
    rc, text = _run(capsys, ["compile", spec, "--cluster", cluster, "-o", "p/child.json"])
    assert rc == 0 and (tmp_path / "p" / "child.json").is_file()


@pytest.mark.parametrize("args, words", [
    (["run"], "a pipeline (.rpeg) or a plan (.json) to run, or --resume RUN_DIR, is needed"),
    (["run", TINY, "--devices", "2"], "re-plans a resumed run; it goes with --resume"),
    (["run", TINY, "--spec", TINY], "names the pipeline of a plan file"),
    (["run", TINY, "--strategy", "manual"], "'manual' is not one of"),
    (["run", TINY, "--seed", "-1"], "greater than or equal to 0"),
    (["run", TINY, "--cluster", LOCAL, "--profile", "shipped"], "--profile"),
    (["run", "--resume", "somewhere", TINY], "give no FILE with it"),
    (["run", "--resume", "somewhere", "workload.steps=5"], "an override (workload.steps=5)"),
    (["run", "--resume", "somewhere", "--staleness", "0"], "cannot go with --resume"),
    # the run directory was resumed in place, the other never written
    (["run", "--resume", "somewhere", "--run-dir", "other"], "goes on in its own directory"),
    (["run", "--resume", "somewhere", "--seed", "5"], "a resumed run keeps its plan"),
    (["graph", TINY, "--chunks", "rollout"], "must be STAGE=N"),
    # the wrong kind of file is a usage error, whether or not its folder exists
    (["graph", TINY, "-o", "no/such/folder/g.txt"], "-o"),
    (["graph", TINY, "--chunks", "rollout=2"], "needs --steps"),
    (["compile", TINY, "--cluster", LOCAL, "--strategy", "manual"], "'manual' is not one of"),
    (["compile", TINY, "--cluster", LOCAL, "--budget", "0"], f"{BUDGET}, not 0; the default"),
    (["compile", TINY, "--cluster", LOCAL, "--budget", "-1"], f"{BUDGET}, not -1; the default"),
    (["compile", TINY, "--cluster", LOCAL, "--iterations", "0"], f"{BUDGET}, not 0; the default"),
    (["compile", TINY, "--cluster", LOCAL, "--budget", "100001"], f"{BUDGET}, not 100,001"),
    (["compile", TINY, "--cluster", LOCAL, "--budget", "10" * 20], f"{BUDGET}, not 1,010,"),
    (["diff", TINY, GRPO, "--cluster", LOCAL, "--budget", "0"], f"{BUDGET}, not 0; the default"),
    (["compile", TINY, "--cluster", LOCAL, "--seed", "-1"], "greater than or equal to 0"),
    (["diff", TINY, GRPO, "--cluster", LOCAL, "--seed", "-3"], "greater than or equal to 0"),
    (["diff", TINY, GRPO, "--budget", "10"], "it goes with --cluster"),
    (["diff", TINY, GRPO, "--force"], "two specs have no plan to check"),
    (["diff", LOCAL, LOCAL, "--cluster", "/no/such.rpeg"], "two clusters are compared as"),
    (["show", str(ROOT / "pipelines"), "--force"], "a run directory is checked against"),
    (["calibrate", "--dispatch-only"], "give it with --out"),
    # said before minutes of measuring, not after; options that did nothing
    (["calibrate", "--name", "bad name"], "as the language writes a name"),
    (["calibrate", "-o", "p.json"], "writes a .rpeg file"),
    (["calibrate", "--calls", "3"], "counts the calls of the tools --tools measures"),
    (["calibrate", "--tools", TINY, "--repeats", "7"], "--tools measures a pipeline's"),
    (["compile", TINY, "--cluster", LOCAL, "--seed", str(2**64)],
     "less than or equal to 9223372036854775807"),
    (["calibrate", "--control-only"], "give it with --out"),
])
def test_usage_errors_exit_2(capsys, args, words):
    rc, text = _run(capsys, args)
    assert rc == 2 and words in text, text


def test_strategy_manual_is_not_offered():
    from typer.testing import CliRunner

    from rpeg.cli import _register_all, app
    _register_all()
    for cmd in ("compile", "run"):
        text = CliRunner().invoke(app, [cmd, "--help"]).output
        assert "colocated" in text and "manual" not in text, cmd


def test_version(capsys):
    rc, text = _run(capsys, ["--version"])
    assert rc == 0 and text.strip() == f"rpeg {rpeg.__version__}"


def test_a_missing_command_module_is_an_error_not_a_silent_gap(capsys, monkeypatch):
    import rpeg.cli
    monkeypatch.setattr(rpeg.cli, "COMMANDS", ("check", "nope"))
    rc, text = _run(capsys, ["--help"])
    assert rc == 1
    assert "'nope' command must be installed, not missing (no module rpeg.cli.nope)" in text


@pytest.mark.parametrize("args, words", [
    (["graph", TINY, "-n", "2", "--chunks", "rollout=999999999"], "at most 32 chunks"),
    (["graph", TINY, "-n", "2", "--chunks", "adv=3"], "must name a generate stage"),
])
def test_chunks_the_spec_cannot_have_exit_1(capsys, args, words):
    """A step's responses split into at most that many chunks (a billion hung the unroll),
    of a generate stage only."""
    rc, text = _run(capsys, args)
    assert rc == 1 and words in text, text


def test_a_plan_compiled_again_takes_no_search_option(capsys, tmp_path):
    """rpeg compile PLAN.json searches with the options it records: another one given did
    nothing (exit 0, "strategy search, seed 0"); -o over the plan is refused as well."""
    plan = tmp_path / "p.json"
    assert main(["compile", TINY, "--cluster", LOCAL, "-o", str(plan), "--no-gantt",
                 "--budget", "50"]) == 0
    capsys.readouterr()
    for extra in (["--seed", "5"], ["--strategy", "colocated"], ["--patience", "3"],
                  ["--memory-reserve", "50%"], ["--no-carry"]):
        rc, text = _run(capsys, ["compile", str(plan), *extra])
        assert rc == 2 and "compiled again with the options it records" in text, (extra, text)
    rc, text = _run(capsys, ["compile", str(plan), "-o", str(plan)])
    assert rc == 1 and "a file this command reads" in text


def test_check_quiet_prints_errors_only(capsys):
    """-q: "Print errors only" (it printed ppo_llama8b's warning)."""
    spec = str(ROOT / "pipelines" / "ppo_llama8b.rpeg")
    assert main(["check", spec]) == 0
    assert "warning" in capsys.readouterr().err
    assert main(["check", "-q", spec]) == 0
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
