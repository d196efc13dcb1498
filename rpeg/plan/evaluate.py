"""Price a plan: op timings from the cost model, per-device memory, the simulated step.

    >>> from rpeg.spec import load, load_cluster                       # doctest: +SKIP
    >>> ev = Evaluator(load("pipelines/ppo_llama8b.rpeg"),
    ...                load_cluster("pipelines/clusters/gh200_64.rpeg"))  # doctest: +SKIP
    >>> result = ev.evaluate(plan)                                      # doctest: +SKIP
    >>> result.feasible, result.plan.predicted.step_time_s              # doctest: +SKIP
    (True, 41.3)

An :class:`Evaluator` holds one pipeline, one cluster and a cache of cost-model
answers (the cost functions are pure, so caching is safe); ``evaluate`` is a
function of the plan alone. Memory per device is what every model keeps there
between stages (:func:`rpeg.cost.memory.resident_memory`, one copy per distinct
layout, the trained copy with its gradients and optimizer state) plus the
largest transient need of any op placed there. A generate op runs as many sequences at
once as the memory left beside the resident weights holds (in waves when the local
batch does not fit, :func:`rpeg.cost.stages.generation_rows`). A plan whose peak exceeds the
device's capacity is infeasible and carries a :class:`Shortfall` saying why.
"""

from __future__ import annotations

import attrs
import numpy as np

from rpeg.cost.compute import Roof
from rpeg.cost.engine_sync import collective_sync_time, engine_copy
from rpeg.cost.generation import batching_of
from rpeg.cost.memory import MemoryCost, Parallel, resident_memory, usable_memory
from rpeg.cost.partial import smallest_cap
from rpeg.cost.stages import (
    estimate_stage,
    generation_chunks,
    generation_rows,
    stage_memory,
    weight_sync_time,
)
from rpeg.errors import CostError, GraphError, PlanError
from rpeg.graph import Graph, build, work_of
from rpeg.graph.unroll import chunk_counts
from rpeg.plan.evalcost import EVAL_OP, eval_time, trainer_devices
from rpeg.plan.model import Plan, Predicted, StagePlacement
from rpeg.plan.passes import elide_syncs, fuse, reads_in_place
from rpeg.plan.simulate import OpTiming, Timeline, simulate, steps_for, tasks_per_step
from rpeg.plan.staleness import staleness_problem, step_graph
from rpeg.plan.usage import memory_uses, op_uses
from rpeg.spec.functions import loss_of
from rpeg.spec.model import Cluster, OpKind, Pipeline

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

    @property
    def step_time_s(self) -> float:
        return self.plan.predicted.step_time_s if self.plan.predicted else float("inf")


def parallel_of(p: StagePlacement) -> Parallel:
    return Parallel(dp=p.dp, tp=p.tp, pp=p.pp, microbatches=p.microbatches,
                    recompute=p.recompute, zero=p.zero, offload=p.offload, cp=p.cp, ep=p.ep,
                    packing=p.packing, param_offload=p.param_offload,
                    max_num_seqs=p.max_num_seqs, kv_fraction=p.kv_fraction,
                    cuda_graph=p.cuda_graph)


def settle_batching(pipeline: Pipeline, plan: Plan, cluster: Cluster,
                    engine_kv: tuple = ()) -> Plan:
    """``plan`` with each generate stage's batching as it runs, recorded in its placement:
    the placement's ``max_num_seqs``, ``kv_fraction`` and ``cuda_graph``, else the stage's
    (:func:`rpeg.cost.generation.batching_of`); a ``kv_fraction`` still 0 is the share the
    executor's engine takes (``engine_kv``, as ``Limits.kv_share`` reads it), else what is
    free."""
    from rpeg.plan.space import Limits
    limits = Limits(engine_kv=engine_kv)
    out = []
    for p in plan.placements:
        if pipeline.stage(p.stage).kind is not OpKind.GENERATE:
            out.append(p)
            continue
        seqs, frac, graph = batching_of(work_of(pipeline, p.stage), p)
        frac = frac or limits.kv_share(p.engine, cluster.gpu)
        out.append(attrs.evolve(p, max_num_seqs=seqs, kv_fraction=frac, cuda_graph=graph))
    out = tuple(out)
    return plan if out == plan.placements else attrs.evolve(plan, placements=out)


