"""Checkpoints and run directories: atomic writes, damage detected, hostile contents refused;
the cut that makes a checkpoint complete. No Dask, no torch: fast."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from rpeg.errors import RuntimeFailure
from rpeg.runtime.core.cuts import carried, closure, core_view
from rpeg.runtime.dask.resume import resume_run
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan
from rpeg.runtime.rundir import checkpoints as ckio
from rpeg.spec import load

ROOT = Path(__file__).resolve().parents[2]


def _fake_checkpoint(run_dir: Path, step: int) -> ckio.Checkpoint:
    from safetensors.numpy import save_file
    tmp = ckio.begin(run_dir, step)
    (tmp / "actor@0").mkdir()
    save_file({"w": np.arange(250, dtype=np.float32)}, str(tmp / "actor@0" / "model.safetensors"))
    ckio.save_tree(tmp, "carry", {"rollout/s2/c0": {"logprobs": (np.arange(3.0),)}})
    return ckio.commit(run_dir, tmp, step, {"replicas": {"actor@0": step}})


def test_commit_then_latest_round_trip(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    ck = _fake_checkpoint(tmp_path, 4)
    got = ckio.latest(tmp_path)
    assert got.step == 4 and got.path == ck.path
    assert got.state["replicas"] == {"actor@0": 4}
    carry = ckio.load_tree(got.path, "carry")
    assert np.array_equal(carry["rollout/s2/c0"]["logprobs"][0], np.arange(3.0))
    assert ckio.latest(tmp_path, before=4).step == 2


def test_incomplete_checkpoints_never_look_complete(tmp_path):
    _fake_checkpoint(tmp_path, 2)
    partial = ckio.begin(tmp_path, 4)                   # crash before the rename
    (partial / "state.json").write_text("{}")
    renamed = ckio.folder(tmp_path) / ckio.step_name(6)  # crash after the rename, before the marker
    renamed.mkdir()
    (renamed / "state.json").write_text(json.dumps({"step": 6}))
    assert ckio.latest(tmp_path).step == 2
    ckio.prune(tmp_path, keep=5)
    assert not partial.exists()


@pytest.mark.parametrize("damage, says", [
    (lambda ck: (ck.path / "actor@0" / "model.safetensors").write_bytes(b"x" * 10), "truncated"),
    (lambda ck: (ck.path / "actor@0" / "model.safetensors").write_bytes(
        b"y" * (ck.path / "actor@0" / "model.safetensors").stat().st_size), "checksum"),
    (lambda ck: (ck.path / "actor@0" / "model.safetensors").unlink(), "missing"),
    (lambda ck: (ck.path / ckio.MARKER).write_text("{not json"), "must be JSON"),
    (lambda ck: (ck.path / ckio.MARKER).write_text(json.dumps({"format": 99, "files": {}})),
     "format"),
    (lambda ck: (ck.path / ckio.MARKER).write_text(json.dumps(
        {"format": 1, "files": {"../../../etc/passwd": {"size": 1, "sha256": ""}}})), "outside"),
], ids=["truncated", "flipped", "missing", "marker-not-json", "wrong-version", "path-escape"])
def test_damaged_checkpoint_is_refused_and_skipped(tmp_path, damage, says):
    _fake_checkpoint(tmp_path, 2)
    ck = _fake_checkpoint(tmp_path, 4)
    damage(ck)
    with pytest.raises(RuntimeFailure, match=says) as info:
        ckio.validate(ck.path)
    assert info.value.span is not None and str(ck.path) in info.value.span.path
    skipped: list[str] = []
    assert ckio.latest(tmp_path, skipped=skipped).step == 2       # falls back to the older one
    assert len(skipped) == 1 and says.split()[0] in skipped[0]


def test_carried_data_may_not_name_arbitrary_classes(tmp_path):
    ck = _fake_checkpoint(tmp_path, 2)
    doc = {"__dict__": {"x": {"__attrs__": "os:system", "fields": {"command": "touch pwned"}}}}
    (ck.path / "carry.json").write_text(json.dumps(doc))
    with pytest.raises(RuntimeFailure, match="only rpeg's own values"):
        ckio.load_tree(ck.path, "carry")
    assert not (Path.cwd() / "pwned").exists()


_WRITER = textwrap.dedent("""
    import os, sys
    from pathlib import Path
    from rpeg.runtime.rundir import checkpoints as ckio
    run = Path(sys.argv[1])
    step = 0
    while True:
        step += 1
        tmp = ckio.begin(run, step)
        for n in range(4):
            (tmp / f"part{n}.bin").write_bytes(os.urandom(1 << 20))
        ckio.commit(run, tmp, step, {"n": step})
        ckio.prune(run, keep=3)
