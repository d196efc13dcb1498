"""A plan's staleness: what it chose for each stage, read one way by everything that reads it.

    >>> spec = load("pipelines/tiny_ppo.rpeg")                    # doctest: +SKIP
    >>> chosen_staleness(spec, plan)                              # doctest: +SKIP
    {'rollout': 0}
    >>> explicit(spec, plan).staleness                            # doctest: +SKIP
    (('rollout', 0),)

A spec bounds a stage's staleness (``staleness rollout <= 1``); a plan chooses, for each
bounded stage, a staleness within the bound, and for a generate stage how many steps it
carries responses over (``StagePlacement.carry``), which spends the same bound
(:func:`rpeg.graph.versions.bound_problem`). rpeg writes every bounded stage into
``Plan.staleness``, a synchronous one as 0 (:func:`explicit`). A stage a plan does not
list — plans written before every stage was listed stored a synchronous choice as an
empty list — is synchronous, staleness 0: the cost model priced those plans that way,
and the runtime and ``rpeg verify`` read them the same way, never as the spec's bound.

The cost model and the simulator (``rpeg.plan.evaluate.plan_graph``), the runtime
(``rpeg.runtime.lowering.instances``) and ``rpeg verify`` build their step graph with
:func:`step_graph`, so the version edges they read carry the same lags.
"""

from __future__ import annotations

import attrs

from rpeg.cost.partial import smallest_cap
from rpeg.graph import Graph, build
from rpeg.graph.versions import bound_problem
from rpeg.plan.model import Plan
from rpeg.spec.model import OpKind, Pipeline


def chosen_staleness(pipeline: Pipeline, plan: Plan) -> dict[str, int]:
    """Stage -> the staleness the plan chose, for every stage the spec bounds (a stage the
    plan does not list: 0) and any other the plan lists."""
    chosen = {stage: plan.staleness_of(stage) for stage, _ in pipeline.staleness}
    return {**chosen, **dict(plan.staleness)}


def explicit(pipeline: Pipeline, plan: Plan) -> Plan:
    """``plan`` with every stage the spec bounds listed in its staleness, 0 included."""
    listed = tuple(sorted(chosen_staleness(pipeline, plan).items()))
    return plan if listed == plan.staleness else attrs.evolve(plan, staleness=listed)


def step_graph(pipeline: Pipeline, plan: Plan) -> Graph:
    """The step graph of the plan's structural choices (staleness, sharing), unfused."""
    return build(pipeline, staleness=chosen_staleness(pipeline, plan),
                               share=bool(plan.shared))


def staleness_problem(pipeline: Pipeline, plan: Plan) -> str | None:
    """Why the plan's staleness or partial rollouts break the spec, or None: only a
    generate stage carries responses over, and every stage's staleness plus its carry stays
    within the spec's bound (a response's oldest token is that many updates old)."""
    bounds = dict(pipeline.staleness)
    stages = {s.name for s in pipeline.stages}
    carries = {p.stage: p.carry for p in plan.placements if p.carry and p.stage in stages}
    for stage, carry in carries.items():
        kind = pipeline.stage(stage).kind
        if kind is not OpKind.GENERATE:
            return (f"partial rollouts must be asked of a generate stage, not '{stage}' "
                    f"({kind.value})")
        if pipeline.stage(stage).arg("refill_rounds"):
            return (f"stage '{stage}' samples dynamically (refill_rounds): it must generate "
                    f"whole groups of responses each step, not carry them over ({carry})")
    for stage, lag in chosen_staleness(pipeline, plan).items():
        if stage not in stages:
            return f"the plan's staleness must name stages of the pipeline, not '{stage}'"
        problem = bound_problem(stage, lag, carries.get(stage, 0), bounds.get(stage, 0))
        if problem:
            return problem
    for stage, carry in carries.items():
        if stage not in bounds:
            return bound_problem(stage, 0, carry, 0)
    return None


def describe(pipeline: Pipeline, plan: Plan) -> str:
    """One sentence per bounded stage: the staleness it reads with, the steps it carries
    responses over, and so how old a token may be, against the spec's bound."""
    bounds = dict(pipeline.staleness)
    if not bounds:
        return "synchronous (staleness 0)"
    longest = pipeline.workload.gen_len.max_len
    out = []
    for stage, lag in sorted(chosen_staleness(pipeline, plan).items()):
        carry = next((p.carry for p in plan.placements if p.stage == stage), 0)
        allows = f"the spec's bound {bounds.get(stage, 0)}"
        if not carry:
            out.append(f"{stage} synchronous (staleness 0 of {allows})" if not lag else
                       f"{stage} reads weights up to {_updates(lag)} old (staleness {lag} of "
                       f"{allows})")
            continue
        reads = "this step's weights" if not lag else f"weights up to {_updates(lag)} old"
        steps = "step" if carry == 1 else "steps"
        turns = _max_turns(pipeline, stage)
        what = (f"conversations over {carry} {steps} (they pause between turns: about "
                f"{-(-turns // (carry + 1))} of their up to {turns} turns a step)") if turns \
            else (f"responses over {carry} {steps} (partial rollouts: about "
                  f"{smallest_cap(longest, carry)} of their up to {longest} tokens a step)")
        out.append(f"{stage} reads {reads} and carries {what}, so a token is at most "
                   f"{_updates(lag + carry)} old (staleness {lag} + carry {carry} of {allows})")
    return "; ".join(out)


def _max_turns(pipeline: Pipeline, stage: str) -> int:
    """A generate stage's most turns when it holds conversations (0: single responses)."""
    from rpeg.spec.tools import conversation
    s = pipeline.stage(stage)
    conv = conversation(s, int(s.arg("max_len") or pipeline.workload.gen_len.max_len)) \
        if s.kind is OpKind.GENERATE else None
    return conv.max_turns if conv is not None else 0


def _updates(n: int) -> str:
    return f"{n} update" + ("" if n == 1 else "s")
