"""Enumerate -> prune -> estimate: the ways each stage can run on each block size.

    >>> from rpeg.spec import load, load_cluster                        # doctest: +SKIP
    >>> t = choice_table(load("pipelines/ppo_llama8b.rpeg"),
    ...                  load_cluster("pipelines/clusters/gh200_64.rpeg"), Limits())  # doctest: +SKIP
    >>> best = t.options("actor_step", 16)[0]                           # doctest: +SKIP
    >>> best.par, round(best.time_s, 1), round(best.memory / 1e9)       # doctest: +SKIP
    (Parallel(dp=8, tp=2, ...), 9.8, 71)

Three steps, each handing a typed value to the next:

1. ``enumerate_layouts`` — every (size, DP x TP x PP, micro-batches, ZeRO, recompute,
   optimizer offload, engine; generation in 1-4 waves) the model and the backend accept
   (:class:`Layout`);
2. ``prune`` — drop layouts whose stage alone cannot fit a device (its transient need
   plus its own model's weights), priced with the pure memory functions;
3. ``estimate`` — price the rest on a representative block of that size and keep,
   per size, the Pareto front of (time, memory) as :class:`Choice` values.

The search (``rpeg.plan.search``) then only ever picks among these choices.
"""

from __future__ import annotations

import math

import attrs

from rpeg.cost.memory import Parallel, resident_memory
from rpeg.cost.stages import estimate_stage, offload_time, stage_memory
from rpeg.errors import CostError
from rpeg.plan.pinned import matches
from rpeg.plan.space import Limits, block_sizes, generate_engines, layouts
from rpeg.spec.model import Cluster, Engine, OpKind, Pipeline

MICROBATCHES = (1, 2, 4, 8, 16, 32)
ZERO = (0, 1, 2, 3)
WAVES = (1, 2, 4)      # generation: the local batch in this many waves (smaller KV cache)
OFFLOAD = (False, True)   # train: optimizer state in host memory between steps


@attrs.frozen
class Layout:
    stage: str
    size: int
    par: Parallel
    engine: Engine
    rows: int | None = None   # generation: sequences at once per replica (None: all)


@attrs.frozen
class Choice:
    stage: str
    size: int
    par: Parallel
    engine: Engine
    time_s: float
    memory: float          # bytes per device: transient need + the stage's own model copy


