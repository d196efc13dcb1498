"""Baseline plans in the same cost model: what a competent user would configure by hand.

    >>> ctx = Context.of(pipeline, cluster, Limits())                 # doctest: +SKIP
    >>> out = colocated(ctx, Evaluator(pipeline, cluster))            # doctest: +SKIP
    >>> out.best.plan.strategy, round(out.best.step_time_s, 1)        # doctest: +SKIP
    (<Strategy.COLOCATED: 'colocated'>, 52.7)

- **colocated** (verl's hybrid engine): every stage on every GPU, time-shared, all
  models resident together; one tensor-parallel degree for the training/inference
  engine and one for generation, tuned by a grid over both, over the memory
  headroom each stage may use (which trades speed for ZeRO, micro-batches,
  recomputation) and over offloading the optimizer state to host memory between
  train steps (verl's optimizer offload). Generation runs in waves when its KV cache
  does not fit beside the resident models. Synchronous.
- **split** (OpenRLHF): disjoint contiguous GPU groups — generation, then one group per
  model holding its training and inference stages (on fewer GPUs than that, the models
  share the groups after generation's); the grid is every split of the cluster into
  those groups at 1/16 granularity, each stage in the fastest layout that fits,
  synchronous and (as OpenRLHF's async mode allows) at the spec's staleness bound.
- **realloc** (ReaL): every call with its own parallel strategy on all GPUs or half of
  them, parameters reallocated between calls (priced as weight resharding);
  synchronous; tuned by coordinate descent over each call's options.

Each returns the best feasible plan it found, and the closest infeasible one for the
diagnosis when none fits.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

import attrs

from rpeg.cost.memory import usable_memory
from rpeg.errors import PlanError
from rpeg.plan.choices import Choice, model_stages
from rpeg.plan.edit import Context, empty_plan, options, put, repair
from rpeg.plan.evaluate import Evaluation, Evaluator
from rpeg.plan.model import Plan, Strategy
from rpeg.plan.space import Block
from rpeg.spec.model import OpKind

HEADROOM = (1.0, 0.6, 0.4, 0.25, 0.15)       # share of a GPU one stage's choice may use
SPLIT_SIMULATED = 48                         # splits simulated, of those the rough estimate ranks best


@attrs.frozen
class Outcome:
    strategy: Strategy
    best: Evaluation | None          # the fastest feasible plan
    closest: Evaluation | None       # the infeasible plan nearest to fitting
    tried: int


class _Best:
    def __init__(self, strategy: Strategy, evaluator: Evaluator) -> None:
        self.strategy, self.ev = strategy, evaluator
        self.best: Evaluation | None = None
        self.closest: Evaluation | None = None
        self.tried = 0
        self.seen: set = set()

    def offer(self, plan: Plan | None) -> None:
        if plan is None:
            return
        plan = attrs.evolve(plan, strategy=self.strategy)
        if plan in self.seen:
            return
        self.seen.add(plan)
        self.tried += 1
        # a plan no faster than the best so far is not simulated: its step's least says so
        r = self.ev.evaluate(plan, detail=False,
                             bound=None if self.best is None else self.best.step_time_s)
        if r.feasible:
            if self.best is None or r.step_time_s < self.best.step_time_s:
                self.best = r
        elif self.closest is None or r.shortfall.over < self.closest.shortfall.over:
            self.closest = r

    def outcome(self) -> Outcome:
        return Outcome(self.strategy, self.best, self.closest, self.tried)


def _tps(ctx: Context, stage: str, size: int) -> list[int]:
    return sorted({c.par.tp for c in options(ctx, stage, size)})


def _fill(ctx: Context, plan: Plan, assignments: Iterable[tuple[str, Block, int | None,
                                                                  float]],
          offload: bool | None = None) -> Plan | None:
    """Put each (stage, block, tp or None, headroom) with its fastest fitting choice
    (train stages with their optimizer state offloaded or not, when ``offload`` says)."""
    cap = usable_memory(ctx.cluster.gpu)
    for stage, block, tp, room in assignments:
        opts = [c for c in options(ctx, stage, block.size)
                if (tp is None or c.par.tp == tp) and c.memory <= room * cap
                and (offload is None or c.par.offload == offload
                     or ctx.pipeline.stage(stage).kind is not OpKind.TRAIN)]
        if not opts:
            return None
        plan = put(ctx, plan, stage, block, opts[0])
    return repair(ctx, plan)


def colocated(ctx: Context, ev: Evaluator) -> Outcome:
    best = _Best(Strategy.COLOCATED, ev)
    everything = Block(0, ctx.n)
    stages = model_stages(ctx.pipeline)
    gens = [s for s in stages if ctx.pipeline.stage(s).kind is OpKind.GENERATE]
    others = [s for s in stages if s not in gens]
    gen_tps = sorted({tp for s in gens for tp in _tps(ctx, s, ctx.n)}) or [None]
    eng_tps = sorted({tp for s in others for tp in _tps(ctx, s, ctx.n)}) or [None]
    for gtp, etp, room, off in itertools.product(gen_tps, eng_tps, HEADROOM, (False, True)):
        plan = _fill(ctx, empty_plan(ctx),
                     [(s, everything, gtp, room) for s in gens]
                     + [(s, everything, etp, room) for s in others], offload=off)
        best.offer(plan)
    return best.outcome()


def _groups(ctx: Context) -> list[list[list[str]]]:
    """The GPU groups of a split: generation stages first, then one group per model with
    all its other stages; each group a list of models' stages (one model each, unless the
    cluster has fewer devices than groups: then the models share the groups after
    generation's, as evenly as they go, in the spec's order)."""
    stages = model_stages(ctx.pipeline)
    gens = [s for s in stages if ctx.pipeline.stage(s).kind is OpKind.GENERATE]
    by_model: dict[str, list[str]] = {}
    for s in stages:
        if s not in gens:
            by_model.setdefault(ctx.pipeline.stage(s).target, []).append(s)
    models = list(by_model.values())
    room = ctx.n - (1 if gens else 0)        # groups the models may have
    if models and len(models) > room >= 1:
        share = -(-len(models) // room)
        merged = [models[i:i + share] for i in range(0, len(models), share)]
    else:
        merged = [[m] for m in models]
    return ([[gens]] if gens else []) + merged


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0,) + cuts + (total,)
        yield tuple(b - a for a, b in itertools.pairwise(bounds))


def split(ctx: Context, ev: Evaluator, found: Found | None = None) -> Outcome:
    best = _Best(Strategy.SPLIT, ev)
    bounds = sorted({(s, ctx.pipeline.staleness_of(s)) for s in
                     (x.name for x in ctx.pipeline.stages)} - {(s, 0) for s in
                                                            (x.name for x in ctx.pipeline.stages)})
    stalenesses = [()] + ([tuple(bounds)] if bounds else [])
    if found is None or found.splits is None:
        splits = _splits(ctx, ev)
        if found is not None:
            found.splits = splits
    else:
        splits = found.splits
    for plan in splits:
        for st in stalenesses:
            best.offer(attrs.evolve(plan, staleness=st))
    return best.outcome()


def _splits(ctx: Context, ev: Evaluator, keep: int = SPLIT_SIMULATED) -> tuple[Plan, ...]:
    """The synchronous split plans worth simulating: each split of the cluster into the
    groups' blocks in the first headroom that fits, the ``keep`` most promising (rough
    step: slowest group + generation), the most promising first, ties in the order of the
    splits. They never read the staleness bounds.

    A split's rough step is one of its headrooms' (that of the first plan fitting), so the
    least of them bounds it from below: the splits are checked for memory (the dear part)
    in the order of that bound, and once ``keep`` of them fit, each rougher than the
    bound of the next, the rest could only rank after them. The same plans, in the same
    order, as checking every split."""
    groups = _groups(ctx)
    if len(groups) > ctx.n or len(groups) < 2:
        return ()                       # no two disjoint groups: nothing is split
    units = 16
    while units > len(groups) and ctx.n % units:
        units //= 2
    units = max(min(units, ctx.n), len(groups))
    unit = ctx.n // units
    rooms = HEADROOM if max(len(g) for g in groups) > 1 else (1.0, 0.75)
    tries = []                          # (least rough step, index, [(rough, plan) per room])
    for index, sizes in enumerate(_compositions(units, len(groups))):
        blocks = _blocks(sizes, unit)
        if not all(_respects_nodes(ctx, b.start, b.size) for b in blocks):
            continue
        roughs = [(_rough_step(ctx, ev, p, groups), p)
                  for p in _split_plans(ctx, groups, blocks, rooms)]
        if roughs:
            tries.append((min(r for r, _ in roughs), index, roughs))
    tries.sort(key=lambda t: t[:2])
    kept: list[tuple[float, int, Plan]] = []          # by (rough step, index)
    for bound, index, roughs in tries:
        if len(kept) >= keep and kept[keep - 1][:2] < (bound, index):
            break
        fitting = next(((r, p) for r, p in roughs if ev.fits(p)), None)
        if fitting is not None:
            bisect.insort(kept, (fitting[0], index, fitting[1]), key=lambda c: c[:2])
    return tuple(plan for _, _, plan in kept[:keep])


def _blocks(sizes: tuple[int, ...], unit: int) -> list[Block]:
    """The groups' contiguous blocks of ``sizes`` units of ``unit`` devices each."""
    starts = itertools.accumulate(sizes[:-1], initial=0)
    return [Block(start * unit, k * unit) for start, k in zip(starts, sizes, strict=True)]


