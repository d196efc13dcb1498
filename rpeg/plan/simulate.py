"""Event-driven simulation of a placed graph (:class:`rpeg.plan.lower.Placed`) on a set of
devices.

    >>> from rpeg.graph import Graph, Op, DataEdge
    >>> from rpeg.spec.model import OpKind
    >>> g = Graph("toy", (Op("a", OpKind.FORWARD, outputs=("x",)),
    ...                   Op("b", OpKind.FORWARD, inputs=("x",))),
    ...           (DataEdge("a", "b", "x"),), (), (), ())
    >>> timings = {"a": OpTiming((0,), 2.0), "b": OpTiming((0,), 1.0)}
    >>> tl = simulate(Placed(g, responses=1), timings, steps=3)
    >>> [(str(e.instance), e.start, e.end) for e in tl.events[:3]]
    [('a@0', 0.0, 2.0), ('b@0', 2.0, 3.0), ('a@1', 3.0, 5.0)]
    >>> tl.step_time_s
    3.0

Rules. The instances (op, step, chunk) and their dependencies are the placed graph's
(:meth:`Placed.edges <rpeg.plan.lower.Placed.edges>`: data, versions, stream order, write
after read on a shared replica), the ones the runtime lays its calls out from, in the
value's fused view (:meth:`Placed.fused <rpeg.plan.lower.Placed.fused>`: the plan's fused
stages one op, as the op timings price them), a round of
a generate op's chunks (a chunk on each of its blocks, side by side) one instance on all
its devices (:meth:`Placed.by_round <rpeg.plan.lower.Placed.by_round>`, as the cost model
prices a round: one chunk of the step's responses); the op timings say where each op runs
and for how long. An instance is ready when every data and
version dependency has finished; it starts as soon as every device it needs is free
(devices are exclusive: colocated ops time-share them). Among ready instances
the earliest step goes first, then graph order, then chunk. A generate op split
into chunks runs its chunks back to back on its devices, chunk i ending when the
cost model says its responses are finished, so per-sample consumers start on
early chunks while long responses still decode. Ops with no devices (host-side
reward functions, advantage computation) never wait for a device.

The steady-state step time is the mean interval between step completions over
the second half of the simulated steps (the first steps fill the pipeline), leaving
out the last ``max staleness`` steps, which drain it, and (given enough steps, see
:func:`steps_for`) the first ``2 (max staleness + 1)``, which fill it; the window spans
a whole number of every period up to ``max staleness + 1`` steps the schedule may
repeat with. It is never less than the busiest device's work in one step: a window
still in the fill (the slack staleness gives takes long to use up when generation and
training run at nearly the same rate) would read faster than any steady state.
"""

from __future__ import annotations

import functools
import gc
import heapq
import math

import attrs
import numpy as np

from rpeg.errors import PlanError
from rpeg.graph import DepKind, Graph, Instance, chunk_counts
from rpeg.graph.unroll import STREAM, unroll_edges
from rpeg.plan.lower import Placed
from rpeg.spec.model import OpKind


@attrs.frozen
class OpTiming:
    """What the simulator needs to know of one op: where it runs and for how long.

    ``chunk_ends`` (generate ops only): seconds from the op's start at which each
    chunk's responses are finished, the last equal to ``time_s``; ``chunk_sizes``:
    responses per chunk, used to split per-sample consumers' time. ``chunk_times``
    (per-sample consumers of a chunked generate): seconds of each chunk priced on its own
    (its responses, padded to its longest); without them ``time_s`` is split by responses.
    """

    devices: tuple[int, ...]
    time_s: float
    chunk_ends: tuple[float, ...] = ()
    chunk_sizes: tuple[int, ...] = ()
    chunk_times: tuple[float, ...] = ()


@attrs.frozen
class Event:
    instance: Instance
    devices: tuple[int, ...]
    start: float
    end: float


