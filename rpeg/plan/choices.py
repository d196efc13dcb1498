"""Enumerate -> prune -> estimate: the ways each stage can run on each block size.

    >>> from rpeg.spec import load, load_cluster                        # doctest: +SKIP
    >>> t = choice_table(load("pipelines/ppo_llama8b.rpeg"),
    ...                  load_cluster("pipelines/clusters/gh200_64.rpeg"), Limits())  # doctest: +SKIP
    >>> best = t.options("actor_step", 16)[0]                           # doctest: +SKIP
    >>> best.par, round(best.time_s, 1), round(best.memory / 1e9)       # doctest: +SKIP
    (Layout(dp=8, tp=2, ...), 9.8, 71)

Three steps, each handing a typed value to the next:

1. ``enumerate_layouts`` — every (size, DP x TP x PP, micro-batches, ZeRO, recompute,
   optimizer offload, engine) the model and the backend accept (:class:`Candidate`);
2. ``prune`` — drop layouts whose stage alone cannot fit a device (its transient need
   plus its own model's weights), priced with the pure memory functions;
3. ``estimate`` — price the rest on a representative block of that size and keep,
   per size, the Pareto front of (time, memory) as :class:`Choice` values.

The search (``rpeg.plan.search``) then only ever picks among these choices.
"""

from __future__ import annotations

import functools
import math

import attrs

from rpeg.cost.memory import resident_memory, usable_memory
from rpeg.cost.stages import estimate_stage, generation_rows, offload_time, stage_memory
from rpeg.cost.topology import Topology
from rpeg.errors import CostError
from rpeg.graph.layout import Layout, changed
from rpeg.graph.work import work_of
from rpeg.plan.pinned import FOREIGN, matches, overlay
from rpeg.plan.space import Limits, block_sizes, generate_engines, layouts
from rpeg.spec.model import Cluster, Engine, OpKind, Pipeline, Zero

MICROBATCHES = (1, 2, 4, 8, 16, 32)
ZERO = tuple(Zero)
OFFLOAD = (False, True)   # train: optimizer state in host memory between steps


@attrs.frozen
class Candidate:
    stage: str
    size: int
    par: Layout
    engine: Engine
    rows: int | None = None   # generation: sequences at once per replica (None: all)


@attrs.frozen
class Choice:
    stage: str
    size: int
    par: Layout
    engine: Engine
    time_s: float
    memory: float          # bytes per device: transient need + the stage's own model copy


@attrs.frozen
class ChoiceTable:
    sizes: tuple[int, ...]
    table: tuple[tuple[str, tuple[tuple[int, tuple[Choice, ...]], ...]], ...]

    def options(self, stage: str, size: int) -> tuple[Choice, ...]:
        return self._by_stage.get(stage, {}).get(size, ())

    @functools.cached_property
    def _by_stage(self) -> dict[str, dict[int, tuple[Choice, ...]]]:
        out: dict[str, dict[int, tuple[Choice, ...]]] = {}
        for name, per_size in self.table:
            out.setdefault(name, dict(per_size))
        return out

    def sizes_of(self, stage: str) -> tuple[int, ...]:
        for name, per_size in self.table:
            if name == stage:
                return tuple(s for s, c in per_size if c)
        return ()

    @property
    def stages(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.table)


def model_stages(pipeline: Pipeline) -> tuple[str, ...]:
    """Stages that run a model on devices (everything but host-side rewards and compute)."""
    return tuple(s.name for s in pipeline.stages
                 if s.kind not in (OpKind.COMPUTE, OpKind.SYNC_WEIGHTS)
                 and pipeline.has_model(s.target or ""))


