"""This machine's profile for the embedded default: the cache per CPU, first-use
calibration, the shipped profile said to be another machine's, the choice's sources."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rpeg.errors import RuntimeFailure
from rpeg.runtime.calibrate.machine import (
    SHIPPED_CLUSTER,
    SHIPPED_PROFILE,
    MachineId,
    ProfileChoice,
    calibrated_on,
    choice_from_env,
    local_profile,
)
from rpeg.spec import load_cluster

TINY = Path(__file__).resolve().parents[2] / "pipelines" / "tiny_ppo.rpeg"

HERE = MachineId("Example CPU 9000", 4)
ELSEWHERE = MachineId("Other CPU 1", 4)


class FakeCalibration:
    """Writes the shipped profile as if it had been measured on ``machine``; counts calls."""

    def __init__(self, machine: MachineId) -> None:
        self.machine, self.calls = machine, 0

    def __call__(self, profile, cluster) -> str:
        self.calls += 1
        text = SHIPPED_PROFILE.read_text()
        on = calibrated_on(load_cluster(SHIPPED_CLUSTER).gpu)
        profile.write_text(text.replace(f"rpeg calibrate on {on.cpu} ({on.cores} cores",
                                        f"rpeg calibrate on {self.machine.cpu} "
                                        f"({self.machine.cores} cores"))
        shutil.copy(SHIPPED_CLUSTER, cluster)
        cluster.write_text(cluster.read_text().replace("profiles/local_cpu.rpeg", profile.name))
        return "fake"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RPEG_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_key_names_the_cpu_and_its_cores(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) CPU @ 2.20GHz\n")
    m = MachineId.here(info)
    assert m.cpu == "Intel(R) Xeon(R) CPU @ 2.20GHz"
    assert m.key == f"intel-r-xeon-r-cpu-2-20ghz-{m.cores}c"


def test_first_use_calibrates_once_then_the_cache_serves(cache):
    fake, said = FakeCalibration(HERE), []
    first = local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=said.append)
    assert fake.calls == 1 and first.this_machines and "calibrating this machine" in said[0]
    assert first.cluster.parent == cache / "machines" / HERE.key
    assert calibrated_on(load_cluster(first.cluster).gpu) == HERE
    again = local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=said.append)
    assert fake.calls == 1 and again.cluster == first.cluster
    assert "this machine's profile" in again.note and "calibrated 20" in again.note
    local_profile(ProfileChoice.CALIBRATE, machine=HERE, calibrate=fake, say=said.append)
    assert fake.calls == 2 and sorted(p.name for p in first.cluster.parent.parent.iterdir()) \
        == [HERE.key]                              # replaced whole, nothing left beside it


def test_another_cpu_is_calibrated_anew(cache):
    fake = FakeCalibration(HERE)
    local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=lambda _: None)
    other = FakeCalibration(ELSEWHERE)
    moved = local_profile(ProfileChoice.AUTO, machine=ELSEWHERE, calibrate=other,
                          say=lambda _: None)
    assert other.calls == 1 and moved.cluster.parent.name == ELSEWHERE.key


def test_a_damaged_cache_is_calibrated_again(cache):
    fake = FakeCalibration(HERE)
    made = local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=lambda _: None)
    (made.cluster.parent / "profile.rpeg").write_text("profile {")
    local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=lambda _: None)
    assert fake.calls == 2


def test_a_cache_from_an_earlier_calibration_is_measured_again(cache):
    """A profile cached before the calibration measured what the cost model now reads (its
    machine.json without the calibration's number) is calibrated again on first use."""
    import json
    fake = FakeCalibration(HERE)
    made = local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=lambda _: None)
    meta = made.cluster.parent / "machine.json"
    old = json.loads(meta.read_text())
    assert old.pop("calibration") >= 2
    meta.write_text(json.dumps(old))
    local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=lambda _: None)
    assert fake.calls == 2
    local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=lambda _: None)
    assert fake.calls == 2


def test_a_cache_from_the_calibration_before_is_measured_again(cache):
    """A profile the calibration before this one cached (its prices fitted to medians of 2
    calls, which one disturbed call moved by 10-25%) is calibrated again on first use."""
    import json

    from rpeg.runtime.calibrate.machine import CALIBRATION, QUICK_REPEATS
    assert QUICK_REPEATS >= 5               # a median the two slowest calls do not move
    fake = FakeCalibration(HERE)
    made = local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=lambda _: None)
    meta = made.cluster.parent / "machine.json"
    old = json.loads(meta.read_text())
    meta.write_text(json.dumps({**old, "calibration": CALIBRATION - 1}))
    local_profile(ProfileChoice.AUTO, machine=HERE, calibrate=fake, say=lambda _: None)
    assert fake.calls == 2


def test_the_shipped_profile_is_never_presented_as_this_machines(cache):
    shipped_on = calibrated_on(load_cluster(SHIPPED_CLUSTER).gpu)
    assert shipped_on is not None                  # the shipped file says where it was measured
    elsewhere = local_profile(ProfileChoice.SHIPPED, machine=ELSEWHERE)
    assert elsewhere.cluster == SHIPPED_CLUSTER and not elsewhere.this_machines
    assert f"measured on {shipped_on}, not on this machine ({ELSEWHERE})" in elsewhere.note
    assert "not this machine's" in elsewhere.note
    like = local_profile(ProfileChoice.SHIPPED, machine=shipped_on)
    assert like.this_machines and "like this one" in like.note
    assert not cache.exists()                      # nothing measured, nothing cached


def test_the_choice_comes_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("RPEG_LOCAL_PROFILE", raising=False)
    assert choice_from_env() is ProfileChoice.AUTO
    monkeypatch.setenv("RPEG_LOCAL_PROFILE", "Shipped")
    assert choice_from_env() is ProfileChoice.SHIPPED
    assert choice_from_env("calibrate") is ProfileChoice.CALIBRATE
    with pytest.raises(RuntimeFailure, match="must be auto, calibrate or shipped, not 'x'"):
        choice_from_env("x")


def test_rpeg_run_refuses_an_unknown_profile_choice(capsys):
    from rpeg.cli import main
    assert main(["run", str(TINY), "--profile", "x"]) == 2
    assert "must be auto, calibrate or shipped" in capsys.readouterr().err


def test_the_tests_plan_with_the_shipped_profile():
    """Every process a test starts inherits the choice (tests/conftest.py)."""
    out = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get("
                          "'RPEG_LOCAL_PROFILE'))"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "shipped"


@pytest.mark.slow
def test_a_real_first_use_calibration_is_cached_and_prices_plans(cache):
    """The short calibration itself: this machine measured, the profile cached and named
    after it, and the local cluster it writes plans like the shipped one."""
    from rpeg.plan import SearchOptions, compile_plan
    from rpeg.runtime.plans import runtime_limits
    from rpeg.spec import load
    made = local_profile(ProfileChoice.CALIBRATE, say=lambda _: None)
    assert made.this_machines and made.cluster.is_file()
    cluster = load_cluster(made.cluster)
    assert calibrated_on(cluster.gpu) == MachineId.here() and cluster.num_gpus == 2
    assert cluster.gpu.dispatch_s > 0 and cluster.gpu.vllm_work_scale > 0
    plan = compile_plan(load(TINY), cluster, options=SearchOptions(iterations=100,
                                                                    limits=runtime_limits()))
    assert plan.predicted.step_time_s > 0
