"""Simulated annealing over plans, seeded by the best baseline; reproducible.

    >>> opts = SearchOptions(seed=1, iterations=2000)                   # doctest: +SKIP
    >>> result = anneal(ctx, Evaluator(pipeline, cluster), start, opts)  # doctest: +SKIP
    >>> result.best.step_time_s <= start.step_time_s                    # doctest: +SKIP
    True

State: a whole :class:`Plan`. A move changes one thing and :func:`repair` restores the
spec's rules; the evaluator prices it (infeasible plans are rejected outright, so
the best plan kept is always feasible). Moves:

- ``block``      move a stage — or the whole group of stages sharing its devices — to
                 another aligned block (a different size, or the same size elsewhere);
- ``resize``     grow or shrink a stage group's block by whole nodes at one end;
- ``layout``     another DP x TP x PP / micro-batch / ZeRO / recompute choice, same devices;
- ``colocate``   put a stage on the devices of another one;
- ``partition``  generation on one part of the cluster, the rest on the other part
                 (or training everywhere, forwards streaming beside generation; or two
                 separately trained models on a part of the rest each, side by side);
- ``chunks``     stream a generate stage's responses in 1, 2, 4, 8 or 16 chunks;
- ``offload``    keep a train stage's optimizer state in host memory between steps, or not
                 (frees device memory for colocated stages, costs two host-link copies);
- ``staleness``  another staleness for a stage, within the spec's bound;
- ``partial``    partial rollouts for a generate stage: each response spans up to
                 ``carry + 1`` steps, a step also advancing the next ones' responses (or
                 whole responses again); the carry comes out of the stage's staleness
                 bound, so the stage's own staleness is lowered when it needs the room;
- ``share``      merge or unmerge a ``share`` group's backbones;
- ``fuse``       fuse or unfuse two per-sample ops on the same devices.

Acceptance is Metropolis with a geometric temperature schedule from
``t_start`` to ``t_end`` (fractions of the start plan's step time) over
``iterations`` (or until ``patience`` proposals bring nothing better), split over
``chains`` independent walks from the start plan; every ``restart_every`` iterations
a walk returns to the best plan so far, and a walk that has not bettered its own best
for ``stall`` proposals starts again, warm, from the next of the other baselines' plans
(then the start plan again): another basin. The patience runs from the last gain of at
least :data:`MIN_GAIN` of the step (the gains since it summed): a walk that only
shaves hundredths of a percent off its best, over and over, has found its basin's floor,
and those crumbs no longer buy it another ``patience`` proposals.

Most proposals are worse than the plan they would replace; such a plan matters only if
the Metropolis draw takes it. So once any plan fits, a proposal is priced up to a bound
(``Evaluator.evaluate(bound=...)``: its step's lower bound, the busiest device's work of
a step, then its simulated step, before the control plane's tasks are counted): the most
the walk's next draw would accept, that draw read ahead without taking it
(:func:`_accepts_below`), or the walk's best if higher. A proposal at or above it is
rejected as pricing it in full would have rejected it; the draw is taken where it would
be taken after pricing it in full, so the random stream, the walk and the plan are
those of pricing every proposal in full.

A walk's moves are random, so late in a walk, its temperature low, the one change that
still betters its best (a generation block shrunk to a rack, say) is found only by chance.
So each walk's best is then polished (:func:`polish`): a greedy descent over a fixed
neighbourhood (each group of stages sharing devices grown or shrunk at either end, each
generate stage's chunk counts, each stage's fastest layouts on its devices), without a
random draw, its neighbours priced counted as proposals (``SearchResult.polished``). The
ladder answers with the best polished plan; the walks start from the walks' own plans, as
without polishing, so it only ever finds a faster plan.

A spec with staleness bounds is searched as a ladder (``compile_report``): one walk per
cap 0, 1, ... up to the largest bound (:func:`staleness_caps`, :func:`capped`), each
starting from the best of the baselines under its cap and of the walk below it (above
cap 0, warm, with 3/4 of the patience; where partial rollouts are possible, a second walk
per cap adds them, see ``rpeg.plan.compile``). Every plan a tighter bound allows is allowed by a
looser one, and a walk depends only on its cap, so raising the bound never returns a
slower plan. On a cluster of 8 racks or more the ladder first climbs on its first 1/8
of the racks, each cap's best plan there one more start of the same cap's walks on the
whole cluster (the rest of its GPUs idle), so more GPUs never return a slower plan than
that sub-cluster's. One
``numpy.random.Generator`` drives everything, so the same inputs and seed give the
same plan: the budget is a count of proposals (``iterations``, ``patience``), never a
time. ``time_cap_s`` is a safety cap on the wall-clock seconds of the whole ladder; a
search it stops says so (``SearchResult.time_capped``, recorded in the plan).
"""

