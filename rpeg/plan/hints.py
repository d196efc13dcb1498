"""What to change when nothing fits: hints that were checked to help, or the limit that binds.

    >>> from rpeg.spec import load, load_cluster                               # doctest: +SKIP
    >>> hs = stage_hints(pipeline, cluster, limits, "actor_step")             # doctest: +SKIP
    >>> [h.text for h in hs]                                                   # doctest: +SKIP
    ['add GPUs: on 32 GPUs actor_step fits as dp 16, tp 2, zero 3 (58.1 GB)']

A hint is given only where applying it makes the stage fit, which is checked here with the
cost model before it is printed: a stage that fits in no layout this executor runs on this
cluster (every tp, ZeRO level, offload and recomputation it allows already tried) is
checked on a cluster with more GPUs, with the layouts of an executor with everything the
cost model prices, and with a smaller memory reserve; a plan whose stages fit one at a time
but not together is checked with the one change to the op that fills the fullest GPU
(offload, recomputation, a higher ZeRO level, more micro-batches, fewer sequences at once),
and with more GPUs. Where nothing checked helps, the message says what binds: the largest
tensor parallelism the engine runs here, the node's GPUs, the memory the smallest layout
still needs. Each :class:`Hint` also says the change as a ``place`` pin (or a GPU count),
which is what the tests apply to see it converge.
"""

from __future__ import annotations

import attrs

from rpeg.cost.memory import resident_memory, usable_memory, with_reserve
from rpeg.cost.stages import stage_memory
from rpeg.errors import CostError, PlanError
from rpeg.graph.work import work_of
from rpeg.plan.choices import enumerate_layouts
from rpeg.plan.space import Limits, block_sizes, generate_engines
from rpeg.spec.model import Cluster, OpKind, Pipeline

GB = 1e9
MORE_GPUS = (2, 4, 8)          # cluster sizes tried, in multiples of this one's


@attrs.frozen
class Hint:
    text: str
    stage: str = ""
    pin: tuple[tuple[str, object], ...] = ()   # layout keys to pin on the stage
    gpus: int = 0                              # GPUs the cluster needs (0: as it is)
    reserve: float | None = None               # a memory reserve that leaves room
    any_executor: bool = False                 # an executor with everything priced


def least_need(pipeline: Pipeline, stage: str, cluster: Cluster, limits: Limits,
               sizes: tuple[int, ...] | None = None):
    """(the smallest per-GPU need of ``stage`` alone over its layouts on ``sizes`` devices
    (default: the cluster's blocks), that layout's Layout and engine, the need by kind);
    (inf, None, None, ()) when it has no layout."""
    s = pipeline.stage(stage)
    model = pipeline.model(s.target)
    best = (float("inf"), None, None, ())
    sizes = block_sizes(cluster) if sizes is None else sizes
    for lay in enumerate_layouts(pipeline, stage, sizes, cluster, limits):
        par = lay.par
        try:
            m = stage_memory(work_of(pipeline, stage), par, cluster, rows=1,
                             engine=lay.engine) + resident_memory(
                model, par, cluster, trained=s.kind is OpKind.TRAIN,
                engine=lay.engine)
        except CostError:
            continue
        if m.total < best[0]:
            best = (m.total, par, lay.engine, tuple((k, float(getattr(m, k))) for k in (
                "weights", "grads", "optimizer", "activations", "kv_cache", "buffers")))
    return best


def bigger(cluster: Cluster, k: int) -> Cluster:
    """``cluster`` with ``k`` times the nodes (more racks where it has racks)."""
    if cluster.racks > 1:
        return attrs.evolve(cluster, racks=cluster.racks * k)
    return attrs.evolve(cluster, nodes_per_rack=cluster.nodes_per_rack * k)


def stage_hints(pipeline: Pipeline, cluster: Cluster, limits: Limits,
                stage: str) -> tuple[Hint, ...]:
    """Checked ways to make ``stage`` fit alone, for a stage that fits in no layout here."""
    cap = usable_memory(cluster.gpu)
    out = []
    for k in MORE_GPUS:
        more = bigger(cluster, k)
        need, par, engine, _ = least_need(pipeline, stage, more, limits)
        if need <= usable_memory(more.gpu) and par is not None:
            out.append(Hint(f"add GPUs: on {more.num_gpus} GPUs {stage} fits as "
                            f"{_words(par, engine)} ({need / GB:.1f} GB)", stage,
                            gpus=more.num_gpus))
            break
    if limits != Limits():
        need, par, engine, _ = least_need(pipeline, stage, cluster, Limits())
        if need <= cap and par is not None:
            out.append(Hint(f"plan it for any executor (--any-executor): {stage} fits as "
                            f"{_words(par, engine)} ({need / GB:.1f} GB), which `rpeg run` "
                            f"does not execute", stage, any_executor=True))
    need, par, engine, _ = least_need(pipeline, stage, cluster, limits)
    if par is not None and cap < need <= cluster.gpu.memory * 0.98:
        reserve = max(1 - need / cluster.gpu.memory - 0.005, 0.0)
        out.append(Hint(f"a smaller memory reserve: {stage} alone, in its smallest layout, "
                        f"needs {need / GB:.1f} GB of the {cluster.gpu.memory / GB:.0f} "
                        f"(--memory-reserve {100 * reserve:.0f}%, or reserve in the cluster); "
                        f"what shares its GPUs needs room beside it", stage,
                        reserve=round(reserve, 3)))
    return tuple(out)


