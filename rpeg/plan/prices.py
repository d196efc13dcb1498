"""The cost model's answers a planner asks again and again, each computed once.

    >>> prices = Prices.of(load("pipelines/ppo_llama8b.rpeg"),
    ...                    load_cluster("pipelines/clusters/gh200_64.rpeg"))  # doctest: +SKIP
    >>> prices.stage_cost("actor_step", placement).time_s                    # doctest: +SKIP
    9.8

A search prices thousands of plans that differ from each other in one stage: the cost of
every other op is the same as before. Every answer here is a pure function of a stage's
:class:`rpeg.graph.work.Work`, a placement's layout and the cluster's profile, memoised
per function and keyed by exactly what that function reads of the placement:

- time (:meth:`stage_cost`, :meth:`chunk_ends`, :meth:`sync_time`): the layout and where
  its devices sit in the cluster's tree (:meth:`timed`: moved to the first node or rack
  alike, since the cluster's nodes and racks are alike);
- memory (:meth:`transient`, :meth:`resident`, :meth:`gen_rows`): the layout alone, on
  any devices (:meth:`laid`).

A cost function changed in :mod:`rpeg.cost` changes these answers with it: nothing here
restates a formula. Loading profiles is the caller's business.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from rpeg.cost.engine_sync import collective_sync_time, engine_copy, tp_blocks
from rpeg.cost.generation import StageCost
from rpeg.cost.memory import resident_memory
from rpeg.cost.partial import smallest_cap
from rpeg.cost.stages import (
    estimate_stage,
    generation_chunks,
    generation_rows,
    stage_memory,
    weight_sync_time,
)
from rpeg.graph import build
from rpeg.graph.ids import fused_name
from rpeg.graph.work import Work
from rpeg.plan.model import StagePlacement
from rpeg.plan.oplayout import fused_train
from rpeg.spec.model import Cluster, Model, Pipeline, Zero

MIB = 2 ** 20

# (responses, longest response, mean length) of one streamed chunk
Chunk = tuple[int, float, float]


class _Memo(dict):
    """One pure function's answers, by its arguments: ``memo[args]`` (a tuple of them; the
    argument itself for a function of one, ``one``). A hit is one dict lookup, no call of
    Python's (asked some hundred thousand times a search); a miss computes the answer."""

    def __init__(self, fn: Callable, one: bool = False) -> None:
        super().__init__()
        self.fn = fn
        self.one = one

    def __missing__(self, args):
        out = self[args] = self.fn(args) if self.one else self.fn(*args)
        return out


