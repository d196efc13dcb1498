"""Where people look: shell completion from the command line, the Dask dashboard address."""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rpeg.runtime.rundir.record import dashboard_line

ROOT = Path(__file__).resolve().parents[2]


def _complete(words: str, cword: int) -> list[str]:
    script = Path(sys.executable).with_name("rpeg")
    if not script.exists():
        pytest.skip("the rpeg entry point is not installed in this environment")
    env = dict(os.environ, COMP_WORDS=words, COMP_CWORD=str(cword),
               _RPEG_COMPLETE="complete_bash", PYTHONPATH=str(ROOT))
    out = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_shell_completion_completes_commands_and_options():
    assert _complete("rpeg sh", 1) == ["show"]
    assert {"--plots", "--json", "--no-verify"} <= set(_complete("rpeg show --", 2))
    assert "colocated" in _complete("rpeg compile x.rpeg --strategy ", 4)


def test_dashboard_address_only_when_served():
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address="127.0.0.1:0", silence_logs=logging.ERROR) as cluster, \
            Client(cluster) as client:
        line = dashboard_line(client)
        if importlib.util.find_spec("bokeh") is None:
            assert line is None                   # no bokeh: no dashboard page to point at
        else:
            assert line.startswith("dask dashboard: http://127.0.0.1:")
            port = int(line.rsplit(":", 1)[1].split("/")[0])
            assert port == cluster.scheduler.http_server.port
            import urllib.request
            with urllib.request.urlopen(line.split(": ", 1)[1], timeout=10) as page:
                assert page.status == 200 and b"Dask" in page.read()