@attrs.frozen
class Timeline:
    events: tuple[Event, ...]
    steps: int
    step_time_s: float
    step_ends: tuple[float, ...]          # when each step's last instance finished
    window: tuple[float, float]           # the steady-state interval measured
    num_devices: int

    def busy(self) -> np.ndarray:
        """Fraction of the steady-state window each device spends running an op."""
        lo, hi = self.window
        out = np.zeros(self.num_devices)
        if hi <= lo:
            return out
        per_set: dict[tuple[int, ...], float] = {}
        for devices, span in _device_spans(self.events, lo, hi):
            per_set[devices] = per_set.get(devices, 0.0) + span
        for devices, span in per_set.items():
            out[list(devices)] += span
        return out / (hi - lo)

    def bubbles(self) -> tuple[tuple[tuple[int, ...], float], ...]:
        """(device group, idle seconds per step) for every group the events use."""
        lo, hi = self.window
        per: dict[tuple[int, ...], float] = {}
        steps = max((hi - lo) / self.step_time_s, 1e-12) if self.step_time_s else 1.0
        busy = self.busy()
        for g in groups_of(self.events):
            per[g] = float((1.0 - busy[list(g)].mean()) * (hi - lo) / steps)
        return tuple(sorted(per.items()))


def groups_of(events) -> tuple[tuple[int, ...], ...]:
    """The atoms: maximal device sets that every event uses entirely or not at all."""
    return tuple(sorted(tuple(sorted(a)) for a in _atoms({e.devices for e in events
                                                          if e.devices})))


def _device_spans(events, lo: float, hi: float):
    for e in events:
        span = min(e.end, hi) - max(e.start, lo)
        if span > 0 and e.devices:
            yield e.devices, span


