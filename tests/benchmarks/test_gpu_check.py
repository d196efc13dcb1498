"""benchmarks/gpu_check.py and gpu_node_check.py cannot rot: every spec they write passes
``rpeg check`` (the GPU's and the CPU dry run's), and the check exits non-zero when a run
or a verify fails. CI runs the single-GPU check's CPU dry run end to end
(``make test-gpu-check``)."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402
from benchmarks.gpu_node_check import node_checks  # noqa: E402

CASES = [(c, 1, "h200") for c in gpu_check.ONE_GPU] + \
        [(c, n, "h100") for n in (2, 8) for c in node_checks(n)]


@pytest.mark.parametrize("cpu", [True, False])
@pytest.mark.parametrize("check, gpus, kind", CASES,
                         ids=[f"{c.name}-{n}" for c, n, _ in CASES])
def test_the_specs_it_writes_pass_rpeg_check(check, gpus, kind, cpu, tmp_path):
    from rpeg.cli import main
    spec, cluster = gpu_check.write_inputs(tmp_path, cpu, check, gpus, kind)
    assert main(["check", str(spec), str(cluster)]) == 0


@pytest.mark.parametrize("codes", [(1, None), (0, 1)])
def test_it_exits_non_zero_when_its_run_or_verify_fails(codes, tmp_path, monkeypatch):
    answers = iter(codes)

    def child(*args, log):
        log.write_text(f"$ rpeg {' '.join(args)}\n")
        return next(answers), 0.0
    monkeypatch.setattr(gpu_check, "rpeg", child)
    out = tmp_path / "out"
    assert gpu_check.main(["--cpu", "--out", str(out), "--only", "train"]) == 1
    text = (out / "gpu_check.md").read_text()
    assert "exit 1" in text and "Result: FAILED" in text


def test_on_gpus_a_run_must_place_each_device_on_a_gpu_of_its_own():
    base = {"check": "x", "run_rc": 0, "verify_rc": 0}
    assert gpu_check.ok({**base, "placed": True})
    assert not gpu_check.ok({**base, "placed": False})