from __future__ import annotations

import bisect
import math
import time

import attrs
import numpy as np

from rpeg.cost.memory import usable_memory
from rpeg.errors import PlanError
from rpeg.graph.versions import carry_room
from rpeg.plan.choices import model_stages
from rpeg.plan.edit import Context, empty_plan, options, put, repair
from rpeg.plan.evaluate import Evaluation, Evaluator, plan_graph
from rpeg.plan.model import Plan, Strategy
from rpeg.plan.options import Method, SearchOptions
from rpeg.plan.passes import fusable
from rpeg.plan.space import Block, device_blocks
from rpeg.spec.model import OpKind, Pipeline

CHUNKS = (1, 2, 4, 8, 16)
POLISH_PROPOSALS = 300   # the most neighbours a polish prices (see polish)
MIN_GAIN = 0.001         # a walk's patience runs from its last gain of this share of its step
PARTITIONS = (1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 7 / 8)   # share of the devices generating


@attrs.frozen
class SearchResult:
    best: Evaluation
    iterations: int
    accepted: int
    improved: int
    seconds: float                           # wall-clock
    trace: tuple[tuple[int, float], ...]     # (iteration, best step time) at each improvement
    time_capped: bool = False                # stopped by the options' time cap
    polished: int = 0                        # of the proposals, neighbours polish priced


def score(r: Evaluation, cap: float) -> float:
    """What the walk minimises: the step time, or for a plan that does not fit a penalty
    above every feasible plan that shrinks as the plan gets closer to fitting."""
    if r.feasible:
        return r.step_time_s
    return 1e9 * (1.0 + r.shortfall.over / cap)