def steps_for(staleness: int) -> int:
    """Steps to simulate for a steady-state window past the fill (see the module doc):
    2 (k + 1) filling, whole periods (at least 3 steps) measured, k + 1 draining.

        >>> [steps_for(k) for k in (0, 1, 2)]
        [6, 10, 15]
    """
    drain = staleness + 1
    period = math.lcm(*range(1, drain + 1))
    return 2 * drain + -(-3 // period) * period + drain


def chunk_durations(graph: Graph, timings: dict[str, OpTiming],
                    counts: dict[str, int]) -> dict[tuple[str, int], float]:
    """Seconds of every (op, chunk): generate chunks from their finish times, per-sample
    consumers in proportion to the responses in the chunk they consume."""
    sizes: dict[str, tuple[int, ...]] = {}
    out: dict[tuple[str, int], float] = {}
    for name in graph.topo_order():
        t = timings[name]
        n = counts.get(name, 1)
        if t.chunk_ends and n == len(t.chunk_ends):
            prev = 0.0
            for c, end in enumerate(t.chunk_ends):
                out[(name, c)] = max(end - prev, 0.0)
                prev = max(prev, end)
            sizes[name] = t.chunk_sizes or (1,) * n
            continue
        share = (1,) * n
        if n > 1:
            share = next((sizes[p] for p in graph.producers(name)
                          if len(sizes.get(p, ())) == n), share)
            sizes[name] = share
        if n > 1 and len(t.chunk_times) == n:
            out.update(((name, c), x) for c, x in enumerate(t.chunk_times))
            continue
        total = float(sum(share))
        for c in range(n):
            out[(name, c)] = t.time_s * share[c] / total
    return out


def simulate(placed: Placed, timings: dict[str, OpTiming], steps: int = 6, *,
             events: bool = True, crossing_s: float = 0.0,
             shared: Contention | None = None) -> Timeline:
    """Run ``steps`` steps of ``placed`` (its instances and dependency edges,
    :meth:`Placed.edges <rpeg.plan.lower.Placed.edges>`) with the given op timings; see the
    module doc.
    ``events=False``: the step figures only, no per-instance events (a search needs no
    more; ``busy`` and ``bubbles`` are then empty). ``crossing_s``: what an output takes to
    reach an op on other devices (a new task dispatched there); an op on the same devices
    as its input's producer (the same task, or the next one already queued) waits nothing.
    ``shared``: the devices are a host's cores, and an op computes slower while other
    devices of its host compute too (:class:`Contention`): each running op's rate is
    re-set whenever an op starts or ends on its host.

        >>> from rpeg.graph import Graph, Op, DataEdge
        >>> from rpeg.spec.model import OpKind
        >>> g = Graph("toy", (Op("a", OpKind.FORWARD, outputs=("x",)),
        ...                   Op("b", OpKind.FORWARD, inputs=("x",))),
        ...           (DataEdge("a", "b", "x"),), (), (), ())
        >>> t = {"a": OpTiming((0,), 2.0), "b": OpTiming((1,), 1.0)}
        >>> tl = simulate(Placed(g, responses=1), t, steps=2, crossing_s=0.5)
        >>> [(e.start, e.end) for e in tl.events]
        [(0.0, 2.0), (2.0, 4.0), (2.5, 3.5), (4.5, 5.5)]

    Two devices of one host, each op 1.25x slower while the other device computes:
    ``a@1`` runs beside ``b@0`` for 1.25 s (1 s of the work of each), then alone.

        >>> tl = simulate(Placed(g, responses=1), t, steps=2, crossing_s=0.5,
        ...               shared=Contention(1.25, 2))
        >>> [(e.start, e.end) for e in tl.events]
        [(0.0, 2.0), (2.0, 4.25), (2.5, 3.75), (4.75, 5.75)]
    """
    placed = placed.fused()          # the plan's fused stages as one op each, as priced
    graph = placed.graph
    prep = prepared(placed.by_round(), steps)
    durations = chunk_durations(graph, timings, prep.counts)
    num_devices = 1 + max((max(t.devices) for t in timings.values() if t.devices), default=0)

    needs = _needs(tuple(sorted((n, t.devices) for n, t in timings.items())))
    insts = prep.instances                       # in priority order
    need = [needs[op] for op in prep.ops]
    dur = [durations[key] for key in prep.keys]
    waiting = list(prep.waiting)
    dependents = prep.dependents
    ready = [k for k, w in enumerate(waiting) if w == 0]
    busy = 0
    running: list[tuple[float, int]] = []
    arriving: list[tuple[float, int]] = []      # (when its last input arrives, instance)
    at = [0.0] * len(insts)                      # when each instance's inputs are all there
    start = [0.0] * len(insts)
    end = [0.0] * len(insts)
    now = 0.0
    started = 0
    push, pop = heapq.heappush, heapq.heappop
    cores = _Cores(shared, prep.ops, timings) if shared is not None \
        and shared.slowdown != 1.0 else None
    while ready or running or arriving:
        still: list[int] = []           # start what is ready where its devices are free
        for k in ready:
            if need[k] & busy:
                still.append(k)
                continue
            busy |= need[k]
            start[k] = now
            end[k] = e = now + dur[k]
            push(running, (e, k))
            started += 1
            if cores is not None:
                cores.start(k, dur[k], now)
        ready = still
        if cores is not None:
            running = cores.retimed(now, end)
        if not running and not arriving:
            break
        now = running[0][0] if running else math.inf
        if arriving and arriving[0][0] < now:
            now = arriving[0][0]
        fresh = False
        while running and running[0][0] <= now:
            k = pop(running)[1]
            if cores is not None:
                cores.end(k)
            mine = need[k]
            busy &= ~mine
            for nxt in dependents[k]:
                if crossing_s and need[nxt] != mine:
                    t = now + crossing_s
                    if t > at[nxt]:
                        at[nxt] = t
                waiting[nxt] -= 1
                if waiting[nxt] == 0:
                    if at[nxt] > now:
                        push(arriving, (at[nxt], nxt))
                    else:
                        ready.append(nxt)
                        fresh = True
        while arriving and arriving[0][0] <= now:
            ready.append(pop(arriving)[1])
            fresh = True
        if fresh:
            ready.sort()
    if started != len(insts):
        stuck = sorted(str(insts[k]) for k, w in enumerate(waiting) if w > 0)
        raise PlanError(f"the plan's ops must be schedulable step after step, but "
                        f"{', '.join(stuck[:3])} wait on one another (an op reading a model "
                        f"older than the trainer overwrites in place, or a stale reader "
                        f"of a model its trainer shares)",
                        hint="lower the stale stage's staleness, or keep its model unshared")
    ends = [0.0] * steps
    for s, e in zip(prep.step_of, end, strict=True):
        if e > ends[s]:
            ends[s] = e
    events_ = [Event(i, timings[i.op].devices, start[k], end[k])
               for k, i in enumerate(insts)] if events else []
    drain = 1 + max((e.lag for e in graph.version_edges), default=0)
    return _timeline(events_, steps, num_devices, drain, _floor(durations, needs), ends)


@attrs.frozen
class Contention:
    """Devices that are one host's cores (a CPU machine's workers): an op computes
    ``slowdown`` times slower while all ``per_host`` devices of its host compute than while
    it computes alone (they share the last-level cache, memory bandwidth and the cores
    themselves with the control plane: the profile's ``concurrency_slowdown``, measured by
    ``rpeg calibrate``), and in between in proportion to the other devices busy:
    ``factor(k) = 1 + (slowdown - 1) (k - 1) / (per_host - 1)`` with ``k`` of them busy.
    An op on several devices is priced with the whole slowdown already
    (:func:`rpeg.cost.stages.estimate_stage`: its ranks compute side by side): it runs at
    ``slowdown / factor(k)`` of its priced rate, which on a host of two devices is 1.

        >>> c = Contention(1.3, 2)
        >>> c.factor(1), c.factor(2)
        (1.0, 1.3)
    """

    slowdown: float
    per_host: int

    def factor(self, busy: int) -> float:
        if self.per_host <= 1 or busy <= 1:
            return 1.0
        return 1.0 + (self.slowdown - 1.0) * (min(busy, self.per_host) - 1) \
            / (self.per_host - 1)


class _Cores:
    """The running ops' rates on hosts whose devices contend (see :class:`Contention`):
    each op's work left, in seconds alone, and its end at the current rate."""

    def __init__(self, shared: Contention, ops, timings: dict[str, OpTiming]) -> None:
        self.shared = shared
        where = {n: (t.devices[0] // max(shared.per_host, 1) if t.devices else -1,
                     len(t.devices)) for n, t in timings.items()}
        self.host = [where[op][0] for op in ops]
        self.width = [where[op][1] for op in ops]
        self.left: dict[int, float] = {}     # running instance -> work left (s alone)
        self.rate: dict[int, float] = {}
        self.since = 0.0

    def start(self, k: int, work: float, now: float) -> None:
        self._advance(now)
        own = self.shared.slowdown if self.width[k] > 1 else 1.0
        self.left[k], self.rate[k] = work / own, 1.0

    def end(self, k: int) -> None:
        self.left.pop(k, None)
        self.rate.pop(k, None)

    def _advance(self, now: float) -> None:
        for k, r in self.rate.items():
            self.left[k] -= (now - self.since) * r
        self.since = now

    def retimed(self, now: float, end: list[float]) -> list[tuple[float, int]]:
        """The running ops' heap of (end, instance) at their rates from ``now`` on."""
        self._advance(now)
        busy: dict[int, int] = {}
        for k in self.left:
            if self.host[k] >= 0:
                busy[self.host[k]] = busy.get(self.host[k], 0) + self.width[k]
        heap = []
        for k, left in self.left.items():
            slow = self.shared.factor(busy[self.host[k]]) if self.host[k] >= 0 else 1.0
            self.rate[k] = 1.0 / slow
            end[k] = e = now + max(left, 0.0) * slow
            heap.append((e, k))
        heapq.heapify(heap)
        return heap


def floor(graph: Graph, timings: dict[str, OpTiming]) -> float:
    """The busiest device's work of one step: no steady step :func:`simulate` finds for
    these timings is shorter (it is the figure it never reads below), and it needs no
    simulation, nor the placed graph (its generate ops stream the rounds their timings
    price, :meth:`Placed.by_round <rpeg.plan.lower.Placed.by_round>`).

        >>> from rpeg.graph import Graph, Op, DataEdge
        >>> from rpeg.spec.model import OpKind
        >>> g = Graph("toy", (Op("a", OpKind.FORWARD, outputs=("x",)),
        ...                   Op("b", OpKind.FORWARD, inputs=("x",))),
        ...           (DataEdge("a", "b", "x"),), (), (), ())
        >>> floor(g, {"a": OpTiming((0,), 2.0), "b": OpTiming((1,), 1.0)})
        2.0
    """
    n = _priced(graph.ops, timings)
    chunks = {o.name: n for o in graph.ops if o.kind is OpKind.GENERATE and n > 1}
    durations = chunk_durations(graph, timings, chunk_counts(graph, chunks))
    return _floor(durations, _needs(tuple(sorted((n, t.devices) for n, t in timings.items()))))


def _floor(durations: dict[tuple[str, int], float], needs: dict[str, int]) -> float:
    """The largest work of one step on one atom (``needs``: the atoms each op holds)."""
    load: dict[int, float] = {}
    for (op, _), d in durations.items():
        bits = needs.get(op, 0)
        while bits:
            low = bits & -bits
            load[low] = load.get(low, 0.0) + d
            bits ^= low
    return max(load.values(), default=0.0)


def _priced(ops, timings: dict[str, OpTiming]) -> int:
    """The chunks a step's generate ops stream as their timings price them (the most)."""
    return max((len(timings[o.name].chunk_ends) for o in ops
                if o.kind is OpKind.GENERATE and o.name in timings), default=1) or 1


def prepared(placed: Placed, steps: int) -> _Prepared:
    """:meth:`Placed.edges <rpeg.plan.lower.Placed.edges>` of ``steps`` steps as index
    arrays: what :func:`simulate` prices (cached per placed graph, a value hashed once)."""
    key = _edges_key(placed, steps)
    hit = _PREPARED.get(key)
    if hit is not None:
        return hit
    if len(_PREPARED) > 512:
        _PREPARED.clear()
    prep = _PREPARED[key] = _without_collecting(_prepare_uncached, *key)
    return prep


def _edges_key(placed: Placed, steps: int) -> tuple[Placed, int]:
    """(``placed`` cut to what its edges read, ``steps``): only that, and no more lanes than
    chunks (more change no edge), so that fewer distinct graphs are prepared."""
    n = max(placed.chunks, 1)
    return Placed(placed.graph, 0, chunks=n, carry=placed.carry, in_place=placed.in_place,
                  partly=placed.partly, parts=placed.parts,
                  lanes=tuple((op, min(k, n)) for op, k in placed.lanes)), steps


def _without_collecting(f, *args):
    """``f(*args)`` with the cycle collector off: hundreds of thousands of acyclic edge
    tuples, dropped once indexed; the collector walking the compile's heap for each batch
    of them would cost more than the preparation itself."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return f(*args)
    finally:
        if collecting:
            gc.enable()


@attrs.frozen
class Fed:
    """The instances of a few steps of a placed graph and which take whose outputs as Dask
    tasks do (:func:`fed`): what the count of a step's tasks reads
    (:func:`rpeg.plan.tasks.dispatch_per_step`), without the rest :func:`prepared` makes
    for a simulation."""

    step_of: tuple[int, ...]                   # the step of each, in priority order
    fed: tuple[tuple[int, ...], ...]           # by data, versions and stream order
    keys: tuple[tuple[str, int], ...]          # (op, chunk) of each
    counts: dict                               # op -> its chunks a step


_FED: dict[tuple, Fed] = {}


def fed(placed: Placed, steps: int) -> Fed:
    """:class:`Fed` of ``steps`` steps of ``placed``: the instances and ``fed`` edges of
    :func:`prepared`, alike (cached per placed graph, a value hashed once)."""
    key = _edges_key(placed, steps)
    hit = _FED.get(key)
    if hit is None:
        if len(_FED) > 512:
            _FED.clear()
        hit = _FED[key] = _without_collecting(_fed_uncached, *key)
    return hit


def _fed_uncached(placed: Placed, steps: int) -> Fed:
    counts, cells, edges = _indexed(placed, steps)
    return Fed(tuple(s for _, s, _ in cells), _fed_of(len(cells), edges),
               tuple((op, c) for op, _, c in cells), counts)


def _fed_of(n: int, edges: list[tuple]) -> tuple[tuple[int, ...], ...]:
    """Each of ``n`` instances' dependents by data, versions and stream order (those a
    Dask task takes futures of): every edge but an ordering one, or a stream's."""
    out: list[list[int]] = [[] for _ in range(n)]
    order = DepKind.ORDER
    for src, dst, kind, data in edges:
        if kind is not order or data == STREAM:
            out[src].append(dst)
    return tuple(map(tuple, out))