def enumerate_layouts(pipeline: Pipeline, stage: str, sizes: tuple[int, ...],
                      cluster: Cluster, limits: Limits) -> tuple[Candidate, ...]:
    s = pipeline.stage(stage)
    model = pipeline.model(s.target)
    batch = pipeline.workload.batch
    pin = pipeline.pin(stage)
    if pin is not None and pin.pinned():           # a pinned layout: on its devices only
        sizes = tuple(x for x in sizes if x == pin.size)
    out = []
    if s.kind is OpKind.GENERATE:
        engines = generate_engines(pipeline, stage, limits)
        if pin is not None and pin.engine not in (None, Engine.AUTO) and (
                pin.engine in engines or limits.foreign and pin.engine in FOREIGN):
            engines = (pin.engine,)
    else:
        engines = (Engine.TORCH,)
    train_engine = pin.engine if pin is not None and pin.engine is not None \
        and s.kind is not OpKind.GENERATE else Engine.TORCH
    cp = pin.cp if pin is not None and pin.cp else 1
    for size in sizes:
        if size % cp:
            continue
        for base in layouts(size // cp, model.dims, cluster, limits, batch=batch):
            base = overlay(pin, attrs.evolve(base, cp=cp))
            local = math.ceil(batch / base.dp)
            if s.kind is OpKind.GENERATE:
                if pin is not None and pin.sharded:     # generation on ZeRO-3 shards
                    base = attrs.evolve(base, zero=pin.zero)
                # How many sequences decode at once is the engine's batching bounded by
                # the memory free beside its weights (prune sizes it; the evaluator again
                # from what the plan leaves free).
                for e in engines:
                    if base.tp > limits.engine_max_tp(e) and e in (Engine.TORCH, Engine.VLLM):
                        continue
                    if limits.check_batching(e, base.decoding.max_num_seqs,
                                             base.decoding.kv_fraction,
                                             base.decoding.cuda_graph) is not None:
                        continue        # a pin's batching key this engine does not run
                    if matches(pin, base, e) and limits.check_lora(model, base) is None:
                        # priced with the share the engine takes: the stage's kv_fraction
                        # where the engine runs it (the torch engine decodes in waves)
                        asked = float(s.param("kv_fraction", 0.0) or 0.0) \
                            if limits.check_batching(e, 0, 1.0, False) is None else 0.0
                        share = base.decoding.kv_fraction or asked \
                            or limits.kv_share(e, cluster.gpu)
                        out.append(Candidate(stage, size, changed(base, kv_fraction=share), e))
                continue
            per_step = local
            if s.kind is OpKind.TRAIN:
                per_step = max(local // int(s.param("minibatches", 1) or 1), 1)
            mbs = [m for m in MICROBATCHES if m <= per_step and m >= base.pp] or [base.pp]
            if pin is not None and pin.microbatches:
                mbs = [pin.microbatches]
            train = s.kind is OpKind.TRAIN
            zeros = tuple(z for z in ZERO if z in limits.zero) \
                if (train and base.dp > 1) else (Zero.NONE,)
            if pin is not None and pin.zero is not None and pin.zero in limits.zero:
                # pinned: a train op's even on one device (FSDP2 of one rank); ZeRO-3
                # inference is priced only where pinned
                zeros = (pin.zero,)
            recomputes = (False, True) if (train and limits.recompute) else (False,)
            offloads = OFFLOAD if (train and limits.offload) else (False,)
            # packing: each sequence at its own length, whenever the executor packs (rpeg's
            # torch engine); another system's engine packs where its pin says so
            packing = pin.packing if pin is not None and pin.packing is not None \
                else limits.packing and train_engine is Engine.TORCH
            for m in mbs:
                for z in zeros:
                    for r in recomputes:
                        for o in offloads:
                            par = attrs.evolve(base, microbatches=m, recompute=r, zero=z,
                                               offload=o, packing=packing)
                            if matches(pin, par, train_engine) \
                                    and limits.check_lora(model, par) is None \
                                    and limits.check_eval(pipeline, s, par) is None:
                                out.append(Candidate(stage, size, par, train_engine))
    return tuple(out)


def prune(pipeline: Pipeline, layouts_: tuple[Candidate, ...], cluster: Cluster) -> tuple[
        tuple[Candidate, float], ...]:
    """Layouts whose stage alone fits a device, with that memory need in bytes."""
    out = []
    cap = usable_memory(cluster.gpu)
    resident: dict[tuple, float] = {}        # depends on few of a layout's fields
    works = _works(pipeline, layouts_)
    for lay in layouts_:
        s = pipeline.stage(lay.stage)
        model = pipeline.model(s.target)
        p, trained = lay.par, s.kind is OpKind.TRAIN
        key = (model.name, _resident_fields(p), lay.engine, trained)
        try:
            if key not in resident:
                resident[key] = resident_memory(
                    model, p, cluster, trained=trained,
                    engine=lay.engine).total
            if s.kind is OpKind.GENERATE:
                lay = attrs.evolve(lay, rows=generation_rows(
                    works[lay.stage], p, cluster, cap - resident[key], engine=lay.engine))
            need = stage_memory(works[lay.stage], p, cluster, rows=lay.rows,
                                engine=lay.engine).total + resident[key]
        except CostError:
            continue
        if need <= cap:
            out.append((lay, need))
    return tuple(out)


def _resident_fields(p: Layout) -> tuple:
    """What of ``p`` :func:`resident_memory` reads (its checks included: micro-batches only
    as at least one): layouts differing in their micro-batches, recomputation or packing
    hold the same bytes between stages."""
    return (p.dp, p.tp, p.pp, p.cp, p.ep, p.zero, p.offload, p.param_offload,
            p.microbatches >= 1)


def estimate(pipeline: Pipeline, fitting: tuple[tuple[Candidate, float], ...],
             cluster: Cluster) -> tuple[Choice, ...]:
    """Price each layout on the first aligned block of its size; keep the Pareto fronts."""
    priced: dict[int, list[Choice]] = {}
    kept: dict[Candidate, float] = {}
    works = _works(pipeline, [lay for lay, _ in fitting])
    for lay, need in fitting:
        # an offloaded layout costs its twin's time plus the host-link copies
        p = lay.par
        twin = lay if not p.offload else attrs.evolve(lay, par=attrs.evolve(p, offload=False))
        try:
            if twin not in kept:
                kept[twin] = estimate_stage(works[lay.stage], twin.par,
                                            tuple(range(lay.size)), cluster,
                                            engine=lay.engine, rows=lay.rows).time_s
        except CostError:
            continue
        model = pipeline.model(pipeline.stage(lay.stage).target)
        t = kept[twin] + offload_time(model, lay.par, cluster.gpu, lay.engine)
        priced.setdefault(lay.size, []).append(
            Choice(lay.stage, lay.size, lay.par, lay.engine, t, need))
    out = []
    for size in sorted(priced):
        # Offloading frees memory only beside other stages (the train step still needs the
        # state): its front is kept apart, for colocation to weigh against the host link.
        front = _pareto([c for c in priced[size] if not c.par.offload])
        off = _pareto([c for c in priced[size] if c.par.offload])
        out += sorted(front + off, key=lambda c: (c.time_s, c.memory))
    return tuple(out)


def _works(pipeline: Pipeline, layouts_) -> dict:
    """Stage -> its :func:`work_of`, once per stage the layouts run (not once per layout)."""
    stages = dict.fromkeys(lay.stage for lay in layouts_)
    return {stage: work_of(pipeline, stage) for stage in stages}


def _pareto(choices: list[Choice]) -> list[Choice]:
    choices = sorted(choices, key=lambda c: (c.time_s, c.memory, c.par.zero, c.par.tp))
    front, best_mem = [], math.inf
    for c in choices:
        if c.memory < best_mem:
            front.append(c)
            best_mem = c.memory
    return front


def choice_table(pipeline: Pipeline, cluster: Cluster, limits: Limits,
                 known: ChoiceTable | None = None) -> ChoiceTable:
    """Every model stage's Pareto-optimal ways to run on every block size. ``known``: the
    table of the same pipeline and limits on a cluster pricing alike (:func:`priced_alike`),
    whose sizes are taken from it (each size's choices are priced apart)."""
    sizes = block_sizes(cluster)
    todo = tuple(s for s in sizes if known is None or s not in known.sizes)
    table = []
    for stage in model_stages(pipeline):
        lays = enumerate_layouts(pipeline, stage, todo, cluster, limits)       # 1
        fitting = prune(pipeline, lays, cluster)                               # 2
        choices = estimate(pipeline, fitting, cluster)                         # 3
        per_size = tuple((size, tuple(c for c in choices if c.size == size) if size in todo
                          else known.options(stage, size)) for size in sizes)
        table.append((stage, per_size))
    return ChoiceTable(sizes, tuple(table))


def priced_alike(a: Cluster, b: Cluster) -> bool:
    """Whether each stage's choices on a size are the same on ``a`` as on ``b``: the two
    differ in their racks at most (a choice is priced on the first devices of its size,
    which both number and link alike) and both have a link for every level they have
    (one lacking a level's link prices nothing)."""
    if attrs.evolve(a, racks=b.racks) != b:
        return False
    try:
        Topology.from_cluster(a)
        Topology.from_cluster(b)
    except CostError:
        return False
    return True
