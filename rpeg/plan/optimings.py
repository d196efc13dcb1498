"""How long each op of a plan runs, and what its control plane costs: the cost model's
stage times laid out as the plan's ops run them (fused stages back to back, streamed
chunks one by one, a vLLM engine's sleep and wake, a copy's weight fetch), the weight
syncs, and the calls, tasks and futures a steady step dispatches.

    >>> from rpeg.plan.evaluate import Evaluator                          # doctest: +SKIP
    >>> ev = Evaluator(pipeline, cluster)                                 # doctest: +SKIP
    >>> graph = ev.graph(plan)                                            # doctest: +SKIP
    >>> timings, op_times = ev.timings(plan, graph)                       # doctest: +SKIP

:class:`OpTimings` is the part of :class:`rpeg.plan.evaluate.Evaluator` that answers
these (its memos live in the evaluator; see :mod:`rpeg.plan.evaluate`).
"""

from __future__ import annotations

import attrs

from rpeg.cost.compute import Roof
from rpeg.cost.control import Dispatch
from rpeg.cost.engine_sync import engine_sleeps, sleep_wake_time
from rpeg.cost.memory import devices_are_host
from rpeg.graph import Graph
from rpeg.plan.evalcost import eval_time, trainer_devices
from rpeg.plan.lower import Placed, lower
from rpeg.plan.memorywalk import Walk
from rpeg.plan.model import Plan, StagePlacement
from rpeg.plan.oplayout import (
    all_in_place,
    first_block,
    gathers_in_place,
)
from rpeg.plan.prices import Chunk
from rpeg.plan.simulate import Contention, OpTiming
from rpeg.plan.structure import graph_backbone, sync_devices
from rpeg.spec.model import Engine, OpKind


