"""A refusal names its file once: a message that already quotes the file it is about is not
prefixed with it again (``FILE: error: checkpoint file 'FILE' is missing`` was the form),
and one that does not keeps ``FILE: `` in front. A checkpoint a resume or an export passes
over is described the same way, without a second severity inside its warning."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rpeg.errors import RpegError, RuntimeFailure, Span
from rpeg.runtime.rundir import checkpoints as ckio


def _checkpoint(run_dir: Path, step: int) -> ckio.Checkpoint:
    from safetensors.numpy import save_file
    tmp = ckio.begin(run_dir, step)
    (tmp / "actor@0").mkdir()
    save_file({"w": np.arange(8, dtype=np.float32)}, str(tmp / "actor@0" / "model.safetensors"))
    return ckio.commit(run_dir, tmp, step, {"replicas": {"actor@0": step}})


def _refusal(path: Path) -> RuntimeFailure:
    try:
        ckio.validate(path)
    except RuntimeFailure as e:
        return e
    raise AssertionError(f"{path} was not refused")


def test_a_missing_or_corrupt_checkpoint_file_is_named_once(tmp_path):
    ck = _checkpoint(tmp_path, 2)
    f = ck.path / "actor@0" / "model.safetensors"
    f.write_bytes(b"\0" * f.stat().st_size)
    assert _refusal(ck.path).render() == \
        f"error: checkpoint file '{f}' does not match its checksum (corrupted)"
    f.unlink()
    assert _refusal(ck.path).render() == f"error: checkpoint file '{f}' is missing"


def test_a_message_that_does_not_name_its_file_keeps_it_in_front(tmp_path):
    ck = _checkpoint(tmp_path, 2)
    (ck.path / ckio.MARKER).write_text('{"format": 99, "files": {}}')
    text = _refusal(ck.path).render()
    assert text.startswith(f"{ck.path / ckio.MARKER}: error: checkpoint manifest must be an "
                           "object of format 1 listing its files, not 99\n"), text


def test_a_skipped_checkpoint_is_described_without_a_severity(tmp_path):
    _checkpoint(tmp_path, 2)
    ck = _checkpoint(tmp_path, 4)
    f = ck.path / "actor@0" / "model.safetensors"
    f.unlink()
    skipped: list[str] = []
    assert ckio.latest(tmp_path, skipped=skipped).step == 2
    assert skipped == [f"checkpoint file '{f}' is missing"]


def test_a_line_and_column_are_always_given():
    e = RpegError("'p.rpeg' must name a pipeline", Span("p.rpeg", 3, 7))
    assert str(e) == "p.rpeg:3:7: error: 'p.rpeg' must name a pipeline"
    e = RpegError("unknown key", Span("p.rpeg", 0, 0))
    assert (str(e), e.located) == ("p.rpeg: error: unknown key", "p.rpeg: unknown key")
    assert str(RpegError("no file")) == "error: no file"
