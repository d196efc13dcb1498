"""The dispatch term: measured on a real local cluster, written into a profile, charged by
the simulator where an op's input crosses to other devices."""

from __future__ import annotations

import math

import attrs
import pytest

from rpeg.cost.calibrate import fit_dispatch, with_dispatch
from rpeg.cost.examples import ppo_pipeline
from rpeg.cost.profiles import builtin_cluster, builtin_profile, load_profile, profile_text
from rpeg.cost.stages import estimate_stage, generation_chunks
from rpeg.errors import CostError
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of


def _cpu(dispatch: float):
    c = builtin_cluster("local_cpu")
    return attrs.evolve(c, gpu=with_dispatch(c.gpu, {"dispatch_s": dispatch}))


def test_dispatch_is_charged_where_an_input_crosses_devices():
    """A stage's own cost has no dispatch in it; the simulator charges it where an op's
    input comes from another device (a new task there): a plan on one device pays none,
    a split one pays it on its chain between the devices."""
    from rpeg.plan.evaluate import Evaluator
    from rpeg.runtime.placement import split_plan
    p = ppo_pipeline("tiny", prompts=16)
    without, with_ = _cpu(0.0), _cpu(0.004)
    for stage in ("rollout", "ref_lp", "actor_step", "scores", "adv"):
        assert estimate_stage(work_of(p, stage), Layout(), (0,), with_).time_s == \
            estimate_stage(work_of(p, stage), Layout(), (0,), without).time_s
    assert generation_chunks(work_of(p, "rollout"), Layout(), (0,), with_, 2) == \
        generation_chunks(work_of(p, "rollout"), Layout(), (0,), without, 2)
    for devices, crossings in ((1, False), (2, True)):
        plan = split_plan(p, devices, staleness=0, share=False)
        a = Evaluator(p, without).evaluate(plan).step_time_s
        b = Evaluator(p, with_).evaluate(plan).step_time_s
        if crossings:
            assert b >= a + 2 * 0.004 - 1e-9     # out to the other device and back, at least
        else:
            assert b == pytest.approx(a)


def test_shipped_profiles_carry_dispatch_and_it_round_trips(tmp_path):
    for name in ("local_cpu", "a100", "h100", "h200", "gh200"):
        assert 0 < builtin_profile(name).dispatch_s < 0.1, name
    p = with_dispatch(builtin_cluster("local_cpu").gpu, {"dispatch_s": 0.0025})
    path = tmp_path / "cpu.rpeg"
    path.write_text(profile_text(p))
    assert load_profile(path).dispatch_s == pytest.approx(0.0025)
    with pytest.raises(CostError, match="between 0 and 1 s"):
        fit_dispatch({"dispatch_s": math.nan})


@pytest.mark.slow
def test_dispatch_is_measured_on_a_real_cluster():
    from rpeg.runtime.calibrate.dispatch import measure_dispatch
    m = measure_dispatch(tasks=12, repeats=1)
    for key in ("dispatch_s", "same_worker_s", "cross_worker_s", "round_trip_s"):
        assert 0 < m[key] < 1.0, (key, m)
    assert m["round_trip_s"] > m["same_worker_s"]     # a client round trip costs more


def test_a_measurement_leaves_the_environment_as_it_found_it(monkeypatch):
    """What a cluster writes into ``os.environ`` (a nanny's pre-spawn settings) is undone:
    keys added are removed, keys changed or removed are restored."""
    import os

    from rpeg.runtime.calibrate.dispatch import environ_kept
    monkeypatch.setenv("RPEG_TEST_KEPT", "a")
    monkeypatch.setenv("RPEG_TEST_GONE", "b")
    monkeypatch.delenv("RPEG_TEST_NEW", raising=False)
    before = dict(os.environ)
    with environ_kept():
        os.environ["RPEG_TEST_KEPT"] = "changed"
        del os.environ["RPEG_TEST_GONE"]
        os.environ["RPEG_TEST_NEW"] = "1"
    assert dict(os.environ) == before


@pytest.mark.slow
def test_a_dispatch_measurement_leaves_no_dask_settings_in_the_environment():
    """A cluster of Dask's defaults writes ``MALLOC_TRIM_THRESHOLD_=65536`` and one-thread
    settings into the client's environment; after the measurement they are gone, so no
    process this one starts later (a run's workers, a tool's sandbox) inherits them."""
    import os

    from rpeg.runtime.calibrate.dispatch import measure_dispatch
    before = dict(os.environ)
    measure_dispatch(tasks=4, repeats=1)
    assert dict(os.environ) == before
