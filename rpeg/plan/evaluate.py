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

import attrs
import numpy as np

from rpeg.cost.checkpoint import (
    CHECKPOINT_OP,
    cadence,
    checkpoint_bytes,
    per_step,
    save_time,
)
from rpeg.cost.generation import StageCost
from rpeg.cost.memory import usable_memory
from rpeg.errors import CostError, PlanError
from rpeg.graph import Graph
from rpeg.plan.control import ControlPlane
from rpeg.plan.evalcost import EVAL_OP
from rpeg.plan.lower import Placed
from rpeg.plan.memorywalk import Held, MemoryWalk, Shortfall, Walk  # noqa: F401 — re-exported
from rpeg.plan.model import Plan, Predicted, StagePlacement
from rpeg.plan.optimings import OpTimings
from rpeg.plan.prices import Chunk, Prices
from rpeg.plan.simulate import OpTiming, Timeline, floor, simulate, steps_for
from rpeg.plan.staleness import staleness_problem, step_graph
from rpeg.plan.structure import (  # noqa: F401 — re-exported: what the plan makes of its graph
    Stages,
    backbone,
    fused_of,
    graph_backbone,
    is_host_op,
    plan_graph,
    settle_batching,
    settled,
    stream_sources,
    sync_devices,
    synced_in_place,
)
from rpeg.plan.usage import memory_uses, op_uses
from rpeg.spec.model import Cluster, OpKind, Pipeline

GB = 1e9


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


class Evaluator(MemoryWalk, OpTimings):
    """Prices plans of one pipeline on one cluster (see the module doc): a plan's walk and
    memory (:class:`rpeg.plan.memorywalk.MemoryWalk`), its op timings and control plane
    (:class:`rpeg.plan.optimings.OpTimings`); the memos both read are kept here."""

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
        self._unfused: dict[Graph, Graph] = {}      # a fused graph -> the graph it fuses
        self._per_graph: dict[tuple, tuple] = {}
        self._ops: dict[tuple, OpTiming] = {}
        self._copies: dict[tuple, tuple] = {}
        self._backbones: dict[tuple, tuple] = {}    # (BackboneCopies, shared) -> copies
        self._settled: dict[StagePlacement, StagePlacement] = {}
        self._priced: dict[tuple, _Priced] = {}
        self._placed: dict[tuple, Placed] = {}
        self.control = ControlPlane(pipeline, cluster, self.graph)
        self._eval: dict[tuple[int, ...], float] = {}
        self._saves: dict[tuple, float] = {}
        self._index: dict[StagePlacement | tuple[int, ...], slice | np.ndarray] = {}
        self._synced: dict[tuple, frozenset[str]] = {}
        self._problems: dict[tuple, str | None] = {}
        self._fits: dict[tuple, bool] = {}
        self._rests: dict[tuple, float] = {}
        self._chunks: dict[tuple, int] = {}
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

    # --- the plan's graph ------------------------------------------------------------

    def step_graph(self, plan: Plan) -> Graph:
        """The plan's step graph, unfused, its weight syncs kept (which read no model: the
        copies lowered from it are the runtime's, whose graph has none of the syncs that
        move nothing, :func:`plan_graph` unfused)."""
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
            if plan.fusion:
                # the unfused graph's fused object, which the fused view of the plan's placed
                # graph (Placed.fused, what the simulator prices) shares
                loose = self.graph(attrs.evolve(plan, fusion=()))
                self._graphs[key] = fused_of(loose, plan)
                self._unfused[self._graphs[key]] = loose
            else:
                self._graphs[key] = plan_graph(self.pipeline, plan, base, fused=False)
        return self._graphs[key]

    def unfused(self, plan: Plan, graph: Graph | None = None) -> Graph:
        """The plan's step graph without its fusion (:func:`plan_graph` ``fused=False``): the
        graph of its placed value (:meth:`placed`). ``graph``: the plan's (:meth:`graph`)."""
        graph = graph or self.graph(plan)
        return self._unfused.get(graph, graph) if plan.fusion else graph

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

    def checkpoint_time(self, plan: Plan, graph: Graph) -> float:
        """Seconds of one checkpoint of the plan's trained models
        (:func:`rpeg.cost.checkpoint.save_time`), written from their train ops' devices."""
        per_node = self.cluster.gpus_per_node
        trained = tuple((self.stages.target[o.stages[0]],
                         plan.placement(o.stages[0]).devices)
                        for o in graph.ops if o.kind is OpKind.TRAIN and o.writes_model)
        if trained not in self._saves:
            gpu = self.cluster.gpu
            self._saves[trained] = save_time(tuple(
                (checkpoint_bytes(self.pipeline.model(m), gpu), tuple(devices))
                for m, devices in trained), gpu, per_node)
        return self._saves[trained]

    def checkpoint_writers(self, plan: Plan, graph: Graph) -> tuple[int, float]:
        """(the devices that write a checkpoint, the bytes they write together): each trained
        model's, from its train op's devices (:meth:`checkpoint_time`)."""
        gpu = self.cluster.gpu
        trained = [(self.stages.target[o.stages[0]], plan.placement(o.stages[0]).devices)
                   for o in graph.ops if o.kind is OpKind.TRAIN and o.writes_model]
        devices = {d for _, ds in trained for d in ds}
        return len(devices), sum(checkpoint_bytes(self.pipeline.model(m), gpu)
                                 for m, _ in trained)

    def checkpoint_share(self, saved: float) -> float:
        """A step's share of the checkpoints a run of the workload's steps writes, at its
        cadence (``checkpoint_every``)."""
        return per_step(saved, *cadence(self.pipeline))

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
        saved = self.checkpoint_time(plan, graph)      # a checkpoint at every cut
        if saved:
            every += self.checkpoint_share(saved)
            op_times = tuple(op_times) + ((CHECKPOINT_OP, round(saved, 6)),)
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


__all__ = ["Evaluator", "Evaluation", "Shortfall", "Walk", "is_host_op",
           "plan_graph", "settle_batching"]
