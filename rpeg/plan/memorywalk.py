"""A plan's memory: one walk over its ops finds the copies of each model's weights, what
they leave free, each generate op's wave size, the chunks each streamed op consumes and
each device's largest transient need; whether the plan fits, and what fills a device that
overflows.

    >>> from rpeg.plan.evaluate import Evaluator                          # doctest: +SKIP
    >>> ev = Evaluator(pipeline, cluster)                                 # doctest: +SKIP
    >>> graph = ev.graph(plan); walk = ev.walk(plan, graph)               # doctest: +SKIP
    >>> peak, shortfall = ev.memory(plan, graph, walk)                    # doctest: +SKIP

:class:`MemoryWalk` is the part of :class:`rpeg.plan.evaluate.Evaluator` that answers
these (its memos live in the evaluator); :class:`Walk`, :class:`Held` and
:class:`Shortfall` are what it answers with (see :mod:`rpeg.plan.evaluate`).
"""

from __future__ import annotations

import functools

import attrs
import numpy as np

from rpeg.cost.memory import MemoryCost, resident_memory, usable_memory
from rpeg.cost.stages import stage_memory
from rpeg.errors import CostError
from rpeg.graph import Graph
from rpeg.graph.ids import ReplicaKey
from rpeg.plan.copies import copies as copies_of
from rpeg.plan.lower import PASSES, lower
from rpeg.plan.model import Plan, StagePlacement
from rpeg.plan.oplayout import chunks_per_step, rounds_of
from rpeg.plan.prices import Chunk
from rpeg.plan.structure import backbone, stream_sources
from rpeg.plan.usage import KINDS
from rpeg.spec.model import OpKind, Zero


@attrs.frozen
class Shortfall:
    """Why a plan does not fit: the worst device and what fills it."""

    device: int
    need: float                 # bytes
    capacity: float
    op: str                     # the op with the largest transient need there
    model: str                  # the model the largest resident share belongs to
    what: tuple[tuple[str, float], ...]      # (what, bytes) filling the device
    kinds: tuple[tuple[str, float], ...] = ()   # (weights / grads / ... , bytes) there
    layout: StagePlacement | None = None        # how the op with the largest need runs

    @property
    def over(self) -> float:
        return self.need - self.capacity


@attrs.frozen
class Held:
    """One copy of a model's weights as the cost model prices it: as ``placement`` holds
    it, on ``devices`` (:class:`rpeg.plan.copies.Copy`)."""

    model: str                      # the spec model it is priced as
    placement: StagePlacement       # the placement laying it out
    trained: bool
    devices: tuple[int, ...]
    key: ReplicaKey = ReplicaKey("")    # the runtime's key of it (actor, actor~vllm, ...)


@attrs.frozen(eq=False)
class Walk:
    """What one walk over a plan's ops finds, which its memory and its time both read."""

    copies: tuple[Held, ...]
    resident: np.ndarray               # bytes per device between stages
    rows: dict[str, int]               # generate stage -> sequences at once per replica
    streamed: dict[str, tuple[Chunk, ...]]   # op -> the chunks it consumes as generated
    transient: np.ndarray              # the largest transient need per device
    needs: tuple[tuple[str, tuple[int, ...], float], ...]   # (stage, devices, transient)
    # ops reading only copies an op before them reads there: no fetch of their own
    # (:meth:`rpeg.plan.copies.Copies.read_before`)
    read_before: frozenset[str] = frozenset()

    @property
    def peak(self) -> np.ndarray:
        return self.resident + self.transient

    def top(self, device: int) -> str:
        """The stage with the largest transient need on ``device`` (the first, in the
        spec's order, of those with as much); "" for none."""
        best, most = "", 0.0
        for stage, devices, b in self.needs:
            if b > most and device in _members(devices):
                best, most = stage, b
        return best