def is_host_op(pipeline: Pipeline, stage: str) -> bool:
    """Ops that run on the host CPU beside the devices (python rewards, advantages)."""
    s = pipeline.stage(stage)
    return s.kind is OpKind.COMPUTE or (s.kind is OpKind.SCORE
                                       and not pipeline.has_model(s.target or ""))


def streams_of(plan: Plan, graph: Graph) -> tuple[tuple[str, int, int], ...]:
    """(generate op, data-parallel blocks streaming its chunks, steps it carries responses
    over) of each generate op of ``plan``."""
    out = []
    for o in graph.ops:
        if o.kind is OpKind.GENERATE:
            p = plan.placement(o.stages[0])
            out.append((o.name, max(1, len(p.devices) // max(p.tp, 1)), p.carry))
    return tuple(out)


def plan_graph(pipeline: Pipeline, plan: Plan, base: Graph | None = None) -> Graph:
    """The step graph the plan's structural choices make: staleness, sharing, fusion, and no
    weight sync where the generator reads the trained weights in place (as it runs).
    ``base``: the plan's unfused step graph, when already built."""
    try:
        graph = base or step_graph(pipeline, plan)
        return fuse(elide_syncs(graph, synced_in_place(graph, plan)), plan.fusion)
    except GraphError as e:
        raise PlanError(f"plan structure must be one the spec allows, not: {e.message}",
                        e.span, hint=e.hint) from None


def synced_in_place(graph: Graph, plan: Plan) -> frozenset[str]:
    """Models whose weight sync moves nothing under ``plan``: every generate op reading them
    reads the trainer's weights in place (:func:`rpeg.plan.passes.reads_in_place`)."""
    trainer = {o.writes_model: plan.placement(o.stages[0]) for o in graph.ops
               if o.kind is OpKind.TRAIN and o.writes_model and plan.has_placement(o.stages[0])}
    out = set()
    for o in graph.ops:
        if o.kind is not OpKind.SYNC_WEIGHTS or o.reads_model not in trainer:
            continue
        readers = [plan.placement(g.stages[0]) for g in graph.ops if g.kind is OpKind.GENERATE
                   and g.reads_model == o.reads_model and plan.has_placement(g.stages[0])]
        if readers and all(reads_in_place(trainer[o.reads_model], r) for r in readers):
            out.add(o.reads_model)
    return frozenset(out)


class Evaluator:
    """Prices plans of one pipeline on one cluster (see the module doc)."""

    def __init__(self, pipeline: Pipeline, cluster: Cluster, steps: int | None = None,
                 engine_kv: tuple = ()) -> None:
        self.pipeline = pipeline
        self.cluster = cluster
        self.steps = steps
        self.engine_kv = engine_kv      # the executor's KV share per engine (Limits.engine_kv)
        self._cost: dict[tuple, object] = {}
        self._graphs: dict[tuple, Graph] = {}
        self._last_rows: tuple[Plan, dict, dict] | None = None
        self._last_roofs: tuple[Plan, dict] | None = None
        # what each stage computes, from the step graph's ops: all the cost model prices
        self.works = {w.stage: w for o in build(pipeline).ops for w in o.work}
        w = pipeline.workload
        self.gen_tokens = w.batch * w.gen_len.mean()

    # --- cached cost-model calls ---------------------------------------------------

    def stage_time(self, stage: str, p: StagePlacement, rows: int | None = None,
                   chunk: tuple[int, float] | None = None, off_policy: bool = False) -> float:
        """Seconds of ``stage``; ``chunk``: (responses, longest, mean length) of one streamed
        chunk; ``off_policy``: a train stage corrects for responses sampled with older weights."""
        return self.stage_cost(stage, p, rows, chunk, off_policy).time_s

    def stage_cost(self, stage: str, p: StagePlacement, rows: int | None = None,
                   chunk: tuple[int, float] | None = None, off_policy: bool = False):
        """The cost model's :class:`rpeg.cost.StageCost` of ``stage`` (see ``stage_time``)."""
        key = ("t", stage, p, rows, chunk, off_policy)
        if key not in self._cost:
            canonical = ("t", stage, self.canonical(p), rows, chunk, off_policy)
            if canonical not in self._cost:
                q = canonical[2]
                batch, padded, mean = chunk if chunk is not None else (None, None, None)
                self._cost[canonical] = estimate_stage(
                    self.works[stage], parallel_of(q), q.devices, self.cluster,
                    engine=q.engine, rows=rows, batch=batch, padded_len=padded,
                    partial=self.cap(q), off_policy=off_policy, mean_len=mean)
            self._cost[key] = self._cost[canonical]
        return self._cost[key]

    def chunk_ends(self, stage: str, p: StagePlacement,
                   rows: int | None = None) -> tuple[tuple[float, int, float, float], ...]:
        """(end, responses, longest response, mean length) of each chunk of a generate
        stage."""
        p = self.canonical(p)
        key = ("c", stage, p, rows)
        if key not in self._cost:
            self._cost[key] = generation_chunks(self.works[stage], parallel_of(p), p.devices,
                                                self.cluster, p.chunks, engine=p.engine,
                                                rows=rows, with_lengths=True,
                                                partial=self.cap(p))
        return self._cost[key]

    def transient(self, stage: str, p: StagePlacement, rows: int | None = None,
                  chunks: tuple[tuple[int, float, float], ...] = ()) -> float:
        """Bytes a stage needs while it runs: for the whole batch, or (``chunks`` of a
        streamed consumer) the largest of its chunks, each processed on its own."""
        key = ("m", stage, parallel_of(p), p.engine, p.carry, rows, chunks)
        if key not in self._cost:
            par = parallel_of(p)
            if chunks:
                self._cost[key] = max(stage_memory(self.works[stage], par, self.cluster,
                                                   batch=n, padded_len=top,
                                                   engine=p.engine, mean_len=mean).total
                                      for n, top, mean in chunks)
            else:
                self._cost[key] = stage_memory(self.works[stage], par, self.cluster,
                                               rows=rows, partial=self.cap(p),
                                               engine=p.engine).total
        return self._cost[key]

    def streamed(self, plan: Plan, graph: Graph, rows: dict) -> dict[str, tuple]:
        """Ops that consume a chunked generation chunk by chunk: op -> (responses, longest
        response, mean length) per chunk, as the generation finishes them."""
        ends = {}
        for o in graph.ops:
            if o.kind is OpKind.GENERATE and plan.placement(o.stages[0]).chunks > 1:
                p = plan.placement(o.stages[0])
                e = self.chunk_ends(o.stages[0], p, rows.get(o.stages[0]))
                if len(e) > 1:
                    ends[o.name] = tuple((n, top, mean) for _, n, top, mean in e)
        if not ends:
            return {}
        counts = chunk_counts(graph, {g: len(e) for g, e in ends.items()})
        out = {}
        for name in graph.topo_order():
            if name in ends or counts.get(name, 1) <= 1:
                continue
            src = _streamed_from(graph, name, ends)
            if src is not None and len(ends[src]) == counts[name]:
                out[name] = ends[src]
        return out

    def cap(self, p: StagePlacement) -> int:
        """Tokens a step decodes per response when a generate stage carries responses over
        ``p.carry`` steps: each advances by about an equal share of the longest (0: all)."""
        return smallest_cap(self.pipeline.workload.gen_len.max_len, p.carry)

    def gen_rows(self, stage: str, p: StagePlacement, free: float) -> int:
        """Sequences a generate stage runs at once per replica with ``free`` bytes per GPU."""
        key = ("g", stage, parallel_of(p), p.engine, p.carry, round(free / 2**20))
        if key not in self._cost:
            self._cost[key] = generation_rows(self.works[stage], parallel_of(p),
                                              self.cluster, free, partial=self.cap(p),
                                              engine=p.engine)
        return self._cost[key]

    def rows_of(self, plan: Plan, graph: Graph, resident: np.ndarray | None = None) -> dict:
        """Per generate stage: its wave size given what stays resident on its devices."""
        if resident is None:
            resident = self.resident_bytes(plan, graph)[0]
        cap = usable_memory(self.cluster.gpu)
        out = {}
        for s in self.pipeline.stages:
            if s.kind is not OpKind.GENERATE:
                continue
            p = plan.placement(s.name)
            free = cap - float(resident[np.fromiter(p.devices, int)].max())
            out[s.name] = self.gen_rows(s.name, p, free)
        return out

    def resident(self, model: str, p: StagePlacement, trained: bool) -> float:
        """Bytes a copy of ``model`` keeps between stages: a ZeRO-3 copy (trained, or a
        frozen model served on shards) sharded over its data and context parallel ranks."""
        zero = p.zero if trained or p.zero >= 3 else 0
        key = ("r", model, p.tp, p.pp, p.dp, p.cp, p.ep, zero,
               p.offload if trained else False, p.param_offload, trained, p.engine)
        if key not in self._cost:
            par = attrs.evolve(parallel_of(p), zero=zero, offload=p.offload and trained)
            self._cost[key] = resident_memory(self.pipeline.model(model), par,
                                              self.cluster, trained=trained,
                                              engine=p.engine).total
        return self._cost[key]

    def sync_time(self, model: str, src: StagePlacement, dst: StagePlacement) -> float:
        src, dst = self.canonical(src, dst)
        key = ("s", model, src, dst)
        if key not in self._cost and engine_copy(src, dst):     # collectives into vLLM
            blocks = tuple(dst.devices[i:i + dst.tp] for i in range(0, len(dst.devices), dst.tp))
            self._cost[key] = collective_sync_time(self.pipeline.model(model), src.devices,
                                                   parallel_of(src), blocks, self.cluster)
        if key not in self._cost:
            self._cost[key] = weight_sync_time(self.pipeline.model(model), src.devices,
                                               parallel_of(src), dst.devices, parallel_of(dst),
                                               self.cluster)
        return self._cost[key]

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
            ps = tuple(attrs.evolve(p, devices=tuple(d - shift for d in p.devices))
                       for p in ps)
        return ps if len(ps) > 1 else ps[0]

    def graph(self, plan: Plan) -> Graph:
        base_key = (plan.staleness, plan.shared)
        if base_key not in self._graphs:
            self._graphs[base_key] = step_graph(self.pipeline, plan)
        base = self._graphs[base_key]
        key = (base_key, plan.fusion, synced_in_place(base, plan))
        if key not in self._graphs:
            self._graphs[key] = plan_graph(self.pipeline, plan, base)
        return self._graphs[key]

    # --- the evaluation ------------------------------------------------------------

    def evaluate(self, plan: Plan, *, simulate_infeasible: bool = False,
                 detail: bool = True) -> Evaluation:
        """Price ``plan``; CostError from an impossible layout becomes a PlanError.
        ``detail=False`` skips the per-device figures (busy fractions, model homes) the
        search does not need."""
        problem = staleness_problem(self.pipeline, plan)
        if problem:
            raise PlanError(problem, hint="lower the stage's carry or its staleness")
        plan = settle_batching(self.pipeline, plan, self.cluster, self.engine_kv)  # as it runs
        graph = self.graph(plan)
        try:
            peak, shortfall = self.memory(plan, graph)
        except CostError as e:
            raise PlanError(f"plan layout must be one the cost model can price, not: "
                            f"{e.message}", e.span, hint=e.hint) from None
        capacity = self.cluster.gpu.memory
        reserve = capacity - usable_memory(self.cluster.gpu)
        feasible = shortfall is None
        timeline = None
        memory = memory_uses(self, plan, graph) if detail else ()
        predicted = Predicted(float("inf"), tuple(float(x) for x in peak),
                              memory_capacity=capacity, memory=memory, memory_reserve=reserve)
        if feasible or simulate_infeasible:
            timings, op_times = self.timings(plan, graph)
            steps = self.steps or steps_for(max((k for _, k in plan.staleness), default=0))
            timeline = simulate(graph, timings, steps=steps, events=detail,
                                crossing_s=max(self.cluster.gpu.dispatch_s, 0.0),
                                streams=streams_of(plan, graph))
            control, tasks = self._control(plan, graph, timings, steps)
            step = timeline.step_time_s + control
            if self.pipeline.evaluation is not None:    # an eval op every `every` steps
                held_out = self.eval_time(plan)
                step += held_out / self.pipeline.evaluation.every
                op_times = tuple(op_times) + ((EVAL_OP, held_out),)
            predicted = Predicted(
                step_time_s=step,
                peak_memory=tuple(round(float(x)) for x in peak) if detail else (),
                busy=tuple(round(float(b), 4) for b in timeline.busy()) if detail else (),
                tokens_per_s=self.gen_tokens / step if step > 0 else 0.0,
                op_times=op_times, memory_capacity=capacity, control_s=round(control, 6),
                tasks_per_step=tasks, memory=memory, memory_reserve=reserve,
                ops=op_uses(self, plan, timings, op_times, self._last_roofs[1])
                if detail else ())
        homes = self.homes(plan, graph) if detail else plan.model_homes
        return Evaluation(attrs.evolve(plan, predicted=predicted, model_homes=homes),
                          feasible, shortfall, timeline)

    def eval_time(self, plan: Plan) -> float:
        devices = trainer_devices(self.pipeline, plan)
        key = ("e", devices)
        if key not in self._cost:
            self._cost[key] = eval_time(self.pipeline, devices, self.cluster)
        return self._cost[key]

    def fits(self, plan: Plan) -> bool:
        """Memory only: does every device hold what the plan puts on it?"""
        try:
            return self.memory(plan, self.graph(plan))[1] is None
        except CostError:
            return False

    def timings(self, plan: Plan, graph: Graph):
        timings: dict[str, OpTiming] = {}
        op_times: list[tuple[str, float]] = []
        roofs: dict[str, Roof] = {}          # per op: FLOPs and bytes on one of its devices
        trainer = {o.writes_model: o for o in graph.ops if o.kind is OpKind.TRAIN}
        last = self._last_rows
        if last is not None and last[0] is plan:
            rows, streamed = last[1], last[2]
        else:
            rows = self.rows_of(plan, graph)
            streamed = self.streamed(plan, graph, rows)
        for op in graph.ops:
            if op.kind is OpKind.SYNC_WEIGHTS:
                continue
            p = plan.placement(op.stages[0])
            if op.kind is OpKind.GENERATE:
                r = rows.get(op.stages[0])
                ends = self.chunk_ends(op.stages[0], p, r) if p.chunks > 1 else ()
                t = self.stage_time(op.stages[0], p, r)
                roofs[op.name] = self.stage_cost(op.stages[0], p, r).roof
                timing = OpTiming(p.devices, t, tuple(e[0] for e in ends),
                                  tuple(e[1] for e in ends))
            elif op.kind is OpKind.TRAIN:
                # Train stages of a shared backbone: one pass with a combined loss on the
                # first stage's schedule (its minibatches); the extra head costs nothing here.
                off = self._off_policy(op, plan, graph)
                t = self.stage_time(op.stages[0], p, off_policy=off)
                roofs[op.name] = self.stage_cost(op.stages[0], p, off_policy=off).roof
                t += self._reload(op, p, trainer, plan)
                timing = OpTiming(p.devices, t)
            else:
                # streamed: each chunk priced on its own responses, padded to its longest
                per_chunk = [self._fused(op, plan, c) for c in streamed.get(op.name, ())]
                roofs[op.name] = sum((self.stage_cost(s, plan.placement(s), chunk=c).roof
                                      for c in streamed.get(op.name, None) or (None,)
                                      for s in op.stages), Roof())
                reload = self._reload(op, p, trainer, plan)
                if per_chunk:
                    per_chunk[0] += reload
                    t = sum(per_chunk)
                else:
                    t = self._fused(op, plan, None) + reload
                # host ops too: they run in their device's worker, which waits for them
                timing = OpTiming(p.devices, t, chunk_times=tuple(per_chunk))
            timings[op.name] = timing
            op_times.append((op.name, round(timing.time_s, 6)))
        for op in graph.ops:
            if op.kind is not OpKind.SYNC_WEIGHTS:
                continue
            src = plan.placement(trainer[op.reads_model].stages[0])
            reader = next(o for o in graph.ops if o.kind is OpKind.GENERATE
                          and o.reads_model == op.reads_model)
            dst = plan.placement(reader.stages[0])
            model = self._model_name(trainer[op.reads_model])
            t = self.sync_time(model, src, dst)
            # one collective: the trainer's devices that hold its weights (the first tp
            # block; every one when ZeRO-3 shards them) gather and send, the readers (torch
            # copies, or a vLLM engine's own copy) receive (rpeg.runtime.instances)
            sources = src.devices if src.zero >= 3 else src.devices[:max(src.tp, 1)]
            devices = tuple(sorted(set(sources) | set(dst.devices)))
            timings[op.name] = OpTiming(devices, t)
            op_times.append((op.name, round(t, 6)))
        self._last_roofs = (plan, roofs)      # evaluate() reports them (op_uses)
        return timings, tuple((n, round(timings[n].time_s, 6)) for n, _ in op_times)

    def control_time(self, plan: Plan, graph: Graph, timings: dict[str, OpTiming],
                     steps: int = 6) -> float:
        """Seconds a step loses to the control plane where it shares the devices' cores.

        On a machine whose devices are CPU cores (the local profile: ``host_cores``), the
        client, the Dask scheduler and the workers' event loops run on those same cores:
        per step, ``control_step_s`` for each device in use (the round trip that collects
        its trace, its worker's loop) and ``control_task_s`` for each Dask task the runtime
        dispatches (:func:`rpeg.plan.simulate.tasks_per_step`). That CPU time, spread over
        the host's cores, delays the devices' work by its share: ``W / host_cores``. Both
        are fitted by ``rpeg calibrate`` from real runs; profiles without ``host_cores``
        (GPUs, whose host CPUs are not the devices) pay nothing here.
        """
        return self._control(plan, graph, timings, steps)[0]

    def _control(self, plan: Plan, graph: Graph, timings: dict[str, OpTiming],
                 steps: int) -> tuple[float, int]:
        """(:meth:`control_time`, the Dask tasks a step it counted; 0 where not charged)."""
        gpu = self.cluster.gpu
        cores = gpu.host_cores
        if cores <= 0:
            return 0.0, 0
        used = {d for t in timings.values() for d in t.devices}
        tasks = self.dask_tasks(plan, graph, timings, steps)
        cpu = gpu.control_step_s * len(used) + gpu.control_task_s * tasks
        return cpu / (cores * max(1, -(-len(used) // self.cluster.gpus_per_node))), tasks

    def dask_tasks(self, plan: Plan, graph: Graph, timings: dict[str, OpTiming],
                   steps: int = 6) -> int:
        """Dask tasks a steady step of ``plan`` dispatches under the runtime's fusion."""
        # the runtime runs a fused op's stages as calls of their own, each starting a task
        # where its own inputs say so: counted on the graph without fusion
        loose = self.graph(attrs.evolve(plan, fusion=()))
        where = {}
        for op in loose.ops:
            if op.kind is OpKind.SYNC_WEIGHTS:
                where[op.name] = OpTiming(timings[op.name].devices, 0.0)
            else:
                p = plan.placement(op.stages[0])
                where[op.name] = OpTiming(p.devices, 0.0, (0.0,) * p.chunks
                                          if op.kind is OpKind.GENERATE and p.chunks > 1
                                          else ())
        collective = frozenset(
            o.name for o in loose.ops if len(where[o.name].devices) > 1 and o.stages
            and (o.kind is OpKind.TRAIN or plan.placement(o.stages[0]).tp > 1))
        key = ("tasks", id(loose), tuple(where.values()), collective, steps)
        if key not in self._cost:
            self._cost[key] = tasks_per_step(loose, where, steps, collective)
        return self._cost[key]

    def _off_policy(self, op, plan: Plan, graph: Graph) -> bool:
        """A policy-gradient train op whose responses were sampled with older weights (the
        generate stage's staleness or carry, or truncated importance sampling asked for on
        every batch): it runs the correction's extra forward."""
        stage = self.pipeline.stage(op.stages[0])
        if not loss_of(stage, self.pipeline).policy:
            return False
        if getattr(stage.param("loss"), "get", dict().get)("tis") is not None:
            return True                          # corrected on every batch, stale or not
        return any(plan.staleness_of(g.stages[0]) + plan.placement(g.stages[0]).carry > 0
                   for g in graph.ops if g.kind is OpKind.GENERATE
                   and g.reads_model == op.writes_model)

    def _fused(self, op, plan: Plan, chunk: tuple[int, float, float] | None) -> float:
        """Seconds of an op's stages back to back (fused: one dispatch instead of several)."""
        times = [self.stage_time(s, plan.placement(s), chunk=chunk) for s in op.stages]
        return max(sum(times) - (len(times) - 1) * self.cluster.gpu.call_overhead, max(times))

    def _model_name(self, op) -> str:
        return self.pipeline.stage(op.stages[0]).target

    def _reload(self, op, p: StagePlacement, trainer, plan: Plan) -> float:
        """A forward op reading a model trained on other devices fetches the new weights."""
        if op.kind is not OpKind.FORWARD or op.reads_model not in trainer:
            return 0.0
        src = plan.placement(trainer[op.reads_model].stages[0])
        if src.devices == p.devices and (src.tp, src.pp) == (p.tp, p.pp) and src.zero < 3:
            return 0.0
        stage = next(s for s in op.stages if self.pipeline.stage(s).target is not None
                     and self.pipeline.has_model(self.pipeline.stage(s).target)
                     and graph_backbone(plan, self.pipeline.stage(s).target) == op.reads_model)
        return self.sync_time(self.pipeline.stage(stage).target, src, p)

    # --- memory ---------------------------------------------------------------------

    def copies(self, plan: Plan, graph: Graph):
        """(model, placement, trained) for every copy of every model's weights: the trained
        copy where its train stage runs, one weights-only copy per other layout reading it."""
        by_backbone: dict[str, list[str]] = {}
        for s in self.pipeline.stages:
            if s.kind is OpKind.COMPUTE or not self.pipeline.has_model(s.target or ""):
                continue
            by_backbone.setdefault(graph_backbone(plan, s.target), []).append(s.name)
        out = []
        for stages in by_backbone.values():
            model = self.pipeline.stage(stages[0]).target
            seen = []
            train = next((s for s in stages if self.pipeline.stage(s).kind is OpKind.TRAIN),
                         None)
            sharded = None
            if train is not None:
                p = plan.placement(train)
                out.append((self.pipeline.stage(train).target, p, True))
                seen.append((p.devices, p.tp, p.pp, p.zero >= 3))
                sharded = p.devices if p.zero >= 3 else None
            for s in stages:
                if self.pipeline.stage(s).kind is OpKind.TRAIN:
                    continue
                p = plan.placement(s)
                if p.zero >= 3 and p.devices == sharded:
                    continue      # a pass on ZeRO-3 shards gathers the trained copy's
                key = (p.devices, p.tp, p.pp, p.zero >= 3)
                if key not in seen:
                    seen.append(key)
                    out.append((model, p, False))
        return out

    def resident_bytes(self, plan: Plan, graph: Graph):
        """(bytes resident per device, the same per model)."""
        n = plan.num_devices
        resident = np.zeros(n)
        by_model: dict[str, np.ndarray] = {}
        for model, p, trained in self.copies(plan, graph):
            b = self.resident(model, p, trained)
            idx = np.fromiter(p.devices, int)
            resident[idx] += b
            by_model.setdefault(model, np.zeros(n))[idx] += b
        return resident, by_model

    def memory(self, plan: Plan, graph: Graph) -> tuple[np.ndarray, Shortfall | None]:
        resident, by_model = self.resident_bytes(plan, graph)
        rows = self.rows_of(plan, graph, resident)
        streamed = self.streamed(plan, graph, rows)
        self._last_rows = (plan, rows, streamed)   # timings() of the same plan reuses them
        transient, top, chunks_of = self.transients(plan, graph, rows, streamed)
        peak = resident + transient
        cap = usable_memory(self.cluster.gpu)
        worst = int(np.argmax(peak - cap))
        if peak[worst] <= cap:
            return peak, None
        what = sorted(((m, float(v[worst])) for m, v in by_model.items() if v[worst] > 0),
                      key=lambda x: -x[1])
        op = top[worst]
        what.append((f"{op} (transient)", float(transient[worst])))
        kinds = self.kinds(plan, graph, worst, op, rows.get(op), chunks_of.get(op, ()))
        return peak, Shortfall(worst, float(peak[worst]), cap, op,
                               what[0][0] if what else "", tuple(what), kinds,
                               plan.placement(op) if op else None)

    def transients(self, plan: Plan, graph: Graph, rows: dict, streamed: dict
                   ) -> tuple[np.ndarray, list[str], dict]:
        """(the largest transient bytes of any op on each device, that op's stage ('' for
        none), the chunks each streamed stage is priced in)."""
        chunks_of = {s: streamed[o.name] for o in graph.ops if o.name in streamed
                     for s in o.stages}
        n = plan.num_devices
        transient = np.zeros(n)
        top_op = np.full(n, -1)
        stages = [s.name for s in self.pipeline.stages]
        followers = {s for o in graph.ops if o.kind is OpKind.TRAIN for s in o.stages[1:]}
        for k, stage in enumerate(stages):
            if stage in followers:            # runs inside the lead stage's op
                continue
            p = plan.placement(stage)
            b = self.transient(stage, p, rows.get(stage), chunks_of.get(stage, ()))
            idx = np.fromiter(p.devices, int)
            bigger = b > transient[idx]
            transient[idx[bigger]] = b
            top_op[idx[bigger]] = k
        return transient, [stages[k] if k >= 0 else "" for k in top_op], chunks_of

    def kinds(self, plan: Plan, graph: Graph, device: int, op: str, rows, chunks
              ) -> tuple[tuple[str, float], ...]:
        """What fills ``device`` by kind (weights, gradients, optimizer state, activations,
        KV cache, buffers): every copy resident there and the op's transient need."""
        total = MemoryCost()
        for model, p, trained in self.copies(plan, graph):
            if device in p.devices:
                zero = p.zero if trained or p.zero >= 3 else 0
                par = attrs.evolve(parallel_of(p), zero=zero, offload=p.offload and trained)
                total += resident_memory(self.pipeline.model(model), par, self.cluster,
                                         trained=trained,
                                         engine=p.engine)
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
        return tuple((k, float(getattr(total, k))) for k in
                     ("weights", "grads", "optimizer", "activations", "kv_cache", "buffers"))

    def homes(self, plan: Plan, graph: Graph) -> tuple[tuple[str, tuple[int, ...]], ...]:
        out: dict[str, set[int]] = {}
        for model, p, _ in self.copies(plan, graph):
            out.setdefault(model, set()).update(p.devices)
        return tuple((m, tuple(sorted(d))) for m, d in sorted(out.items()))


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


def graph_backbone(plan: Plan, model: str) -> str:
    for group in plan.shared:
        if model in group:
            return "+".join(group)
    return model


__all__ = ["Evaluator", "Evaluation", "Shortfall", "parallel_of", "plan_graph"]
