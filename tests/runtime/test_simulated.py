"""The client's work grows with a step's work, not faster: the scheduling core and the
fusion driven on a simulated clock (``rpeg.runtime.calibrate.simulated``) for the shipped PPO
pipeline at two sizes, 8x apart."""

from __future__ import annotations

import pytest

from rpeg.resources import shipped
from rpeg.runtime.calibrate.simulated import drive, scaled
from rpeg.runtime.lowering import joins
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

STEPS = 6


@pytest.fixture(scope="module")
def ppo8b():
    return load(shipped("pipelines", "ppo_llama8b.rpeg"))


def _driven(pipeline, devices: int, repeats: int = 3):
    plan = scaled(split_plan(pipeline, 2, chunks=2, dp=2, staleness=1), devices // 2)
    calls = build_calls(pipeline, plan, STEPS)
    runs = [drive(calls, STEPS, 2, lambda c: 1.0) for _ in range(repeats)]
    return min(runs, key=lambda r: r.client_cpu_per_step_s)      # the least disturbed


def test_the_clients_cpu_per_step_grows_no_faster_than_the_step(ppo8b):
    small, large = _driven(ppo8b, 16), _driven(ppo8b, 128)
    calls = large.calls_per_step / small.calls_per_step
    assert 6 <= calls <= 10                        # 8x the devices: about 8x the calls
    # what the core walks: every call's dependencies, linear in the calls
    assert large.edges_per_step / small.edges_per_step <= 1.5 * calls
    # and its CPU: quadratic growth would be about 8x beyond the calls' ratio; twice the
    # ratio leaves room for noise (the minimum of three runs each, thread CPU time)
    ratio = large.client_cpu_per_step_s / small.client_cpu_per_step_s
    assert ratio <= 2 * calls, (ratio, calls)


def test_without_joins_a_gang_copies_every_wait_into_every_rank(ppo8b, monkeypatch):
    """What the test above guards against: a train op's ranks each waiting for everything
    the gang waits for is quadratic in devices."""
    monkeypatch.setattr(joins, "join_of", lambda devices: None)
    small, large = _driven(ppo8b, 16, repeats=1), _driven(ppo8b, 128, repeats=1)
    calls = large.calls_per_step / small.calls_per_step
    assert large.edges_per_step / small.edges_per_step > 4 * calls
