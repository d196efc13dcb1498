"""The RPEG IR: one RL step as ops and data edges, plus parameter-version edges across steps.

    >>> g = build(load("pipelines/ppo_llama8b.rpeg"))     # doctest: +SKIP
    >>> print(g)                                                        # doctest: +SKIP
    graph ppo_llama8b
      op rollout      generate      actor   reads prompts -> responses, logprobs   needs actor >= s-1
      ...
      version actor   actor_step -> sync_actor -> rollout   lag 1

An op reads data (``inputs``) and writes data (``outputs``); it may also read the
parameters of a model (``reads_model``) or write a new version of them
(``writes_model``, train and weight-sync ops). A version edge says: the reader at
step s needs the version the writer produced at step s - 1 - lag, i.e. version
>= s - lag, where lag is the staleness (0 = synchronous).

The graph is a value: passes return new graphs (``attrs.evolve``), and
``str(graph)`` is deterministic for golden tests and ``rpeg diff``.
"""

from __future__ import annotations

import functools

import attrs

from rpeg.errors import NOWHERE, Span
from rpeg.graph.ids import Backbone, fused_name
from rpeg.graph.order import topological
from rpeg.graph.work import Work
from rpeg.spec.model import OpKind


@attrs.frozen(cache_hash=True)       # a key of the copies' and layouts' memos: hashed once
class Op:
    name: str                          # unique in the graph; the stage name, or sync_<model>
    kind: OpKind
    inputs: tuple[str, ...] = ()       # data read
    outputs: tuple[str, ...] = ()      # data written
    # whose parameters it reads (generate, forward, train); whose new version it makes (train;
    # sync: at the reader)
    reads_model: Backbone | None = attrs.field(default=None, converter=Backbone.maybe)
    writes_model: Backbone | None = attrs.field(default=None, converter=Backbone.maybe)
    stages: tuple[str, ...] = ()       # spec stages this op implements (more than one when fused)
    span: Span = attrs.field(default=NOWHERE, eq=False, repr=False)
    grouped: bool = False              # needs the step's whole batch (a group or batch estimator)
    # what each stage computes, as the cost model prices it (rpeg.graph.work)
    work: tuple[Work, ...] = attrs.field(default=(), eq=False, repr=False)

    @property
    def per_sample(self) -> bool:
        """Works response by response, so it can consume a stream of generated chunks (a
        group estimator normalises over a prompt's samples, which chunks split: it waits
        for the whole step)."""
        return self.kind in (OpKind.FORWARD, OpKind.SCORE, OpKind.COMPUTE) and not self.grouped


@attrs.frozen
class DataEdge:
    src: str
    dst: str
    data: str


# The lag of a train op's edge to its weight sync: the sync runs right after the train op,
# in the same step (s - 1 - SAME_STEP = s), so it carries the version just made.
SAME_STEP = -1


@attrs.frozen
class VersionEdge:
    """``reader`` at step s needs the version ``writer`` produced at step s - 1 - lag."""

    model: str
    writer: str
    reader: str
    lag: int = 0

    @property
    def same_step(self) -> bool:
        return self.lag == SAME_STEP


@attrs.frozen(cache_hash=True)       # a planner's cache key: hashed once
class Graph:
    name: str
    ops: tuple[Op, ...]
    data_edges: tuple[DataEdge, ...]
    version_edges: tuple[VersionEdge, ...]
    models: tuple[str, ...]                       # models (backbones) whose parameters ops read
    trained: tuple[str, ...]                      # models some op writes
    shared: tuple[tuple[str, tuple[str, ...]], ...] = ()   # backbone -> models merged into it
    workload_data: tuple[str, ...] = ("prompts",)

    def op(self, name: str) -> Op:
        return self._by_name[name]

    def has_op(self, name: str) -> bool:
        return name in self._by_name

    def producers(self, name: str) -> tuple[str, ...]:
        """Ops whose data ``name`` reads, in graph order."""
        return self._neighbours[0].get(name, ())

    def consumers(self, name: str) -> tuple[str, ...]:
        return self._neighbours[1].get(name, ())

    def topo_order(self) -> tuple[str, ...]:
        """Ops in an order where every producer comes before its consumers within a step
        (data edges, and train -> weight sync), stable in graph order."""
        return self._topo_order

    # derived once (a graph is a value; these are read in every simulated instance)

    @functools.cached_property
    def _by_name(self) -> dict[str, Op]:
        out: dict[str, Op] = {}
        for o in self.ops:
            out.setdefault(o.name, o)
        return out

    @functools.cached_property
    def _neighbours(self) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        srcs: dict[str, set[str]] = {}
        dsts: dict[str, set[str]] = {}
        for e in self.data_edges:
            srcs.setdefault(e.dst, set()).add(e.src)
            dsts.setdefault(e.src, set()).add(e.dst)
        return ({n: tuple(o.name for o in self.ops if o.name in s) for n, s in srcs.items()},
                {n: tuple(o.name for o in self.ops if o.name in d) for n, d in dsts.items()})

    @functools.cached_property
    def _topo_order(self) -> tuple[str, ...]:
        before: dict[str, list[str]] = {o.name: [] for o in self.ops}
        for e in self.data_edges:
            before[e.dst].append(e.src)
        for e in self.version_edges:
            if e.same_step:
                before[e.reader].append(e.writer)
        return topological([o.name for o in self.ops], before.get)

    def lag_of(self, op: str) -> int:
        """The staleness an op reads its model's parameters with (0 if it reads none)."""
        return max((e.lag for e in self.version_edges if e.reader == op), default=0)

    def backbone(self, model: str) -> Backbone:
        for b, members in self.shared:
            if model in members:
                return Backbone(b)
        return Backbone(model)

    def __str__(self) -> str:
        w = max([len(o.name) for o in self.ops] + [4])
        lines = [f"graph {self.name}"]
        for o in self.ops:
            reads = ", ".join(o.inputs) or "-"
            writes = ", ".join(o.outputs) or "-"
            model = ""
            if o.reads_model:
                model += f"  reads {o.reads_model}"
                lag = self.lag_of(o.name)
                if o.kind is OpKind.SYNC_WEIGHTS:
                    model += " from this step's train"
                elif any(e.reader == o.name for e in self.version_edges):
                    model += f" >= s-{lag}" if lag else " = s"
            if o.writes_model:
                model += f"  writes {o.writes_model}"
            fused = f"  fuses {fused_name(o.stages)}" if len(o.stages) > 1 else ""
            lines.append(f"  op {o.name:<{w}}  {o.kind.value:<12}  {reads} -> {writes}{model}{fused}")
        for e in self.data_edges:
            lines.append(f"  data {e.src} -> {e.dst}  [{e.data}]")
        for e in self.version_edges:
            lines.append(f"  version {e.model}  {e.writer} -> {e.reader}  lag {e.lag}")
        for b, members in self.shared:
            lines.append(f"  shared {b} = {', '.join(members)}")
        return "\n".join(lines)