class OpTimings:
    """Op timings and the control plane of a plan, for :class:`rpeg.plan.evaluate.Evaluator`
    (see the module doc)."""

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
        for op in graph.ops:
            if op.kind is OpKind.SYNC_WEIGHTS:
                continue
            p = plan.placement(op.stages[0])
            if op.kind is OpKind.GENERATE:
                out[op.name] = self.stage_cost(op.stages[0], p,
                                               walk.rows.get(op.stages[0])).roof
            elif op.kind is OpKind.TRAIN:
                off = self._off_policy(op, plan, graph)
                out[op.name] = self.stage_cost(*self._trained(op, plan), off_policy=off).roof
            else:
                at = first_block if _one_call(op, p) else _same
                out[op.name] = sum((self.stage_cost(s, at(plan.placement(s)), chunk=c).roof
                                    for c in walk.streamed.get(op.name, None) or (None,)
                                    for s in op.stages), Roof())
        return out

    def _op_timing(self, graph: Graph, op, plan: Plan, walk: Walk, trainer) -> OpTiming:
        """Where ``op`` runs and for how long, from what it reads of the plan and the walk
        (memoised by exactly that)."""
        p = plan.placement(op.stages[0])
        off = op.kind is OpKind.TRAIN and self._off_policy(op, plan, graph)
        rest, rounds = 0.0, 1
        if op.kind is OpKind.GENERATE:
            rest, rounds = self._rest(op, p, plan, graph), self._rounds(plan, graph, op)
            key = (graph, op.name, p, walk.rows.get(op.stages[0]), rest, rounds)
        elif op.kind is OpKind.TRAIN:
            key = (graph, op.name, self._trained(op, plan)[1], off)
        else:
            src = plan.placement(trainer[op.reads_model].stages[0]) \
                if op.kind is OpKind.FORWARD and op.reads_model in trainer else None
            key = (graph, op.name, tuple(plan.placement(s) for s in op.stages),
                   walk.streamed.get(op.name, ()), src, plan.shared,
                   src is not None and not walk.read_before.isdisjoint(op.stages))
        timing = self._ops.get(key)
        if timing is None:
            timing = self._ops[key] = self._time_op(op, p, plan, walk, trainer, off, rest,
                                                    rounds)
        return timing

    def _trained(self, op, plan: Plan) -> tuple[str, StagePlacement]:
        """(work, placement) a train op runs as (:meth:`rpeg.plan.prices.Prices.trained`)."""
        return self.prices.trained(op.stages, tuple(plan.placement(s) for s in op.stages))

    def _time_op(self, op, p: StagePlacement, plan: Plan, walk: Walk, trainer,
                 off_policy: bool, rest: float = 0.0, rounds: int = 1) -> OpTiming:
        if op.kind is OpKind.GENERATE:
            r = walk.rows.get(op.stages[0])
            ends = self.prices.chunk_ends(op.stages[0], attrs.evolve(p, chunks=rounds), r) \
                if rounds > 1 else ()
            t = self.stage_time(op.stages[0], p, r) + rest
            return OpTiming(p.devices, t, tuple(e[0] for e in ends), tuple(e[1] for e in ends))
        if op.kind is OpKind.TRAIN:
            # Train stages of a shared backbone: one pass with a combined loss on the one
            # schedule they run on (oplayout.fused_train); the extra head costs nothing here.
            t = self.stage_time(*self._trained(op, plan), off_policy=off_policy)
            return OpTiming(p.devices, t + self._reload(op, p, trainer, plan, walk))
        # streamed: each chunk priced on its own responses, padded to its longest
        per_chunk = [self._fused(op, plan, c) for c in walk.streamed.get(op.name, ())]
        reload = self._reload(op, p, trainer, plan, walk)
        if per_chunk:
            per_chunk[0] += reload
            t = sum(per_chunk)
        else:
            # a pass at dp > 1 runs split over its blocks (rpeg.plan.oplayout.split_parts),
            # as its stages are priced; a group estimator, one call over the whole batch on
            # its first block, is priced there
            if _one_call(op, p):
                at = first_block(p)
                return OpTiming(at.devices, sum(self.stage_time(s, first_block(
                    plan.placement(s))) for s in op.stages) + self._reload(op, at, trainer, plan, walk))
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

    def placed(self, plan: Plan, graph: Graph | None = None) -> Placed:
        """The plan's placed graph (:func:`rpeg.plan.lower.lower`, the value the runtime lays
        its calls out from and ``rpeg verify`` checks a run against: its step graph unfused,
        without the weight syncs that move nothing, its fusion as data). The simulator
        prices its fused view (:meth:`~rpeg.plan.lower.Placed.fused`, lowered by the passes
        it prices), which reads no pass of the value itself: it is lowered by none here.
        ``graph``: the plan's as priced (:meth:`graph`), when at hand. Memoised by it and
        the placements (a search prices each proposal once, and its floor first)."""
        graph = graph or self.graph(plan)
        key = (graph, plan.placements)
        placed = self._placed.get(key)
        if placed is None:
            if len(self._placed) > 256:
                self._placed.clear()
            placed = self._placed[key] = lower(self.unfused(plan, graph), plan, self.responses,
                                               passes=())
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

    def _reload(self, op, p: StagePlacement, trainer, plan: Plan, walk: Walk) -> float:
        """A forward op reading a copy of a trained model of its own fetches the new
        weights: the weight transfer the runtime adds into that copy
        (``rpeg.plan.lower.Placed.transfers``), priced as a weight sync from its trainer.
        None where it reads the trainer's weights in place on every device
        (:func:`~rpeg.plan.oplayout.all_in_place`) or runs on its ZeRO-3 shards
        (:func:`~rpeg.plan.oplayout.gathers_in_place`, whose gather the pass prices): the
        rule :func:`rpeg.plan.copies.copies` keys the copies by. (A pass on the shards per
        chunk would read a copy, which the runtime refuses: one chunk is checked.) None
        either where an op before it reads the same copies on its devices
        (:attr:`~rpeg.plan.memorywalk.Walk.read_before`): the runtime fills a copy once a
        version, whoever reads it."""
        if op.kind is not OpKind.FORWARD or op.reads_model not in trainer:
            return 0.0
        src = plan.placement(trainer[op.reads_model].stages[0])
        if all_in_place(src, p) or gathers_in_place(op, src, p, chunks=1):
            return 0.0
        target = self.stages.target
        stage = next(s for s in op.stages if s in self.stages.modelled
                     and graph_backbone(plan, target[s]) == op.reads_model)
        if stage in walk.read_before:
            return 0.0
        return self.prices.sync_time(target[stage], src, p)


def _one_call(op, p: StagePlacement) -> bool:
    """Whether ``op`` (a pass or host op placed as ``p``) runs one call a step over the whole
    batch on its first block though placed at dp > 1: a group estimator, which needs the
    whole batch (:func:`rpeg.plan.oplayout.split_parts` splits every other)."""
    return p.dp > 1 and not op.per_sample


def _same(p: StagePlacement) -> StagePlacement:
    """A placement as it is (pricing not narrowed to a first block)."""
    return p


__all__ = ["OpTimings"]
