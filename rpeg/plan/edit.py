"""Building and editing plans consistently: the helpers search and baselines share.

    >>> ctx = Context.of(pipeline, cluster, Limits())               # doctest: +SKIP
    >>> plan = empty_plan(ctx)                                      # doctest: +SKIP
    >>> plan = put(ctx, plan, "rollout", Block(0, 16), ctx.table.options("rollout", 16)[0])  # doctest: +SKIP
    >>> plan = repair(ctx, plan)                                    # doctest: +SKIP

A plan being edited must stay one the spec allows: the train stages of a shared
backbone run as one op (same placement), fused ops share their devices, host-side
stages sit with the stage that feeds them, and the spec's hints hold — ``place
STAGE on gpus a..b`` fixes a stage's devices, ``colocate A, B`` pins stages (or every
stage of a model) onto the same devices. :func:`repair` restores all of these.
"""

from __future__ import annotations

import functools
import itertools

import attrs

from rpeg.cost.partial import max_carries
from rpeg.plan.choices import (
    Choice,
    ChoiceTable,
    choice_table,
    enumerate_layouts,
    estimate,
    model_stages,
    priced_alike,
    prune,
)
from rpeg.plan.model import Plan, StagePlacement
from rpeg.plan.pinned import check_pins, honour
from rpeg.plan.space import Block, Limits
from rpeg.plan.structure import is_host_op
from rpeg.spec.model import Cluster, OpKind, Pipeline


@attrs.frozen
class Context:
    pipeline: Pipeline
    cluster: Cluster
    limits: Limits
    table: ChoiceTable
    pinned: tuple[tuple[str, Block], ...]          # place hints
    together: tuple[tuple[str, ...], ...]          # colocate hints, as stage names
    _extra: dict = attrs.field(factory=dict, eq=False, repr=False)   # sizes off the table

    @classmethod
    def of(cls, pipeline: Pipeline, cluster: Cluster, limits: Limits,
           like: Context | None = None) -> Context:
        """``pipeline`` on ``cluster``, its choices priced. ``like``: a context of the same
        pipeline and limits (a sub-cluster's whole): where its cluster prices alike
        (:func:`~rpeg.plan.choices.priced_alike`), the choices it priced are shared."""
        check_pins(pipeline, cluster, limits)
        if like is not None and not (like.pipeline == pipeline and like.limits == limits
                                     and priced_alike(like.cluster, cluster)):
            like = None
        table = choice_table(pipeline, cluster, limits, like.table if like else None)
        pinned = [(pin.stage, Block(pin.first, pin.size)) for pin in pipeline.place]
        together = []
        for group in pipeline.colocate:
            stages = []
            for name in group:
                if pipeline.has_model(name):
                    stages += [s.name for s in pipeline.stages if s.target == name
                               and s.name in table.stages]
                elif name in table.stages:
                    stages.append(name)
            together.append(tuple(dict.fromkeys(stages)))
        return cls(pipeline, cluster, limits, table, tuple(pinned), tuple(together),
                   like._extra if like else {})

    @property
    def n(self) -> int:
        return self.cluster.num_gpus

    @functools.cached_property
    def host(self) -> frozenset[str]:
        """Stages that run on the host beside the devices (:func:`is_host_op`)."""
        return frozenset(s.name for s in self.pipeline.stages
                         if is_host_op(self.pipeline, s.name))

    @functools.cached_property
    def upstream(self) -> dict[str, tuple[str, ...]]:
        """Host stage -> the stages upstream of it, nearest first (:func:`feeder`)."""
        return {s: _upstream(self.pipeline, s) for s in self.host}

    @functools.cached_property
    def stage_rank(self) -> dict[str, int]:
        """Stage -> its place in the spec."""
        return {s.name: i for i, s in enumerate(self.pipeline.stages)}

    @functools.cached_property
    def model_stages(self) -> tuple[str, ...]:
        return model_stages(self.pipeline)

    @functools.cached_property
    def _trains_of(self) -> dict[tuple[str, ...], list[str]]:
        return {}

    def pinned_block(self, stage: str) -> Block | None:
        return dict(self.pinned).get(stage)

    def shared_groups(self, plan: Plan) -> list[list[str]]:
        """Train stages that run as one op because their models share a backbone."""
        out = []
        for group in plan.shared:
            if group not in self._trains_of:
                self._trains_of[group] = [s.name for s in self.pipeline.stages
                                          if s.kind is OpKind.TRAIN and s.target in group]
            out.append(self._trains_of[group])
        return out


