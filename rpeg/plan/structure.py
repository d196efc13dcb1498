"""What a plan's structure makes of the step graph and its stages, read by the evaluator.

    >>> graph = plan_graph(pipeline, plan)                              # doctest: +SKIP
    >>> synced_in_place(graph, plan)                                    # doctest: +SKIP
    frozenset({'actor'})

The step graph a plan's structural choices make (staleness, sharing, fusion, and no weight
sync where the generator reads the trained weights in place), which of its ops stream a
generation's chunks, the batching each generate stage runs with, and what the evaluator
reads of the spec's stages (:class:`Stages`, read once). Pure functions of a plan and its
graph; the evaluator memoises them by what they read.
"""

from __future__ import annotations

import functools

import attrs

from rpeg.cost.engine_sync import sync_senders
from rpeg.cost.generation import batching_of
from rpeg.errors import GraphError, PlanError
from rpeg.graph import Graph
from rpeg.graph.ids import Backbone
from rpeg.graph.unroll import chunk_counts
from rpeg.plan.model import Plan, StagePlacement
from rpeg.plan.oplayout import all_in_place
from rpeg.plan.passes import elide_syncs, fused_graph
from rpeg.plan.staleness import step_graph
from rpeg.spec.functions import loss_of
from rpeg.spec.model import Cluster, OpKind, Pipeline


def settle_batching(pipeline: Pipeline, plan: Plan, cluster: Cluster,
                    engine_kv: tuple = ()) -> Plan:
    """``plan`` with each generate stage's batching as it runs, recorded in its placement:
    the placement's ``max_num_seqs``, ``kv_fraction`` and ``cuda_graph``, else the stage's
    (:func:`rpeg.cost.generation.batching_of`); a ``kv_fraction`` still 0 is the share the
    executor's engine takes (``engine_kv``, as ``Limits.kv_share`` reads it), else what is
    free."""
    from rpeg.graph import work_of
    from rpeg.plan.space import Limits
    limits = Limits(engine_kv=engine_kv)
    out = []
    for p in plan.placements:
        if pipeline.stage(p.stage).kind is not OpKind.GENERATE:
            out.append(p)
            continue
        out.append(settled(work_of(pipeline, p.stage), p, limits, cluster))
    out = tuple(out)
    return plan if out == plan.placements else attrs.evolve(plan, placements=out)


def settled(work, p: StagePlacement, limits, cluster: Cluster) -> StagePlacement:
    """A generate placement ``p`` with its batching as it runs (``p`` itself when it
    records that already): see :func:`settle_batching`."""
    seqs, frac, graph = batching_of(work, p)
    frac = frac or limits.kv_share(p.engine, cluster.gpu)
    if (seqs, frac, graph) == (p.max_num_seqs, p.kv_fraction, p.cuda_graph):
        return p
    return p.changed(max_num_seqs=seqs, kv_fraction=frac, cuda_graph=graph)


def is_host_op(pipeline: Pipeline, stage: str) -> bool:
    """Ops that run on the host CPU beside the devices (python rewards, advantages)."""
    s = pipeline.stage(stage)
    return s.kind is OpKind.COMPUTE or (s.kind is OpKind.SCORE
                                       and not pipeline.has_model(s.target or ""))


def plan_graph(pipeline: Pipeline, plan: Plan, base: Graph | None = None, *,
               fused: bool = True) -> Graph:
    """The step graph the plan's structural choices make: staleness, sharing, fusion, and no
    weight sync where the generator reads the trained weights in place (as it runs).
    ``base``: the plan's unfused step graph, when already built; ``fused`` False: its ops
    unfused, the graph of the plan's placed value (:func:`rpeg.plan.lower.lower`), which the
    runtime lays its op calls out from, ``rpeg verify`` checks a run against
    (``rpeg.runtime.lowering.instances.graph_for``) and the simulator prices through its
    fused view (:func:`fused_of` of it), as the cost model prices
    and counts it: a weight sync the graph kept where its generator reads in place would
    stand, in the placed graph, for the transfers filling other readers' copies, and its
    version edge would order the generator after them, which the runtime never does."""
    try:
        graph = base or step_graph(pipeline, plan)
        graph = elide_syncs(graph, synced_in_place(graph, plan))
    except GraphError as e:
        raise _refused(e) from None
    return fused_of(graph, plan) if fused else graph


def fused_of(graph: Graph, plan: Plan) -> Graph:
    """``graph`` (the plan's step graph unfused, :func:`plan_graph` ``fused=False``) with the
    plan's fused stages as one op each (:func:`rpeg.plan.passes.fused_graph`: for one graph
    object, one fused object, which the fused view of the plan's placed graph,
    :meth:`rpeg.plan.lower.Placed.fused`, shares)."""
    try:
        return fused_graph(graph, plan.fusion)
    except GraphError as e:
        raise _refused(e) from None


def _refused(e: GraphError) -> PlanError:
    return PlanError(f"plan structure must be one the spec allows, not: {e.message}", e.span,
                     hint=e.hint)


