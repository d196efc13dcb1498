"""A known execution priced as it ran: `rpeg compile --strategy pinned`."""

from __future__ import annotations

import pytest

from rpeg.errors import PlanError
from rpeg.plan.evaluate import Evaluator
from rpeg.plan.known import pinned_plan
from rpeg.plan.model import Strategy
from rpeg.spec import load

from .conftest import ROOT

PINS = ("place rollout on gpus 1..1 { engine = torch }",
        "place ref_lp on gpus 0..0 { microbatches = 2 }",
        "place values on gpus 0..1 { dp = 2 }",
        "place actor_step on gpus 0..1 { dp = 2; microbatches = 2 }",
        "place critic_step on gpus 0..1 { dp = 2 }")


def _spec(tmp_path, *pins: str):
    text = (ROOT / "pipelines/tiny_ppo.rpeg").read_text().replace("staleness rollout <= 1",
                                                                   "staleness rollout <= 0")
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    (tmp_path / "data").mkdir(exist_ok=True)
    path = tmp_path / "pinned.rpeg"
    path.write_text(text + "".join(p + "\n" for p in pins))
    return load(path)


def test_every_stage_runs_where_and_how_its_pin_says(tmp_path, local_cpu):
    pipeline = _spec(tmp_path, *PINS)
    plan = pinned_plan(pipeline, local_cpu)
    assert plan.strategy is Strategy.PINNED
    got = {p.stage: (p.devices, p.dp, p.microbatches) for p in plan.placements}
    assert got["rollout"] == ((1,), 1, 1)
    assert got["ref_lp"] == ((0,), 1, 2)
    assert got["actor_step"] == ((0, 1), 2, 2)
    # host stages sit with the model stage feeding them
    assert got["scores"][0] == (1,) and got["adv"][0] == (0, 1)
    ev = Evaluator(pipeline, local_cpu).evaluate(plan)
    assert ev.feasible and ev.step_time_s > 0


def test_a_stage_left_unpinned_is_named_at_its_line(tmp_path, local_cpu):
    pipeline = _spec(tmp_path, *PINS[:-1])
    with pytest.raises(PlanError, match="stage 'critic_step' must be placed") as info:
        pinned_plan(pipeline, local_cpu)
    assert info.value.span.line == pipeline.stage("critic_step").span.line


def test_rpeg_compile_prices_the_pins_without_a_search(tmp_path, local_cpu, capsys):
    from rpeg.cli import main
    pipeline = _spec(tmp_path, *PINS)
    rc = main(["compile", pipeline.path, "--cluster", local_cpu.path, "--strategy", "pinned",
               "--no-gantt", "-o", str(tmp_path / "p.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "strategy pinned" in out and "speedup" not in out
