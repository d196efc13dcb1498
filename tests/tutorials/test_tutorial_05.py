"""Tutorial 05 runs as written: a Dask scheduler and two workers started with the `dask`
command line on 127.0.0.1, `rpeg run --scheduler` on them, verify and show; the SLURM
script's batch script (slow: real processes and a real run)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.backends.ranks import free_port

_spec = importlib.util.spec_from_file_location(
    "tutorial_runner", Path(__file__).with_name("tutorial_runner.py"))
runner = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runner)

TUTORIAL = runner.ROOT / "tutorials" / "05-scale-out.md"


def test_tutorial_names_the_commands_a_user_types():
    text = TUTORIAL.read_text(encoding="utf-8")
    for words in ("dask scheduler", "dask worker", "--resources GPU=1", "--nthreads 1",
                  "--protocol tls", "--tls-ca certs/ca.pem",
                  "rpeg run pipelines/tiny_ppo.rpeg --scheduler", "SLURMCluster", "--cuda"):
        assert words in text
    blocks = runner.blocks(text)
    assert sum(b.background for b in blocks) == 6          # scheduler + two workers, twice


@pytest.mark.slow
def test_tutorial_runs_as_written(tmp_path):
    pytest.importorskip("dask_jobqueue")
    port = free_port()
    session = runner.Session(tmp_path, substitute={"8786": str(port)})
    session.env["HEAD"] = "127.0.0.1"
    (session.work / "pipelines").symlink_to(runner.ROOT / "pipelines")   # "the repository folder"
    outputs = []
    try:
        for block in runner.blocks(TUTORIAL.read_text(encoding="utf-8")):
            outputs.append(session.run(block, timeout=300))
    finally:
        session.close()
    joined = "\n".join(outputs)
    assert "2 workers" in joined
    assert f"where: the Dask scheduler at tcp://127.0.0.1:{port}" in joined
    assert joined.count("placement, dependencies, versions - ok") == 3   # verify, show, verify tls
    tls = json.loads((session.work / "runs" / "tls" / "record.json").read_text())
    assert tls["where"]["scheduler"] == f"tls://127.0.0.1:{port}" and tls["status"] == "ok"
    assert all(a.startswith("tls://") for a in tls["where"]["workers"].values())
    assert "#SBATCH --gres=gpu:1" in joined and "--resources GPU=1" in joined
    assert f"tcp://127.0.0.1:{port}" in joined.split("#SBATCH --gres=gpu:1")[1]
    record = json.loads((session.work / "runs" / "scaled" / "record.json").read_text())
    assert record["where"]["scheduler"] == f"tcp://127.0.0.1:{port}"
    assert len(record["where"]["workers"]) == 2
    for proc, _ in session.background:
        assert proc.poll() is not None                       # everything it started stopped
