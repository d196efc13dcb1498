"""Damaged and hostile run directories: ``rpeg verify``, ``rpeg show`` and ``rpeg run
--resume`` refuse each with exit 1 and a message naming the file and the field, never
hang (pipes are refused, not waited on), never write outside the run directory
(symlinks are refused, not followed), and a refused resume leaves the directory as it
was. One real run (a small PPO pipeline, 4 steps, checkpoints at 2 and 4) is made once
and copied for each case."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.runtime.rundir import checkpoints as ckio
from tests.reliability.hostile import RUN_DIR_DAMAGE
from tests.reliability.test_hostile_input import no_hang

STEPS = 4


def _tree(path: Path) -> dict[str, str]:
    """Every file under ``path`` (symlinks not followed) and a hash of its bytes."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.name == "run.lock":                 # holds the pid of whoever locked it last
            continue
        if p.is_symlink():
            out[str(p.relative_to(path))] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(path))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _refused(argv: list[str], capsys, *names: str, rc: int = 1) -> str:
    capsys.readouterr()
    with no_hang():
        got = main(argv)
    out, err = capsys.readouterr()
    assert got == rc, (argv, out, err)
    assert "Traceback" not in err and "internal error" not in err, err
    for name in names:
        assert name in err + out, (argv, name, err, out)
    for line in err.splitlines():                 # a refusal names its file once
        paths = re.findall(r"(?<![:/])/[^\s':,()]+", line)
        assert len(paths) == len(set(paths)), line
    return err + out


def _every(run: Path) -> list[list[str]]:
    return [["verify", str(run)], ["show", str(run)],
            ["run", "--resume", str(run), "--no-progress"]]


def _remanifest(ck: Path) -> None:
    """Rewrite a checkpoint's manifest for its files as they are now (a deliberate edit
    that the checksums no longer catch)."""
    files = {k: v for k, v in ckio._manifest(ck).items() if k != ckio.MARKER}
    (ck / ckio.MARKER).write_text(json.dumps({"format": ckio.FORMAT, "step": int(ck.name[5:]),
                                              "files": files}))


# --- the catalogue: pipes, symlinks, run.json fields, metrics ---------------------------------

@pytest.mark.parametrize("case", sorted(RUN_DIR_DAMAGE))
def test_a_damaged_run_directory_is_refused_and_nothing_outside_touched(run, tmp_path, capsys,
                                                                         case):
    damage, says, commands = RUN_DIR_DAMAGE[case]
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    damage(run, outside)
    before, before_outside = _tree(run), _tree(outside)
    argv = {"verify": ["verify", str(run)], "show": ["show", str(run)],
            "resume": ["run", "--resume", str(run), "--no-progress"]}
    for command in commands:
        _refused(argv[command], capsys, says)
        assert _tree(outside) == before_outside, f"{command} touched a file outside the run"
        assert _tree(run) == before, f"a refused {command} changed the run directory"


def test_a_pipe_is_named_as_the_file_it_stands_for(run, capsys):
    (run / "trace.json").unlink()
    os.mkfifo(run / "trace.json")
    _refused(["verify", str(run)], capsys, str(run / "trace.json"), "named pipe")


def test_resume_refuses_fewer_steps_than_its_checkpoint_has_done(run, capsys):
    before = _tree(run)
    _refused(["run", "--resume", str(run), "--no-progress", "--steps", "2"], capsys,
             "--steps must be at least the 4 steps")
    assert _tree(run) == before


def test_steps_beyond_the_specs_range_are_a_usage_error(run, capsys):
    _refused(["run", "--resume", str(run), "--no-progress", "--steps", "99999999999"],
             capsys, "10000000", rc=2)


# --- metrics.jsonl --------------------------------------------------------------------------

def test_a_metrics_line_cut_short_is_shown_and_reported_by_verify(run, capsys):
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text(text[:-20])          # the last row cut mid-write
    out = _refused(["show", str(run), "--no-verify"], capsys, rc=0)
    assert "metrics.jsonl line 4 is not JSON (cut short)" in out
    _refused(["verify", str(run)], capsys, "metrics.jsonl line 4")
    before = _tree(run)
    _refused(["run", "--resume", str(run), "--no-progress"], capsys, "metrics.jsonl", "line 4")
    assert _tree(run) == before, "a refused resume changed the run directory"


def test_a_row_cut_short_after_the_checkpoint_is_dropped_on_resume(run, capsys):
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "rew')                          # a kill during step 4's write
    _refused(["run", "--resume", str(run), "--no-progress"], capsys, "nothing to resume", rc=0)
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] \
        == list(range(STEPS))