def _split_plans(ctx: Context, groups: list[list[list[str]]], blocks: list[Block],
                 rooms: Iterable[float]) -> list[Plan]:
    """The split's plan in each of ``rooms`` where every model's stages have choices on
    its group's block (:func:`_group_choices`), repaired: the plans to try in turn. A
    headroom choosing what the one before it chose adds no plan (it would be the same)."""
    plans, before = [], None
    for room in rooms:
        picks = [(block, _group_choices(ctx, model, block.size, room))
                 for group, block in zip(groups, blocks, strict=True) for model in group]
        if any(chosen is None for _, chosen in picks) or picks == before:
            continue
        before = picks
        plan = empty_plan(ctx)
        for block, chosen in picks:
            for stage, choice in chosen:
                plan = put(ctx, plan, stage, block, choice)
        plan = repair(ctx, plan)
        if plan is not None:
            plans.append(plan)
    return plans


def _respects_nodes(ctx: Context, start: int, size: int) -> bool:
    """Whole nodes, or GPUs of one node (a group never straddles a node boundary)."""
    gpn = ctx.cluster.gpus_per_node
    if size % gpn == 0:
        return start % gpn == 0
    return start // gpn == (start + size - 1) // gpn


def _group_choices(ctx: Context, group: list[str], size: int,
                   room: float) -> list[tuple[str, Choice]] | None:
    """One model's stages on a block of ``size`` devices, as a user sets up one engine per
    model: the train stage in its fastest layout within ``room`` of a GPU, the model's
    other stages in the same TP x PP layout (one copy of the weights) when they can;
    None where a stage has no choice within ``room``."""
    cap = usable_memory(ctx.cluster.gpu)
    order = sorted(group, key=lambda s: ctx.pipeline.stage(s).kind is not OpKind.TRAIN)
    layout = None
    picks = []
    for stage in order:
        opts = [c for c in options(ctx, stage, size) if c.memory <= room * cap]
        same = [c for c in opts if layout and (c.par.tp, c.par.pp) == layout]
        pick = (same or opts or [None])[0]
        if pick is None:
            return None
        layout = layout or (pick.par.tp, pick.par.pp)
        picks.append((stage, pick))
    return picks


