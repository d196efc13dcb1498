"""Which plan a run executes: a hand-written plan file is held to the runtime's limits before
any worker starts, like a compiled one."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rpeg.errors import PlanError
from rpeg.runtime.placement import split_plan
from rpeg.runtime.plans import plan_for_run
from rpeg.spec import load

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "pipelines" / "tiny_ppo.rpeg"


def _with(plan, stage: str, **changes):
    return attrs.evolve(plan, placements=tuple(
        p.changed(**changes) if p.stage == stage else p for p in plan.placements))


def test_a_hand_written_plan_within_the_limits_is_taken(tmp_path):
    plan = split_plan(load(SPEC), 2)
    plan.save(tmp_path / "plan.json")
    pipeline, got, spec = plan_for_run(tmp_path / "plan.json", spec=SPEC)
    assert got == plan and spec == SPEC


def test_a_hand_written_plan_asking_for_pipeline_parallelism_is_refused(tmp_path):
    plan = _with(split_plan(load(SPEC), 2), "actor_step", devices=(0, 1), dp=1, tp=1, pp=2)
    assert plan.inconsistency() is None
    plan.save(tmp_path / "plan.json")
    with pytest.raises(PlanError, match=r"stage 'actor_step'.*pp") as e:
        plan_for_run(tmp_path / "plan.json", spec=SPEC)
    assert "recompile" in (e.value.hint or "")
