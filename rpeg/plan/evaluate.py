"""Price a plan: op timings from the cost model, per-device memory, the simulated step.

    >>> from rpeg.spec import load, load_cluster                       # doctest: +SKIP
    >>> ev = Evaluator(load("pipelines/ppo_llama8b.rpeg"),
    ...                load_cluster("pipelines/clusters/gh200_64.rpeg"))  # doctest: +SKIP
    >>> result = ev.evaluate(plan)                                      # doctest: +SKIP
    >>> result.feasible, result.plan.predicted.step_time_s              # doctest: +SKIP
    (True, 41.3)

An :class:`Evaluator` holds one pipeline, one cluster and the cost model's answers
(:class:`rpeg.plan.prices.Prices`: pure functions of a stage's work, a placement's
layout and the profile, each computed once); ``evaluate`` is a function of the plan
alone. One walk over the plan's ops (:meth:`Evaluator.walk`) finds what memory and time
both read: the copies of each model's weights, the wave size of each generate op, the
chunks each streamed op consumes. Memory per device is what every model keeps there
between stages (:func:`rpeg.cost.memory.resident_memory`, of each copy the runtime keeps
there, :func:`rpeg.plan.copies.copies`: the trained copy with its gradients and optimizer
state, and the copies readers of other layouts and vLLM engines read) plus the
largest transient need of any op placed there. A generate op runs as many sequences at
once as the memory left beside the resident weights holds (in waves when the local
batch does not fit, :func:`rpeg.cost.stages.generation_rows`). A plan whose peak exceeds the
device's capacity is infeasible and carries a :class:`Shortfall` saying why.

A search needs a plan's step time only when it could be below a bound (the plan it
would replace): ``evaluate(plan, bound=b)`` first prices the step's lower bound, the
busiest device's work of one step (:func:`rpeg.plan.simulate.floor`, which no simulated
step is below) with the least control plane any packing of its calls costs
(:func:`rpeg.plan.dispatchfloor.dispatch_floor`), and simulates only when that is below
``b``; then it counts the step's Dask tasks (:func:`rpeg.plan.tasks.dispatch_per_step`)
only when the simulated step with that least control plane is still below ``b``.
Otherwise the evaluation says the plan is
no faster than its lower bound (``Evaluation.bounded``); a search reads that figure only
as a bound, so how tight it is changes no decision. Evaluations a search asks for again
(another walk of the staleness ladder, a baseline of another cap) are answered from
memory, a bounded one's simulated step with it.
"""

from __future__ import annotations

import functools

import attrs
import numpy as np

from rpeg.cost.compute import Roof
from rpeg.cost.control import Dispatch
from rpeg.cost.engine_sync import engine_sleeps, sleep_wake_time
from rpeg.cost.generation import StageCost
from rpeg.cost.memory import MemoryCost, devices_are_host, resident_memory, usable_memory
from rpeg.cost.stages import stage_memory
from rpeg.errors import CostError, PlanError
from rpeg.graph import Graph
from rpeg.graph.ids import ReplicaKey
from rpeg.plan.control import ControlPlane
from rpeg.plan.copies import copies as copies_of
from rpeg.plan.evalcost import EVAL_OP, eval_time, trainer_devices
from rpeg.plan.lower import PASSES, PRICED, Placed, lower
from rpeg.plan.model import Plan, Predicted, StagePlacement
from rpeg.plan.oplayout import (
    all_in_place,
    chunks_per_step,
    first_block,
    gathers_in_place,
    one_call,
    op_layout,
    own_runtime,
    rounds_of,
    streamed_ops,
)
from rpeg.plan.prices import Chunk, Prices, parallel_of
from rpeg.plan.simulate import Contention, OpTiming, Timeline, floor, simulate, steps_for
from rpeg.plan.staleness import staleness_problem, step_graph
from rpeg.plan.structure import (  # noqa: F401 — re-exported: what the plan makes of its graph
    Stages,
    backbone,
    graph_backbone,
    is_host_op,
    plan_graph,
    settle_batching,
    settled,
    stream_sources,
    sync_devices,
    synced_in_place,
)
from rpeg.plan.usage import KINDS, memory_uses, op_uses
from rpeg.spec.model import Cluster, Engine, OpKind, Pipeline, Zero