def placement(stage: str, block: Block | tuple[int, ...], choice: Choice,
              chunks: int = 1, carry: int = 0) -> StagePlacement:
    devices = block.devices if isinstance(block, Block) else tuple(block)
    return StagePlacement(stage, devices, choice.par, choice.engine, chunks, carry)


def put(ctx: Context, plan: Plan, stage: str, block: Block | tuple[int, ...],
        choice: Choice) -> Plan:
    """``plan`` with ``stage`` on ``block`` as ``choice`` says (a pinned stage on its pin)."""
    block = ctx.pinned_block(stage) or block
    old = {p.stage: p for p in plan.placements}
    chunks, carry = (old[stage].chunks, old[stage].carry) if stage in old else (1, 0)
    new = placement(stage, block, choice, chunks, carry)
    if stage in old:
        placements = tuple(new if p.stage == stage else p for p in plan.placements)
    else:
        placements = plan.placements + (new,)
    return attrs.evolve(plan, placements=_ordered(ctx, placements), predicted=None)


def _ordered(ctx: Context, placements) -> tuple[StagePlacement, ...]:
    rank = ctx.stage_rank
    ranks = [rank.get(p.stage, -1) for p in placements]
    if min(ranks, default=0) >= 0 and all(a < b for a, b in itertools.pairwise(ranks)):
        return tuple(placements)             # in the spec's order already (most edits)
    by = {p.stage: p for p in placements}
    return tuple(by[s.name] for s in ctx.pipeline.stages if s.name in by)


def empty_plan(ctx: Context) -> Plan:
    return Plan(ctx.pipeline.name, ctx.cluster.name, ctx.n, ())


def options(ctx: Context, stage: str, size: int) -> tuple[Choice, ...]:
    """The Pareto-optimal choices for ``stage`` on ``size`` devices, fastest first
    (sizes that are not aligned block sizes are priced on first use). A pinned stage has
    choices on its pinned devices only, whatever ``size`` asks."""
    pinned = ctx.pinned_block(stage)
    size = pinned.size if pinned else size
    if size in ctx.table.sizes:
        return ctx.table.options(stage, size)
    key = (stage, size)
    if key not in ctx._extra:
        lays = enumerate_layouts(ctx.pipeline, stage, (size,), ctx.cluster, ctx.limits)
        ctx._extra[key] = estimate(ctx.pipeline, prune(ctx.pipeline, lays, ctx.cluster),
                                   ctx.cluster)
    return ctx._extra[key]


def choice_for(ctx: Context, stage: str, size: int, budget: float | None = None,
               rank: int = 0) -> Choice | None:
    """The ``rank``-th fastest way to run ``stage`` on ``size`` devices within ``budget``
    bytes per device (None: any that fits alone)."""
    options_ = [c for c in options(ctx, stage, size) if budget is None or c.memory <= budget]
    if not options_:
        return None
    return options_[min(rank, len(options_) - 1)]


