"""benchmarks/gpu_check.py cannot rot: the specs it writes pass ``rpeg check`` (the GPU's
and the CPU dry run's), and it exits non-zero when its run or its verify fails."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402


@pytest.mark.parametrize("cpu", [True, False])
def test_the_specs_it_writes_pass_rpeg_check(cpu, tmp_path):
    spec, cluster = gpu_check.write_inputs(tmp_path, cpu)
    done = subprocess.run([sys.executable, "-m", "rpeg", "check", str(spec), str(cluster)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("codes", [(1, None), (0, 1)])
def test_it_exits_non_zero_when_its_run_or_verify_fails(codes, tmp_path, monkeypatch):
    answers = iter(codes)

    def child(*args, log):
        log.write_text(f"$ rpeg {' '.join(args)}\n")
        return next(answers), 0.0
    monkeypatch.setattr(gpu_check, "rpeg", child)
    assert gpu_check.main(["--cpu", "--out", str(tmp_path / "out")]) == 1
    assert "exit 1" in (tmp_path / "out" / "gpu_check.md").read_text()
