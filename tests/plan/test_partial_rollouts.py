"""Partial rollouts as a plan choice: priced, kept within the staleness bound, searched,
and refused by a backend that cannot execute them."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpeg.errors import PlanError
from rpeg.plan import SearchOptions, compile_report
from rpeg.plan.compile import check_executable
from rpeg.plan.edit import repair
from rpeg.plan.model import Plan
from rpeg.plan.search import Moves
from rpeg.plan.space import Limits
from rpeg.runtime.plans import runtime_limits
from rpeg.spec import load_cluster

from .conftest import EVERY_ENGINE, ROOT, colocated_start

QUICK = SearchOptions(seed=0, iterations=300, patience=200, limits=EVERY_ENGINE)


@pytest.fixture(scope="module")
def gh64():
    return load_cluster(ROOT / "pipelines/clusters/gh200_64.rpeg")


@pytest.fixture(scope="module")
def start(ppo8b, gh64):
    ctx, ev, out = colocated_start(ppo8b, gh64)
    return ctx, ev, out.best.plan


def with_carry(plan: Plan, stage: str, carry: int, lag: int = 0) -> Plan:
    return attrs.evolve(plan, predicted=None,
                        staleness=((stage, lag),) if lag else (),
                        placements=tuple(attrs.evolve(p, carry=carry) if p.stage == stage
                                         else p for p in plan.placements))


def test_a_capped_rollout_is_priced_faster_within_the_bound(start):
    _, ev, plan = start                          # ppo_llama8b: staleness rollout <= 1
    whole = ev.evaluate(plan)
    half = ev.evaluate(with_carry(plan, "rollout", 1))
    assert half.feasible and half.step_time_s < whole.step_time_s
    assert dict(half.plan.predicted.op_times)["rollout"] \
        < dict(whole.plan.predicted.op_times)["rollout"]
    assert "carry rollout = 1" in str(half.plan)
    assert ev.cap(half.plan.placement("rollout")) == 2048


def test_carries_beyond_the_bound_are_an_error(start):
    _, ev, plan = start
    with pytest.raises(PlanError, match=r"at most 1 updates old, not 2 \(staleness 1 \+ carry 1"):
        ev.evaluate(with_carry(plan, "rollout", 1, lag=1))
    with pytest.raises(PlanError, match=r"not 2 \(staleness 0 \+ carry 2"):
        ev.evaluate(with_carry(plan, "rollout", 2))
    with pytest.raises(PlanError, match="generate stage, not 'ref_lp'"):
        ev.evaluate(with_carry(plan, "ref_lp", 1))
    assert ev.evaluate(with_carry(plan, "rollout", 0, lag=1)).feasible


def test_repair_brings_a_cap_back_within_the_bound(start):
    ctx, _, plan = start
    assert repair(ctx, with_carry(plan, "rollout", 2)).placement("rollout").carry == 1
    assert repair(ctx, with_carry(plan, "rollout", 1, lag=1)).placement("rollout").carry == 0
    runtime = attrs.evolve(ctx, limits=runtime_limits())
    assert repair(runtime, with_carry(plan, "rollout", 1)).placement("rollout").carry == 0


@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 6))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_moves_never_leave_the_bound(start, seed, steps):
    import numpy as np
    ctx, ev, plan = start
    moves = Moves(ctx, np.random.default_rng(seed))
    for _ in range(steps):
        new = moves.partial(plan) if seed % 2 else moves.propose(plan)
        new = repair(ctx, new) if new is not None else None
        if new is None:
            continue
        plan = new
        assert plan.staleness_of("rollout") + plan.placement("rollout").carry <= 1


def test_search_uses_partial_rollouts_only_where_the_backend_runs_them(ppo8b, gh64):
    r = compile_report(ppo8b, gh64, options=QUICK)
    assert r.plan.placement("rollout").carry == 1  # the 4,096-token tail is worth cutting
    plain = compile_report(ppo8b, gh64, options=attrs.evolve(
        QUICK, limits=attrs.evolve(EVERY_ENGINE, carry_engines=frozenset())))
    assert all(p.carry == 0 for p in plain.plan.placements)
    assert r.plan.predicted.step_time_s < plain.plan.predicted.step_time_s
    with pytest.raises(PlanError, match="whole responses each step with the"):
        check_executable(r.plan, attrs.evolve(EVERY_ENGINE, carry_engines=frozenset()))
    again = Plan.from_json(r.plan.to_json())
    assert again == r.plan


def test_a_plan_written_before_partial_rollouts_still_loads(start):
    _, _, plan = start
    data = plan.to_dict()
    for p in data["placements"]:
        del p["carry"]
    assert Plan.from_dict(data) == plan


def test_compile_plans_what_rpeg_run_executes_unless_asked_for_any_executor(tmp_path, capsys):
    from rpeg.cli import main
    spec = str(ROOT / "pipelines/ppo_llama8b.rpeg")
    gh = str(ROOT / "pipelines/clusters/gh200_64.rpeg")
    quick = ["--iterations", "300", "--no-gantt"]
    assert main(["compile", spec, "--cluster", gh, "-o", str(tmp_path / "a.json"), *quick,
                 "--any-executor"]) == 0
    text = capsys.readouterr().out
    assert "staleness: rollout reads this step's weights and carries responses over 1 step " \
           "(partial rollouts: about 2048 of their up to 4096 tokens a step), so a token is " \
           "at most 1 update old (staleness 0 + carry 1 of the spec's bound 1)" in text
    assert "synchronous" not in text
    assert text.count("note: planned for any executor (--any-executor)") == 1
    # it says once whether rpeg run could run it
    assert ("`rpeg run` cannot execute this plan" in text) != \
        ("`rpeg run` executes this plan too" in text)
    for flags, name in (((), "b.json"), (("--runnable",), "c.json")):
        assert main(["compile", spec, "--cluster", gh, "-o", str(tmp_path / name), *quick,
                     *flags]) == 0
        text = capsys.readouterr().out
        assert "cannot execute" not in text and "note: planned for any executor" not in text
        runnable = Plan.load(tmp_path / name)
        check_executable(runnable, Limits.runtime())
        assert all(p.engine in Limits.runtime().carry_engines
                   for p in runnable.placements if p.carry)
    assert (tmp_path / "b.json").read_text() == (tmp_path / "c.json").read_text()


def test_diff_names_the_carry(start):
    from rpeg.plan.diff import diff_plans
    _, _, plan = start
    text = str(diff_plans(plan, with_carry(plan, "rollout", 1)))
    assert text.splitlines()[1:] == ["  carry rollout: 0 -> 1"]


def test_allowing_partial_rollouts_never_returns_a_slower_plan(ppo8b):
    """The walk without partial rollouts is the same one a backend without them gets; the
    walk that adds them starts from its best (here, a case where a single walk over the
    larger space once ended slower)."""
    from rpeg.cost.profiles import cluster_of
    gh16 = cluster_of("gh200", 4, 4)
    for k in (1, 2):
        spec = attrs.evolve(ppo8b, staleness=(("rollout", k),))
        carry = compile_report(spec, gh16, options=QUICK)
        plain = compile_report(spec, gh16, options=attrs.evolve(
            QUICK, limits=attrs.evolve(EVERY_ENGINE, carry_engines=frozenset())))
        assert carry.plan.predicted.step_time_s <= plain.plan.predicted.step_time_s + 1e-9
