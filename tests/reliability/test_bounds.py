"""Every input is bounded: ``--steps`` of every command, the output of ``rpeg verify`` and
``rpeg check`` (a summary, the first N, a count), a spec of 4 MB checked in time linear in
its size (figures: benchmarks/reliability.py), and symlink loops and ``extend`` cycles said
at the ``extend`` that reaches them, as FILE:LINE:COL."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from rpeg.cli import main
from rpeg.spec.parser import MAX_SOURCE_BYTES
from tests.reliability.test_hostile_input import no_hang
from tests.reliability.test_run_dirs import _refused

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ROOT / "pipelines"


def generated_spec(folder: Path, stages: int, line: int = 100) -> Path:
    """tiny_ppo with ``stages`` more forward stages, each a line of ``line`` bytes (whose
    outputs nothing reads: each is a warning)."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(PIPELINES / "rewards.py", folder / "rewards.py")
    if not (folder / "data").exists():
        (folder / "data").symlink_to(PIPELINES / "data")
    head = (PIPELINES / "tiny_ppo.rpeg").read_text()
    out = folder / f"generated_{stages}.rpeg"
    with out.open("w") as f:
        f.write(head)
        for i in range(stages):
            text = f"stage extra_{i:06d} = forward(ref, responses) -> lp_{i:06d}"
            f.write(text + "  # " + "g" * max(line - len(text) - 5, 0) + "\n")
    return out


def test_simulate_steps_are_bounded(capsys):
    _refused(["simulate", "plan.json", "--steps", "100000000"], capsys, "--steps", rc=2)


def test_verify_lists_the_first_violations_and_counts_the_rest(run, capsys):
    trace = json.loads((run / "trace.json").read_text())
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("ph") != "X"]
    (run / "trace.json").write_text(json.dumps(trace))
    text = _refused(["verify", str(run)], capsys, "never ran")
    lines = text.strip().splitlines()
    assert len(lines) == 22, text                # the summary, 20 violations, the count
    assert "missing" in lines[0] and lines[-1].startswith("  ... and ")
    assert main(["verify", str(run), "--violations", "3"]) == 1
    assert len(capsys.readouterr().out.strip().splitlines()) == 5


def test_a_4_mb_spec_of_40000_stages_is_checked_with_bounded_output(tmp_path, capsys):
    spec = generated_spec(tmp_path, 40_000)
    assert 3_900_000 < spec.stat().st_size <= MAX_SOURCE_BYTES
    with no_hang(300):
        assert main(["check", str(spec)]) == 0
    out, err = capsys.readouterr()
    assert "40007 stages" in out
    assert err.count("warning:") == 20 and "and 39,980 more warnings" in err


def test_an_extend_through_a_symlink_loop_is_said_at_the_extend(tmp_path, capsys):
    (tmp_path / "inc").mkdir()
    os.symlink("loop.rpeg", tmp_path / "inc" / "loop.rpeg")
    spec = tmp_path / "v.rpeg"
    spec.write_text('pipeline v\nextend "inc/loop.rpeg"\n')
    text = _refused(["check", str(spec)], capsys, f"{spec}:2:8: error: extend 'inc/loop.rpeg'",
                    "symbolic links")
    assert "^" in text                               # the line, with a caret under the path


def test_an_extend_of_a_spec_over_the_size_limit_is_said_at_the_extend(tmp_path, capsys):
    (tmp_path / "big.rpeg").write_bytes(b"# " + b"x" * MAX_SOURCE_BYTES + b"\n")
    spec = tmp_path / "v.rpeg"
    spec.write_text('pipeline v\nextend "big.rpeg"\n')
    _refused(["check", str(spec)], capsys, f"{spec}:2:8: error: extend 'big.rpeg'",
             "a .rpeg file may be at most")
    _refused(["check", str(tmp_path / "big.rpeg")], capsys,
             f"{tmp_path / 'big.rpeg'}: error:", "may be at most")


def test_an_extend_cycle_is_said_at_the_extend_that_closes_it(tmp_path, capsys):
    (tmp_path / "a.rpeg").write_text('pipeline a\nextend "b.rpeg"\n')
    (tmp_path / "b.rpeg").write_text('pipeline b\nextend "a.rpeg"\n')
    _refused(["check", str(tmp_path / "a.rpeg")], capsys,
             f"{tmp_path / 'b.rpeg'}:2:8: error: extend cycle: a.rpeg -> b.rpeg -> a.rpeg")
