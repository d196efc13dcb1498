"""A run directory written before profiles had typed fields still prices as it did."""

from __future__ import annotations

from rpeg.runtime.rundir.serial import from_data, to_data
from rpeg.spec.model import GpuProfile


def test_a_profile_with_the_old_extra_pairs_reads_them_into_its_fields():
    data = to_data(GpuProfile("cpu", memory=8e9, host_cores=2.0, dispatch_s=0.004))
    old = {k: v for k, v in data.items() if k not in ("host_cores", "dispatch_s")}
    old["extra"] = [["host_cores", 2.0], ["dispatch_s", 0.004], ["gone", 1.0]]
    got = from_data(old)
    assert (got.host_cores, got.dispatch_s) == (2.0, 0.004)
    assert got == from_data(data)
