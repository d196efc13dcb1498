"""Pipeline -> step graph: ops from stages, data edges, weight-sync ops, version edges.

    >>> g = build(load("pipelines/ppo_llama8b.rpeg"), share=True)          # doctest: +SKIP
    >>> g.op("actor_step+critic_step").writes_model                         # doctest: +SKIP
    'actor+critic'

Passes in order (each a function from value to value):
  1. ops        — one op per stage; models named through the sharing alias; an estimator
                  that needs groups or lengths also reads its scores' responses
  2. merge      — train ops of one shared backbone become one op (one combined loss)
  3. syncs      — a weight-sync op for every trained model a generate op reads
  4. data edges — producer -> consumer for every datum read
  5. versions   — reader at step s needs the writer's version from step s - 1 - lag
"""

from __future__ import annotations

import attrs

from rpeg.errors import GraphError
from rpeg.graph.ids import Backbone, fused_name
from rpeg.graph.ir import SAME_STEP, DataEdge, Graph, Op, VersionEdge
from rpeg.graph.work import work_of
from rpeg.spec.functions import function
from rpeg.spec.model import OpKind, Pipeline
from rpeg.spec.registry import Scope
from rpeg.spec.stages import implicit_inputs


def build(pipeline: Pipeline, staleness: dict[str, int] | None = None,
          share: bool = False) -> Graph:
    bounds = _bounds(pipeline, staleness)
    alias = _alias(pipeline) if share else {}
    ops = _ops(pipeline, alias)                          # 1
    ops = _merge_trainers(ops)                           # 2
    ops = _add_syncs(ops)                                # 3
    data = _data_edges(ops, pipeline)                    # 4
    versions = _version_edges(ops, bounds)               # 5
    read = tuple(dict.fromkeys(m for o in ops for m in (o.reads_model,) if m))
    trained = tuple(dict.fromkeys(o.writes_model for o in ops
                                  if o.kind is OpKind.TRAIN and o.writes_model))
    shared = tuple(sorted({(b, tuple(m for m in alias if alias[m] == b))
                           for b in set(alias.values())}))
    return Graph(pipeline.name, tuple(ops), data, versions, read, trained, shared)


def _bounds(pipeline: Pipeline, chosen: dict[str, int] | None) -> dict[str, int]:
    bounds = dict(pipeline.staleness)
    for stage, k in (chosen or {}).items():
        limit = bounds.get(stage, 0)
        if k < 0 or k > limit:
            raise GraphError(f"staleness {k} for stage '{stage}' is outside the spec's bound "
                             f"0..{limit}", pipeline.stage(stage).span)
        bounds[stage] = k
    return bounds


def _alias(pipeline: Pipeline) -> dict[str, str]:
    alias: dict[str, str] = {}
    for group in pipeline.shares:
        backbone = Backbone.of(group)
        for m in group:
            alias[m] = backbone
    return alias


def _ops(pipeline: Pipeline, alias: dict[str, str]) -> list[Op]:
    models = {m.name for m in pipeline.models}
    ops = []
    for s in pipeline.stages:
        target = alias.get(s.target, s.target) if s.target else None
        reads = target if s.target in models and s.kind is not OpKind.COMPUTE else None
        writes = target if s.kind is OpKind.TRAIN else None
        fn = function(s.function)
        # an estimator of groups or lengths also reads the responses its scores are of
        inputs = s.inputs + implicit_inputs(pipeline, s)
        ops.append(Op(s.name, s.kind, inputs, s.outputs, reads, writes, (s.name,), s.span,
                      grouped=fn.scope is not Scope.SAMPLE, work=(work_of(pipeline, s.name),)))
    trainers: dict[str, Op] = {}
    for o in ops:
        if o.kind is OpKind.TRAIN and len(o.stages) == 1:
            first = trainers.get(o.writes_model)
            if first is not None and not Backbone(o.writes_model).shared:
                raise GraphError(f"model '{o.writes_model}' is trained by two stages, "
                                 f"'{first.name}' and '{o.name}'", o.span,
                                 notes=[("first trained here", first.span)],
                                 hint="train each model in one stage (epochs and minibatches "
                                      "repeat it)")
            trainers.setdefault(o.writes_model, o)
    return ops


def _merge_trainers(ops: list[Op]) -> list[Op]:
    """Train ops writing one backbone become one op: one combined loss, one optimizer step."""
    groups: dict[str, list[Op]] = {}
    for o in ops:
        if o.kind is OpKind.TRAIN:
            groups.setdefault(o.writes_model, []).append(o)
    out: list[Op] = []
    for o in ops:
        group = groups.get(o.writes_model) if o.kind is OpKind.TRAIN else None
        if not group or len(group) == 1:
            out.append(o)
        elif o is group[0]:
            inputs = tuple(dict.fromkeys(i for g in group for i in g.inputs))
            stages = tuple(s for g in group for s in g.stages)
            out.append(attrs.evolve(o, name=fused_name(stages), inputs=inputs, stages=stages,
                                    work=tuple(w for g in group for w in g.work)))
    return out


def _add_syncs(ops: list[Op]) -> list[Op]:
    trained = {o.writes_model for o in ops if o.kind is OpKind.TRAIN}
    out = list(ops)
    for o in ops:
        if o.kind is OpKind.GENERATE and o.reads_model in trained:
            name = f"sync_{o.reads_model}"
            if not any(x.name == name for x in out):
                out.append(Op(name, OpKind.SYNC_WEIGHTS, reads_model=o.reads_model,
                              writes_model=o.reads_model, span=o.span))
    return out


def _data_edges(ops: list[Op], pipeline: Pipeline) -> tuple[DataEdge, ...]:
    producer = {d: o.name for o in ops for d in o.outputs}
    edges = []
    for o in ops:
        for d in o.inputs:
            if d in producer:
                edges.append(DataEdge(producer[d], o.name, d))
    return tuple(edges)


def _version_edges(ops: list[Op], bounds: dict[str, int]) -> tuple[VersionEdge, ...]:
    writer = {o.writes_model: o.name for o in ops if o.kind is OpKind.TRAIN}
    sync = {o.reads_model: o.name for o in ops if o.kind is OpKind.SYNC_WEIGHTS}
    edges = []
    for o in ops:
        m = o.reads_model
        if m is None or m not in writer:
            continue
        if o.kind is OpKind.SYNC_WEIGHTS:
            edges.append(VersionEdge(m, writer[m], o.name, SAME_STEP))       # right after its train
            continue
        lag = max((bounds.get(s, 0) for s in o.stages), default=0)
        src = sync[m] if o.kind is OpKind.GENERATE else writer[m]
        edges.append(VersionEdge(m, src, o.name, lag))
    return tuple(edges)
