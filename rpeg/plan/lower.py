"""A plan's step graph placed on its devices: the one value the runtime lays its op calls
out from (``rpeg.runtime.lowering.instances.build_calls``) and the cost model counts a step's calls
and tasks from (``rpeg.plan.tasks.layouts_of``).

    >>> placed = lower(graph, plan, responses=512)                         # doctest: +SKIP
    >>> placed.layout("rollout").devices_of(0), placed.chunks              # doctest: +SKIP
    ((0, 1), 8)

``lower`` runs an ordered list of pure passes (:data:`PASSES`), each adding one thing:

1. ``layouts``: each op's :class:`~rpeg.plan.oplayout.OpLayout` (its instances' devices,
   :func:`~rpeg.plan.oplayout.op_layout`; a weight sync's, the devices of its calls,
   :func:`~rpeg.plan.oplayout.sync_calls`), and which ops run per chunk;
2. ``chunks``: the chunks a step streams (:func:`~rpeg.plan.oplayout.chunks_per_step`);
3. ``engine_syncs``: for each trained model, who takes part in its weight sync into vLLM
   engines' own copies (:func:`rpeg.cost.engine_sync.engine_sync_layout`).

Not here yet: the instances' dependency edges and their packing into tasks, which the
runtime still derives from these (``rpeg.runtime.lowering.ordering``, ``rpeg.plan.packing``).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from rpeg.cost.engine_sync import SyncLayout, engine_sync_layout
from rpeg.graph import Graph
from rpeg.plan.oplayout import OpLayout, chunks_per_step, op_layout, streamed_ops, sync_calls
from rpeg.spec.model import OpKind


@attrs.frozen
class Placed:
    """A step graph on its devices (see the module doc); the fields a pass has not set yet
    are empty."""

    graph: Graph
    responses: int                                         # responses a step generates
    layouts: tuple[tuple[str, OpLayout], ...] = ()         # op -> its layout, graph order
    streamed: frozenset[str] = frozenset()                 # ops that run per chunk
    chunks: int = 0                                        # chunks a step streams
    engine_syncs: tuple[tuple[str, SyncLayout], ...] = ()  # trained model -> its sync

    def layout(self, op: str) -> OpLayout:
        return dict(self.layouts)[op]

    def engine_sync(self, model: str) -> SyncLayout:
        return dict(self.engine_syncs)[model]


Placing = Callable[[object], object]         # graph op -> the placement of its stage


def _trainer_and_reader(graph: Graph, model: str | None):
    train = next((o for o in graph.ops if o.kind is OpKind.TRAIN and o.writes_model == model),
                 None)
    reader = next((o for o in graph.ops if o.kind is OpKind.GENERATE
                   and o.reads_model == model), None)
    return train, reader


def layouts(p: Placed, placement_of: Placing) -> Placed:
    streamed = streamed_ops(p.graph)
    out = []
    for op in p.graph.ops:
        if op.kind is OpKind.SYNC_WEIGHTS:
            train, reader = _trainer_and_reader(p.graph, op.reads_model)
            devices = sync_calls(placement_of(train), placement_of(reader)) \
                if train is not None and reader is not None else ()
            out.append((op.name, OpLayout(devices, everywhere=True, collective=True)))
        else:
            out.append((op.name, op_layout(op, placement_of(op), op.name in streamed)))
    return attrs.evolve(p, layouts=tuple(out), streamed=streamed)


def chunks(p: Placed, placement_of: Placing) -> Placed:
    return attrs.evolve(p, chunks=chunks_per_step(p.graph, placement_of, p.responses))


def engine_syncs(p: Placed, placement_of: Placing) -> Placed:
    out = []
    for op in p.graph.ops:
        if op.kind is OpKind.TRAIN and op.writes_model:
            readers = [placement_of(o) for o in p.graph.ops if o.kind is OpKind.GENERATE
                       and o.reads_model == op.writes_model]
            out.append((op.writes_model, engine_sync_layout(placement_of(op), readers)))
    return attrs.evolve(p, engine_syncs=tuple(out))


PASSES = (layouts, chunks, engine_syncs)


def lower(graph: Graph, plan, responses: int, placement_of: Placing | None = None) -> Placed:
    """``graph`` (the plan's step graph, its ops unfused) placed by ``plan``: each op on
    its stage's placement (``placement_of``: op -> placement, where a caller checks them;
    else the plan's placement of the op's first stage); ``responses``: those a step
    generates."""
    placement_of = placement_of or (lambda o: plan.placement(o.stages[0]))
    p = Placed(graph, responses)
    for step in PASSES:
        p = step(p, placement_of)
    return p


__all__ = ["PASSES", "Placed", "chunks", "engine_syncs", "layouts", "lower"]
