"""Spec + cluster -> the fastest plan that fits: the planner's table of contents.

    >>> from rpeg.spec import load, load_cluster                          # doctest: +SKIP
    >>> plan = compile_plan(load("pipelines/ppo_llama8b.rpeg"),
    ...                     load_cluster("pipelines/clusters/gh200_64.rpeg"),
    ...                     options=SearchOptions(seed=0, iterations=1500))  # doctest: +SKIP
    >>> plan.predicted.step_time_s                                        # doctest: +SKIP
    10.02

``compile_report`` also returns the baselines it measured against and the search's
statistics (the CLI prints them); ``compile_plan`` returns the plan alone. The plan
records the options it was searched with (``Plan.search``), so ``recompile`` makes it
again from its file.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import attrs

import rpeg
from rpeg.cost.memory import usable_memory, with_reserve
from rpeg.errors import PlanError, Span
from rpeg.plan.baselines import BASELINES, Found, run_baselines
from rpeg.plan.choices import Choice, model_stages
from rpeg.plan.edit import Context, placement, repair
from rpeg.plan.evaluate import Evaluation, Evaluator, Shortfall
from rpeg.plan.hints import (
    MORE_GPUS,
    Hint,
    binding,
    least_need,
    more_gpus_hint,
    plan_hints,
    reserve_hint,
    stage_hints,
)
from rpeg.plan.model import Plan, Strategy
from rpeg.plan.options import SearchOptions, SearchRecord, Start
from rpeg.plan.pinned import check_pins
from rpeg.plan.search import (
    SearchResult,
    anneal,
    capped,
    merged,
    polish,
    random_plan,
    staleness_caps,
)
from rpeg.plan.space import Limits, generate_engines
from rpeg.plan.staleness import explicit
from rpeg.plan.validate import spec_hash_of
from rpeg.spec.model import Cluster, Engine, OpKind, Pipeline

GB = 1e9
WARM_PATIENCE = 0.75     # share of the patience a walk started from a tighter cap's best gets
CARRY_PATIENCE = 0.5     # ... and a walk adding partial rollouts to the best without them
SUB_SHARE = 8            # a cluster of this many racks or more is first searched on 1/8 of them
SEEDED_PATIENCE = 0.25   # share of its patience a walk gets where the sub-cluster's plan is a start


@attrs.frozen
class CompileReport:
    plan: Plan
    evaluation: Evaluation
    baselines: tuple[tuple[Strategy, Evaluation | None], ...]
    search: SearchResult | None
    seconds: float

    def speedup(self, strategy: Strategy) -> float | None:
        ev = dict(self.baselines).get(strategy)
        if ev is None:
            return None
        return ev.step_time_s / self.evaluation.step_time_s


def compile_plan(pipeline: Pipeline, cluster: Cluster, strategy: Strategy = Strategy.SEARCH,
                 options: SearchOptions | None = None) -> Plan:
    """The best plan found for ``pipeline`` on ``cluster`` (PlanError if none fits)."""
    return compile_report(pipeline, cluster, strategy, options).plan


def compile_report(pipeline: Pipeline, cluster: Cluster, strategy: Strategy = Strategy.SEARCH,
                   options: SearchOptions | None = None) -> CompileReport:
    opts = options or SearchOptions()
    began = time.perf_counter()
    spec = pipeline
    if opts.staleness_cap is not None:                    # plans a tighter bound allows
        pipeline = capped(pipeline, opts.staleness_cap)
    check_backend(pipeline, opts.limits, cluster)                      # refuse what can't run
    ctx = Context.of(pipeline, cluster, opts.limits)                   # enumerate, prune, estimate
    ev = Evaluator(pipeline, cluster, steps=opts.steps, engine_kv=opts.limits.engine_kv)
    if strategy is Strategy.PINNED:                                    # priced as written
        return _pinned_report(pipeline, cluster, ev, opts, began)
    wanted = tuple(BASELINES) if strategy is Strategy.SEARCH else (strategy,)
    if strategy not in BASELINES and strategy is not Strategy.SEARCH:
        raise PlanError(f"strategy must be search, colocated, split or realloc, not "
                        f"{strategy.value}")
    unfit = unfit_stage(ctx)                           # nothing fits: said before any search
    if unfit is not None:
        raise unfit
    if strategy is not Strategy.SEARCH:
        outcomes = run_baselines(wanted, ctx, ev)                      # hand-tuned baselines
        feasible, closest = _found(outcomes)
        if not feasible:
            raise no_fit(ctx, closest, ev, strategy)
        best, result = min(feasible, key=lambda e: e.step_time_s), None
    else:
        outcomes, best, result = _search_ladder(ctx, ev, opts)         # optimise
    # the full figures, every bounded stage's staleness written out (a synchronous one as 0)
    best = ev.evaluate(explicit(spec, attrs.evolve(best.plan, predicted=None)))
    baselines_full = [(o.strategy, ev.evaluate(explicit(spec, o.best.plan))
                       if o.best else None) for o in outcomes]
    if strategy is Strategy.SEARCH and opts.start is Start.BASELINES:
        # never slower than a baseline it could start from, as priced in full
        best = min([best] + [e for _, e in baselines_full if e is not None and e.feasible],
                   key=lambda e: e.step_time_s)
    record = SearchRecord(opts, result.iterations if result else 0,
                          result.time_capped if result else False)
    plan = attrs.evolve(best.plan, strategy=strategy, seed=opts.seed,
                        spec_hash=spec_hash(pipeline), rpeg_version=rpeg.__version__,
                        spec_path=_abs(pipeline.path), cluster_path=_abs(cluster.path),
                        search=record)
    final = attrs.evolve(best, plan=plan)
    baselines = tuple(baselines_full)
    return CompileReport(plan, final, baselines, result, time.perf_counter() - began)


def _pinned_report(pipeline: Pipeline, cluster: Cluster, ev: Evaluator, opts: SearchOptions,
                   began: float) -> CompileReport:
    """The plan the spec's pins describe, priced; PlanError when it does not fit."""
    from rpeg.plan.known import pinned_plan
    plan = pinned_plan(pipeline, cluster, opts.limits)
    result = ev.evaluate(plan)
    if not result.feasible:
        raise pinned_no_fit(pipeline, cluster, result.shortfall, opts.limits, result)
    plan = attrs.evolve(result.plan, seed=opts.seed, spec_hash=spec_hash(pipeline),
                        rpeg_version=rpeg.__version__, spec_path=_abs(pipeline.path),
                        cluster_path=_abs(cluster.path),
                        search=SearchRecord(opts, 0, False))
    return CompileReport(plan, attrs.evolve(result, plan=plan), (), None,
                         time.perf_counter() - began)