GB = 1e9


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
class Evaluation:
    plan: Plan                       # with ``predicted`` filled
    feasible: bool
    shortfall: Shortfall | None
    timeline: Timeline | None
    bounded: bool = False            # not simulated: the step is at least the one predicted

    @property
    def step_time_s(self) -> float:
        return self.plan.predicted.step_time_s if self.plan.predicted else float("inf")


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


@attrs.frozen(eq=False)
class _Priced:
    """What an evaluation of one plan found, kept to answer the same plan again."""

    plan: Plan                          # settled, unpredicted
    homes: tuple | None                 # the model homes found (None: the plan's own)
    feasible: bool
    shortfall: Shortfall | None
    predicted: Predicted
    timeline: Timeline | None
    bounded: bool
    simulated: Timeline | None = None   # a bounded plan's simulated step, kept to reprice it


class Evaluator:
    """Prices plans of one pipeline on one cluster (see the module doc)."""

    def __init__(self, pipeline: Pipeline, cluster: Cluster, steps: int | None = None,
                 engine_kv: tuple = ()) -> None:
        from rpeg.plan.space import Limits
        self.pipeline = pipeline
        self.cluster = cluster
        self.steps = steps
        self.engine_kv = engine_kv      # the executor's KV share per engine (Limits.engine_kv)
        self.prices = Prices.of(pipeline, cluster)
        self.works = self.prices.works
        self.stages = Stages.of(pipeline)
        self._limits = Limits(engine_kv=engine_kv)
        self._graphs: dict[tuple, Graph] = {}
        self._per_graph: dict[tuple, tuple] = {}
        self._ops: dict[tuple, OpTiming] = {}
        self._copies: dict[tuple, tuple] = {}
        self._settled: dict[StagePlacement, StagePlacement] = {}
        self._priced: dict[tuple, _Priced] = {}
        self._placed: dict[tuple, Placed] = {}
        self.control = ControlPlane(pipeline, cluster, self.graph)
        self._eval: dict[tuple[int, ...], float] = {}
        self._index: dict[StagePlacement | tuple[int, ...], slice | np.ndarray] = {}
        self._synced: dict[tuple, frozenset[str]] = {}
        self._problems: dict[tuple, str | None] = {}
        self._fits: dict[tuple, bool] = {}
        self._rests: dict[tuple, float] = {}
        w = pipeline.workload
        self.gen_tokens = w.batch * w.gen_len.mean()
        self.responses = w.prompts * w.samples          # a step's (the runtime's chunks)

    # --- the cost model's answers (rpeg.plan.prices) ---------------------------------

    def stage_cost(self, stage: str, p: StagePlacement, rows: int | None = None,
                   chunk: Chunk | None = None, off_policy: bool = False) -> StageCost:
        """The cost model's :class:`rpeg.cost.StageCost` of ``stage`` (see ``stage_time``)."""
        return self.prices.stage_cost(stage, p, rows, chunk, off_policy)

    def stage_time(self, stage: str, p: StagePlacement, rows: int | None = None,
                   chunk: Chunk | None = None, off_policy: bool = False) -> float:
        """Seconds of ``stage``; ``chunk``: (responses, longest, mean length) of one streamed
        chunk; ``off_policy``: a train stage corrects for responses sampled with older weights."""
        return self.prices.stage_cost(stage, p, rows, chunk, off_policy).time_s

    def chunk_ends(self, stage: str, p: StagePlacement,
                   rows: int | None = None) -> tuple[tuple[float, int, float, float], ...]:
        """(end, responses, longest response, mean length) of each chunk of a generate
        stage."""
        return self.prices.chunk_ends(stage, p, rows)

    def transient(self, stage: str, p: StagePlacement, rows: int | None = None,
                  chunks: tuple[Chunk, ...] = ()) -> float:
        return self.prices.transient(stage, p, rows, chunks)

    def resident(self, model: str, p: StagePlacement, trained: bool) -> float:
        return self.prices.resident(model, p, trained)

    def gen_rows(self, stage: str, p: StagePlacement, free: float) -> int:
        return self.prices.gen_rows(stage, p, free)

    def sync_time(self, model: str, src: StagePlacement, dst: StagePlacement) -> float:
        return self.prices.sync_time(model, src, dst)

    def cap(self, p: StagePlacement) -> int:
        return self.prices.cap(p)

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

    # --- the plan's graph ------------------------------------------------------------

    def step_graph(self, plan: Plan) -> Graph:
        """The plan's step graph, unfused, its weight syncs kept: the one the runtime lays
        its op calls out from."""
        base_key = (tuple(x for x in plan.staleness if x[1]), plan.shared)   # 0: unlisted
        if base_key not in self._graphs:
            self._graphs[base_key] = step_graph(self.pipeline, plan)
        return self._graphs[base_key]

    def graph(self, plan: Plan) -> Graph:
        """The step graph the plan's structural choices make (:func:`plan_graph`)."""
        base_key = (tuple(x for x in plan.staleness if x[1]), plan.shared)   # 0: unlisted
        base = self.step_graph(plan)
        readers = (base_key, tuple(plan.placement(st) for st in self.stages.syncing
                                   if plan.has_placement(st)))
        synced = self._synced.get(readers)
        if synced is None:
            synced = self._synced[readers] = synced_in_place(base, plan)
        key = (base_key, plan.fusion, synced)
        if key not in self._graphs:
            self._graphs[key] = plan_graph(self.pipeline, plan, base)
        return self._graphs[key]

    def settle(self, plan: Plan) -> Plan:
        """``plan`` with each generate stage's batching as it runs (:func:`settle_batching`),
        every placement the one instance of its value this evaluator keeps (so the memos
        keyed by placements find it by identity)."""
        out = []
        for p in plan.placements:
            q = self._settled.get(p)
            if q is None:
                q = p
                if self.stages.kind.get(p.stage) is OpKind.GENERATE:
                    q = settled(self.works[p.stage], p, self._limits, self.cluster)
                    q = self._settled.setdefault(q, q)
                self._settled[p] = q
            out.append(q)
        if all(a is b for a, b in zip(out, plan.placements, strict=True)):
            return plan
        return attrs.evolve(plan, placements=tuple(out))

    # --- one walk over the plan's ops --------------------------------------------------

    def walk(self, plan: Plan, graph: Graph) -> Walk:
        """The copies each model keeps, what they leave free, each generate op's wave size,
        the chunks each streamed op consumes, and each device's largest transient need."""
        copies, spread = self._held(plan)
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
        for stage in self._priced_stages(graph):
            p = plan.placement(stage)
            b = self.prices.transient(stage, p, rows.get(stage), chunks_of.get(stage, ()))
            at = self._at(p)
            transient[at] = np.maximum(transient[at], b)
            needs.append((stage, p.devices, b))
        return Walk(copies, resident, rows, streamed, transient, tuple(needs))

    def _priced_stages(self, graph: Graph) -> tuple[str, ...]:
        """The stages whose transient need is priced: all but those running inside another
        stage's op (a shared backbone's train stages after the first)."""
        key = ("priced", graph)
        if key not in self._per_graph:
            followers = {s for o in graph.ops if o.kind is OpKind.TRAIN for s in o.stages[1:]}
            self._per_graph[key] = tuple(s for s in self.stages.order if s not in followers)
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
        out. ``graph`` is not read (the copies are those of the plan's step graph)."""
        return self._held(plan)[0]

    def _held(self, plan: Plan) -> tuple[tuple[Held, ...], tuple]:
        """(:meth:`copies`, the same spread for the resident bytes: (model, placement,
        trained, index of its devices) of each run of consecutive copies priced alike on
        devices apart, which add the same bytes to the same devices in the same order as
        the copies one by one, a tensor-parallel block's second copies at once)."""
        base = self.step_graph(plan)
        ops = self._model_ops(base)
        key = (base, tuple(plan.placement(o.stages[0]) for o in ops))
        out = self._copies.get(key)
        if out is None:
            def placing(op):
                return plan.placement(op.stages[0])

            # the op layouts and chunks a step streams: what the copies are read from
            placed = lower(base, plan, self.responses, placing, passes=PASSES[:2])
            names = self._model_names(plan.shared)
            held = tuple(
                Held(names[(c.key.backbone, c.trained)], c.placement, c.trained, c.devices,
                     c.key)
                for c in copies_of(placed, placing).held)
            out = self._copies[key] = (held, _spread(held))
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
                p = attrs.evolve(plan.placement(o.stages[0]), chunks=rounds)
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
        chunks = chunks_per_step(graph, lambda o: plan.placement(o.stages[0]), self.responses)
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
                par = attrs.evolve(parallel_of(p), zero=zero, offload=p.offload and trained)
                total += resident_memory(self.pipeline.model(model), par, self.cluster,
                                         trained=trained, engine=p.engine)
        if op:
            p = plan.placement(op)
            par = parallel_of(p)
            if chunks:
                total += max((stage_memory(self.works[op], par, self.cluster, batch=n,
                                           padded_len=top, engine=p.engine, mean_len=mean)
                              for n, top, mean in chunks), key=lambda m: m.total)
            else:
                total += stage_memory(self.works[op], par, self.cluster, rows=rows,
                                      partial=self.cap(p), engine=p.engine)
        return tuple((k, float(getattr(total, k))) for k in KINDS)

    def homes(self, plan: Plan, graph: Graph) -> tuple[tuple[str, tuple[int, ...]], ...]:
        out: dict[str, set[int]] = {}
        for h in self.copies(plan):
            out.setdefault(h.model, set()).update(h.devices)
        return tuple((m, tuple(sorted(d))) for m, d in sorted(out.items()))

    # --- time -----------------------------------------------------------------------

    def timings(self, plan: Plan, graph: Graph, walk: Walk | None = None):
        """(op -> where and how long it runs, (op, seconds) in graph order, syncs last)."""
        walk = walk or self.walk(plan, graph)
        timings: dict[str, OpTiming] = {}
        trainer = {o.writes_model: o for o in graph.ops if o.kind is OpKind.TRAIN}
        for op in graph.ops:
            if op.kind is not OpKind.SYNC_WEIGHTS:
                timings[op.name] = self._op_timing(graph, op, plan, walk, trainer)
        for op in graph.ops:
            if op.kind is not OpKind.SYNC_WEIGHTS:
                continue
            src = plan.placement(trainer[op.reads_model].stages[0])
            reader = next(o for o in graph.ops if o.kind is OpKind.GENERATE
                          and o.reads_model == op.reads_model)
            dst = plan.placement(reader.stages[0])
            model = self.stages.target[trainer[op.reads_model].stages[0]]
            t = self.prices.sync_time(model, src, dst)
            timings[op.name] = OpTiming(sync_devices(src, dst), t)
        return timings, tuple((n, round(t.time_s, 6)) for n, t in timings.items())

    def roofs(self, plan: Plan, graph: Graph, walk: Walk) -> dict[str, Roof]:
        """Per op (not the syncs): the FLOPs and bytes the cost model prices it with, on one
        of its devices (the busiest), as :meth:`timings` times it."""
        out: dict[str, Roof] = {}
        trainer = {o.writes_model: o for o in graph.ops if o.kind is OpKind.TRAIN}
        for op in graph.ops:
            if op.kind is OpKind.SYNC_WEIGHTS:
                continue
            p = plan.placement(op.stages[0])
            if op.kind is OpKind.GENERATE:
                out[op.name] = self.stage_cost(op.stages[0], p,
                                               walk.rows.get(op.stages[0])).roof
            elif op.kind is OpKind.TRAIN:
                off = self._off_policy(op, plan, graph)
                out[op.name] = self.stage_cost(op.stages[0], p, off_policy=off).roof
            else:
                src = plan.placement(trainer[op.reads_model].stages[0]) \
                    if op.kind is OpKind.FORWARD and op.reads_model in trainer else None
                at = first_block if self._one_call(graph, op, plan, walk, src) else _same
                out[op.name] = sum((self.stage_cost(s, at(plan.placement(s)), chunk=c).roof
                                    for c in walk.streamed.get(op.name, None) or (None,)
                                    for s in op.stages), Roof())
        return out

    def _one_call(self, graph: Graph, op, plan: Plan, walk: Walk, src) -> bool:
        """Whether ``op`` (a pass or host op) runs as one call a step on its first block
        over the whole batch (:func:`rpeg.plan.oplayout.one_call`; ``src``: the placement
        training the model it reads, or None), priced at dp 1 there: in a plan rpeg's own
        runtime executes (:func:`~rpeg.plan.oplayout.own_runtime`) on the local host's
        cores (:attr:`_lays_out_calls`)."""
        p = plan.placement(op.stages[0])
        return p.dp > 1 and not walk.streamed.get(op.name) and self._lays_out_calls \
            and own_runtime(plan.placements) and one_call(
            op, p, src, chunks_per_step(graph, lambda o: plan.placement(o.stages[0]),
                                        self.responses), op.name in streamed_ops(graph))

    @functools.cached_property
    def _lays_out_calls(self) -> bool:
        """Whether pricing follows rpeg's runtime's call layout for passes and host ops
        (:func:`rpeg.plan.oplayout.one_call`): on a cluster whose devices are the host's
        cores, where rpeg's runtime is what runs and is measured against the prediction
        (``benchmarks/runtime.py``). A GPU cluster's pinned layouts include other systems'
        configurations on engines named torch (verl's FSDP workers, OpenRLHF's DeepSpeed
        ones), whose passes split the batch over their data-parallel ranks, as the
        published rows (``benchmarks/published.py``) were fitted and recorded with."""
        return devices_are_host(self.cluster.gpu)

    def _op_timing(self, graph: Graph, op, plan: Plan, walk: Walk, trainer) -> OpTiming:
        """Where ``op`` runs and for how long, from what it reads of the plan and the walk
        (memoised by exactly that)."""
        p = plan.placement(op.stages[0])
        off = op.kind is OpKind.TRAIN and self._off_policy(op, plan, graph)
        rest, rounds, one = 0.0, 1, False
        if op.kind is OpKind.GENERATE:
            rest, rounds = self._rest(op, p, plan, graph), self._rounds(plan, graph, op)
            key = (graph, op.name, p, walk.rows.get(op.stages[0]), rest, rounds)
        elif op.kind is OpKind.TRAIN:
            key = (graph, op.name, p, off)
        else:
            src = plan.placement(trainer[op.reads_model].stages[0]) \
                if op.kind is OpKind.FORWARD and op.reads_model in trainer else None
            one = self._one_call(graph, op, plan, walk, src)
            key = (graph, op.name, tuple(plan.placement(s) for s in op.stages),
                   walk.streamed.get(op.name, ()), src, plan.shared, one)
        timing = self._ops.get(key)
        if timing is None:
            timing = self._ops[key] = self._time_op(op, p, plan, walk, trainer, off, rest,
                                                    rounds, one)
        return timing

    def _time_op(self, op, p: StagePlacement, plan: Plan, walk: Walk, trainer,
                 off_policy: bool, rest: float = 0.0, rounds: int = 1,
                 one: bool = False) -> OpTiming:
        if op.kind is OpKind.GENERATE:
            r = walk.rows.get(op.stages[0])
            ends = self.prices.chunk_ends(op.stages[0], attrs.evolve(p, chunks=rounds), r) \
                if rounds > 1 else ()
            t = self.stage_time(op.stages[0], p, r) + rest
            return OpTiming(p.devices, t, tuple(e[0] for e in ends), tuple(e[1] for e in ends))
        if op.kind is OpKind.TRAIN:
            # Train stages of a shared backbone: one pass with a combined loss on the
            # first stage's schedule (its minibatches); the extra head costs nothing here.
            t = self.stage_time(op.stages[0], p, off_policy=off_policy)
            return OpTiming(p.devices, t + self._reload(op, p, trainer, plan))
        # streamed: each chunk priced on its own responses, padded to its longest
        per_chunk = [self._fused(op, plan, c) for c in walk.streamed.get(op.name, ())]
        reload = self._reload(op, p, trainer, plan) if not one else 0.0
        if per_chunk:
            per_chunk[0] += reload
            t = sum(per_chunk)
        elif one:
            # one call a step, on the first block, over the whole batch (the runtime's
            # layout, rpeg.plan.oplayout.OpLayout.calls): its data-parallel degree splits
            # nothing, so it is priced there at dp 1, and fetches weights only there
            t = sum(self.stage_time(s, first_block(plan.placement(s))) for s in op.stages)
            t += self._reload(op, first_block(p), trainer, plan)
            return OpTiming(op_layout(op, p, False).devices_of(0), t)
        else:
            t = self._fused(op, plan, None) + reload
        # host ops too: they run in their device's worker, which waits for them
        return OpTiming(p.devices, t, chunk_times=tuple(per_chunk))

    def control_time(self, plan: Plan, graph: Graph, timings: dict[str, OpTiming],
                     steps: int = 6, step_s: float = 0.0) -> float:
        """Seconds a step of ``step_s`` seconds of work loses to the control plane
        (:class:`rpeg.plan.control.ControlPlane`): where the devices are the host's own
        cores (the CPU profile: ``host_cores``) its CPU spread over them; elsewhere the
        client's and the Dask scheduler's time on the calls, tasks and futures a step
        dispatches (:meth:`dispatch`), serialised in one thread each. ``graph`` is not read
        (the count is the plan's graph's, without fusion)."""
        return self.control.time(plan, timings, steps, step_s)[0]

    def dask_tasks(self, plan: Plan, graph: Graph, timings: dict[str, OpTiming],
                   steps: int = 6) -> int:
        """Dask tasks a steady step of ``plan`` dispatches (:meth:`dispatch`)."""
        return self.control.dispatch(plan, timings, steps).tasks

    def dispatch(self, plan: Plan, graph: Graph, timings: dict[str, OpTiming],
                 steps: int = 6) -> Dispatch:
        """The op calls, Dask tasks and futures a steady step of ``plan`` dispatches
        (:meth:`rpeg.plan.control.ControlPlane.dispatch`)."""
        return self.control.dispatch(plan, timings, steps)

    def placed(self, plan: Plan, graph: Graph) -> Placed:
        """``graph`` (the plan's as priced: fused, without the weight syncs that move
        nothing) placed by ``plan`` (:func:`rpeg.plan.lower.lower`): the instances and edges
        the simulator prices, by the rules the runtime executes. Memoised by the
        placements (a search prices each proposal once, and its floor first)."""
        key = (graph, plan.placements)
        placed = self._placed.get(key)
        if placed is None:
            if len(self._placed) > 256:
                self._placed.clear()
            placed = self._placed[key] = lower(graph, plan, self.responses, passes=PRICED)
        return placed

    @property
    def contention(self) -> Contention | None:
        """How much slower an op computes while the other devices of its host compute too,
        where the devices are a host's cores (the CPU profile's ``host_cores`` and
        ``concurrency_slowdown``); None elsewhere."""
        gpu = self.cluster.gpu
        if gpu.host_cores <= 0 or gpu.concurrency_slowdown == 1.0:
            return None
        return Contention(gpu.concurrency_slowdown, self.cluster.gpus_per_node)

    def eval_time(self, plan: Plan) -> float:
        devices = trainer_devices(self.pipeline, plan)
        if devices not in self._eval:
            self._eval[devices] = eval_time(self.pipeline, devices, self.cluster)
        return self._eval[devices]

    def _off_policy(self, op, plan: Plan, graph: Graph) -> bool:
        """A policy-gradient train op whose responses were sampled with older weights (the
        generate stage's staleness or carry, or truncated importance sampling asked for on
        every batch): it runs the correction's extra forward."""
        stage = op.stages[0]
        if stage not in self.stages.policy:
            return False
        if stage in self.stages.corrected:
            return True                          # corrected on every batch, stale or not
        return any(plan.staleness_of(g.stages[0]) + plan.placement(g.stages[0]).carry > 0
                   for g in graph.ops if g.kind is OpKind.GENERATE
                   and g.reads_model == op.writes_model)

    def _rest(self, op, p: StagePlacement, plan: Plan, graph: Graph) -> float:
        """A vLLM engine sharing a GPU with a trainer sleeps between its generate ops and
        wakes for the next (``engine_sleeps``): its weights out and back, once a step."""
        if p.engine is not Engine.VLLM:
            return 0.0
        trainers = tuple(plan.placement(o.stages[0]) for o in graph.ops
                         if o.kind is OpKind.TRAIN)
        key = ("rest", op.name, p, trainers)      # by the placements, not their devices
        rest = self._rests.get(key)
        if rest is None:
            trained = {d for t in trainers for d in t.devices}
            rest = self._rests[key] = sleep_wake_time(
                self.pipeline.model(self.stages.target[op.stages[0]]), p.tp,
                self.cluster.gpu) if engine_sleeps(
                p.devices, trained, devices_are_host(self.cluster.gpu)) else 0.0
        return rest

    def _fused(self, op, plan: Plan, chunk: Chunk | None) -> float:
        """Seconds of an op's stages back to back. Fused, they share a dispatch (one Dask
        task: the control plane's count, :meth:`dispatch`), but each stage is still a call
        of its own in the worker, paying its own ``call_overhead`` (embedding, head,
        wrapper): the time is the stages' sum."""
        return sum(self.stage_time(s, plan.placement(s), chunk=chunk) for s in op.stages)

    def _reload(self, op, p: StagePlacement, trainer, plan: Plan) -> float:
        """A forward op reading a copy of a trained model of its own fetches the new
        weights: the weight transfer the runtime adds into that copy
        (``rpeg.plan.lower.Placed.transfers``), priced as a weight sync from its trainer.
        None where it reads the trainer's weights in place on every device
        (:func:`~rpeg.plan.oplayout.all_in_place`) or runs on its ZeRO-3 shards
        (:func:`~rpeg.plan.oplayout.gathers_in_place`, whose gather the pass prices): the
        rule :func:`rpeg.plan.copies.copies` keys the copies by. (A pass on the shards per
        chunk would read a copy, which the runtime refuses: one chunk is checked.)"""
        if op.kind is not OpKind.FORWARD or op.reads_model not in trainer:
            return 0.0
        src = plan.placement(trainer[op.reads_model].stages[0])
        if all_in_place(src, p) or gathers_in_place(op, src, p, chunks=1):
            return 0.0
        target = self.stages.target
        stage = next(s for s in op.stages if s in self.stages.modelled
                     and graph_backbone(plan, target[s]) == op.reads_model)
        return self.prices.sync_time(target[stage], src, p)

    # --- the evaluation ------------------------------------------------------------

    def evaluate(self, plan: Plan, *, simulate_infeasible: bool = False,
                 detail: bool = True, bound: float | None = None) -> Evaluation:
        """Price ``plan``; CostError from an impossible layout becomes a PlanError.
        ``detail=False`` skips the per-device figures (busy fractions, model homes, what
        fills a device that overflows) the search does not need. ``bound``: simulate only
        when the step could be below it (see the module doc)."""
        chosen = (plan.staleness, tuple((p.stage, p.carry) for p in plan.placements if p.carry))
        if chosen not in self._problems:
            self._problems[chosen] = staleness_problem(self.pipeline, plan)
        problem = self._problems[chosen]
        if problem:
            raise PlanError(problem, hint="lower the stage's carry or its staleness")
        if detail or simulate_infeasible:
            return self._wrap(plan, self._price(plan, detail, simulate_infeasible, None))
        key = (plan.placements, plan.staleness, plan.shared, plan.fusion)
        priced = self._priced.get(key)
        if priced is None or priced.bounded and (bound is None
                                                 or priced.predicted.step_time_s < bound):
            priced = self._priced[key] = self._price(
                plan, False, False, bound, priced.simulated if priced is not None else None)
        return self._wrap(plan, priced)

    def _wrap(self, plan: Plan, priced: _Priced) -> Evaluation:
        homes = plan.model_homes if priced.homes is None else priced.homes
        out = attrs.evolve(plan, placements=priced.plan.placements, predicted=priced.predicted,
                           model_homes=homes)
        return Evaluation(out, priced.feasible, priced.shortfall, priced.timeline,
                          priced.bounded)

    def _price(self, plan: Plan, detail: bool, simulate_infeasible: bool,
               bound: float | None, known: Timeline | None = None) -> _Priced:
        """Price ``plan`` (see :meth:`evaluate`); ``known``: its step as simulated before
        (by an evaluation that stopped at the bound)."""
        if plan.predicted is not None:
            plan = attrs.evolve(plan, predicted=None)
        plan = self.settle(plan)                                       # as it runs
        graph = self.graph(plan)
        try:
            walk = self.walk(plan, graph)
            peak, shortfall = self.memory(plan, graph, walk, detail=detail)
        except CostError as e:
            raise PlanError(f"plan layout must be one the cost model can price, not: "
                            f"{e.message}", e.span, hint=e.hint) from None
        capacity = self.cluster.gpu.memory
        reserve = capacity - usable_memory(self.cluster.gpu)
        feasible = shortfall is None
        homes = self.homes(plan, graph) if detail else None
        memory = memory_uses(self, plan, graph, walk) if detail else ()
        if not (feasible or simulate_infeasible):
            return _Priced(plan, homes, False, shortfall,
                           Predicted(float("inf"), tuple(peak.tolist()),
                                     memory_capacity=capacity, memory=memory,
                                     memory_reserve=reserve), None, False)
        timings, op_times = self.timings(plan, graph, walk)
        steps = self.steps or steps_for(max((k for _, k in plan.staleness), default=0))
        held_out = self.eval_time(plan) if self.pipeline.evaluation is not None else None
        every = held_out / self.pipeline.evaluation.every if held_out is not None else 0.0
        if held_out is not None:                       # an eval op every `every` steps
            op_times = tuple(op_times) + ((EVAL_OP, held_out),)
        # the control plane's time grows with the step's (heartbeats): at the floor, a floor
        work = floor(graph, timings) if bound is not None and feasible else 0.0
        if bound is not None and feasible:
            # the control plane's least first: no need to pack the step's calls into tasks
            # for a plan its work and that least already hold at the bound; what it says is
            # a step no greater than the counted one, so whatever the search decides from
            # it, the counted one would have decided too (or the plan is simulated)
            least = work + self.control.floor(plan, timings, steps, work) + every
            if least >= bound:
                return _Priced(plan, homes, True, None, Predicted(
                    least, op_times=op_times, memory_capacity=capacity,
                    control_s=round(least - work - every, 6), memory_reserve=reserve),
                    None, True)
        timeline = known if known is not None else simulate(
            self.placed(plan, graph), timings, steps=steps, events=detail,
            crossing_s=max(self.cluster.gpu.dispatch_s, 0.0), shared=self.contention)
        if bound is not None and feasible:
            # the simulated step, and the control plane's least again (as it grows with
            # the step): packing the step's calls into tasks only for a plan that could
            # still be below the bound
            least = timeline.step_time_s + self.control.floor(
                plan, timings, steps, timeline.step_time_s) + every
            if least >= bound:
                return _Priced(plan, homes, True, None, Predicted(
                    least, op_times=op_times, memory_capacity=capacity,
                    control_s=round(least - timeline.step_time_s - every, 6),
                    memory_reserve=reserve), None, True, timeline)
        control, tasks = self.control.time(plan, timings, steps, timeline.step_time_s)
        step = timeline.step_time_s + control + every
        predicted = Predicted(
            step_time_s=step,
            peak_memory=tuple(round(float(x)) for x in peak) if detail else (),
            busy=tuple(round(float(b), 4) for b in timeline.busy()) if detail else (),
            tokens_per_s=self.gen_tokens / step if step > 0 else 0.0,
            op_times=op_times, memory_capacity=capacity, control_s=round(control, 6),
            tasks_per_step=tasks, memory=memory, memory_reserve=reserve,
            ops=op_uses(self, plan, graph, timings, op_times, self.roofs(plan, graph, walk))
            if detail else ())
        return _Priced(plan, homes, feasible, shortfall, predicted, timeline, False)


def _same(p: StagePlacement) -> StagePlacement:
    return p


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
def _members(devices: tuple[int, ...]):
    """``devices`` for membership tests: a range where they are one run (memoised: asked
    of every copy of a plan that does not fit; read-only)."""
    at = _at(devices)
    return range(at.start, at.stop) if isinstance(at, slice) else set(devices)


__all__ = ["Evaluator", "Evaluation", "Shortfall", "Walk", "is_host_op", "parallel_of",
           "plan_graph", "settle_batching"]
