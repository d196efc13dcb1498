"""The control plane's price of a plan's steady step, as an evaluator reads it.

    >>> from rpeg.spec import load, load_cluster                        # doctest: +SKIP
    >>> ev = Evaluator(load("pipelines/ppo_llama8b.rpeg"),
    ...                load_cluster("pipelines/clusters/gh200_64.rpeg"))   # doctest: +SKIP
    >>> graph = ev.graph(plan); timings = ev.timings(plan, graph)[0]     # doctest: +SKIP
    >>> ev.control.time(plan, timings, steps=6, step_s=30.0)             # doctest: +SKIP
    (0.98, 450)

A :class:`ControlPlane` prices the op calls, Dask tasks and futures a steady step of a
plan dispatches (:func:`rpeg.plan.tasks.dispatch_per_step`: the step's calls packed into
tasks as the runtime's fusion packs them) in seconds a step loses to them
(:func:`rpeg.cost.control.control_time`, or :func:`rpeg.cost.control.shared_cores_time`
where the devices are the host's own cores). A cheaper figure, no more than the counted
one, lets a search skip the count for a plan that cannot beat its bound:
:meth:`ControlPlane.floor` (:func:`rpeg.plan.dispatchfloor.dispatch_floor`, the step
neither unrolled nor packed).

Each count is a function of the plan's graph without fusion, each op's layout with its
devices renamed in order of appearance (:func:`rpeg.plan.tasks.relabelled`), the chunks a
step streams, the steps unrolled and the fused stages; it is memoised by exactly that,
so plans alike but for the devices they use are counted once.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from rpeg.cost.control import Dispatch, control_time, shared_cores_time, terms_of
from rpeg.graph import Graph
from rpeg.plan.dispatchfloor import dispatch_floor
from rpeg.plan.model import Plan
from rpeg.plan.simulate import OpTiming
from rpeg.plan.tasks import dispatch_per_step, layouts_of, relabelled, shared_of
from rpeg.spec.model import Cluster, OpKind, Pipeline


@attrs.define(eq=False)
class ControlPlane:
    """Prices the control plane of plans of one pipeline on one cluster (see the module
    doc); ``graph``: the evaluator's step graph of a plan (memoised there)."""

    pipeline: Pipeline
    cluster: Cluster
    graph: Callable[[Plan], Graph]
    _tasks: dict[tuple, Dispatch] = attrs.field(factory=dict, init=False)
    _floors: dict[tuple, Dispatch] = attrs.field(factory=dict, init=False)
    _laid: dict[tuple, tuple] = attrs.field(factory=dict, init=False)
    _names: dict[tuple, tuple] = attrs.field(factory=dict, init=False)
    _shared: dict = attrs.field(factory=dict, init=False)
    _kept: dict = attrs.field(factory=dict, init=False)

    def time(self, plan: Plan, timings: dict[str, OpTiming], steps: int,
             step_s: float = 0.0) -> tuple[float, int]:
        """(seconds a step of ``step_s`` seconds of work loses to the control plane, the
        Dask tasks a step it counted: :meth:`dispatch`)."""
        d = self.dispatch(plan, timings, steps)
        return self.charged(d, step_s), d.tasks

    def charged(self, d: Dispatch, step_s: float) -> float:
        """Seconds a step of ``step_s`` seconds of work loses to dispatching ``d``."""
        gpu = self.cluster.gpu
        if gpu.host_cores > 0:
            nodes = -(-d.devices // self.cluster.gpus_per_node)
            return shared_cores_time(gpu, d.devices, d.tasks, nodes, step_s)
        return control_time(terms_of(gpu)[0], d, step_s).charged_s

    def floor(self, plan: Plan, timings: dict[str, OpTiming], steps: int,
              step_s: float) -> float:
        """No more than :meth:`time`: priced from :func:`dispatch_floor` (the step's calls,
        and of its tasks and futures those no fusion changes), whose every count is no
        more than :meth:`dispatch`'s, without packing the calls into tasks."""
        loose, _, chunks, named, _ = self.layouts(plan, timings)
        key = (loose, named, chunks, steps)
        low = self._floors.get(key)
        if low is None:
            low = self._floors[key] = dispatch_floor(loose, dict(named), chunks, steps)
        return self.charged(low, step_s)

    def dispatch(self, plan: Plan, timings: dict[str, OpTiming], steps: int = 6) -> Dispatch:
        """The op calls, Dask tasks and futures a steady step of ``plan`` dispatches
        (:func:`rpeg.plan.tasks.dispatch_per_step`), counted once for all plans whose
        layouts differ only in the devices they name (:func:`rpeg.plan.tasks.relabelled`)."""
        loose, _, chunks, named, placed = self.layouts(plan, timings)
        shared = self._shared.get(placed)
        if shared is None:              # the proposal's, asked for its count alone
            self._shared.clear()
            shared = self._shared[placed] = shared_of(placed, plan)
        key = (loose, named, chunks, steps, plan.fusion, shared)
        d = self._tasks.get(key)
        if d is None:
            d = self._tasks[key] = dispatch_per_step(loose, dict(named), chunks, steps,
                                                     plan.fusion, shared=shared)
        return d

    def layouts(self, plan: Plan, timings: dict[str, OpTiming]):
        """(the plan's graph without fusion, each op's layout, the chunks a step streams:
        :func:`rpeg.plan.tasks.layouts_of`, the layouts relabelled:
        :func:`rpeg.plan.tasks.relabelled`, and the placed graph), memoised by what that
        reads: the placements, and where the weight syncs run. The runtime runs a fused op's
        stages as calls of their own, in one task where their inputs allow: counted on the
        graph without fusion. Only the last is kept (a search asks for the floor and the count of one
        proposal in turn; more would only burden memory)."""
        loose = self.graph(attrs.evolve(plan, fusion=()) if plan.fusion else plan)
        syncs = tuple(timings[o.name].devices for o in loose.ops
                      if o.kind is OpKind.SYNC_WEIGHTS)
        key = (loose, plan.placements, syncs)
        laid = self._laid.get(key)
        if laid is None:                # the proposal's floor, then its count: one kept
            self._laid.clear()
            layouts, chunks, placed = layouts_of(self.pipeline, plan, loose, timings)
            laid = self._laid[key] = (loose, layouts, chunks, self.relabelled(layouts), placed)
        return laid

    def relabelled(self, layouts: dict) -> tuple:
        """:func:`rpeg.plan.tasks.relabelled`, asked once per set of layouts (each hashed
        once), and without renaming where the first op's devices are 0 .. n - 1 and every
        other op's lie among them: each device then keeps its name."""
        ordered = tuple(sorted(layouts.items()))
        out = self._names.get(ordered)
        if out is None:
            if len(self._names) > 4096:
                self._names.clear()
                self._kept.clear()
            kept = self._kept
            # each layout the one instance of its value kept here: the count's memos by
            # layout then find it by identity, not comparing its devices
            out = self._names[ordered] = tuple(
                (op, kept.setdefault(lay, lay)) for op, lay in
                (ordered if _named_in_order(ordered) else relabelled(layouts)))
        return out


def _named_in_order(ordered: tuple) -> bool:
    """Whether :func:`rpeg.plan.tasks.relabelled` leaves every layout of ``ordered`` (op,
    layout) as it is: the first's devices are 0 .. n - 1 and the others' among them."""
    first = ordered[0][1].devices if ordered else ()
    n = len(first)
    return bool(n) and first[0] == 0 and first[-1] == n - 1 \
        and first == tuple(range(n)) \
        and all(not lay.devices or (min(lay.devices) >= 0 and max(lay.devices) < n)
                for _, lay in ordered[1:])


__all__ = ["ControlPlane"]