def pinned_no_fit(pipeline: Pipeline, cluster: Cluster, sf: Shortfall,
                  limits: Limits | None = None, evaluation: Evaluation | None = None
                  ) -> PlanError:
    """The error for a pinned plan that does not fit: the stage, what fills the GPU, and a
    checked change that makes it fit (:mod:`rpeg.plan.hints`)."""
    limits = limits or Limits()
    hs: tuple[Hint, ...] = ()
    if evaluation is not None:
        ev = Evaluator(pipeline, cluster, engine_kv=limits.engine_kv)
        hs = plan_hints(ev, evaluation.plan, sf, limits)
        r = reserve_hint(ev, evaluation.plan, cluster)
        hs += (r,) if r is not None else ()
    return shortfall_error(pipeline, cluster, limits, sf, "the pinned plan", hs,
                           "no one change to it that this executor runs makes it fit")


def shortfall_error(pipeline: Pipeline, cluster: Cluster, limits: Limits, sf: Shortfall,
                    what: str, hints: tuple[Hint, ...] = (), otherwise: str = "") -> PlanError:
    """``what`` does not fit: the GPU, the stage with the largest need there and its layout,
    what fills the GPU by kind against what a plan may use of it, and the checked hints
    (else ``otherwise``: what binds)."""
    cap = usable_memory(cluster.gpu)
    s = pipeline.stage(sf.op) if sf.op else None
    kinds = ", ".join(f"{k.replace('_', ' ')} {b / GB:.1f} GB" for k, b in sf.kinds if b > 0)
    layout = f" running {sf.op} as {_layout_words(sf.layout)}" if sf.layout else ""
    err = PlanError(
        f"{what} must fit in {cap / GB:.0f} GB per GPU ({cluster.gpu.memory / GB:.0f} GB "
        f"less its {cluster.gpu.reserve:.0%} reserve), not need {sf.need / GB:.1f} GB on "
        f"GPU {sf.device}{layout} ({kinds or ', '.join(f'{w} {b / GB:.1f} GB' for w, b in sf.what)})",
        s.span if s else None,
        hint="; ".join(h.text for h in hints) if hints else otherwise)
    err.hints = hints
    return err