@attrs.frozen
class _Prepared:
    instances: tuple[Instance, ...]            # sorted by priority: step, graph order, chunk
    waiting: tuple[int, ...]                   # dependencies of each
    step_of: tuple[int, ...]                   # the step of each
    dependents: tuple[tuple[int, ...], ...]    # every kind of dependency
    fed: tuple[tuple[int, ...], ...]           # by data, versions and stream order (Dask tasks)
    counts: dict
    ops: tuple[str, ...] = ()                  # the op of each
    keys: tuple[tuple[str, int], ...] = ()     # (op, chunk) of each


_PREPARED: dict[tuple, _Prepared] = {}


def _prepare_uncached(placed: Placed, steps: int) -> _Prepared:
    """The instances and edges of ``steps`` steps of ``placed`` (those of
    :meth:`Placed.edges <rpeg.plan.lower.Placed.edges>`) as index arrays: unrolled with each
    instance named by its index, the instances coming out in priority order."""
    counts, cells, edges = _indexed(placed, steps)
    waiting = [0] * len(cells)
    dependents: list[list[int]] = [[] for _ in cells]
    for src, dst, _, _ in edges:
        waiting[dst] += 1
        dependents[src].append(dst)
    return _Prepared(tuple(Instance(*cell) for cell in cells), tuple(waiting),
                     tuple(s for _, s, _ in cells), tuple(map(tuple, dependents)),
                     _fed_of(len(cells), edges), dict(sorted(counts.items())),
                     tuple(op for op, _, _ in cells), tuple((op, c) for op, _, c in cells))