@attrs.frozen
class ChoiceTable:
    sizes: tuple[int, ...]
    table: tuple[tuple[str, tuple[tuple[int, tuple[Choice, ...]], ...]], ...]

    def options(self, stage: str, size: int) -> tuple[Choice, ...]:
        for name, per_size in self.table:
            if name == stage:
                return dict(per_size).get(size, ())
        return ()

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
                      cluster: Cluster, limits: Limits) -> tuple[Layout, ...]:
    s = pipeline.stage(stage)
    model = pipeline.model(s.target)
    batch = pipeline.workload.batch
    pin = pipeline.pin(stage)
    if pin is not None and pin.pinned():           # a pinned layout: on its devices only
        sizes = tuple(x for x in sizes if x == pin.size)
    out = []
    if s.kind is OpKind.GENERATE:
        engines = generate_engines(pipeline, stage, limits)
    else:
        engines = (Engine.TORCH,)
    for size in sizes:
        for base in layouts(size, model.dims, cluster, limits, batch=batch):
            local = math.ceil(batch / base.dp)
            if s.kind is OpKind.GENERATE:
                # The evaluator sizes the waves from the memory actually free; these
                # priced variants let a memory-bounded choice see the cost of fewer rows.
                waves = sorted({w for w in WAVES if w <= local})
                for e in engines:
                    if base.tp > limits.engine_max_tp(e):
                        continue
                    for w in waves:
                        rows = None if w == 1 else math.ceil(local / w)
                        if matches(pin, base, e):
                            out.append(Layout(stage, size, base, e, rows))
                continue
            per_step = local
            if s.kind is OpKind.TRAIN:
                per_step = max(local // int(s.param("minibatches", 1) or 1), 1)
            mbs = [m for m in MICROBATCHES if m <= per_step and m >= base.pp] or [base.pp]
            train = s.kind is OpKind.TRAIN
            zeros = tuple(z for z in ZERO if z in limits.zero) \
                if (train and base.dp > 1) else (0,)
            if train and pin is not None and pin.zero is not None and pin.zero in limits.zero:
                zeros = (pin.zero,)           # pinned, even on one device (FSDP2 of one rank)
            recomputes = (False, True) if (train and limits.recompute) else (False,)
            offloads = OFFLOAD if (train and limits.offload) else (False,)
            # packing: each sequence at its own length, whenever the executor packs
            packed = limits.packing if pin is None or pin.packed is None else pin.packed
            for m in mbs:
                for z in zeros:
                    for r in recomputes:
                        for o in offloads:
                            par = Parallel(base.dp, base.tp, base.pp, m, r, z, o, packed)
                            if matches(pin, par, Engine.TORCH):
                                out.append(Layout(stage, size, par, Engine.TORCH))
    return tuple(out)


def prune(pipeline: Pipeline, layouts_: tuple[Layout, ...], cluster: Cluster) -> tuple[
        tuple[Layout, float], ...]:
    """Layouts whose stage alone fits a device, with that memory need in bytes."""
    out = []
    cap = cluster.gpu.memory
    resident: dict[tuple, float] = {}        # depends on few of a layout's fields
    for lay in layouts_:
        s = pipeline.stage(lay.stage)
        model = pipeline.model(s.target)
        p, trained = lay.par, s.kind is OpKind.TRAIN
        key = (model.name, p.dp, p.tp, p.pp, p.zero, p.offload, trained)
        try:
            if key not in resident:
                resident[key] = resident_memory(model, p, cluster, trained=trained).total
            need = stage_memory(pipeline, lay.stage, p, cluster, rows=lay.rows).total \
                + resident[key]
        except CostError:
            continue
        if need <= cap:
            out.append((lay, need))
    return tuple(out)


def estimate(pipeline: Pipeline, fitting: tuple[tuple[Layout, float], ...],
             cluster: Cluster) -> tuple[Choice, ...]:
    """Price each layout on the first aligned block of its size; keep the Pareto fronts."""
    priced: dict[int, list[Choice]] = {}
    kept: dict[Layout, float] = {}
    for lay, need in fitting:
        # an offloaded layout costs its twin's time plus the host-link copies
        p = lay.par
        twin = lay if not p.offload else Layout(
            lay.stage, lay.size, Parallel(p.dp, p.tp, p.pp, p.microbatches, p.recompute,
                                          p.zero, False), lay.engine, lay.rows)
        try:
            if twin not in kept:
                kept[twin] = estimate_stage(pipeline, lay.stage, twin.par,
                                            tuple(range(lay.size)), cluster,
                                            engine=lay.engine, rows=lay.rows).time_s
        except CostError:
            continue
        model = pipeline.model(pipeline.stage(lay.stage).target)
        t = kept[twin] + offload_time(model, lay.par, cluster.gpu)
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


def _pareto(choices: list[Choice]) -> list[Choice]:
    choices = sorted(choices, key=lambda c: (c.time_s, c.memory, c.par.zero, c.par.tp))
    front, best_mem = [], math.inf
    for c in choices:
        if c.memory < best_mem:
            front.append(c)
            best_mem = c.memory
    return front


def choice_table(pipeline: Pipeline, cluster: Cluster, limits: Limits) -> ChoiceTable:
    """Every model stage's Pareto-optimal ways to run on every block size."""
    sizes = block_sizes(cluster)
    table = []
    for stage in model_stages(pipeline):
        lays = enumerate_layouts(pipeline, stage, sizes, cluster, limits)      # 1
        fitting = prune(pipeline, lays, cluster)                               # 2
        choices = estimate(pipeline, fitting, cluster)                         # 3
        per_size = tuple((size, tuple(c for c in choices if c.size == size)) for size in sizes)
        table.append((stage, per_size))
    return ChoiceTable(sizes, tuple(table))