@pytest.mark.parametrize("edit, says", [
        (lambda rows: rows[:2] + rows[3:], "step 3 is recorded out of order"),
    (lambda rows: rows[:2], "records 2"),
], ids=["missing-row", "short"])
def test_verify_checks_each_step_once_in_the_metrics(run, capsys, edit, says):
    rows = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join(edit(rows)))
    _refused(["verify", str(run)], capsys, says)
    before = _tree(run)
    _refused(["run", "--resume", str(run), "--no-progress"], capsys, "metrics.jsonl")
    assert _tree(run) == before


# --- the trace ------------------------------------------------------------------------------

def test_an_event_relabelled_with_another_ops_id_is_caught(run, capsys):
    trace = json.loads((run / "trace.json").read_text())
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e["tid"] == 0]
    a, b = next((x, y) for x in ops for y in ops
                if x["args"]["step"] == y["args"]["step"] and x["name"] != y["name"])
    a["args"]["id"], b["args"]["id"] = b["args"]["id"], a["args"]["id"]
    (run / "trace.json").write_text(json.dumps(trace))
    _refused(["verify", str(run)], capsys, "identity", a["args"]["id"])


def test_a_plan_edited_in_the_run_directory_is_checked_against_its_pipeline(run, capsys):
    plan = json.loads((run / "plan.json").read_text())
    plan["placements"] = [p for p in plan["placements"] if p["stage"] != "scores"]
    (run / "plan.json").write_text(json.dumps(plan))
    for argv in (["verify", str(run)], ["run", "--resume", str(run), "--no-progress"]):
        _refused(argv, capsys, "plan.json", "leave out 'scores'")


# --- checkpoints ----------------------------------------------------------------------------

@pytest.mark.parametrize("damage, says", [
    (lambda ck: (ck / ckio.MARKER).write_text("[]"), "manifest must be an object"),
    (lambda ck: (ck / ckio.MARKER).write_text(json.dumps(
        {"format": 1, "files": {"state.json": "big"}})), "entry 'state.json'"),
    (lambda ck: _restate(ck, step=2), "must be for step 4"),
    (lambda ck: _restate(ck, pending="x"), "'pending'"),
    (lambda ck: _rewrite(ck, next(ck.glob("*/*.safetensors")), b"not a tensor" * 10),
     "must be a safetensors file"),
], ids=["manifest-list", "manifest-entry", "state-earlier-step", "state-field",
        "not-safetensors"])
def test_a_damaged_checkpoint_is_named_and_passed_over(run, damage, says):
    ck = run / "checkpoints" / "step-000004"
    damage(ck)
    with pytest.raises(Exception) as info:
        ckio.validate(ck)
    assert says in str(info.value) and type(info.value).__name__ == "RuntimeFailure"
    skipped: list[str] = []
    assert ckio.latest(run, skipped=skipped).step == 2
    assert says in skipped[0]


def _restate(ck: Path, **fields) -> None:
    state = json.loads((ck / ckio.STATE).read_text())
    state.update(fields)
    (ck / ckio.STATE).write_text(json.dumps(state))
    _remanifest(ck)


def _rewrite(ck: Path, path: Path, data: bytes) -> None:
    path.write_bytes(data)
    _remanifest(ck)


def test_carried_data_naming_a_missing_module_refuses_the_resume(run, capsys):
    shutil.rmtree(run / "checkpoints" / "step-000004")      # resume from step 2's, which carries
    ck = run / "checkpoints" / "step-000002"
    doc = (ck / "carry.json").read_text()
    assert "backends.api:" in doc
    (ck / "carry.json").write_text(doc.replace("backends.api:", "backends.api_gone:"))
    _remanifest(ck)
    before = _tree(run)
    _refused(["run", "--resume", str(run), "--no-progress"], capsys, "carry.json",
             "backends.api_gone")
    assert _tree(run) == before


# --- a new run into a directory that holds one -------------------------------------------------

def test_a_run_into_a_directory_holding_a_run_is_refused(run, capsys):
    before = _tree(run)
    spec = Path(json.loads((run / "run.json").read_text())["spec"])
    _refused(["run", str(spec), "--no-progress", "--strategy", "runtime-split", "--run-dir",
              str(run)], capsys, str(run), "holds a run", "--resume")
    assert _tree(run) == before


def test_a_locked_run_directory_is_refused_naming_the_holder(run, capsys):
    from rpeg.runtime.rundir.files import RunLock
    with RunLock.take(run):
        _refused(["run", "--resume", str(run), "--no-progress"], capsys,
                 f"pid {os.getpid()}")