def _indexed(placed: Placed, steps: int) -> tuple[dict[str, int], list[tuple], list[tuple]]:
    """(each op's chunks, the instances as (op, step, chunk) in priority order, the edges as
    (src, dst, kind, datum)) of ``steps`` steps of ``placed``, each instance named by its
    index."""
    graph = placed.graph
    chunks = {op: placed.chunks for op, _ in placed.lanes}
    parts = dict(placed.parts)               # a pass's parts (the task count's; not priced)
    counts = chunk_counts(graph, chunks, parts)
    first: dict[str, int] = {}                   # each op's first index within a step
    per_step = 0
    for op in graph.topo_order():
        first[op], per_step = per_step, per_step + counts[op]
    _, cells, edges = unroll_edges(
        graph, steps, lambda op, s, c: s * per_step + first[op] + c, chunks,
        carry=dict(placed.carry), lanes=dict(placed.lanes), in_place=placed.in_place,
        partly=dict(placed.partly), parts=parts)
    return counts, cells, edges


@functools.lru_cache(maxsize=4096)
def _needs(placed: tuple[tuple[str, tuple[int, ...]], ...]) -> dict[str, int]:
    """Atoms make device checks cheap: each op holds whole atoms, bits of one integer.
    Each op's devices are a few ascending runs (:func:`_runs`): the runs between any two
    of their ends serve as atoms (a finer partition than the devices' memberships: the
    same conflicts, the same loads, the same sets alike), found without looking at each
    device in Python. (Cached: do not modify the answer.)"""
    runs = {n: _runs(devs) for n, devs in placed}
    cut = {x: i for i, x in enumerate(sorted({x for rs in runs.values() for r in rs
                                             for x in r}))}
    return {n: sum((1 << cut[b]) - (1 << cut[a]) for a, b in rs) for n, rs in runs.items()}


