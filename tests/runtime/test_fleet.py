"""The fleet's command line (the children ``Fleet`` starts): a wrong one is a usage message
and exit status 2, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rpeg.runtime.calibrate.fleet import USAGE, main
from tests.conftest import ROOT


def test_no_arguments_is_a_usage_error():
    r = subprocess.run([sys.executable, "-m", "rpeg.runtime.calibrate.fleet"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == f"{USAGE}\nerror: give a command: scheduler or workers\n"


@pytest.mark.parametrize("argv, problem", [
    (["nanny"], "the command must be scheduler or workers, not 'nanny'"),
    (["scheduler"], "scheduler takes FILE, not 0 argument(s)"),
    (["workers", "tcp://127.0.0.1:1"], "workers takes ADDRESS N, not 1 argument(s)"),
    (["workers", "tcp://127.0.0.1:1", "two"], "N must be a count of workers from 1, not 'two'"),
    (["workers", "tcp://127.0.0.1:1", "0"], "N must be a count of workers from 1, not '0'"),
])
def test_a_wrong_command_line_says_what_is_wrong(capsys, argv, problem):
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"{USAGE}\nerror: {problem}\n")