@attrs.frozen(eq=False)
class Prices:
    """The memoised cost functions of one pipeline's stages on one cluster."""

    works: dict[str, Work] = attrs.field(eq=False)         # stage -> what it computes
    models: dict[str, Model] = attrs.field(eq=False)       # model name -> model
    cluster: Cluster = attrs.field(eq=False)
    max_len: int = 0                                        # longest response (tokens)
    _memo: dict[str, _Memo] = attrs.field(init=False, eq=False, factory=dict)
    _interned: dict[StagePlacement, StagePlacement] = attrs.field(init=False, eq=False,
                                                                  factory=dict)

    @classmethod
    def of(cls, pipeline: Pipeline, cluster: Cluster) -> Prices:
        works = {w.stage: w for o in build(pipeline).ops for w in o.work}
        models = {m.name: m for m in pipeline.models}
        prices = cls(works, models, cluster, pipeline.workload.gen_len.max_len)
        for name in ("_stage_cost", "_chunk_ends", "_transient", "_resident", "_gen_rows",
                     "_synced", "_sync_time"):
            prices._memo[name] = _Memo(getattr(prices, name))
        for name in ("_timed", "_laid", "canonical"):                # of one placement
            prices._memo[name] = _Memo(getattr(prices, name), one=True)
        return prices

    # --- placements as the cost functions read them ---------------------------------

    def timed(self, p: StagePlacement) -> StagePlacement:
        """``p`` as time reads it: one chunk, moved to where the cluster's tree looks the
        same (see :meth:`canonical`)."""
        return self._memo["_timed"][p]

    def _timed(self, p: StagePlacement) -> StagePlacement:
        return self._one(self.canonical(attrs.evolve(p, chunks=1) if p.chunks != 1 else p))

    def laid(self, p: StagePlacement) -> StagePlacement:
        """``p`` as memory reads it: its layout, on no device in particular."""
        return self._memo["_laid"][p]

    def _laid(self, p: StagePlacement) -> StagePlacement:
        return self._one(attrs.evolve(p, stage="", devices=(), chunks=1))

    def _one(self, p: StagePlacement) -> StagePlacement:
        """The one instance of ``p``'s value these prices keep: many placements read the
        same way, and the memos keyed by it then find it by identity, not by comparing
        its fields (thousands of devices) again."""
        return self._interned.setdefault(p, p)

    def canonical(self, *ps: StagePlacement):
        """The placements moved together to where the cluster's tree looks the same (its
        nodes and racks are alike, so costs are too): inside one rack, to the first node
        of the first rack; across racks, to the first rack. One or a tuple, as given."""
        if not all(p.devices for p in ps):
            return ps if len(ps) > 1 else ps[0]
        lo, hi = min(min(p.devices) for p in ps), max(max(p.devices) for p in ps)
        gpn = self.cluster.gpus_per_node
        rack = gpn * self.cluster.nodes_per_rack
        shift = (lo // gpn) * gpn if lo // rack == hi // rack else (lo // rack) * rack
        if shift:
            ps = tuple(attrs.evolve(p, devices=_shifted(p.devices, shift)) for p in ps)
        return ps if len(ps) > 1 else ps[0]

    def cap(self, p: StagePlacement) -> int:
        """Tokens a step decodes per response when a generate stage carries responses over
        ``p.carry`` steps: each advances by about an equal share of the longest (0: all)."""
        return smallest_cap(self.max_len, p.carry)

    def trained(self, stages: tuple[str, ...], places: tuple[StagePlacement, ...]
                ) -> tuple[str, StagePlacement]:
        """(name of its work here, placement) of a train op of ``stages`` placed as
        ``places``, as it runs (:func:`rpeg.plan.oplayout.fused_train`): one stage's own;
        a shared backbone's stages' one schedule, its work kept under the op's name
        (:func:`~rpeg.graph.ids.fused_name`, as the graph names the op), so every answer
        here prices it as any stage's."""
        if len(stages) == 1:
            return stages[0], places[0]
        work, p = fused_train(tuple(self.works[s] for s in stages), places)
        name = fused_name(stages)
        self.works.setdefault(name, work)
        return name, p

    # --- time -----------------------------------------------------------------------

    def stage_cost(self, stage: str, p: StagePlacement, rows: int | None = None,
                   chunk: Chunk | None = None, off_policy: bool = False) -> StageCost:
        """The cost of one step of ``stage`` placed as ``p``: ``rows`` sequences generated
        at once per replica; ``chunk``: one streamed chunk on its own; ``off_policy``: a
        train stage corrects for responses sampled with older weights."""
        return self._memo["_stage_cost"][(stage, self._memo["_timed"][p], rows, chunk,
                                           off_policy)]

    def _stage_cost(self, stage, q, rows, chunk, off_policy) -> StageCost:
        batch, padded, mean = chunk if chunk is not None else (None, None, None)
        return estimate_stage(self.works[stage], q.layout, q.devices, self.cluster,
                              engine=q.engine, rows=rows, batch=batch, padded_len=padded,
                              partial=self.cap(q), off_policy=off_policy, mean_len=mean)

    def chunk_ends(self, stage: str, p: StagePlacement, rows: int | None = None
                   ) -> tuple[tuple[float, int, float, float], ...]:
        """(end, responses, longest response, mean length) of each chunk of a generate
        stage."""
        return self._memo["_chunk_ends"][(stage, self._memo["canonical"][p], rows)]

    def _chunk_ends(self, stage, p, rows):
        return generation_chunks(self.works[stage], p.layout, p.devices, self.cluster,
                                 p.chunks, engine=p.engine, rows=rows, with_lengths=True,
                                 partial=self.cap(p))

    def sync_time(self, model: str, src: StagePlacement, dst: StagePlacement) -> float:
        """Seconds to bring ``model``'s new weights from a trainer placed as ``src`` into a
        reader placed as ``dst`` (collectives into a vLLM engine's own copy)."""
        return self._memo["_synced"][(model, src, dst)]

    def _synced(self, model, src, dst) -> float:
        return self._memo["_sync_time"][(model, *self.canonical(src, dst))]

    def _sync_time(self, model, src, dst) -> float:
        m = self.models[model]
        if engine_copy(src, dst):
            blocks = tp_blocks(dst.devices, dst.tp)
            return collective_sync_time(m, src.devices, src.layout, blocks, self.cluster)
        return weight_sync_time(m, src.devices, src.layout, dst.devices,
                                dst.layout, self.cluster)

    # --- memory ---------------------------------------------------------------------

    def transient(self, stage: str, p: StagePlacement, rows: int | None = None,
                  chunks: tuple[Chunk, ...] = ()) -> float:
        """Bytes a stage needs while it runs: for the whole batch, or (``chunks`` of a
        streamed consumer) the largest of its chunks, each processed on its own."""
        return self._memo["_transient"][(stage, self._memo["_laid"][p], rows, chunks)]

    def _transient(self, stage, q, rows, chunks) -> float:
        par, work = q.layout, self.works[stage]
        if chunks:
            return max(stage_memory(work, par, self.cluster, batch=n, padded_len=top,
                                    engine=q.engine, mean_len=mean).total
                       for n, top, mean in chunks)
        return stage_memory(work, par, self.cluster, rows=rows, partial=self.cap(q),
                            engine=q.engine).total

    def resident(self, model: str, p: StagePlacement, trained: bool) -> float:
        """Bytes a copy of ``model`` keeps between stages: a ZeRO-3 copy (trained, or a
        frozen model served on shards) sharded over its data and context parallel ranks."""
        return self._memo["_resident"][(model, self._memo["_laid"][p], trained)]

    def _resident(self, model, q, trained) -> float:
        zero = q.zero if trained or q.zero.shards_params else Zero.NONE
        par = attrs.evolve(q.layout, zero=zero, offload=q.offload and trained)
        return resident_memory(self.models[model], par, self.cluster, trained=trained,
                               engine=q.engine).total

    def gen_rows(self, stage: str, p: StagePlacement, free: float) -> int:
        """Sequences a generate stage runs at once per replica with ``free`` bytes per GPU
        (counted in whole MiB)."""
        return self._memo["_gen_rows"][(stage, self._memo["_laid"][p], int(free // MIB))]

    def _gen_rows(self, stage, q, free_mib) -> int:
        return generation_rows(self.works[stage], q.layout, self.cluster,
                               free_mib * MIB, partial=self.cap(q), engine=q.engine)

    def sizes(self) -> dict[str, int]:
        """Answers held per function (what a search asked, and how much it reused)."""
        return {name.lstrip("_"): len(m) for name, m in self._memo.items()}


def _shifted(devices: tuple[int, ...], shift: int) -> tuple[int, ...]:
    first = devices[0] - shift
    run = tuple(range(first, first + len(devices)))
    if devices[-1] - devices[0] == len(devices) - 1 and devices == tuple(
            range(devices[0], devices[-1] + 1)):
        return run
    return tuple(d - shift for d in devices)


__all__ = ["Prices"]