def _rough_step(ctx: Context, ev: Evaluator, plan: Plan, groups: list[list[list[str]]]
                ) -> float:
    per_group = [sum(ev.stage_time(s, plan.placement(s)) for m in g for s in m)
                 for g in groups]
    return max(per_group) + per_group[0]


def realloc(ctx: Context, ev: Evaluator, starts: Iterable[Plan] = ()) -> Outcome:
    """ReaL-style: synchronous, every call with its own layout; ``starts`` (other baselines'
    plans) seed the descent, since ReaL's space contains them."""
    best = _Best(Strategy.REALLOC, ev)
    stages = model_stages(ctx.pipeline)
    halves = [Block(0, ctx.n)] + ([Block(0, ctx.n // 2), Block(ctx.n // 2, ctx.n // 2)]
                                  if ctx.n >= 2 and ctx.n % 2 == 0 else [])
    for room in HEADROOM:
        best.offer(_fill(ctx, empty_plan(ctx), [(s, halves[0], None, room) for s in stages]))
        if best.best is not None:
            break
    for plan in starts:
        best.offer(_synchronous(plan))
    if best.best is None:
        return best.outcome()
    for _ in range(2):                        # coordinate descent over each call's options
        for s in stages:
            if ctx.pinned_block(s):
                continue
            current = best.best.plan
            for block in halves:
                for c in options(ctx, s, block.size)[:4]:
                    best.offer(repair(ctx, put(ctx, current, s, block, c)))
    return best.outcome()


def _synchronous(plan: Plan) -> Plan:
    """``plan`` as a realloc start: synchronous, unfused, every model its own backbone."""
    return attrs.evolve(plan, staleness=(), fusion=(), shared=(), predicted=None)


BASELINES = {Strategy.COLOCATED: colocated, Strategy.SPLIT: split, Strategy.REALLOC: realloc}


@attrs.define
class Found:
    """What the baselines find for one spec and cluster that no staleness bound changes,
    kept for the next cap of the staleness ladder (:func:`run_baselines`): the colocated
    outcome, the split plans worth simulating, and realloc's outcome from given starts
    (which it makes synchronous)."""

    colocated: Outcome | None = None
    splits: tuple[Plan, ...] | None = None
    realloc: dict[tuple[Plan, ...], Outcome] = attrs.field(factory=dict)


def run_baselines(strategies: Iterable[Strategy], ctx: Context, ev: Evaluator,
                  found: Found | None = None) -> list[Outcome]:
    """Each baseline asked for, in order; realloc is seeded with the others' plans.
    ``found``: what the baselines found for ``ctx``'s pipeline and cluster under other
    staleness caps (updated): what they would find again is taken from it."""
    out: dict[Strategy, Outcome] = {}
    found = found or Found()
    for strategy in strategies:
        if strategy not in BASELINES:
            raise PlanError(f"baseline strategy must be one of "
                            f"{', '.join(s.value for s in BASELINES)}, not {strategy.value}")
        if strategy is Strategy.REALLOC:
            seeds = [o.best.plan for o in out.values() if o.best is not None]
            if not seeds:               # asked alone: the others' grids seed it
                seeds = [o.best.plan for o in (colocated(ctx, ev),) if o.best is not None]
            key = tuple(_synchronous(p) for p in seeds)
            if key not in found.realloc:
                found.realloc[key] = realloc(ctx, ev, key)
            out[strategy] = found.realloc[key]
        elif strategy is Strategy.COLOCATED:
            found.colocated = found.colocated or colocated(ctx, ev)
            out[strategy] = found.colocated
        else:
            out[strategy] = split(ctx, ev, found)
    return list(out.values())


__all__ = ["colocated", "split", "realloc", "run_baselines", "Outcome", "Found"]