def synced_in_place(graph: Graph, plan: Plan) -> frozenset[str]:
    """Models whose weight sync moves nothing under ``plan``: every generate op reading them
    reads the trainer's weights in place (:func:`rpeg.plan.oplayout.all_in_place`)."""
    trainer = {o.writes_model: plan.placement(o.stages[0]) for o in graph.ops
               if o.kind is OpKind.TRAIN and o.writes_model and plan.has_placement(o.stages[0])}
    out = set()
    for o in graph.ops:
        if o.kind is not OpKind.SYNC_WEIGHTS or o.reads_model not in trainer:
            continue
        readers = [plan.placement(g.stages[0]) for g in graph.ops if g.kind is OpKind.GENERATE
                   and g.reads_model == o.reads_model and plan.has_placement(g.stages[0])]
        if readers and all(all_in_place(trainer[o.reads_model], r) for r in readers):
            out.add(o.reads_model)
    return frozenset(out)


@attrs.frozen
class Stages:
    """What the evaluator reads of the spec's stages, read once: their kinds and models,
    which run on the host, and the train stages' off-policy correction."""

    order: tuple[str, ...]                     # every stage, in the spec's order
    kind: dict[str, OpKind] = attrs.field(eq=False)
    target: dict[str, str | None] = attrs.field(eq=False)
    model_stage: frozenset[str] = frozenset()  # stages that run a model of the spec
    modelled: frozenset[str] = frozenset()     # stages whose target is a model
    policy: frozenset[str] = frozenset()       # train stages with a policy-gradient loss
    corrected: frozenset[str] = frozenset()    # ... that correct every batch (tis)
    generates: tuple[str, ...] = ()
    syncing: tuple[str, ...] = ()              # train and generate stages: who syncs in place

    @classmethod
    def of(cls, pipeline: Pipeline) -> Stages:
        trains = [s for s in pipeline.stages if s.kind is OpKind.TRAIN]
        policy = frozenset(s.name for s in trains if loss_of(s, pipeline).policy)
        corrected = frozenset(s.name for s in trains if s.name in policy and getattr(
            s.param("loss"), "get", dict().get)("tis") is not None)
        return cls(tuple(s.name for s in pipeline.stages),
                   {s.name: s.kind for s in pipeline.stages},
                   {s.name: s.target for s in pipeline.stages},
                   frozenset(s.name for s in pipeline.stages if s.kind is not OpKind.COMPUTE
                             and pipeline.has_model(s.target or "")),
                   frozenset(s.name for s in pipeline.stages
                             if pipeline.has_model(s.target or "")),
                   policy, corrected,
                   tuple(s.name for s in pipeline.stages if s.kind is OpKind.GENERATE),
                   tuple(s.name for s in pipeline.stages
                         if s.kind in (OpKind.TRAIN, OpKind.GENERATE)))



def graph_backbone(plan: Plan, model: str) -> Backbone:
    return backbone(plan.shared, model)


def backbone(shared: tuple[tuple[str, ...], ...], model: str) -> Backbone:
    for group in shared:
        if model in group:
            return Backbone.of(group)
    return Backbone(model)



def sync_devices(src: StagePlacement, dst: StagePlacement) -> tuple[int, ...]:
    """The devices a weight sync occupies: the trainer's devices that gather and send
    (:func:`rpeg.cost.engine_sync.sync_senders`) and every device of the reader (its torch
    copies, or its vLLM engines' workers)."""
    return _union(sync_senders(src.devices, max(src.tp, 1), src.zero), dst.devices)


@functools.lru_cache(maxsize=4096)
def _union(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(sorted(set(a) | set(b)))


@functools.lru_cache(maxsize=4096)
def stream_sources(graph: Graph, chunked: tuple[tuple[str, int], ...]
                   ) -> tuple[tuple[str, str], ...]:
    """(op, the chunked generate op whose chunks it consumes one by one) for every op that
    streams, given each chunked generate op's chunk count."""
    ends = dict(chunked)
    counts = chunk_counts(graph, ends)
    found = []
    for name in graph.topo_order():
        if name in ends or counts.get(name, 1) <= 1:
            continue
        src = _streamed_from(graph, name, ends)
        if src is not None and ends[src] == counts[name]:
            found.append((name, src))
    return tuple(found)


def _streamed_from(graph: Graph, op: str, chunked: dict) -> str | None:
    """The chunked generate op whose chunks ``op`` inherits (nearest upstream)."""
    frontier, seen = list(graph.producers(op)), set()
    while frontier:
        name = frontier.pop(0)
        if name in chunked:
            return name
        if name in seen or not graph.op(name).per_sample:
            continue
        seen.add(name)
        frontier += list(graph.producers(name))
    return None


__all__ = ["Stages", "backbone", "fused_of", "graph_backbone", "is_host_op", "plan_graph", "settle_batching",
           "settled", "stream_sources", "sync_devices", "synced_in_place"]