def anneal(ctx: Context, ev: Evaluator, start: Evaluation, opts: SearchOptions,
           others: tuple[Evaluation, ...] = (), stream: tuple[int, ...] = (),
           deadline: float | None = None) -> SearchResult:
    """Search from ``start`` (feasible or not); ``best`` is feasible whenever any plan seen
    was (check ``best.feasible``). ``others``: more feasible plans (the other baselines) a
    stalled walk starts again from in turn, before ``start`` again: other basins.
    ``stream``: which of the seed's random streams drives this walk ((): the seed's own).
    ``deadline``: the ``time.monotonic()`` at which the time cap stops the walk (default:
    ``opts.time_cap_s`` from now)."""
    rng = np.random.default_rng((opts.seed, *stream) if stream else opts.seed)
    moves = Moves(ctx, rng, ev.graph)
    cap = usable_memory(ctx.cluster.gpu)
    best = current = start
    scale = start.step_time_s if start.feasible else 1e9
    t0 = opts.t_start * scale
    ratio = (opts.t_end / opts.t_start) if opts.t_start > 0 else 0.0
    began = time.monotonic()
    if deadline is None:
        deadline = began + opts.time_cap_s
    seen: set[Plan] = set()
    accepted = improved = it = 0
    trace = [(0, score(start, cap))]
    chains = max(1, opts.chains)
    per_chain = max(1, opts.iterations // chains)
    patience = max(1, opts.patience // chains) if opts.patience else 0
    out_of_time = False
    origins = (start,) + tuple(o for o in others if o.feasible and o.plan != start.plan)
    restarts = 0
    anchor = score(start, cap)       # the best plan's step when the patience last restarted
    for _chain in range(chains):              # each chain walks from the start again
        current, last = start, 0
        walk_best, walk_last, walk_from = score(start, cap), 0, 0
        for j in range(1, per_chain + 1):
            it += 1
            if time.monotonic() > deadline:          # the safety cap, not the budget
                out_of_time = True
                break
            if patience and best.feasible and j - last > patience:
                break
            if opts.stall and j - walk_last > opts.stall and opts.method is Method.ANNEAL:
                # stuck in one basin: walk again from another start, warm again
                restarts += 1
                current = origins[restarts % len(origins)]
                walk_best, walk_last, walk_from = score(current, cap), j, j
            if opts.method is Method.RANDOM:
                base = start
            else:
                base = current
                if opts.restart_every and j % opts.restart_every == 0:
                    current = base = best
            plan = moves.propose(base.plan)
            if opts.method is Method.RANDOM and plan is not None:
                for _ in range(int(rng.integers(0, 4))):        # a random point, not a neighbour
                    plan = moves.propose(plan) or plan
            if plan is None:
                continue
            plan = attrs.evolve(plan, strategy=Strategy.SEARCH, seed=opts.seed)
            if plan in seen:
                continue
            seen.add(plan)
            if best.feasible and not start.feasible and scale == 1e9:
                scale = best.step_time_s
                t0 = opts.t_start * scale
            temp = t0 * ratio ** ((j - walk_from) / per_chain) \
                if opts.method is Method.ANNEAL else 0.0
            here = score(base, cap)
            u = None                         # the acceptance draw, once made
            try:
                if best.feasible:
                    # Priced in full only if it could be accepted or better the walk: a plan
                    # whose step is no less than the walk's best and than the most the next
                    # draw would accept (:func:`_accepts_below`, the draw read ahead, not
                    # taken) is rejected; the draw is taken here, in the same place of the
                    # stream as after pricing it in full, and the test is the same.
                    r = ev.evaluate(plan, detail=False, bound=max(
                        _accepts_below(rng, here, temp), walk_best - 1e-12))
                    if r.bounded:
                        if temp <= 0:
                            continue
                        u = rng.random()
                        if u >= math.exp(-(r.step_time_s - here) / temp):
                            continue
                        r = ev.evaluate(plan, detail=False)
                else:
                    r = ev.evaluate(plan, detail=False)
            except PlanError:                # a move the cost model cannot schedule
                continue
            if not r.feasible and best.feasible:
                continue                     # once anything fits, never leave the feasible set
            delta = score(r, cap) - here
            if delta < 0 or (temp > 0 and (rng.random() if u is None else u)
                             < math.exp(-delta / temp)):
                current = r
                accepted += 1
            if score(r, cap) < walk_best - 1e-12:
                walk_best, walk_last = score(r, cap), j
            if score(r, cap) < score(best, cap) - 1e-12:
                best = r
                improved += 1
                if not r.feasible or score(r, cap) < anchor * (1 - MIN_GAIN):
                    last, anchor = j, score(r, cap)     # a gain worth the patience again
                trace.append((it, score(r, cap)))
        if out_of_time:
            break
    return SearchResult(best, it, accepted, improved, time.monotonic() - began, tuple(trace),
                        out_of_time)


def polish(ctx: Context, ev: Evaluator, start: Evaluation, most: int = POLISH_PROPOSALS,
           deadline: float | None = None) -> tuple[Evaluation, int]:
    """A greedy descent from ``start`` over a fixed neighbourhood, no random draw: each
    group of stages sharing devices grown or shrunk by 1, 2, 4 or 8 nodes at either end
    (the ``resize`` move's steps, the stages in their fastest layouts), each generate
    stage's other chunk counts, each stage's other fast layouts on its devices. The first
    neighbour faster than the plan replaces it and the scan starts again; it ends when a
    whole scan brings nothing, after ``most`` neighbours priced or at ``deadline`` (a
    ``time.monotonic()``, the search's safety cap). A walk's random moves
    reach such a neighbour only by chance, and late in a walk, when its temperature is
    low, only the one change (a rack-sized generation block, say) bettering the plan is
    left. Returns the best plan (``start`` if nothing is faster) and the neighbours priced,
    which count as proposals."""
    if not start.feasible:
        return start, 0
    best, tried, seen = start, 0, {start.plan}
    improved = True
    while improved and tried < most:
        improved = False
        for plan in _neighbours(ctx, best.plan):
            if plan is None or plan in seen:
                continue
            seen.add(plan)
            tried += 1
            try:
                r = ev.evaluate(plan, detail=False, bound=best.step_time_s - 1e-9)
            except PlanError:
                r = None
            if r is not None and r.feasible and not r.bounded \
                    and r.step_time_s < best.step_time_s - 1e-9:
                best, improved = r, True
                break
            if tried >= most or deadline is not None and time.monotonic() > deadline:
                return best, tried
    return best, tried


def _neighbours(ctx: Context, plan: Plan):
    """:func:`polish`'s neighbourhood of ``plan``, in a fixed order, each repaired (the
    spec's pins kept; None where a change leaves no plan)."""
    plan = attrs.evolve(plan, predicted=None)
    movable = tuple(s for s in model_stages(ctx.pipeline) if not ctx.pinned_block(s))
    unit, n = ctx.cluster.gpus_per_node, ctx.n
    rack = unit * ctx.cluster.nodes_per_rack
    groups = list(dict.fromkeys(plan.placement(s).devices for s in movable))
    for cur in groups:                                  # grow or shrink a group at one end
        lo, hi = cur[0], cur[-1] + 1
        if cur != tuple(range(lo, hi)):
            continue
        stages = [s for s in movable if plan.placement(s).devices == cur]
        for step in (unit, 2 * unit, 4 * unit, 8 * unit):
            for a, b in ((lo, hi - step), (lo, hi + step), (lo + step, hi), (lo - step, hi)):
                if a < 0 or b > n or b - a < unit or a % unit or b % unit:
                    continue
                if b - a < rack and a // rack != (b - 1) // rack:
                    continue
                new = plan
                for s in stages:
                    choices = options(ctx, s, b - a)
                    if not choices:
                        new = None
                        break
                    new = put(ctx, new, s, tuple(range(a, b)), choices[0])
                yield None if new is None else repair(ctx, new)
    w = ctx.pipeline.workload
    for s in model_stages(ctx.pipeline):                # stream in other chunk counts
        if ctx.pipeline.stage(s).kind is not OpKind.GENERATE:
            continue
        for c in CHUNKS:
            p = plan.placement(s)
            if c != p.chunks and c <= w.prompts * w.samples:
                yield repair(ctx, attrs.evolve(plan, placements=tuple(
                    attrs.evolve(x, chunks=c) if x.stage == s else x for x in plan.placements)))
    for s in model_stages(ctx.pipeline):                # another fast layout, same devices
        devs = plan.placement(s).devices
        for c in options(ctx, s, len(devs))[:3]:
            yield repair(ctx, put(ctx, plan, s, devs, c))


def _accepts_below(rng: np.random.Generator, here: float, temp: float) -> float:
    """The step below which the walk's next Metropolis draw would accept a plan replacing
    one of step ``here`` at temperature ``temp`` (``here`` itself when it draws nothing):
    the draw is read ahead, the generator left as it was, so pricing a proposal up to this
    bound decides what pricing it in full would."""
    if temp <= 0:
        return here
    state = rng.bit_generator.state
    u = rng.random()
    rng.bit_generator.state = state
    return here - temp * math.log(u) if u > 0 else math.inf


def random_plan(ctx: Context, seed: int) -> Plan | None:
    """A plan drawn at random, that no baseline made: each model stage on a random aligned
    block (its ``place`` hint's, if it has one) in a random layout that fits it alone,
    synchronous, then repaired; None when no draw gives every stage a layout."""
    rng = np.random.default_rng((seed, 99))
    blocks = device_blocks(ctx.cluster)
    plan = empty_plan(ctx)
    for stage in model_stages(ctx.pipeline):
        for _ in range(32):
            block = ctx.pinned_block(stage) or blocks[int(rng.integers(len(blocks)))]
            choices = options(ctx, stage, block.size)
            if choices:
                break
        else:
            return None
        plan = put(ctx, plan, stage, block, choices[int(rng.integers(len(choices)))])
    plan = repair(ctx, plan)
    return None if plan is None else attrs.evolve(plan, strategy=Strategy.SEARCH, seed=seed)


def staleness_caps(pipeline: Pipeline) -> tuple[int, ...]:
    """The staleness ladder the planner climbs: 0, 1, ... up to the spec's largest bound."""
    return tuple(range(max((k for _, k in pipeline.staleness), default=0) + 1))


def capped(pipeline: Pipeline, cap: int) -> Pipeline:
    """``pipeline`` with every staleness bound lowered to at most ``cap``: the plans it
    allows are a subset of those ``pipeline`` allows, priced the same."""
    return attrs.evolve(pipeline, staleness=tuple(
        (s, min(k, cap)) for s, k in pipeline.staleness if min(k, cap) > 0))


def merged(results: list[SearchResult]) -> SearchResult:
    """One result for walks run one after the other: the best plan of any (the last
    one's, when each starts from the best of those before it)."""
    offset, trace = 0, []
    best = min(reversed([r.best for r in results]), key=lambda e: (
        not e.feasible, e.step_time_s if e.feasible else e.shortfall.over))
    for r in results:
        trace += [(offset + i, t) for i, t in r.trace]
        offset += r.iterations
    return SearchResult(best, offset, sum(r.accepted for r in results),
                        sum(r.improved for r in results), sum(r.seconds for r in results),
                        tuple(trace), any(r.time_capped for r in results),
                        sum(r.polished for r in results))


class Moves:
    """Proposal moves over plans of one context (see the module doc)."""

    def __init__(self, ctx: Context, rng: np.random.Generator, graphs=None) -> None:
        """``graphs``: plan -> its step graph (:meth:`Evaluator.graph`, which keeps them)."""
        self.ctx, self.rng = ctx, rng
        self.stages = tuple(s for s in model_stages(ctx.pipeline) if not ctx.pinned_block(s))
        self.gens = tuple(s for s in model_stages(ctx.pipeline)
                          if ctx.pipeline.stage(s).kind is OpKind.GENERATE)
        w = ctx.pipeline.workload                  # a chunk streams at least one response
        self.chunk_counts = tuple(c for c in CHUNKS if c <= w.prompts * w.samples) or (1,)
        self.blocks = device_blocks(ctx.cluster)
        self.by_size: dict[int, list[Block]] = {}
        for b in self.blocks:
            self.by_size.setdefault(b.size, []).append(b)
        self.bounded = tuple((s, k) for s, k in ctx.pipeline.staleness if k > 0)
        # a pinned stage keeps its devices; its layout is searched where the pin leaves it open
        self.laid = model_stages(ctx.pipeline)
        self.trains = tuple(s for s in self.laid
                            if ctx.pipeline.stage(s).kind is OpKind.TRAIN) \
            if ctx.limits.offload else ()
        self.partials = tuple((s, k) for s, k in self.bounded if s in self.gens
                              and not ctx.pipeline.stage(s).arg("refill_rounds")) \
            if ctx.limits.carry_engines else ()
        self.table = [
            (self.block, 4.0), (self.layout, 3.0), (self.colocate, 2.0), (self.chunks, 1.0),
            (self.partition, 1.0 if len(self.gens) and ctx.n > 1 else 0.0),
            (self.resize, 2.0 if ctx.n > ctx.cluster.gpus_per_node else 0.0),
            (self.staleness, 1.0 if self.bounded else 0.0),
            (self.share, 0.5 if ctx.pipeline.shares else 0.0), (self.fuse, 0.5),
            (self.offload, 1.0 if self.trains else 0.0),
            (self.partial, 1.0 if self.partials else 0.0)]
        w = np.array([x[1] for x in self.table])
        self.p = w / w.sum()
        # rng.choice(len(table), p=p) as numpy draws it (one uniform, searched in the
        # normalised cumulative weights), without its checks on every call
        cdf = self.p.cumsum()
        self.cdf = (cdf / cdf[-1]).tolist()
        self.graph = graphs or (lambda plan: plan_graph(ctx.pipeline, plan))

    def propose(self, plan: Plan) -> Plan | None:
        k = bisect.bisect_right(self.cdf, self.rng.random())
        new = self.table[k][0](plan)
        return None if new is None or new == plan else repair(self.ctx, new)

    def _pick(self, seq):
        return seq[int(self.rng.integers(len(seq)))] if len(seq) else None

    def _choice(self, stage: str, size: int):
        opts = options(self.ctx, stage, size)
        if not opts:
            return None
        # Mostly the fastest few; sometimes a leaner one (memory headroom for neighbours).
        k = int(min(self.rng.geometric(0.45) - 1, len(opts) - 1))
        return opts[k]

    def block(self, plan: Plan) -> Plan | None:
        stage = self._pick(self.stages)
        if stage is None:
            return None
        cur = plan.placement(stage).devices
        group = [s for s in self.stages if plan.placement(s).devices == cur]
        moving = group if self.rng.random() < 0.5 else [stage]
        sizes = sorted(self.by_size)
        i = sizes.index(len(cur)) if len(cur) in sizes else int(self.rng.integers(len(sizes)))
        step = int(self.rng.choice((-1, 0, 1, 2, -2)))
        size = sizes[min(max(i + step, 0), len(sizes) - 1)]
        block = self._pick(self.by_size[size])
        for s in moving:
            c = self._choice(s, size)
            if c is None:
                return None
            plan = put(self.ctx, plan, s, block, c)
        return plan

    def partition(self, plan: Plan) -> Plan | None:
        """A macro move: generation on the first ``a`` devices, the other model stages on
        the rest (or, half the time, forward stages there and training on every device,
        so forwards stream behind generation), in fast layouts; staleness redrawn."""
        n, unit = self.ctx.n, self.ctx.cluster.gpus_per_node
        cuts = sorted({max(unit, round(n * f / unit) * unit) for f in PARTITIONS} - {n}
                      | ({n // 2} if n > 1 else set()))
        cuts = [a for a in cuts if 0 < a < n]
        if not cuts:
            return None
        a = int(self._pick(cuts))
        gen_block, rest = Block(0, a), Block(a, n - a)
        train_everywhere = self.rng.random() < 0.5
        own = {} if train_everywhere else self._trainer_groups(plan, rest)
        for s in self.stages:
            kind = self.ctx.pipeline.stage(s).kind
            target = self.ctx.pipeline.stage(s).target
            if s in self.gens:
                block = gen_block
            elif kind is OpKind.TRAIN and train_everywhere:
                block = Block(0, n)
            else:
                block = own.get(target, rest)
            c = self._choice(s, block.size)
            if c is None:
                return None
            plan = put(self.ctx, plan, s, block, c)
        if self.bounded:
            plan = attrs.evolve(plan, staleness=tuple(
                (s, int(self.rng.integers(0, k + 1))) for s, k in self.bounded
                if self.rng.random() < 0.8))
            plan = attrs.evolve(plan, staleness=tuple(x for x in plan.staleness if x[1] > 0))
        for s in self.gens:
            plan = attrs.evolve(plan, placements=tuple(
                attrs.evolve(x, chunks=int(self._pick(self.chunk_counts))) if x.stage == s else x
                for x in plan.placements))
        return plan

    def _trainer_groups(self, plan: Plan, rest: Block) -> dict:
        """Half the time, two models trained apart (not one shared backbone) get a part of
        ``rest`` each, whole nodes, so their train steps (and their models' forwards) run
        side by side instead of one after the other; else {} (everything on ``rest``)."""
        unit = self.ctx.cluster.gpus_per_node
        models = [self.ctx.pipeline.stage(s).target for s in self.trains]
        if plan.shared or len(models) != 2 or rest.size < 2 * unit or self.rng.random() < 0.5:
            return {}
        cut = unit * int(self.rng.integers(1, rest.size // unit))
        return {models[0]: Block(rest.start, cut),
                models[1]: Block(rest.start + cut, rest.size - cut)}

    def resize(self, plan: Plan) -> Plan | None:
        """Grow or shrink the block of a stage (and of the stages sharing it) by whole nodes
        at one end: blocks need not be aligned powers of two, so loads can be balanced."""
        stage = self._pick(self.stages)
        if stage is None:
            return None
        cur = plan.placement(stage).devices
        lo, hi = cur[0], cur[-1] + 1
        if cur != tuple(range(lo, hi)):
            return None
        unit, n = self.ctx.cluster.gpus_per_node, self.ctx.n
        step = unit * int(self._pick((1, 1, 2, 4, 8)))
        if self.rng.random() < 0.5:
            hi = min(max(hi + int(self._pick((-step, step))), lo + unit), n)
        else:
            lo = max(min(lo + int(self._pick((-step, step))), hi - unit), 0)
        if (lo, hi) == (cur[0], cur[-1] + 1) or lo % unit or hi % unit:
            return None
        rack = unit * self.ctx.cluster.nodes_per_rack
        if hi - lo < rack and lo // rack != (hi - 1) // rack:
            return None                  # a block smaller than a rack stays inside one
        group = [s for s in self.stages if plan.placement(s).devices == cur]
        for s in group:
            c = self._choice(s, hi - lo)
            if c is None:
                return None
            plan = put(self.ctx, plan, s, tuple(range(lo, hi)), c)
        return plan

    def layout(self, plan: Plan) -> Plan | None:
        stage = self._pick(self.laid)
        if stage is None:
            return None
        devs = plan.placement(stage).devices
        c = self._choice(stage, len(devs))
        return None if c is None else put(self.ctx, plan, stage, devs, c)

    def colocate(self, plan: Plan) -> Plan | None:
        stage, other = self._pick(self.stages), self._pick(model_stages(self.ctx.pipeline))
        if stage is None or other == stage:
            return None
        devs = plan.placement(other).devices
        c = self._choice(stage, len(devs))
        return None if c is None else put(self.ctx, plan, stage, devs, c)

    def chunks(self, plan: Plan) -> Plan | None:
        stage = self._pick(self.gens)
        if stage is None:
            return None
        p = plan.placement(stage)
        new = attrs.evolve(p, chunks=int(self._pick(self.chunk_counts)))
        return attrs.evolve(plan, placements=tuple(new if x.stage == stage else x
                                                   for x in plan.placements))

    def offload(self, plan: Plan) -> Plan | None:
        stage = self._pick(self.trains)
        if stage is None:
            return None
        p = plan.placement(stage)
        new = p.changed(offload=not p.offload)
        return attrs.evolve(plan, placements=tuple(new if x.stage == stage else x
                                                   for x in plan.placements))

    def staleness(self, plan: Plan) -> Plan | None:
        stage, bound = self.bounded[int(self.rng.integers(len(self.bounded)))]
        chosen = dict(plan.staleness)
        chosen[stage] = int(self.rng.integers(0, bound + 1))
        return attrs.evolve(plan, staleness=tuple(sorted((s, k) for s, k in chosen.items()
                                                          if k > 0)))

    def partial(self, plan: Plan) -> Plan | None:
        stage, bound = self.partials[int(self.rng.integers(len(self.partials)))]
        carries = int(self.rng.integers(0, bound + 1))
        plan = attrs.evolve(plan, placements=tuple(
            attrs.evolve(x, carry=carries) if x.stage == stage else x for x in plan.placements))
        if carries > carry_room(bound, plan.staleness_of(stage)):   # make room in the bound
            chosen = {**dict(plan.staleness), stage: bound - carries}
            plan = attrs.evolve(plan, staleness=tuple(sorted(
                (s, k) for s, k in chosen.items() if k > 0)))
        return plan

    def share(self, plan: Plan) -> Plan | None:
        shared = () if plan.shared else self.ctx.pipeline.shares
        return attrs.evolve(plan, shared=shared, fusion=())

    def fuse(self, plan: Plan) -> Plan | None:
        if plan.fusion and self.rng.random() < 0.5:
            drop = int(self.rng.integers(len(plan.fusion)))
            return attrs.evolve(plan, fusion=plan.fusion[:drop] + plan.fusion[drop + 1:])
        graph = self.graph(plan)
        pairs = [pr for pr in fusable(graph)
                 if plan.placement(graph.op(pr[0]).stages[0]).devices
                 == plan.placement(graph.op(pr[1]).stages[0]).devices]
        pair = self._pick(pairs)
        if pair is None:
            return None
        stages = graph.op(pair[0]).stages + graph.op(pair[1]).stages
        rest = tuple(g for g in plan.fusion if not set(g) & set(stages))
        return attrs.evolve(plan, fusion=rest + (stages,))