""")


def test_killing_the_writer_mid_checkpoint_leaves_nothing_that_looks_complete(tmp_path):
    """SIGKILL a process writing 4 MB checkpoints in a loop at several moments: every folder
    with a marker validates, and latest() is always a whole checkpoint."""
    script = tmp_path / "writer.py"
    script.write_text(_WRITER)
    for delay in (0.3, 0.55, 0.8):
        run = tmp_path / f"run{delay}"
        proc = subprocess.Popen([sys.executable, str(script), str(run)], cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        deadline = time.monotonic() + 120               # a loaded machine imports slowly
        while ckio.latest(run) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay)                               # then kill somewhere in later writes
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # folders with a '.' in the name are writes or deletions in progress: never loaded
        marked = [p for p in ckio.folder(run).glob("step-*")
                  if (p / ckio.MARKER).exists() and "." not in p.name]
        for p in marked:
            ckio.validate(p)
        ck = ckio.latest(run)
        assert ck is not None and ck.state["n"] == ck.step


def test_resume_refuses_what_is_not_a_run_directory(tmp_path):
    with pytest.raises(RuntimeFailure, match="must exist"):
        resume_run(tmp_path / "nope")
    with pytest.raises(RuntimeFailure, match="run.json, pipeline.json, plan.json"):
        resume_run(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps({"steps": 1}))
    (tmp_path / "pipeline.json").write_bytes(b"\x80\x04garbage")       # a pickle's opening
    (tmp_path / "plan.json").write_text("[]")
    with pytest.raises(RuntimeFailure, match="pipeline file"):
        resume_run(tmp_path)
    (tmp_path / "pipeline.json").write_text(json.dumps(
        {"__type__": "os:system", "command": "touch pwned"}))
    with pytest.raises(RuntimeFailure):
        resume_run(tmp_path)
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


# --- cuts ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ppo():
    return load(ROOT / "pipelines" / "tiny_ppo.rpeg")


def test_synchronous_cut_is_the_steps_before_it(ppo):
    table = {c.id: c for c in build_calls(ppo, split_plan(ppo, 2, staleness=0), 4)}
    inside = closure(table, 2)
    assert inside == {i for i, c in table.items() if c.step < 2}
    assert carried(table, inside) == set()


def test_async_cut_pulls_in_the_generation_that_reads_the_old_version(ppo):
    """With staleness 1, training of step 1 overwrites version 1 only after generation of
    step 2 read it: that generation belongs before the cut, and its output is carried."""
    table = {c.id: c for c in build_calls(ppo, split_plan(ppo, 2, staleness=1), 4)}
    inside = closure(table, 2)
    extra = {i for i in inside if table[i].step >= 2}
    assert extra and all(table[i].op == "rollout" for i in extra)
    assert carried(table, inside) == extra
    view = {c.id: c for c in core_view(table, inside - closure(table, 1), 2)}
    assert all(view[i].step == 1 for i in extra)          # counted in the last step of the cut
    assert all(d in view for c in view.values() for d in c.all_deps)


def test_the_writers_hashes_are_committed_without_reading_their_files(tmp_path, monkeypatch):
    """The manifest takes each worker-written file's (size, sha256) from its writer; the
    driver hashes only the files nobody hashed (its own state and carry); the manifest is
    as before, so resume's validation (which hashes every file) accepts it."""
    from safetensors.numpy import save_file
    tmp = ckio.begin(tmp_path, 3)
    (tmp / "actor@0").mkdir()
    shard = tmp / "actor@0" / "model.safetensors"
    save_file({"w": np.arange(250, dtype=np.float32)}, str(shard))
    ckio._WRITTEN.clear()
    ckio.hash_written([shard])
    hashed = {"actor@0/model.safetensors": ckio._WRITTEN.pop(str(shard))}
    read = []
    real = ckio._sha256
    monkeypatch.setattr(ckio, "_sha256", lambda f: read.append(f.name) or real(f))
    ck = ckio.commit(tmp_path, tmp, 3, {"replicas": {"actor@0": 3}}, hashed=hashed)
    assert read == ["state.json"]
    files = json.loads((ck.path / ckio.MARKER).read_text())["files"]
    assert files["actor@0/model.safetensors"] == {"size": hashed[
        "actor@0/model.safetensors"][0], "sha256": real(ck.path / "actor@0/model.safetensors")}
    assert ckio.validate(ck.path).step == 3


def test_a_file_unlike_its_writers_hash_is_refused_at_commit(tmp_path):
    """A file whose size is not what its writer hashed, or which is gone, fails the commit,
    naming the file; no checkpoint is made."""
    tmp = ckio.begin(tmp_path, 3)
    (tmp / "a.bin").write_bytes(b"x" * 10)
    with pytest.raises(RuntimeFailure, match="a.bin.*must be the 9 bytes"):
        ckio.commit(tmp_path, tmp, 3, {}, hashed={"a.bin": (9, "0" * 64)})
    with pytest.raises(RuntimeFailure, match="gone.bin.*must be there"):
        ckio.commit(tmp_path, tmp, 3, {}, hashed={"gone.bin": (9, "0" * 64)})
    assert ckio.latest(tmp_path) is None
