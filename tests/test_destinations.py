"""Where a command may write: never into a run directory, written or reached through a link."""

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