@functools.lru_cache(maxsize=4096)
def _runs(devices: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """(first, last + 1) of each maximal run of consecutive devices among ``devices``, in
    ascending order (none for none)."""
    if not devices:
        return ()
    first, last = devices[0], devices[-1]
    if last - first == len(devices) - 1 and devices == tuple(range(first, last + 1)):
        return ((first, last + 1),)
    ds = np.unique(np.fromiter(devices, np.int64, len(devices)))
    breaks = np.flatnonzero(np.diff(ds) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(ds)]))
    return tuple((int(ds[i]), int(ds[j - 1]) + 1) for i, j in zip(starts, ends, strict=True))


def _atoms(sets: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    sig: dict[int, list[int]] = {}
    for k, devs in enumerate(sorted(sets)):
        for d in devs:
            sig.setdefault(d, []).append(k)
    atoms: dict[tuple[int, ...], list[int]] = {}
    for d, ks in sig.items():
        atoms.setdefault(tuple(ks), []).append(d)
    return [tuple(v) for v in atoms.values()]


def _timeline(events: list[Event], steps: int, num_devices: int, drain: int = 1,
              floor: float = 0.0, ends: list[float] | None = None) -> Timeline:
    """The step figures; ``ends``: each step's last end, when known without ``events``."""
    if ends is None:
        ends = [0.0] * steps
        for e in events:
            ends[e.instance.step] = max(ends[e.instance.step], e.end)
    ends = list(ends)
    for s in range(1, steps):               # a step is complete once every earlier one is
        ends[s] = max(ends[s], ends[s - 1])
    # The last steps run faster than the steady state (nothing of a later step competes
    # for their devices): measure before them. The first steps run faster too (with
    # staleness k the first k + 1 generations wait for no update): measure after 2 (k + 1)
    # of them when there are enough, else over the second half. The schedule may repeat
    # every 2 .. k + 1 steps (steps finishing in pairs, say): the window spans a whole
    # number of every such period.
    last = steps - 1 - max(0, min(drain - 1, steps - 2))
    period = math.lcm(*range(1, max(drain, 1) + 1))
    warm = 2 * drain
    if last - warm >= period:
        w = (last - warm) // period * period
    else:
        w = max(1, (last + 1) // 2)
        if period > 1 and last >= period:
            w = max(period, w // period * period)
    if last >= w:
        lo, hi = ends[last - w], ends[last]
        step_time = (hi - lo) / w
    else:
        lo, hi, step_time = 0.0, ends[-1], ends[-1]
    # A window still inside the fill (two pipelines of nearly equal rate take many steps to
    # use up the slack staleness gives) would read faster than the busiest device allows.
    step_time = max(step_time, floor)
    events.sort(key=lambda e: e.start)          # stable: ties stay in priority order
    return Timeline(tuple(events), steps, step_time, tuple(ends), (lo, hi), num_devices)
