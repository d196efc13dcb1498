"""``rpeg run`` refuses what cannot run before it spends time planning: a scheduler with
fewer device workers than the run needs is counted first, and a broken spec is said
before this machine is calibrated."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from rpeg.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "pipelines" / "tiny_ppo.rpeg")
A100_16 = str(ROOT / "pipelines" / "clusters" / "a100_16.rpeg")


@pytest.fixture(scope="module")
def one_worker():
    """A scheduler with one single-threaded GPU=1 worker."""
    from distributed import LocalCluster
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      resources={"GPU": 1}, host="127.0.0.1", dashboard_address="127.0.0.1:0",
                      silence_logs=logging.ERROR) as cluster:
        yield cluster.scheduler_address


def test_too_few_workers_are_refused_before_planning(one_worker, capsys, monkeypatch, tmp_path):
    import rpeg.plan.compile as compile_module

    def never(*_a, **_k):
        raise AssertionError("planned for a scheduler that cannot run the plan")

    monkeypatch.setattr(compile_module, "compile_report", never)
    rc = main(["run", TINY, "--cluster", A100_16, "--scheduler", one_worker, "--no-progress",
               "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "needs 16 workers with resource GPU=1, and the cluster has 1" in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("override", [[], ["workload.prompts=0"]])
def test_a_broken_spec_is_said_before_this_machine_is_calibrated(
        capsys, monkeypatch, tmp_path, override):
    """Calibrating takes minutes on first use; a mistake in the spec (or in an override)
    is said before it, at its line."""
    import rpeg.runtime.calibrate.machine as machine

    def never(*_a, **_k):
        raise AssertionError("calibrated before the spec was checked")

    monkeypatch.setattr(machine, "local_profile", never)
    spec = Path(TINY).read_text()
    if not override:
        spec = spec.replace("pipeline tiny_ppo", "pipeline tiny_ppo\nmodel oops : nosuch {}")
    broken = tmp_path / "broken.rpeg"
    broken.write_text(spec)
    for extra in ("data", "rewards.py"):
        target = Path(TINY).parent / extra
        (tmp_path / extra).symlink_to(target)
    rc = main(["run", str(broken), "--no-progress", "--run-dir", str(tmp_path / "run"),
               *override])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "error:" in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_a_folder_of_the_users_files_is_no_run_directory(capsys, tmp_path, monkeypatch):
    """``--run-dir`` naming a folder that holds the user's own files is refused before a
    worker starts, and the folder is left as it was (a run's files would mix with them)."""
    import rpeg.runtime.dask.runner as runner

    def never(*_a, **_k):
        raise AssertionError("started a cluster for a run directory it must refuse")

    monkeypatch.setattr(runner, "_cluster", never)
    mine = tmp_path / "mydata"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine\n")
    rc = main(["run", TINY, "--steps", "1", "--no-progress", "--strategy", "runtime-split",
               "--run-dir", str(mine)])
    err = capsys.readouterr().err
    assert rc == 1 and "must be empty or new for a new run, and it holds notes.txt, which no " \
                       "run wrote" in err, err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