def _layout_words(p) -> str:
    parts = [f"dp {p.dp}", f"tp {p.tp}", f"pp {p.pp}"] + (
        [f"cp {p.cp}"] if p.cp > 1 else []) + ([f"zero {p.zero}"] if not p.zero.replicated else []) + (
        ["recompute"] if p.recompute else []) + (["offload"] if p.offload else []) + (
        [f"{p.microbatches} micro-batches"] if p.microbatches > 1 else []) + [p.engine.value]
    return ", ".join(parts)


def recompile(plan: Plan, path: str = "<plan>", cluster: str | Path | None = None
              ) -> CompileReport:
    """Compile again what made ``plan`` (read from ``path``): the spec and cluster files it
    names (``cluster`` overrides the latter), its strategy and its recorded search options.
    A reproducible plan (``plan.search.reproducible``) comes back equal, unless the files or
    rpeg changed since; PlanError when the plan lacks what it needs."""
    from rpeg.spec import load, load_cluster

    where = Span(path, 0, 0)
    if plan.search is None:
        raise PlanError("plan must record the search options it was compiled with, not lack "
                        "them (written by hand, or by an older rpeg)", where,
                        hint="compile the spec: rpeg compile SPEC --cluster CLUSTER --seed N")
    from rpeg.plan.validate import plan_spec, recorded_file
    spec = plan_spec(plan, Path(path))
    machine = Path(cluster) if cluster else recorded_file(plan.cluster_path, Path(path))
    if machine is None or not machine.is_file():
        raise PlanError(f"the plan's cluster file must exist to remake the plan, not be "
                        f"missing ({cluster or plan.cluster_path or 'none recorded'})", where,
                        hint="pass --cluster FILE")
    strategy = plan.strategy if plan.strategy is not Strategy.MANUAL else Strategy.SEARCH
    loaded = load_cluster(machine)
    pr = plan.predicted
    if pr is not None and pr.memory_capacity:      # the reserve it was compiled with
        loaded = with_reserve(loaded, pr.memory_reserve / pr.memory_capacity)
    return compile_report(load(spec), loaded, strategy, plan.search.options)


def _found(outcomes) -> tuple[list[Evaluation], list[Evaluation]]:
    return ([o.best for o in outcomes if o.best is not None],
            [o.closest for o in outcomes if o.closest is not None])


def _search_ladder(ctx: Context, ev: Evaluator, opts: SearchOptions):
    """:func:`_ladder` on ``ctx``; on a cluster of at least :data:`SUB_SHARE` racks, first
    on its first 1/SUB_SHARE of the racks (:func:`_sub_cluster`, searched the same way, so
    recursively), that ladder's best plan under each cap (and its best without partial
    rollouts) being one more start of the same cap's walks here. The sub-cluster's plans
    run as they are on the whole cluster, the rest of its GPUs idle, so more GPUs never
    give a slower plan than the sub-cluster's; the budget is the sub-cluster's walks' and
    this one's proposals, so the same seed gives the same plan.
    Returns the baselines under the spec's bound, the best plan, the walks' statistics."""
    deadline = time.monotonic() + opts.time_cap_s     # the safety cap over every walk
    return _seeded(ctx, ev, opts, deadline)[:3]


def _seeded(ctx: Context, ev: Evaluator, opts: SearchOptions, deadline: float):
    """:func:`_search_ladder`'s ladder, with each cap's best plans (as :func:`_ladder`)."""
    sub = _sub_cluster(ctx.cluster)
    try:                       # a pin beyond the sub-cluster, or nothing fits it: no seeds
        small = Context.of(ctx.pipeline, sub, ctx.limits, like=ctx) if sub else None
        if small is None or not all_fit(small):
            found = None
        else:
            sev = Evaluator(ctx.pipeline, sub, steps=ev.steps, engine_kv=ev.engine_kv)
            _, _, found, reached = _seeded(small, sev, opts, deadline)
    except PlanError:
        found = None
    seeds = {} if found is None else {
        cap: tuple(_on(ev, e.plan) for e in plans) for cap, plans in reached.items()}
    outcomes, best, result, reached = _ladder(ctx, ev, opts, deadline, seeds)
    if found is not None:              # the sub-cluster's proposals count as this search's
        result = attrs.evolve(merged([found, result]), best=result.best)
    return outcomes, best, result, reached


