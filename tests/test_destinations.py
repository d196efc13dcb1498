"""Run directories as other commands meet them: never written into (as written or through a
link), and a run whose process is gone told from one still writing."""

from __future__ import annotations

import json
import os

import pytest

from rpeg.destinations import check_file_destination, check_folder_destination, run_dir_around
from rpeg.errors import RpegError


@pytest.fixture()
def run(tmp_path):
    """A run directory as a run leaves it (its record, a checkpoints folder)."""
    d = tmp_path / "runs" / "a"
    (d / "checkpoints").mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"status": "ok"}))
    (d / "plan.json").write_text("{}")
    return d


def test_a_link_into_a_run_directory_leads_inside_it(run, tmp_path):
    os.symlink(run / "checkpoints", tmp_path / "lnk")
    assert run_dir_around(tmp_path / "lnk" / "out") == run
    assert run_dir_around(run / "checkpoints" / "x") == run
    assert run_dir_around(tmp_path / "elsewhere") is None
    with pytest.raises(RpegError, match="inside the run directory"):
        check_folder_destination(tmp_path / "lnk" / "out", "-o")
    with pytest.raises(RpegError, match="inside the run directory"):
        check_file_destination(tmp_path / "lnk" / "plan.json", "-o")


def test_a_run_whose_process_is_gone_reads_as_stopped(run):
    """run.json left at "running" by a killed process: no process holds the run's lock
    (the kernel dropped it), so the record says stopped; while a run holds it, running."""
    from rpeg.runtime.rundir.files import RunLock
    from rpeg.runtime.rundir.record import _status
    assert _status(run, {"status": "running"}) == "stopped"
    assert _status(run, {"status": "ok"}) == "ok"
    with RunLock.take(run):
        assert _status(run, {"status": "running"}) == "running"