def binding(pipeline: Pipeline, cluster: Cluster, limits: Limits, stage: str) -> str:
    """What keeps ``stage`` from fitting when no checked hint helps: the degrees it is
    capped at, and what its smallest layout still needs."""
    s = pipeline.stage(stage)
    need, par, engine, kinds = least_need(pipeline, stage, cluster, limits)
    if par is None:
        return f"{stage} has no layout this executor runs on this cluster"
    top = max(kinds, key=lambda kv: kv[1])[0].replace("_", " ") if kinds else "memory"
    caps = [f"tp at most {min(cluster.gpus_per_node, limits.max_tp)} (tensor parallelism "
            f"inside a node of {cluster.gpus_per_node} GPUs)"]
    if s.kind is OpKind.GENERATE:
        engines = generate_engines(pipeline, stage, limits)
        caps = [f"{e.value} at tp at most {min(limits.engine_max_tp(e), cluster.gpus_per_node)}"
                for e in engines]
        replica = "each replica holds the whole model at that tp, so more GPUs add " \
                  "replicas, not room"
    else:
        replica = "sharding over more GPUs does not bring it under the reserve either " \
                  f"(tried up to {cluster.num_gpus * MORE_GPUS[-1]} GPUs)"
    return (f"nothing this executor runs makes {stage} fit: its smallest layout "
            f"({_words(par, engine)}) needs {need / GB:.1f} GB, most of it {top}, with "
            f"{'; '.join(caps)}; {replica}")


def plan_hints(ev, plan, sf, limits: Limits) -> tuple[Hint, ...]:
    """Checked one-change fixes of the op filling the fullest GPU of ``plan`` (which does
    not fit, though each stage fits alone): the ones after which the whole plan fits."""
    p = sf.layout
    if p is None or not sf.op:
        return ()
    s = ev.pipeline.stage(sf.op)
    tries: list[tuple[str, dict]] = []
    if s.kind is OpKind.TRAIN:
        if not p.offload and limits.offload:
            tries.append(("offload its optimizer state (offload)", {"offload": True}))
        if not p.recompute and limits.recompute:
            tries.append(("recompute activations (recompute)", {"recompute": True}))
        ups = sorted(z for z in limits.zero if z > p.zero)
        if ups and p.dp > 1:
            tries.append((f"raise zero to {ups[0]}", {"zero": ups[0]}))
    if s.kind in (OpKind.TRAIN, OpKind.FORWARD, OpKind.SCORE):
        tries.append((f"use {p.microbatches * 4} micro-batches",
                      {"microbatches": p.microbatches * 4}))
    if s.kind is OpKind.GENERATE and (p.max_num_seqs or 0) != 1:
        half = max((p.max_num_seqs or 64) // 4, 1)
        tries.append((f"decode at most {half} sequences at once (max_num_seqs = {half})",
                      {"max_num_seqs": half}))
    out = []
    for words, change in tries:
        changed = attrs.evolve(plan, placements=tuple(
            q.changed(**change) if q.stage == sf.op else q for q in plan.placements))
        try:
            if ev.fits(changed):
                out.append(Hint(f"{words} for {sf.op}: the plan then fits", sf.op,
                                tuple(change.items())))
        except PlanError:
            continue
    return tuple(out)


def more_gpus_hint(pipeline: Pipeline, cluster: Cluster, limits: Limits) -> Hint | None:
    """Whether a cluster of more GPUs holds a plan (a baseline's): the smallest such."""
    from rpeg.plan.baselines import BASELINES, run_baselines
    from rpeg.plan.edit import Context
    from rpeg.plan.evaluate import Evaluator
    for k in MORE_GPUS:
        more = bigger(cluster, k)
        try:
            ctx = Context.of(pipeline, more, limits)
            found = [o.best for o in run_baselines(tuple(BASELINES), ctx,
                                                   Evaluator(pipeline, more,
                                                             engine_kv=limits.engine_kv))
                     if o.best is not None]
        except PlanError:
            continue
        if found:
            best = min(found, key=lambda e: e.step_time_s)
            return Hint(f"add GPUs: on {more.num_gpus} GPUs the {best.plan.strategy.value} "
                        f"plan fits", gpus=more.num_gpus)
    return None


def reserve_hint(ev, plan, cluster: Cluster) -> Hint | None:
    """A smaller reserve, where the plan fits in the GPU's memory less a smaller one."""
    need = max(plan.predicted.peak_memory) if plan.predicted and plan.predicted.peak_memory \
        else None
    if need is None or need > cluster.gpu.memory * 0.98:
        return None
    reserve = round(max(1 - need / cluster.gpu.memory - 0.005, 0.0), 3)
    if not ev.__class__(ev.pipeline, with_reserve(cluster, reserve),
                        engine_kv=ev.engine_kv).fits(plan):
        return None
    return Hint(f"a smaller memory reserve: the plan needs {need / GB:.1f} GB of the "
                f"{cluster.gpu.memory / GB:.0f} (--memory-reserve {100 * reserve:.0f}%)",
                reserve=reserve)


def _words(par, engine) -> str:
    parts = [f"dp {par.dp}", f"tp {par.tp}"] + ([f"pp {par.pp}"] if par.pp > 1 else []) + (
        [f"zero {par.zero}"] if not par.zero.replicated else []) + (["offload"] if par.offload else []) + (
        ["recompute"] if par.recompute else []) + ([engine.value] if engine else [])
    return ", ".join(parts)


__all__ = ["Hint", "binding", "bigger", "least_need", "more_gpus_hint", "plan_hints",
           "reserve_hint", "stage_hints"]