def _patience(opts: SearchOptions, share: float) -> int:
    """``share`` of the options' patience, at least one proposal (0, no patience, stays 0:
    a small ``--patience`` never becomes a walk of its whole budget)."""
    return max(1, int(opts.patience * share)) if opts.patience else 0


def _sub_cluster(cluster: Cluster) -> Cluster | None:
    """The first 1/:data:`SUB_SHARE` of ``cluster``'s racks (its nodes and links alike), or
    None on a cluster of fewer racks."""
    if cluster.racks < SUB_SHARE:
        return None
    return attrs.evolve(cluster, racks=cluster.racks // SUB_SHARE)


def _on(ev: Evaluator, plan: Plan) -> Evaluation | None:
    """``plan`` (made for a sub-cluster) priced on ``ev``'s cluster; None if it does not fit."""
    plan = attrs.evolve(plan, cluster=ev.cluster.name, num_devices=ev.cluster.num_gpus,
                        predicted=None)
    try:
        r = ev.evaluate(plan, detail=False)
    except PlanError:
        return None
    return r if r.feasible else None


def _ladder(ctx: Context, ev: Evaluator, opts: SearchOptions, deadline: float,
            seeds: dict[int, tuple[Evaluation, ...]] | None = None):
    """Search under each staleness cap in turn, 0 up to the spec's bound. Under cap 0 the
    walk starts from the best baseline; under each higher cap from the better of the best
    plan of the caps below and the best baseline under this cap (warm: 3/4 of the
    patience), the other and the rest of this cap's baselines being the starts it
    restarts from when it stalls. So no walk ends slower than a baseline it could start
    from, what a tighter bound finds is never lost, and the walk under a cap depends
    only on that cap (a spec with a larger bound
    repeats the same walks, then climbs further). Above cap 0, where a generate stage may
    carry responses into later steps, each cap's walk leaves partial rollouts out (the
    walk a backend without them gets), then a second walk (1/2 of the patience) adds
    them, starting from the best of the best plan so far and it and the baselines
    spending the bound on carrying: allowing partial rollouts never returns a slower plan.
    Each walk's best is polished (:func:`rpeg.plan.search.polish`) and the answer is the
    best of those; the walks start from the walks' own bests, so polishing changes no walk
    (a plan is never slower than without it) and a larger bound polishes what a tighter one
    did, and more. With ``Start.RANDOM`` no baseline is a start or a restart: cap 0's walk starts from
    :func:`random_plan`, and every later walk from the search's own plans (the baselines
    are still priced, to compare with). ``seeds``: cap -> the best plan without partial
    rollouts and the best plan a sub-cluster's ladder found under that cap (as this one
    returns them; None where it found none), each one more start of the same cap's walks,
    which then get :data:`SEEDED_PATIENCE` of their patience (the sub-cluster's walks
    searched most of what they would).
    Returns the baselines under the spec's bound, the best plan, the walks' statistics,
    and cap -> (the best plan without partial rollouts, the best plan) up to that cap."""
    caps = staleness_caps(ctx.pipeline)
    seeds = seeds or {}
    reached: dict[int, tuple[Evaluation, ...]] = {}   # what the ladder returns per cap
    plains: list[SearchResult] = []          # the walks without partial rollouts, polished
    walks: list[SearchResult] = []
    done: list[SearchResult] = []            # the walks, their best plans polished
    whole: list[SearchResult] = []           # the walks without partial rollouts
    prev: Evaluation | None = None           # the best of those, which the next cap starts from
    outcomes, closest = [], []
    found = Found()                          # what the baselines find under every cap alike
    for cap in caps:
        plain_seed, carry_seed = seeds.get(cap, (None, None))
        here = ctx if cap == caps[-1] else attrs.evolve(ctx, pipeline=capped(ctx.pipeline, cap))
        outcomes = run_baselines(tuple(BASELINES), here, ev, found)    # hand-tuned baselines
        feasible, near = _found(outcomes)
        closest += near
        feasible.sort(key=lambda e: e.step_time_s)
        if opts.start is Start.RANDOM:            # the search alone: no baseline to start from
            feasible, near = [], []
            drawn = random_plan(here, opts.seed) if prev is None else None
            if drawn is not None:
                r = ev.evaluate(drawn, detail=False)
                feasible, near = ([r], []) if r.feasible else ([], [r])
        if plain_seed is not None:              # the sub-cluster's plan: one more start
            feasible = sorted(feasible + [plain_seed], key=lambda e: e.step_time_s)
        if prev is not None and prev.feasible:    # warm: the best of the tighter caps and
            # of this cap's baselines, the other one first among the walk's restarts
            first, *rest = sorted([prev, *feasible], key=lambda e: e.step_time_s)
            start, others, share, stream = first, tuple(rest), WARM_PATIENCE, (cap,)
        elif feasible:
            start, others, share, stream = feasible[0], tuple(feasible[1:]), 1.0, ()
        elif near or prev is not None:    # the search may still walk into a plan that fits
            start = min(near + ([prev] if prev else []), key=lambda e: e.shortfall.over)
            others, share, stream = (), 1.0, ()
        else:
            continue
        if plain_seed is not None:    # the sub-cluster's walks searched most of the space
            share *= SEEDED_PATIENCE
        # The walk without partial rollouts is the same whatever the backend allows; where
        # a generate stage may carry responses over, a second walk adds them, from the best
        # plan so far. So allowing them never returns a slower plan.
        plain = attrs.evolve(here, limits=attrs.evolve(here.limits, carry_engines=frozenset()))
        walks.append(anneal(plain, ev, start, attrs.evolve(
            opts, patience=_patience(opts, share)), others, stream, deadline))
        done.append(_polished(plain, ev, walks[-1], deadline))
        whole.append(walks[-1])
        plains.append(done[-1])
        prev = merged(whole).best
        reached[cap] = (merged(plains).best, merged(done).best)
        if cap > 0 and _may_carry(here):
            # Starts: the best plan so far, and it and the baselines carrying responses
            # over as many steps as the bound allows (staleness spent on the carry).
            starts = [merged(walks).best] + [
                e for e in (_carrying(here, ev, x.plan) for x in [merged(walks).best, *feasible])
                if e is not None] + ([carry_seed] if carry_seed is not None else [])
            starts.sort(key=lambda e: (not e.feasible, e.step_time_s))
            carry = CARRY_PATIENCE * (SEEDED_PATIENCE if carry_seed is not None else 1.0)
            walks.append(anneal(here, ev, starts[0], attrs.evolve(
                opts, patience=_patience(opts, carry)),
                tuple(e for e in starts[1:] if e.feasible), stream + (1,), deadline))
            done.append(_polished(here, ev, walks[-1], deadline))
            reached[cap] = (merged(plains).best, merged(done).best)
    if not walks:
        raise no_fit(ctx, closest, ev)
    result = merged(done)
    if not result.best.feasible:
        raise no_fit(ctx, closest + [result.best], ev)
    return outcomes, result.best, result, reached


def _polished(ctx: Context, ev: Evaluator, result: SearchResult,
              deadline: float) -> SearchResult:
    """``result`` with its best plan polished (:func:`rpeg.plan.search.polish`; not after
    the time cap stopped the walk): the neighbours priced count as the walk's proposals."""
    if result.time_capped:
        return result
    best, tried = polish(ctx, ev, result.best, deadline=deadline)
    more = dict(iterations=result.iterations + tried, polished=result.polished + tried,
                time_capped=time.monotonic() > deadline)     # the cap may have cut it short
    if best is result.best:
        return attrs.evolve(result, **more)
    return attrs.evolve(result, best=best, improved=result.improved + 1, trace=result.trace
                        + ((result.iterations + tried, best.step_time_s),), **more)


def _carrying(ctx: Context, ev: Evaluator, plan: Plan) -> Evaluation | None:
    """``plan`` with every bounded generate stage spending its whole staleness bound on
    carrying responses over (its own staleness 0), evaluated; None if that is no plan."""
    bounds = {s: k for s, k in ctx.pipeline.staleness
              if k > 0 and ctx.pipeline.stage(s).kind is OpKind.GENERATE}
    new = attrs.evolve(plan, predicted=None,
                       staleness=tuple(x for x in plan.staleness if x[0] not in bounds),
                       placements=tuple(attrs.evolve(p, carry=bounds[p.stage])
                                        if p.stage in bounds else p for p in plan.placements))
    new = repair(ctx, new)
    if new is None or all(p.carry == 0 for p in new.placements):
        return None
    try:
        return ev.evaluate(new, detail=False)
    except PlanError:
        return None


def _may_carry(ctx: Context) -> bool:
    """Whether some generate stage could carry responses into later steps here."""
    return bool(ctx.limits.carry_engines) and any(
        k > 0 and ctx.pipeline.stage(s).kind is OpKind.GENERATE
        for s, k in ctx.pipeline.staleness)


def _abs(path: str) -> str:
    return str(Path(path).resolve()) if path and Path(path).exists() else path


def spec_hash(pipeline: Pipeline) -> str:
    """The hash a plan records of its spec (:func:`rpeg.plan.validate.spec_hash_of`: the
    file and the bases it extends); of the pipeline's value where it was read from no file."""
    return spec_hash_of(pipeline) or \
        hashlib.sha256(repr(attrs.evolve(pipeline, path="")).encode()).hexdigest()[:16]


def check_backend(pipeline: Pipeline, limits: Limits, cluster: Cluster | None = None) -> None:
    """PlanError when the spec asks for something the executor does not run (an engine, a
    pinned layout)."""
    if cluster is not None:
        check_pins(pipeline, cluster, limits)
    used = {s.target for s in pipeline.stages}
    for m in pipeline.models:
        if m.name not in used:
            continue
        why = limits.check_model(m)
        if why:
            raise PlanError(why, m.span, hint="plan it for an executor that builds it with "
                                              "`rpeg compile --any-executor`")
        if m.dtype == "fp8" and cluster is not None and cluster.gpu.fp8_flops <= 0:
            raise PlanError(f"model '{m.name}' must run in a dtype GPU '{cluster.gpu.name}' "
                            f"computes, not fp8 (its profile gives no FP8 throughput)", m.span,
                            hint="use dtype = bf16, or a GPU with FP8 (H100, H200, H20, B200)")
    for s in pipeline.stages:
        if s.kind is OpKind.GENERATE:
            generate_engines(pipeline, s.name, limits)


def check_executable(plan: Plan, limits: Limits) -> None:
    """PlanError when a plan (searched or hand-written) asks more than the backend runs."""
    for p in plan.placements:
        why = limits.check_parallel(p.layout)
        if why:
            raise PlanError(f"stage '{p.stage}': {why}",
                            hint="recompile with this backend's limits")
        if p.engine not in limits.engines and p.engine is not Engine.AUTO:
            raise PlanError(f"stage '{p.stage}' must use an installed engine, not "
                            f"'{p.engine.value}'", hint="install it, or recompile")
        if p.carry and p.engine not in limits.carry_engines:
            raise PlanError(f"stage '{p.stage}' must generate whole responses each step with "
                            f"the {p.engine.value} engine on this backend, not carry them "
                            f"into later steps (carry {p.carry})",
                            hint="recompile with this backend's limits (carry 0)")
        why = limits.check_engine(p.engine, p.tp, p.carry) or limits.check_batching(
            p.engine, p.max_num_seqs, p.kv_fraction, p.cuda_graph)
        if why:
            raise PlanError(f"stage '{p.stage}': {why}",
                            hint="recompile with this backend's limits")


def no_fit(ctx: Context, closest: list[Evaluation], ev: Evaluator | None = None,
           strategy: Strategy = Strategy.SEARCH) -> PlanError:
    """The error for 'nothing fits': which model and op is short, by how much, and a change
    checked to make it fit, else what binds (:mod:`rpeg.plan.hints`; ``ev``: the evaluator
    that priced ``closest``)."""
    unfit = unfit_stage(ctx)
    if unfit is not None:
        return unfit
    if closest:
        near = min(closest, key=lambda e: e.shortfall.over)
        sf: Shortfall = near.shortfall
        ev = ev or Evaluator(ctx.pipeline, ctx.cluster, engine_kv=ctx.limits.engine_kv)
        if not sf.kinds:                            # a search's figures leave them out
            sf = ev.evaluate(attrs.evolve(near.plan, predicted=None)).shortfall or sf
        hs = plan_hints(ev, near.plan, sf, ctx.limits)
        more = more_gpus_hint(ctx.pipeline, ctx.cluster, ctx.limits)
        r = reserve_hint(ev, near.plan, ctx.cluster)
        hs += tuple(h for h in (more, r) if h is not None)
        return shortfall_error(ctx.pipeline, ctx.cluster, ctx.limits, sf,
                               "the best plan found", hs,
                               f"every stage fits alone but they do not fit together on "
                               f"{ctx.cluster.num_gpus} GPUs, and neither one change to "
                               f"{sf.op} nor up to {MORE_GPUS[-1]}x the GPUs makes a plan fit")
    if strategy is Strategy.SPLIT and ctx.n < 2:
        return PlanError(f"the split baseline must have disjoint groups of GPUs for "
                         f"generation and training, not {ctx.n} GPU",
                         hint="use --strategy colocated, realloc or search on one GPU")
    hint = "add GPUs" if ctx.limits == Limits() else \
        "plan it for any executor with `rpeg compile --any-executor`, or add GPUs"
    what = "no plan" if strategy is Strategy.SEARCH else f"no {strategy.value} plan"
    return PlanError(f"{what} fits this cluster: no stage has a layout this executor runs",
                     hint=hint)


def unfit_stage(ctx: Context) -> PlanError | None:
    """The error for a model stage that fits no block of the cluster alone, in any layout
    the executor runs (then nothing fits, whatever a search tries), with a change checked
    to make it fit, else what binds; every other such stage a note of it, with its own
    (a hint applied for the first must not lead into an error it did not say); None if
    there is none."""
    found = [e for e in (_unfit(ctx, s) for s in model_stages(ctx.pipeline)) if e is not None]
    if not found:
        return None
    first, *rest = found
    first.notes = tuple(first.notes) + tuple(
        (e.message + (f" (hint: {e.hint})" if e.hint else ""), e.span) for e in rest)
    return first


def all_fit(ctx: Context) -> bool:
    """Whether every model stage fits some block of the cluster alone (:func:`unfit_stage`
    says nothing), asked without pricing a hint."""
    return all(_fits_alone(ctx, s) for s in model_stages(ctx.pipeline))


def _fits_alone(ctx: Context, stage: str) -> bool:
    return any(ctx.table.options(stage, size) for size in ctx.table.sizes)


def _unfit(ctx: Context, stage: str) -> PlanError | None:
    """:func:`unfit_stage`'s error for ``stage`` alone, or None where it fits a block."""
    if _fits_alone(ctx, stage):
        return None
    cap = usable_memory(ctx.cluster.gpu)
    need, par, engine, kinds = least_need(ctx.pipeline, stage, ctx.cluster, ctx.limits)
    s = ctx.pipeline.stage(stage)
    what = _what(ctx, stage)
    if par is None:
        hint = "check its place pin against the executor" + (
            "" if ctx.limits == Limits() else ", or plan it with --any-executor")
        return PlanError(f"{what} ({stage}) must have a layout this executor runs on "
                         f"this cluster, not none", s.span, hint=hint)
    p = placement(stage, tuple(range(par.size)), Choice(stage, par.size, par,
                                                       engine, 0, need))
    sf = Shortfall(0, need, cap, stage, s.target, (), kinds, p)
    return shortfall_error(ctx.pipeline, ctx.cluster, ctx.limits, sf,
                           f"{what} ({stage}) alone, in its smallest layout,",
                           stage_hints(ctx.pipeline, ctx.cluster, ctx.limits, stage),
                           binding(ctx.pipeline, ctx.cluster, ctx.limits, stage))


def _what(ctx: Context, stage: str) -> str:
    if not stage:
        return "the plan"
    s = ctx.pipeline.stage(stage)
    kind = {OpKind.TRAIN: "training", OpKind.GENERATE: "generation",
            OpKind.FORWARD: "inference", OpKind.SCORE: "scoring"}.get(s.kind, s.kind.value)
    return f"{s.target} {kind}"


__all__ = ["compile_plan", "compile_report", "recompile", "CompileReport", "check_backend",
           "check_executable", "SearchOptions", "Limits"]
