"""The weight transfers and ordering edges of a plan's op calls: pure passes over the calls
:func:`rpeg.runtime.lowering.instances.build_calls` lays out, each returning the calls with
what keeps a run exact added, in one ordered list (``PASSES``).

    >>> from rpeg.plan.lower import Transfer
    >>> ctx = Ordering(transfers={"actor": Transfer("actor", "train", "sync_actor")},
    ...                versions={Instance("rollout", 1): (Instance("train", 0),)})  # its edge
    >>> train = OpCall("train/s0", "train", OpKind.TRAIN, 0, 0, model="actor", writes=1)
    >>> gen = OpCall("rollout/s1/c0", "rollout", OpKind.GENERATE, 1, 0, model="actor",
    ...              version=1)
    >>> [c.after for c in order_versions((train, gen), ctx)]    # the reader of v1 after its writer
    [(), ('train/s0',)]
    >>> calls, ctx = lay_out(pipeline, plan, steps=4)                        # doctest: +SKIP
    >>> ordered(calls, ctx) == build_calls(pipeline, plan, steps=4)          # doctest: +SKIP
    True

* ``add_syncs``: an export/load gang (or a send/receive one into a vLLM engine's copy) for
  every version the run reads of a copy a transfer fills: the placed graph's
  (``rpeg.plan.lower.Placed.moves``, the gangs the task count lays out too);
* ``order_versions``: a reader after the writer of its version, a writer after the readers
  of the version before, on the same device: each device's share of the placed graph's
  version and write-after-read edges (``rpeg.plan.lower.Placed.edges``), of its weight
  transfers' (``Placed.transfer_edges``), and a copy's writer after the one before
  (``Placed.rewrite_edges``);
* ``order_streams``: each device's chunks of a generate op in order (the placed graph's
  stream and carry edges, ``rpeg.plan.lower.Placed.edges``);
* ``order_collectives``: one order of the gangs on every device, the placed graph's
  (``Placed.gang_order``);
* ``order_pushes``: an engine on a sending device is loaded by that send, in process, and
  its receive comes after it;
* ``settle``: each call's ordering edges once each, none to itself.

Each pass takes a tuple of frozen :class:`~rpeg.runtime.lowering.calls.OpCall` values and
the lowering's :class:`Ordering` and returns a new tuple; tests check the property each one
establishes after it (``tests/runtime/test_ordering.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import attrs

from rpeg.cost.control import gangs_before, waiting_before
from rpeg.cost.engine_sync import sync_refusal
from rpeg.errors import PlanError
from rpeg.graph import DepKind, Instance, Unrolled
from rpeg.graph.ids import OpId
from rpeg.graph.order import Cycle, topological
from rpeg.graph.unroll import CARRY, STREAM
from rpeg.plan.lower import LOADS, PUSH, Move, Placed, read_before, read_of
from rpeg.runtime.lowering.calls import OpCall, ranks_together
from rpeg.runtime.lowering.joins import join_gang
from rpeg.runtime.lowering.replicas import (
    EXPORT,
    LOAD,
    RECV,
    SEND,
    base_of,
    engine_key,
)
from rpeg.spec.model import OpKind

Calls = tuple[OpCall, ...]


@attrs.frozen
class Ordering:
    """What the passes read besides the calls: each trained backbone's weight transfers
    (the copies they fill, from which devices), the first step of the run, how each engine
    copy is synced, each generate op's stream edges, and the placed graph's version and
    write-after-read edges (instances of the run's steps, numbered from its first)."""

    transfers: dict          # trained backbone -> its Transfer (Placed.transfers)
    first: int = 0           # the run's first step: every replica starts at this version
    engines: dict = attrs.Factory(dict)   # model -> the layout of its engine sync
    streams: dict = attrs.Factory(dict)   # (generate op, chunk) -> (op, chunk, steps back)
    versions: dict = attrs.Factory(dict)  # reader instance -> the instances making its version
    readers: dict = attrs.Factory(dict)   # writer instance -> the readers it writes after
    before: dict = attrs.Factory(dict)    # writer instance -> the writer of its copy's version
                                          # before (the same op's step before)
    steady: int = -1         # a step from which on those edges are the step before's, shifted
    placed: Placed | None = None   # the placed graph (its one order of collectives)
    steps: int = 0           # the run's steps: first..steps - 1
    edges: Unrolled | None = None   # the placed graph's edges the lowering unrolled

    @classmethod
    def of(cls, placed: Placed, first: int = 0, edges: Unrolled | None = None,
           steps: int = 2) -> Ordering:
        """What the passes read of the placed graph the calls were laid out from: its weight
        transfers and engine syncs, the stream and carry edges of its generate ops (step 1
        of ``edges``, its :meth:`Placed.edges <rpeg.plan.lower.Placed.edges>` of two steps
        or more, where a caller has them), and the version and write-after-read edges of a run of steps
        ``first``..``steps - 1``: those of :func:`version_steps` steps, the rest alike."""
        edges = edges or placed.edges(version_steps(placed.graph, steps - first))
        streams = {(d.dst.op, d.dst.chunk): (d.src.op, d.src.chunk, d.dst.step - d.src.step)
                   for d in edges.deps if d.kind is DepKind.ORDER
                   and d.dst.step == 1 and d.data in (STREAM, CARRY)}
        versions, readers = _version_edges(placed, edges, first)
        n = version_steps(placed.graph, steps - first)
        assert edges.steps >= n, "the version edges of the steps unrolled, at least"
        steady = first + _settled(placed.graph) if n < steps - first else -1
        return cls({t.model: t for t in placed.transfers}, first, dict(placed.engine_syncs),
                   streams, versions, readers, _rewrites(placed, edges, first), steady,
                   placed, steps, edges)

    def gang_order(self, transfers) -> dict[tuple[Instance, str], int]:
        """(instance by the run's steps, gang) -> its place in the placed graph's one order
        of collectives over the run's steps (:meth:`Placed.gang_order
        <rpeg.plan.lower.Placed.gang_order>`), ``transfers`` the instances of the weight
        transfers that run."""
        assert self.placed is not None, "the order of collectives is the placed graph's"
        n = self.steps - self.first
        u = self.edges if self.edges is not None and self.edges.steps == n \
            else self.placed.edges(n)            # those unrolled where they are the run's
        order = self.placed.gang_order(
            u, [Instance(i.op, i.step - self.first, i.chunk) for i in transfers])
        return {(_at(i, self.first), g): n for (i, g), n in order.items()}

    def versions_of(self, i: Instance) -> tuple[Instance, ...]:
        """The instances that may make the version instance ``i`` reads."""
        return self._shifted(self.versions, i)

    def readers_of(self, i: Instance) -> tuple[Instance, ...]:
        """The readers writer instance ``i`` writes after."""
        return self._shifted(self.readers, i)

    def before_of(self, i: Instance) -> tuple[Instance, ...]:
        """The writer of the version before of what writer instance ``i`` writes."""
        return self._shifted(self.before, i)

    def _shifted(self, table: dict, i: Instance) -> tuple[Instance, ...]:
        if self.steady < 0 or i.step <= self.steady:
            return table.get(i, ())
        k = i.step - self.steady
        return tuple(Instance(j.op, j.step + k, j.chunk)
                     for j in table.get(Instance(i.op, self.steady, i.chunk), ()))


def _settled(graph) -> int:
    """A step whose version edges, and those of every step after it, are the step
    before's one step on: past the versions read clamped at the first (``read_version``),
    and those the readers of its writes read."""
    return max((e.lag for e in graph.version_edges), default=0) + 2


def version_steps(graph, steps: int) -> int:
    """The steps of a run of ``steps`` whose placed graph's edges tell every version and
    write-after-read edge of it: a settled step's readers, some steps after it, and those
    of the steps before it; all of them in a shorter run."""
    return min(steps, 2 * _settled(graph) + 1)


def _at(i: Instance, first: int) -> Instance:
    """Instance ``i`` of an unrolling from step 0 in a run from step ``first``."""
    return Instance(i.op, i.step + first, i.chunk) if first else i


def _rewrites(placed: Placed, edges: Unrolled, first: int) -> dict:
    """Writer instance -> the writers of its copy's version before (the placed graph's
    :meth:`~rpeg.plan.lower.Placed.rewrite_edges` among ``edges``), by the run's steps."""
    before: dict[Instance, tuple[Instance, ...]] = defaultdict(tuple)
    for d in placed.rewrite_edges(edges):
        before[_at(d.dst, first)] += (_at(d.src, first),)
    return dict(before)


def _version_edges(placed: Placed, edges: Unrolled, first: int) -> tuple[dict, dict]:
    """(reader -> the instances that may make the version it reads, on a device it runs
    on: its version edges' writers and, for a weight sync's, the sync's own writer (a
    sync that moves nothing to the device), then the weight transfers of those writers'
    steps; writer -> the readers its write-after-read edges order it after, or its data
    edges where one stands for both), instances by the run's steps (``edges``' from
    ``first``), the transfers' edges the placed graph's (:meth:`Placed.transfer_edges`)."""
    syncs = {o.name for o in edges.graph.ops if o.kind is OpKind.SYNC_WEIGHTS}
    trainers = {t.trainer for t in placed.transfers}
    transfers = {t.op for t in placed.transfers}
    at = (lambda i: _at(i, first)) if first else (lambda i: i)
    reading = {o.name for o in edges.graph.ops if o.reads_model}
    into: dict[Instance, list[Instance]] = defaultdict(list)
    readers: dict[Instance, list[Instance]] = defaultdict(list)
    for d in edges.deps:
        if d.kind is DepKind.VERSION:
            into[d.dst].append(d.src)
        elif d.kind is DepKind.ORDER and d.data not in (STREAM, CARRY) \
                or d.kind is DepKind.DATA and d.dst.op in trainers and d.src.op in reading:
            # write after read, or a data edge into a trainer where it implies one (the
            # edges keep one of the two)
            readers[at(d.dst)].append(at(d.src))
    # a trained model's weights also reach the copies the graph syncs none to through the
    # transfers of add_syncs: a reader reads such a copy of its version too, a transfer
    # reads its step's trained weights (where the graph syncs none of them), and each
    # orders its writes after the reads of the version before
    sent: dict[Instance, list[Instance]] = defaultdict(list)
    made_by: dict[Instance, Instance] = {}
    for d in placed.transfer_edges(edges):
        if d.kind is DepKind.ORDER:
            readers[at(d.dst)].append(at(d.src))
        elif d.dst.op in transfers and d.src.op in trainers:
            made_by.setdefault(d.dst, d.src)
        else:
            sent[d.dst].append(d.src)
    versions = {}
    for dst, srcs in into.items():
        made = [s for src in srcs for s in (src, *(into.get(src, ()) if src.op in syncs
                                                   else ()))]
        versions[at(dst)] = tuple(at(s) for s in dict.fromkeys(made + sent.get(dst, [])))
    for dst, src in made_by.items():
        versions.setdefault(at(dst), (at(src),))
    return versions, {k: tuple(dict.fromkeys(v)) for k, v in readers.items()}


def _after(c: OpCall, more) -> OpCall:
    """``c`` also waiting for ``more`` (in order), or ``c`` itself if there is none."""
    more = tuple(more)
    return attrs.evolve(c, after=c.after + more) if more else c


def add_syncs(calls: Calls, ctx: Ordering) -> Calls:
    """The calls and the weight transfers' calls of the run: the placed graph's
    :meth:`~rpeg.plan.lower.Placed.moves` (each version of a trained model its calls read
    of a copy its transfer fills, :attr:`Transfer.fills <rpeg.plan.lower.Transfer>`: off
    the trainer's devices, or split another way; or of a vLLM engine's own).

    One weight transfer per (model, version) runs as a collective over every device taking
    part (``gang``): the home devices that hold the weights (``sources``: the first
    tensor-parallel block, or every home device when ZeRO-3 shards the weights, which they
    gather together) and every device loading a copy (the copies there). The first
    source broadcasts the weights, in buckets, to the devices that are not sources.
    A vLLM engine's own copy (an engine key) is pushed instead: per version, the same sources
    send (``SEND``) and every engine hosting a copy receives (``RECV``) in one group
    (``backends.vllm_backend.sync``), but for an engine sharing a device with a source,
    which that source loads in process (``ctx.engines``: model -> the layout of its sync,
    ``rpeg.cost.engine_sync.engine_sync_layout``; one ``sync_refusal`` refuses is a
    PlanError)."""
    assert ctx.placed is not None, "the transfers are the placed graph's"
    out = list(calls)
    for m in ctx.placed.moves(ctx.steps, ctx.first):
        out += _loads(m) if m.gang == LOADS else _pushes(ctx, m)
    return tuple(out)


def _loads(m: Move) -> list[OpCall]:
    """The export and load calls of one version of a model to the copies it fills."""
    v, key = m.version, m.model
    at: dict[int, tuple] = defaultdict(tuple)        # device -> the copies it loads, by key
    for dev, copy in m.receivers:
        at[dev] += (copy,)
    common = dict(op=m.op, kind=OpKind.SYNC_WEIGHTS, step=v - 1,
                  gang=tuple(sorted(set(m.senders) | set(at))), sources=m.senders)
    out = [OpCall(id=OpId.of(f"sync_{key}", v - 1, role=EXPORT, tp_rank=t), device=src,
                  role=EXPORT, model=key, version=v, fills=at.get(src, ()), **common)
           for t, src in enumerate(m.senders)]
    out += [OpCall(id=OpId.of(f"sync_{copy}", v - 1, role=LOAD, device=dev), device=dev,
                   role=LOAD, model=copy, writes=v, fills=at[dev], **common)
            for dev, copy in m.receivers]
    return out


def _pushes(ctx: Ordering, m: Move) -> list[OpCall]:
    """The receive and send calls that push one version of a model into its engines."""
    key, v = m.model, m.version
    why = sync_refusal(ctx.engines[key])
    if why:
        raise PlanError(f"the weight sync of '{key}' must give every rank of its process "
                        f"group a device of its own, and {why}",
                        hint="host the engine on a sending device of the trainer (the "
                             "first of its devices), or on devices of its own")
    hosts = [d for d, _ in m.receivers]
    common = dict(op=m.op, kind=OpKind.SYNC_WEIGHTS, step=v - 1,
                  tp_group=tuple(sorted(set(m.senders) | set(hosts))))
    out = [OpCall(id=OpId.of(f"sync_{engine_key(key)}", v - 1, role=RECV, device=dev),
                  device=dev, role=RECV, model=engine_key(key), writes=v, **common)
           for dev in hosts]                 # every engine takes every version: one group
    out += [OpCall(id=OpId.of(f"sync_{key}", v - 1, role=SEND, tp_rank=t), device=src,
                   role=SEND, model=key, version=v, **common)
            for t, src in enumerate(m.senders)]
    return out


def order_versions(calls: Calls, ctx: Ordering) -> Calls:
    """Each device's share of the placed graph's version and write-after-read edges
    (``ctx.versions``, ``ctx.readers``): a reader after the call on its device that makes
    the version of the copy it reads (a load or receive of a weight sync there, or a rank
    of the trainer whose weights it reads in place); a writer of version v after the calls
    on its device reading v - 1 of the copy it writes (:func:`~rpeg.plan.lower.read_before`),
    and after the writer of v - 1 there
    of the copy it writes (``ctx.before``: the placed graph's
    :meth:`~rpeg.plan.lower.Placed.rewrite_edges`)."""
    trained = ctx.transfers
    on: dict[tuple, list[OpCall]] = defaultdict(list)     # (instance, device) -> its calls
    calls_of: dict = defaultdict(list)                    # instance -> its calls, in order
    instances = [c.instance for c in calls]
    for c, i in zip(calls, instances, strict=True):
        on[(i, c.device)].append(c)
        calls_of[i].append(c)
    place = {c.id: n for n, c in enumerate(calls)}
    read_by: dict = {}       # writer instance -> (model, device, version) -> readers' ids
    makers: dict = {}        # reader instance -> the instances that may make its version

    def readers_of(i) -> dict:
        if i not in read_by:
            out = read_by[i] = defaultdict(list)
            for m in sorted((m for r in ctx.readers_of(i) for m in calls_of[r]),
                            key=lambda m: place[m.id]):
                out[read_of(m.model, m.device, m.version)].append(m.id)
        return read_by[i]

    out = []
    for c, at in zip(calls, instances, strict=True):
        key, dev, more = c.model, c.device, []
        if c.version > ctx.first and base_of(key) in trained:
            made = makers.get(at)
            if made is None:
                made = makers[at] = ctx.versions_of(at)
            w = next((m.id for i in made for m in on.get((i, dev), ())
                      if m.writes == c.version and m.model == key), None)
            if w is None:
                raise PlanError(f"no op makes version {c.version} of '{key}' on device {dev} "
                                f"for '{c.id}'")
            more.append(w)
        if c.writes >= 0:
            v = c.writes
            waits = readers_of(at).get(read_before(key, dev, v), ())
            more += [r for r in dict.fromkeys(waits) if r != c.id]
            more += [m.id for i in ctx.before_of(at) for m in on.get((i, dev), ())
                     if m.writes == v - 1 and m.model == key][:1]
        out.append(_after(c, more))
    return tuple(out)


def order_streams(calls: Calls, ctx: Ordering) -> Calls:
    """Each device's share of a generate op's stream after its share of the instance before
    (``ctx.streams``: the same chunk's or the one before, this step's or, with partial
    rollouts, the step before's)."""
    at = {(c.op, c.step, c.chunk, c.device): c.id for c in calls if not c.role}
    out = []
    for c in calls:
        src = ctx.streams.get((c.op, c.chunk)) if c.kind is OpKind.GENERATE else None
        where = src and (src[0], c.step - src[2], src[1], c.device)
        out.append(_after(c, [at[where]] if src is not None and where in at else []))
    return tuple(out)


def gangs_of(calls: Calls) -> dict[tuple, list[int]]:
    """Gang -> the indices of its calls: the calls that run collectives together (the ranks
    of a data-parallel train op or a tensor-parallel block, a weight transfer's exports and
    loads, a push's sends and receives), two or more."""
    gangs: dict[tuple, list[int]] = defaultdict(list)
    for i, c in enumerate(calls):
        if c.gang:                         # a weight transfer: its exports and loads together
            gangs[(c.op, c.step, 0, LOADS)].append(i)
        elif c.tp_group or ranks_together(c.kind, c.world):
            # an op's ranks (RANKS: no role), or a push's sends and receives
            gangs[(c.op, c.step, c.chunk, PUSH if c.role in (SEND, RECV) else c.role)].append(i)
    return {k: v for k, v in gangs.items() if len(v) > 1}


def order_collectives(calls: Calls, ctx: Ordering) -> Calls:
    """Calls that run collectives together form a gang (:func:`gangs_of`). Each gang waits
    for the union of its members' dependencies, and on every device gangs run in the placed
    graph's one order of collectives (:meth:`Placed.gang_order
    <rpeg.plan.lower.Placed.gang_order>`: a topological order of its instances, ties
    by step, op and chunk; of one instance, a transfer's exports and loads before its
    pushes), so gloo/NCCL collectives never interleave differently on two ranks. A large
    gang waits through one join call instead of copying all that into every member
    (``rpeg.runtime.lowering.joins``)."""
    gangs = gangs_of(calls)
    if not gangs:
        return calls
    out = list(calls)
    joins: dict[tuple, OpCall] = {}
    for key, at in gangs.items():
        ranks = [out[i] for i in at]
        joined = join_gang(ranks)
        if joined is not None:
            joins[key], ranks = joined
        else:
            own = {r.id for r in ranks}
            union = list(dict.fromkeys(d for r in ranks for d in r.deps + r.after
                                       if d not in own))
            ranks = [attrs.evolve(r, after=tuple(d for d in union if d not in r.deps))
                     for r in ranks]
        for i, r in zip(at, ranks, strict=True):
            out[i] = r
    out += joins.values()
    place = ctx.gang_order({c.instance for c in calls if c.role in TRANSFER_ROLES})
    order = sorted(gangs, key=lambda k: place[(calls[gangs[k][0]].instance, k[3])])
    last_on: dict[int, str] = {}
    more: dict[str, list[str]] = defaultdict(list)
    for key in order:
        ranks = [out[i] for i in gangs[key]]
        # every member waits for the previous gang on each member's device: a rank that
        # starts never blocks in a collective whose partner still waits for other work
        before = gangs_before([c.device for c in ranks], last_on)
        for c in waiting_before(ranks, joins.get(key)):
            more[c.id] += before
        for c in ranks:
            last_on[c.device] = c.id
    out = [_after(c, more.get(c.id, ())) for c in out]
    _topo(out)          # an order the calls' own edges contradict: a cycle, refused here
    return tuple(out)


TRANSFER_ROLES = (EXPORT, LOAD, SEND, RECV)      # the calls of a weight transfer


def order_pushes(calls: Calls, ctx: Ordering) -> Calls:
    """A device both sending a version and hosting an engine that takes it hosts an engine
    sharing a sending device, which the send loads in process (``sync_layout``): its
    ``recv`` comes after the ``send`` and only marks the version served."""
    send = {(c.op, c.step, c.device): c.id for c in calls if c.role == SEND}
    return tuple(_after(c, [send[(c.op, c.step, c.device)]] if c.role == RECV
                        and (c.op, c.step, c.device) in send else []) for c in calls)


def settle(calls: Calls, ctx: Ordering) -> Calls:
    """Each call's ordering edges once each, in their first place, none to the call itself."""
    out = []
    for c in calls:
        after = tuple(dict.fromkeys(a for a in c.after if a != c.id))
        out.append(attrs.evolve(c, after=after) if after != c.after else c)
    return tuple(out)


# the passes in the order the lowering runs them: versions are ordered with the syncs in
# place, and the collectives' one order sees every other edge
PASSES: tuple[Callable[[Calls, Ordering], Calls], ...] = (
    add_syncs, order_versions, order_streams, order_collectives, order_pushes, settle)


def ordered(calls: Calls, ctx: Ordering) -> Calls:
    """``calls`` through every pass of ``PASSES``, in order."""
    for run in PASSES:
        calls = run(calls, ctx)
    return calls


def _topo(calls) -> tuple[str, ...]:
    """Call ids in a dependency order; ties go to the earlier call in ``calls``."""
    table = {c.id: c for c in calls}
    try:
        return topological(list(table), lambda i: table[i].deps + table[i].after)
    except Cycle as e:
        raise PlanError(f"the op calls must have no dependency cycle, and {e.stuck[:3]} "
                        "are in one") from None
