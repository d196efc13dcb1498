"""Op calls built a window at a time equal, call for call, those of a build of the whole run;
a run extended from a checkpoint restarts with every replica at that step's version."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import attrs
import pytest

from rpeg.plan.model import Plan
from rpeg.runtime.core.windows import CallWindows
from rpeg.runtime.lowering.instances import build_calls, lookback
from rpeg.runtime.placement import split_plan
from rpeg.spec import load
from tests.runtime.test_tp_run import plan_with

ROOT = Path(__file__).resolve().parents[2]
STEPS = 30


def _carrying(plan: Plan) -> Plan:
    return attrs.evolve(plan, staleness=tuple((s, 0) for s, _ in plan.staleness),
                        placements=tuple(attrs.evolve(p, carry=1) if p.stage == "rollout"
                                         else p for p in plan.placements))


@pytest.fixture(scope="module")
def stale2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("s2")
    shutil.copy(ROOT / "pipelines" / "rewards.py", folder / "rewards.py")
    text = (ROOT / "pipelines" / "tiny_ppo.rpeg").read_text()
    (folder / "s2.rpeg").write_text(re.sub(r"staleness rollout <= \d", "staleness rollout <= 2",
                                           text))
    return load(folder / "s2.rpeg")


def _plans(stale2):
    ppo, grpo = load(ROOT / "pipelines/tiny_ppo.rpeg"), load(ROOT / "pipelines/tiny_grpo.rpeg")
    out = {}
    for name, p in (("ppo", ppo), ("grpo", grpo), ("stale2", stale2)):
        for st in (0, 1, None):
            for dp in (1, 2):
                out[f"{name}-s{st}-dp{dp}"] = (p, split_plan(p, 2, staleness=st, dp=dp))
        out[f"{name}-carry"] = (p, _carrying(split_plan(p, 2)))
        out[f"{name}-share"] = (p, split_plan(p, 2, share=True, dp=2))
    out["ppo-tp"] = (ppo, plan_with(ppo, (0, 1), 2))
    out["ppo-dp2tp2"] = (ppo, plan_with(ppo, (0, 1, 2, 3), 2, devices=4, staleness=1))
    out["stale2-tp-gen"] = (stale2, plan_with(stale2, (0, 1), 2, gen=(2,), devices=3,
                                             staleness=2))
    return out


def test_windows_equal_the_whole_runs_build(stale2):
    for name, (pipeline, plan) in _plans(stale2).items():
        whole = {c.id: c for c in build_calls(pipeline, plan, STEPS)}
        windows = CallWindows(pipeline, plan, STEPS)
        for start, end in ((0, 4), (4, 8), (8, 12), (13, 20), (20, 30), (28, 30)):
            table = windows.around(start, end)
            r = lookback(pipeline, plan)
            lo, hi = max(0, start - 2 * r), min(STEPS, end + 2 * r)
            want = {i: c for i, c in whole.items() if lo <= c.step < hi}
            got = {i: c for i, c in table.items() if lo <= c.step < hi}
            assert got == want, (name, start, end, sorted(set(got) ^ set(want))[:4])


def test_a_window_of_a_long_run_is_built_around_its_segment():
    """A 200,000-step run's first segment needs the calls of its first steps, not of every
    step: the window holds a bounded number of steps however long the run."""
    pipeline = load(ROOT / "pipelines/tiny_ppo.rpeg")
    plan = split_plan(pipeline, 2, staleness=1)
    windows = CallWindows(pipeline, plan, 200_000)
    table = windows.around(0, 10)
    steps = {c.step for c in table.values()}
    assert min(steps) == 0 and max(steps) < 200
    later = windows.around(150_000, 150_010)
    assert min(c.step for c in later.values()) >= 150_000 - 4 * lookback(pipeline, plan)


def test_a_run_built_from_a_later_step_reads_no_older_version():
    """build_calls(first=b): every replica starts at version b, as at step 0 with b = 0."""
    pipeline = load(ROOT / "pipelines/tiny_ppo.rpeg")
    plan = split_plan(pipeline, 2, staleness=1)
    calls = build_calls(pipeline, plan, 12, first=6)
    assert min(c.step for c in calls if not c.role) == 6
    readers = [c for c in calls if c.version >= 0]
    assert readers and min(c.version for c in readers) == 6
    gen6 = next(c for c in calls if c.op == "rollout" and c.step == 6)
    assert gen6.version == 6                                  # clamped, as step 0 reads 0
    shifted = {c.id: c for c in build_calls(pipeline, plan, 6)}
    assert {c.id.replace("/s6", "/s0") for c in calls if c.step == 6 and not c.role} \
        == {i for i, c in shifted.items() if c.step == 0 and not c.role}