def repair(ctx: Context, plan: Plan) -> Plan | None:
    """The nearest plan keeping every rule in the module doc, or None if there is none."""
    by = {p.stage: p for p in plan.placements}
    # 1. place hints: a pinned stage keeps its block and the layout its pin fixes
    for stage, block in ctx.pinned:
        if is_host_op(ctx.pipeline, stage):
            continue
        p = by.get(stage)
        if p is None or p.devices != block.devices:
            c = choice_for(ctx, stage, block.size)
            if c is None:
                return None
            p = placement(stage, block, c, p.chunks if p else 1, p.carry if p else 0)
        by[stage] = honour(ctx.pipeline.pin(stage), p)
    # 2. colocate hints: everyone on the first member's devices
    for group in ctx.together:
        lead = next((s for s in group if ctx.pinned_block(s)), group[0] if group else None)
        if lead is None or lead not in by:
            continue
        devs = by[lead].devices
        for s in group:
            if s in by and by[s].devices != devs:
                c = choice_for(ctx, s, len(devs))
                if c is None:
                    return None
                by[s] = placement(s, devs, c, by[s].chunks, by[s].carry)
    # 3. shared backbone: the train stages run as one op, on the first one's placement
    for group in ctx.shared_groups(plan):
        first = by[group[0]]
        for s in group[1:]:
            by[s] = attrs.evolve(first, stage=s)
    # 4. host-side stages sit with the stage feeding them, or where they are pinned
    for s in ctx.pipeline.stages:
        if s.name not in ctx.host:
            continue
        if ctx.pinned_block(s.name):
            by[s.name] = _on_host(by.get(s.name), s.name, ctx.pinned_block(s.name).devices)
        else:
            src = _feeder(ctx, s.name, by)
            if src is not None:
                by[s.name] = _on_host(by.get(s.name), s.name, src.devices)
    if any(s.name not in by for s in ctx.pipeline.stages):
        return None
    # 5. fused stages must share devices; drop a fusion that no longer does
    fusion = tuple(g for g in plan.fusion if len({by[s].devices for s in g}) == 1)
    # 6. a partial rollout carries a response over no more steps than the staleness leaves
    for s, p in by.items():
        if p.carry:
            by[s] = attrs.evolve(p, carry=fit_carry(ctx, plan, p))
    return attrs.evolve(plan, placements=_ordered(ctx, by.values()), fusion=fusion,
                        predicted=None)


def fit_carry(ctx: Context, plan: Plan, p: StagePlacement) -> int:
    """``p.carry``, or as much of it as the stage's staleness bound leaves (its chosen
    staleness plus the carry must stay in the bound, :mod:`rpeg.cost.partial`); 0 where the
    stage's engine cannot carry responses over on this backend."""
    stage = ctx.pipeline.stage(p.stage)
    if p.engine not in ctx.limits.carry_engines or stage.kind is not OpKind.GENERATE \
            or stage.arg("refill_rounds"):
        return 0
    bound = dict(ctx.pipeline.staleness).get(p.stage, 0)
    return min(p.carry, max_carries(bound, plan.staleness_of(p.stage)))


def feeder(pipeline: Pipeline, stage: str, by: dict[str, StagePlacement]
           ) -> StagePlacement | None:
    """The placement of the nearest model stage upstream of ``stage``."""
    for name in _upstream(pipeline, stage):
        if name in by and not is_host_op(pipeline, name):
            return by[name]
    firsts = [by[s] for s in model_stages(pipeline) if s in by]
    return firsts[0] if firsts else None


def _feeder(ctx: Context, stage: str, by: dict[str, StagePlacement]) -> StagePlacement | None:
    """:func:`feeder`, from what ``ctx`` knows of the pipeline."""
    for name in ctx.upstream[stage]:
        if name in by and name not in ctx.host:
            return by[name]
    return next((by[s] for s in ctx.model_stages if s in by), None)


def _upstream(pipeline: Pipeline, stage: str) -> tuple[str, ...]:
    """The stages upstream of ``stage``, nearest first (breadth first over its inputs)."""
    out, seen, frontier = [], set(), list(pipeline.stage(stage).inputs)
    while frontier:
        data = frontier.pop(0)
        src = pipeline.producer(data)
        if src is None or src.name in seen:
            continue
        seen.add(src.name)
        out.append(src.name)
        frontier += list(src.inputs)
    return tuple(out)


def _on_host(old: StagePlacement | None, stage: str, devices: tuple[int, ...]
             ) -> StagePlacement:
    """A host stage's placement on ``devices`` (``old`` itself when it is that already)."""
    new = StagePlacement.of(stage, devices, dp=len(devices))
    return old if old == new else new
