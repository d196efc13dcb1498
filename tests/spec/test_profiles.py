"""Profile files: every key is a declared GpuProfile field, and any other is refused at its
line:col (a misspelt key must not fall back silently to a default)."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest

from rpeg.cost.profiles import profile_text
from rpeg.errors import SpecError
from rpeg.resources import profiles_dir
from rpeg.spec import check_file
from rpeg.spec.cluster import load_profile
from rpeg.spec.model import GpuProfile

ERRORS = Path(__file__).resolve().parents[1] / "fixtures" / "errors"


@pytest.mark.parametrize("name", ["profile_misspelt_key", "profile_extra_section",
                                  "profile_zero_memory", "cluster_inline_profile_no_rates",
                                  "profile_no_slowdown", "profile_half_launch",
                                  "profile_gpu_layer_overhead"])
def test_a_key_or_figure_that_cannot_be_is_refused(name, monkeypatch):
    """A key that is no field, and a figure the cost model divides by (memory, the GEMM rate, the bandwidth)
    that is 0 or not given is refused where it is (or where the profile is named), not
    found as a division by zero when a plan is priced."""
    monkeypatch.chdir(ERRORS)
    with pytest.raises(SpecError) as info:
        check_file(f"{name}.rpeg")
    golden = ERRORS / f"{name}.golden"
    if os.environ.get("RPEG_UPDATE_GOLDEN"):
        golden.write_text(info.value.render() + "\n", encoding="utf-8")
    assert info.value.render() + "\n" == golden.read_text(encoding="utf-8")


@pytest.mark.parametrize("path", sorted(profiles_dir().glob("*.rpeg")), ids=lambda p: p.stem)
def test_every_shipped_profile_loads_and_reads_back(path, tmp_path):
    p = load_profile(path)
    assert p.dispatch_s > 0                      # every shipped profile prices Dask's dispatch
    (tmp_path / "p.rpeg").write_text(profile_text(p), encoding="utf-8")
    back = load_profile(tmp_path / "p.rpeg")
    for f in attrs.fields(GpuProfile):
        want = getattr(p, f.name)
        assert getattr(back, f.name) == (want if not isinstance(want, float)
                                         else pytest.approx(want, rel=1e-3)), f.name
