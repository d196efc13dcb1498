"""The dispatch term: measured on a real local cluster, written into a profile, charged by
the cost model once per model stage (host ops ride in their neighbour's task)."""

from __future__ import annotations

import math

import attrs
import pytest

from rpeg.cost.calibrate import fit_dispatch, with_dispatch
from rpeg.cost.examples import ppo_pipeline
from rpeg.cost.memory import Parallel
from rpeg.cost.profiles import builtin_cluster, builtin_profile, load_profile, profile_text
from rpeg.cost.stages import estimate_stage, generation_chunks
from rpeg.errors import CostError


def _cpu(dispatch: float):
    c = builtin_cluster("local_cpu")
    return attrs.evolve(c, gpu=with_dispatch(c.gpu, {"dispatch_s": dispatch}))


def test_model_stages_pay_one_dispatch_and_host_ops_none():
    p = ppo_pipeline("tiny", prompts=16)
    without, with_ = _cpu(0.0), _cpu(0.004)
    for stage in ("rollout", "ref_lp", "actor_step"):
        a = estimate_stage(p, stage, Parallel(), (0,), without)
        b = estimate_stage(p, stage, Parallel(), (0,), with_)
        assert b.time_s == pytest.approx(a.time_s + 0.004)
        assert dict(b.breakdown)["dispatch"] == 0.004
    for stage in ("scores", "adv"):
        assert estimate_stage(p, stage, Parallel(), (0,), with_).time_s == \
            estimate_stage(p, stage, Parallel(), (0,), without).time_s
    ends = generation_chunks(p, "rollout", Parallel(), (0,), with_, 2)
    assert ends[-1][0] == pytest.approx(estimate_stage(p, "rollout", Parallel(), (0,),
                                                       with_).time_s)


def test_shipped_profiles_carry_dispatch_and_it_round_trips(tmp_path):
    for name in ("local_cpu", "a100", "h100", "h200", "gh200"):
        assert 0 < builtin_profile(name).get("dispatch_s") < 0.1, name
    p = with_dispatch(builtin_cluster("local_cpu").gpu, {"dispatch_s": 0.0025})
    path = tmp_path / "cpu.rpeg"
    path.write_text(profile_text(p))
    assert load_profile(path).get("dispatch_s") == pytest.approx(0.0025)
    with pytest.raises(CostError, match="between 0 and 1 s"):
        fit_dispatch({"dispatch_s": math.nan})


@pytest.mark.slow
def test_dispatch_is_measured_on_a_real_cluster():
    from rpeg.runtime.dispatch import measure_dispatch
    m = measure_dispatch(tasks=12, repeats=1)
    for key in ("dispatch_s", "same_worker_s", "cross_worker_s", "round_trip_s"):
        assert 0 < m[key] < 1.0, (key, m)
    assert m["round_trip_s"] > m["same_worker_s"]     # a client round trip costs more