class MemoryWalk:
    """A plan's walk and memory, for :class:`rpeg.plan.evaluate.Evaluator` (see the
    module doc)."""

    def _at_devices(self, devices: tuple[int, ...]) -> slice | np.ndarray:
        """An index of ``devices`` into a per-device array (see :func:`_at`)."""
        at = self._index.get(devices)
        if at is None:
            at = self._index[devices] = _at(devices)
        return at

    def _at(self, p: StagePlacement) -> slice | np.ndarray:
        """An index of ``p``'s devices into a per-device array (see :func:`_at`)."""
        at = self._index.get(p)
        if at is None:
            at = self._index[p] = _at(p.devices)
        return at

    # --- one walk over the plan's ops --------------------------------------------------

    def walk(self, plan: Plan, graph: Graph) -> Walk:
        """The copies each model keeps, what they leave free, each generate op's wave size,
        the chunks each streamed op consumes, and each device's largest transient need."""
        copies, spread, before = self._held(plan, graph)
        n = plan.num_devices
        resident = np.zeros(n)
        for model, placement, trained, at in spread:
            resident[at] += self.prices.resident(model, placement, trained)
        rows = self.rows_of(plan, graph, resident)
        streamed = self.streamed(plan, graph, rows)
        chunks_of = {s: streamed[o] for o, stages in self._streaming(graph)
                     if o in streamed for s in stages}
        transient = np.zeros(n)
        needs = []
        for stage, trains in self._priced_stages(graph):
            p = plan.placement(stage)
            # a shared backbone's train stages: the one train they run as
            work, q = self.prices.trained(trains, tuple(plan.placement(s) for s in trains)) \
                if trains else (stage, p)
            b = self.prices.transient(work, q, rows.get(stage), chunks_of.get(stage, ()))
            at = self._at(p)
            transient[at] = np.maximum(transient[at], b)
            needs.append((stage, p.devices, b))
        return Walk(copies, resident, rows, streamed, transient, tuple(needs), before)

    def _priced_stages(self, graph: Graph) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(stage, the stages of its train op where several run as one, else ()) of the
        stages whose transient need is priced: all but those running inside another
        stage's op (a shared backbone's train stages after the first)."""
        key = ("priced", graph)
        if key not in self._per_graph:
            fused = {o.stages[0]: o.stages for o in graph.ops
                     if o.kind is OpKind.TRAIN and len(o.stages) > 1}
            followers = {s for stages in fused.values() for s in stages[1:]}
            self._per_graph[key] = tuple((s, fused.get(s, ())) for s in self.stages.order
                                         if s not in followers)
        return self._per_graph[key]

    def _streaming(self, graph: Graph) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """(op, its stages) of every op of ``graph``."""
        key = ("stages", graph)
        if key not in self._per_graph:
            self._per_graph[key] = tuple((o.name, o.stages) for o in graph.ops)
        return self._per_graph[key]

    def copies(self, plan: Plan, graph: Graph | None = None) -> tuple[Held, ...]:
        """Every copy of every model's weights, on the devices the runtime keeps it on
        (:func:`rpeg.plan.copies.copies`, by which it keys its replicas): the trained copy
        where its train op runs, the others as the first op reading them there lays them
        out. ``graph``: the plan's (:meth:`graph`), when at hand."""
        return self._held(plan, graph)[0]

    def _held(self, plan: Plan, graph: Graph | None = None
              ) -> tuple[tuple[Held, ...], tuple, frozenset[str]]:
        """(:meth:`copies`, the same spread for the resident bytes: (model, placement,
        trained, index of its devices) of each run of consecutive copies priced alike on
        devices apart, which add the same bytes to the same devices in the same order as
        the copies one by one, a tensor-parallel block's second copies at once; the ops
        fetching no copy of their own, :attr:`Walk.read_before`). Read from the plan's
        placed value (:meth:`placed`: the one the runtime keys its replicas by), its op
        layouts and chunks lowered (:data:`~rpeg.plan.lower.PASSES`' first two), which
        :func:`~rpeg.plan.lower.lower` keeps for the passes after them."""
        unfused = self.unfused(plan, graph)         # the placed value's graph
        ops = self._model_ops(unfused)
        key = (unfused, tuple(plan.placement(o.stages[0]) for o in ops))
        out = self._copies.get(key)
        if out is None:
            def placing(op):
                return plan.placement(op.stages[0])

            # the op layouts and chunks a step streams: what the copies are read from
            laid = lower(unfused, plan, self.responses, placing, passes=PASSES[:2])
            found = copies_of(laid, placing)
            parts = tuple(self._backbone_held(part, plan.shared) for part in found.backbones)
            out = self._copies[key] = (
                tuple(h for held, _ in parts for h in held),
                tuple(run for _, spread in parts for run in spread), found.read_before())
        return out

    def _backbone_held(self, part, shared: tuple[tuple[str, ...], ...]) -> tuple:
        """(the copies, their spread) of one backbone's copies
        (:class:`rpeg.plan.copies.BackboneCopies`), kept by the part: a plan that moves an
        op of another backbone finds them again. A run of :func:`_spread` never spans two
        backbones (their copies are priced as models of their own), so a plan's spread is
        its backbones' one after another."""
        key = (part, shared)
        out = self._backbones.get(key)
        if out is None:
            if len(self._backbones) > 1024:     # each holds its part alive: bounded
                self._backbones.clear()
            names = self._model_names(shared)
            held = tuple(
                Held(names[(c.key.backbone, c.trained)], c.placement, c.trained, c.devices,
                     c.key)
                for c in part.held)
            out = self._backbones[key] = (held, _spread(held))
        return out

    def _model_ops(self, graph: Graph) -> tuple:
        """The ops of ``graph`` that read or train a model (not its weight syncs)."""
        key = ("model ops", graph)
        if key not in self._per_graph:
            self._per_graph[key] = tuple(o for o in graph.ops if o.reads_model
                                         and o.kind is not OpKind.SYNC_WEIGHTS)
        return self._per_graph[key]

    def _model_names(self, shared: tuple[tuple[str, ...], ...]) -> dict:
        """(backbone, trained) -> the spec model its copies are priced as: its train
        stage's for the trained copy, its first stage's for the others."""
        key = ("names", shared)
        if key not in self._per_graph:
            by: dict[str, list[str]] = {}
            for s in self.stages.order:
                if s in self.stages.model_stage:
                    by.setdefault(backbone(shared, self.stages.target[s]), []).append(s)
            out = {}
            for b, stages in by.items():
                train = next((s for s in stages if self.stages.kind[s] is OpKind.TRAIN), None)
                out[(b, False)] = self.stages.target[stages[0]]
                out[(b, True)] = self.stages.target[train or stages[0]]
            self._per_graph[key] = out
        return self._per_graph[key]

    def resident_bytes(self, plan: Plan, graph: Graph):
        """(bytes resident per device, the same per model)."""
        n = plan.num_devices
        resident = np.zeros(n)
        by_model: dict[str, np.ndarray] = {}
        for h in self.copies(plan):
            b = self.prices.resident(h.model, h.placement, h.trained)
            at = self._at_devices(h.devices)
            resident[at] += b
            by_model.setdefault(h.model, np.zeros(n))[at] += b
        return resident, by_model

    def rows_of(self, plan: Plan, graph: Graph, resident: np.ndarray | None = None) -> dict:
        """Per generate stage: its wave size given what stays resident on its devices."""
        if resident is None:
            resident = self.resident_bytes(plan, graph)[0]
        cap = usable_memory(self.cluster.gpu)
        out = {}
        for s in self.stages.generates:
            p = plan.placement(s)
            free = cap - float(resident[self._at(p)].max())
            out[s] = self.prices.gen_rows(s, p, free)
        return out

    def streamed(self, plan: Plan, graph: Graph, rows: dict) -> dict[str, tuple]:
        """Ops that consume a chunked generation chunk by chunk: op -> (responses, longest
        response, mean length) per chunk, as the generation finishes them."""
        ends = {}
        for o in graph.ops:
            rounds = self._rounds(plan, graph, o) if o.kind is OpKind.GENERATE else 1
            if rounds > 1:
                p = _in_rounds(plan.placement(o.stages[0]), rounds)
                e = self.prices.chunk_ends(o.stages[0], p, rows.get(o.stages[0]))
                if len(e) > 1:
                    ends[o.name] = tuple((n, top, mean) for _, n, top, mean in e)
        if not ends:
            return {}
        return {op: ends[src] for op, src in
                stream_sources(graph, tuple(sorted((g, len(e)) for g, e in ends.items())))}

    def _rounds(self, plan: Plan, graph: Graph, op) -> int:
        """The rounds generate op ``op`` streams a step's chunks in, each priced as one chunk
        of the step's responses (:func:`rpeg.plan.oplayout.rounds_of`: the chunks the
        runtime streams, :func:`rpeg.plan.oplayout.chunks_per_step`)."""
        key = ("chunks", graph, plan.placements)
        chunks = self._chunks.get(key)
        if chunks is None:           # asked of each generate op, by the walk and the timings
            if len(self._chunks) > 256:
                self._chunks.clear()
            chunks = self._chunks[key] = chunks_per_step(
                graph, lambda o: plan.placement(o.stages[0]), self.responses)
        return rounds_of(plan.placement(op.stages[0]), chunks)

    # --- memory ---------------------------------------------------------------------

    def memory(self, plan: Plan, graph: Graph, walk: Walk | None = None, *,
               detail: bool = True) -> tuple[np.ndarray, Shortfall | None]:
        """(peak bytes per device, why the plan does not fit or None). ``detail=False``
        leaves the shortfall's breakdown by kind out (a search compares shortfalls only)."""
        walk = walk or self.walk(plan, graph)
        peak = walk.peak
        cap = usable_memory(self.cluster.gpu)
        worst = int(np.argmax(peak - cap))
        if peak[worst] <= cap:
            return peak, None
        by_model: dict[str, float] = {}
        for h in walk.copies:
            by_model.setdefault(h.model, 0.0)
            if worst in _members(h.devices):
                by_model[h.model] += self.prices.resident(h.model, h.placement, h.trained)
        what = sorted(((m, b) for m, b in by_model.items() if b > 0), key=lambda x: -x[1])
        op = walk.top(worst)
        what.append((f"{op} (transient)", float(walk.transient[worst])))
        kinds = self.kinds(plan, graph, worst, op, walk.rows.get(op),
                           self.chunks_of(graph, walk).get(op, ()), walk) if detail else ()
        return peak, Shortfall(worst, float(peak[worst]), cap, op,
                               what[0][0] if what else "", tuple(what), kinds,
                               plan.placement(op) if op else None)

    def chunks_of(self, graph: Graph, walk: Walk) -> dict[str, tuple]:
        """Per stage of a streamed op: the chunks it is priced in."""
        return {s: walk.streamed[o] for o, stages in self._streaming(graph)
                if o in walk.streamed for s in stages}

    def fits(self, plan: Plan) -> bool:
        """Memory only: does every device hold what the plan puts on it? (Memoised: each
        staleness ladder's baselines try the same plans.)"""
        key = (plan.placements, plan.staleness, plan.shared, plan.fusion)
        fits = self._fits.get(key)
        if fits is None:
            try:
                graph = self.graph(plan)
                fits = self.memory(plan, graph, detail=False)[1] is None
            except CostError:
                fits = False
            self._fits[key] = fits
        return fits

    def kinds(self, plan: Plan, graph: Graph, device: int, op: str, rows, chunks,
              walk: Walk | None = None) -> tuple[tuple[str, float], ...]:
        """What fills ``device`` by kind (weights, gradients, optimizer state, activations,
        KV cache, buffers): every copy resident there and the op's transient need."""
        total = MemoryCost()
        copies = walk.copies if walk is not None else self.copies(plan)
        for h in copies:
            model, p, trained = h.model, h.placement, h.trained
            if device in _members(h.devices):
                zero = p.zero if trained or p.zero.shards_params else Zero.NONE
                par = attrs.evolve(p.layout, zero=zero, offload=p.offload and trained)
                total += resident_memory(self.pipeline.model(model), par, self.cluster,
                                         trained=trained, engine=p.engine)
        if op:
            p = plan.placement(op)
            trains = dict(self._priced_stages(graph)).get(op) if graph is not None else ()
            work, p = self.prices.trained(trains, tuple(plan.placement(s) for s in trains)) \
                if trains else (op, p)
            par = p.layout
            if chunks:
                total += max((stage_memory(self.works[work], par, self.cluster, batch=n,
                                           padded_len=top, engine=p.engine, mean_len=mean)
                              for n, top, mean in chunks), key=lambda m: m.total)
            else:
                total += stage_memory(self.works[work], par, self.cluster, rows=rows,
                                      partial=self.cap(p), engine=p.engine)
        return tuple((k, float(getattr(total, k))) for k in KINDS)

    def homes(self, plan: Plan, graph: Graph) -> tuple[tuple[str, tuple[int, ...]], ...]:
        out: dict[str, set[int]] = {}
        for h in self.copies(plan):
            out.setdefault(h.model, set()).update(h.devices)
        return tuple((m, tuple(sorted(d))) for m, d in sorted(out.items()))


def _spread(held: tuple[Held, ...]) -> tuple:
    """(model, placement, trained, index of the devices) of each run of consecutive
    copies priced alike (:meth:`Evaluator._held`) whose devices are apart."""
    out: list = []
    run: list[Held] = []
    seen: set[int] = set()

    def close() -> None:
        if run:
            devices = run[0].devices if len(run) == 1 else \
                tuple(d for h in run for d in h.devices)
            out.append((run[0].model, run[0].placement, run[0].trained, _at(devices)))

    for h in held:
        if run and (h.model, h.placement, h.trained) == (
                run[0].model, run[0].placement, run[0].trained) and seen.isdisjoint(h.devices):
            run.append(h)
        else:
            close()
            run, seen = [h], set()
        seen.update(h.devices)
    close()
    return tuple(out)


def _at(devices: tuple[int, ...]) -> slice | np.ndarray:
    """An index of ``devices`` into a per-device array: a slice where they are one run."""
    if devices and devices[-1] - devices[0] == len(devices) - 1 \
            and devices == tuple(range(devices[0], devices[-1] + 1)):
        return slice(devices[0], devices[-1] + 1)
    return np.fromiter(devices, int, len(devices))


@functools.lru_cache(maxsize=4096)
def _in_rounds(p: StagePlacement, rounds: int) -> StagePlacement:
    """A generate placement streaming ``rounds`` chunks a step, as its chunks are priced
    (memoised: asked of each streamed generate op of every plan)."""
    return attrs.evolve(p, chunks=rounds)


@functools.lru_cache(maxsize=4096)
def _members(devices: tuple[int, ...]):
    """``devices`` for membership tests: a range where they are one run (memoised: asked
    of every copy of a plan that does not fit; read-only)."""
    at = _at(devices)
    return range(at.start, at.stop) if isinstance(at, slice) else set(devices)


__all__ = ["Held", "MemoryWalk", "Shortfall", "Walk"]
