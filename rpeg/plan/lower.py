"""A plan's step graph placed on its devices: the one value (:func:`lower` of the plan's
step graph unfused, without the weight syncs that move nothing, its fusion kept as data,
:attr:`Placed.fusion`) the runtime lays its op calls out from
(``rpeg.runtime.lowering.instances.build_calls``), ``rpeg verify`` checks a run's trace
against (``rpeg.runtime.verify``), the simulator prices (``rpeg.plan.simulate``, lowered by
the passes it prices, :data:`PRICED`: ``Evaluator.placed``; it prices the value's fused view,
:meth:`Placed.fused`, a pure function of the value: the plan's fused stages as one op each,
the graph the cost model times), and the cost model counts a step's calls and tasks from
(``rpeg.plan.tasks.layouts_of``, lowered by :data:`COUNTED`).

    >>> placed = lower(graph, plan, responses=512)                         # doctest: +SKIP
    >>> placed.layout("rollout").devices_of(0), placed.chunks              # doctest: +SKIP
    ((0, 1), 8)

``lower`` runs an ordered list of pure passes (:data:`PASSES`), each adding one thing:

1. ``chunks``: the chunks a step streams (:func:`~rpeg.plan.oplayout.chunks_per_step`: a
   whole number of rounds, a chunk on each block of a generate op side by side);
2. ``layouts``: each op's :class:`~rpeg.plan.oplayout.OpLayout` (its instances' devices,
   :func:`~rpeg.plan.oplayout.op_layout`: a pass on its trainer's ZeRO-3 shards on every
   rank, :func:`~rpeg.plan.oplayout.gathers_in_place`; a weight sync's, the devices of its
   calls, :func:`~rpeg.plan.oplayout.sync_calls`), which ops run per chunk, and which
   split a step's batch over their blocks (:func:`~rpeg.plan.oplayout.split_parts`: an
   instance a part, each reading all its inputs, read whole);
3. ``engine_syncs``: for each trained model, who takes part in its weight sync into vLLM
   engines' own copies (:func:`rpeg.cost.engine_sync.engine_sync_layout`);
4. ``streams``: how each generate op streams its chunks (its data-parallel blocks, the
   steps it carries responses over: :func:`~rpeg.plan.oplayout.stream_of`) and which readers
   read the very replica their writer writes, somewhere: what its instances' dependency
   edges need beside the graph;
5. ``transfers``: each trained model's weight transfers to the copies of it no weight
   sync of the graph fills (:class:`Transfer`, their op :func:`transfer_of`, the
   runtime's exports and loads, sends and receives), whose typed edges are
   :meth:`Placed.transfer_edges`, and each copy's writer after its writer before,
   :meth:`Placed.rewrite_edges`;

what the simulator prices ends there (:data:`PRICED`); the runtime also reads

6. ``replicas``: the copy each op's calls read on each device (:attr:`Placed.reads`,
   :func:`rpeg.plan.copies.copies`' key, the one the cost model prices memory by) and
   every copy on every device (:class:`Resident`: the tensor-parallel block splitting it,
   a vLLM engine's block from its host, whether it is the trained copy), by which the
   runtime keys its op calls and sets up each worker's replicas
   (``rpeg.runtime.lowering.context.RunContext``);
7. ``fills``: each transfer's sending devices and the copies it fills, on which devices
   (:attr:`Transfer.fills`: loaded, or pushed into a vLLM engine's own; read off the
   copies rule, not the replicas, so the task count lowers by :data:`COUNTED` alone);
   their gangs of calls, :meth:`Placed.moves` (a :class:`Move` per version: the exports
   and a load per copy by device, or the receives on the engines' hosts and the sends),
   are what the runtime adds for every version its calls read past the run's first step
   (``rpeg.runtime.lowering.ordering.add_syncs``) and what the task count lays out for a
   steady step (``rpeg.plan.tasks.transfer_gangs``);
8. ``collectives``: the op order that breaks ties in the one order of collectives
   (:attr:`Placed.op_order`, :meth:`Placed.collective_order`, below).

    >>> placed.reads_of("rollout")     # engines on 0-3, the actor on 4-7   # doctest: +SKIP
    {0: 'actor~vllm', 1: 'actor~vllm', 2: 'actor~vllm', 3: 'actor~vllm'}
    >>> placed.transfers[0].fills, placed.replicas[0]                      # doctest: +SKIP
    ((('actor~vllm', 0), ('actor~vllm', 1), ('actor~vllm', 2), ('actor~vllm', 3)),
     Resident(key='actor', device=4, group=(), engine=(), trained=True))

The instances and their typed dependency edges over a run's steps are
:meth:`Placed.edges` (:func:`rpeg.graph.unroll`, the one rule): data edges, version edges
(a reader of version ``s - k`` after its writer), and ordering ones -- a generate op's
chunks in order on each block (``stream``), a carried stream's next step after its last
chunk (``carry``), a writer after the readers of the version before that read the replica
it writes (write after read; a reader sharing it on some of its blocks only, the
``partly`` of :class:`Placed`: its chunks there, which wait for the trainer rather than
the weight sync loading a copy for its other blocks). The runtime takes its calls' data
dependencies, each device's stream order, and each device's version and write-after-read
order from them (``rpeg.runtime.lowering.ordering.order_versions``: a reader after the call
on its device making the copy it reads, among its version edges' writers). The simulator
prices them round by round (:meth:`Placed.by_round`): a round's chunks, one on each block
side by side, as one instance on all the op's devices, the cost model pricing a round as
one chunk of the step's responses -- the instances and edges the runtime runs, a round's
chunks collapsed into one.

    >>> u = placed.edges(steps=3)                                            # doctest: +SKIP
    >>> [str(d.src) for d in u.deps if d.dst == Instance("rollout", 1, 2)]   # doctest: +SKIP
    ['sync_actor@0', 'rollout@1']

The weight transfers' edges (:meth:`Placed.transfer_edges`, over the instances of
:meth:`Placed.edges`): a reader of a trained model also reads the version its writer's
step's transfer makes, a transfer reads its step's trained weights before the next step
writes them, and fills a copy after the readers of the version before; the runtime orders
its transfer calls by them (``rpeg.runtime.lowering.ordering``), whichever copies they
fill. The simulator does not read these edges: the cost model prices a transfer as the
fetch of the op reading the copy it fills (``Evaluator._reload``: a weight sync from the
trainer, in that op's time on its devices, after its trainer), and none where the reader
reads the trained weights in place or on their ZeRO-3 shards -- where no copy of its own
exists (:func:`rpeg.plan.copies.copies`, the copies' memory) and no transfer runs.

A copy's writer comes after the writer of its version before (:meth:`Placed.rewrite_edges`:
a copy has one writer op, its trainer or its model's transfers, so that op's step before);
the runtime orders each device's writes of a copy by them.

The one order of collectives (:meth:`Placed.collective_order`): every device runs its
gangs (a train op's ranks, a tensor-parallel block, a transfer's exports and loads, a
push's sends and receives) in the order of one topological order of the run's instances
over :meth:`Placed.edges`, :meth:`Placed.transfer_edges` and :meth:`Placed.rewrite_edges`
(the transfers that run alone), ties by one key: (step, the op's place in
:attr:`Placed.op_order`, chunk) -- the graph's op order, each transfer's op (where the
graph has no weight sync of that name) just after its trainer (pass 8, ``collectives``)
-- and, of one instance, its gangs in :data:`GANGS`' order: an op's ranks, a transfer's
exports and loads, then its pushes (:meth:`Placed.gang_order`). A device's
order is its share of that one order, so the ranks of every gang meet their collectives
in the same relative order on all their devices
(``rpeg.runtime.lowering.ordering.order_collectives`` chains each device's gangs by it).
The packing of calls into tasks: one :class:`rpeg.plan.packing.Packer` both sides pack by (a
join's task placed by one rule, :meth:`~rpeg.plan.packing.Packer.join`), which the runtime
feeds with its calls and the cost model with its own unrolling (``rpeg.plan.tasks``, whose
module doc lists what the two feeds still differ in).
"""

from __future__ import annotations

import bisect
import functools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from itertools import groupby, repeat
from operator import itemgetter

import attrs

from rpeg.cost.engine_sync import SyncLayout, engine_sync_layout, sync_senders
from rpeg.graph import Dep, DepKind, Graph, Instance, Unrolled, unroll
from rpeg.graph.ids import ReplicaKey, engine_key
from rpeg.graph.order import topological
from rpeg.graph.versions import read_version
from rpeg.plan.copies import copies
from rpeg.plan.oplayout import (
    OpLayout,
    any_in_place,
    chunks_per_step,
    gathers_in_place,
    op_layout,
    reads_in_place_on,
    split_parts,
    stream_of,
    streamed_ops,
    sync_calls,
)
from rpeg.plan.passes import fused_graph
from rpeg.spec.model import OpKind


def transfer_of(model: str) -> str:
    """The op of the weight transfers of trained ``model`` (its backbone): the exports and
    loads, sends and receives the runtime adds; a weight sync of the graph into ``model``
    bears the same name, its transfers and the graph's one instance a step."""
    return f"sync_{model}"


@attrs.frozen
class Transfer:
    """The weight transfers of a trained model to the copies of it no weight sync of the
    graph fills (a reader's second copy, a vLLM engine's own): an instance a step,
    ``op``'s, which reads its trainer's weights of that step and fills the copies with the
    version they make."""

    model: str            # the trained backbone
    trainer: str          # its train op
    op: str               # the transfers' op (transfer_of(model))
    sources: tuple[int, ...] = ()      # the trainer's devices that send (sync_senders)
    # (copy, device) of every copy it fills, by key and device: a reader's off its
    # trainer's devices or split another way (loaded), a vLLM engine's own (pushed)
    fills: tuple[tuple[ReplicaKey, int], ...] = ()


# the gangs of one instance in the one order of collectives (Placed.collective_order):
# an op's ranks, then a weight transfer's exports and loads, then its pushes
RANKS, LOADS, PUSH = "", "sync", "push"
GANGS = (RANKS, LOADS, PUSH)


@attrs.frozen
class Move:
    """One gang of a weight transfer, moving one version of a trained model to the copies
    that read it (:meth:`Placed.moves`): the exports on its sources and a load of each copy
    on each device loading one (``LOADS``), or a receive on each vLLM engine's host and a
    send on each sender (``PUSH``)."""

    model: str                      # the trained backbone
    op: str                         # the transfer's op (Transfer.op)
    version: int                    # the version it makes (-1: any, a steady step's)
    gang: str                       # LOADS or PUSH (GANGS: its place in an instance)
    senders: tuple[int, ...]        # the exports' or sends' devices, by rank
    # (device, a copy it fills there), by device and copy: a load of each, or an engine's
    # receive on its host
    receivers: tuple[tuple[int, ReplicaKey], ...]

    @property
    def devices(self) -> tuple[int, ...]:
        """The devices of its calls in the order the runtime adds them: the exports then a
        load per copy (``LOADS``); the receives then the sends (``PUSH``)."""
        takes = tuple(map(itemgetter(0), self.receivers))
        return self.senders + takes if self.gang == LOADS else takes + self.senders


def read_of(copy, device: int, version: int) -> tuple:
    """A call's read of ``version`` of ``copy`` on ``device``, as a write ordered after it
    finds it (:func:`read_before`)."""
    return copy, device, version


def read_before(copy, device: int, writes: int) -> tuple:
    """The read (:func:`read_of`) that a write of version ``writes`` of ``copy`` on
    ``device`` waits for among the readers its instance writes after (write after read):
    of the version before, of that copy, on that device; so a weight transfer's writes wait
    only on the devices it fills (its loads and receives, :attr:`Move.receivers`). The one
    rule the runtime orders each device's writer by
    (``rpeg.runtime.lowering.ordering.order_versions``) and the cost model finds a weight
    sync's readers by (``rpeg.plan.tasks``, which reads one copy a device: ``copy`` None).

        >>> read_before("actor~vllm", 3, 5) == read_of("actor~vllm", 3, 4)
        True
    """
    return copy, device, writes - 1            # read_of(copy, device, writes - 1)


def push_hosts(lay: SyncLayout) -> tuple[int, ...]:
    """The hosts of the vLLM engines a push into their own copies reaches (every engine
    takes every version: in its group, or loaded in process by a sender), by device."""
    return tuple(sorted(b[0] for b in lay.group + lay.local))


@attrs.frozen
class Resident:
    """One copy of a backbone's weights on one device, as the runtime keys and holds it
    (the key :func:`rpeg.plan.copies.copies` gives the calls reading it there)."""

    key: ReplicaKey
    device: int
    group: tuple[int, ...] = ()      # the tensor-parallel block splitting it (() whole)
    engine: tuple[int, ...] = ()     # a vLLM engine's own copy: the devices its workers span
    trained: bool = False            # the trained copy, on a device of its train op
    serves: str = ""                 # an engine's copy: the generate op whose batching it runs


@attrs.frozen
class Placed:
    """A step graph on its devices (see the module doc); the fields a pass has not set yet
    are empty."""

    graph: Graph
    responses: int                                         # responses a step generates
    layouts: tuple[tuple[str, OpLayout], ...] = ()         # op -> its layout, graph order
    streamed: frozenset[str] = frozenset()                 # ops that run per chunk
    # op -> the parts it splits a step's batch into, one a block (split_parts)
    parts: tuple[tuple[str, int], ...] = ()
    chunks: int = 0                                        # chunks a step streams
    engine_syncs: tuple[tuple[str, SyncLayout], ...] = ()  # trained model -> its sync
    lanes: tuple[tuple[str, int], ...] = ()                # generate op -> blocks streaming
    carry: tuple[tuple[str, int], ...] = ()                # generate op -> steps it carries
    in_place: frozenset[tuple[str, str]] = frozenset()     # (writer, reader) on one replica
    # of those, (writer, reader) sharing it on some of the reader's blocks alone ->
    # (its blocks, those): chunk c on block c mod blocks
    partly: tuple[tuple[tuple[str, str], tuple[int, frozenset[int]]], ...] = ()
    # op -> (device, the copy its calls there read) of each op reading a model
    reads: tuple[tuple[str, tuple[tuple[int, ReplicaKey], ...]], ...] = ()
    replicas: tuple[Resident, ...] = ()                    # every copy, by key and device
    transfers: tuple[Transfer, ...] = ()                   # a trained model's, graph order
    # the ops by which ties in the order of collectives go: the graph's op order, each
    # transfer's op just after its trainer (collective_order)
    op_order: tuple[str, ...] = ()
    # the plan's fused stages (Plan.fusion): data of the value, the graph unfused; its
    # fused view (fused()) is what the simulator prices
    fusion: tuple[tuple[str, ...], ...] = ()
    # the placement of each op but the weight syncs, in graph order: what every pass reads
    placements: tuple[object, ...] = ()

    def layout(self, op: str) -> OpLayout:
        return self._layout_of[op]

    @functools.cached_property
    def _layout_of(self) -> dict[str, OpLayout]:
        """Op -> its layout, derived once (not part of the value)."""
        return dict(self.layouts)

    def reads_of(self, op: str) -> dict[int, ReplicaKey]:
        """Device -> the copy ``op``'s calls there read ({}: it reads no model)."""
        return dict(dict(self.reads).get(op, ()))

    def engine_sync(self, model: str) -> SyncLayout:
        return dict(self.engine_syncs)[model]

    def moves(self, steps: int | None = None, first: int = 0) -> tuple[Move, ...]:
        """The gangs of the weight transfers (:attr:`transfers`) a run of steps
        ``first``..``steps - 1`` runs, in the order the runtime adds their calls: each
        version past ``first`` (a run starts with every copy at that version) that some op
        reads (:func:`~rpeg.graph.versions.read_version`) of a copy a transfer fills (its
        loads, by model and version), then the pushes into vLLM engines' own copies (by
        model and version); ``steps`` None: those of one steady step, every copy filled
        (version -1)."""
        if steps is None:
            return _moves(self.transfers, self.engine_syncs)
        return _moves(self.transfers, self.engine_syncs, self._versions_read(steps, first))

    def _versions_read(self, steps: int, first: int) -> dict[tuple[ReplicaKey, int], set[int]]:
        """(copy, device) -> the versions past ``first`` some op reads of it in a run of
        steps ``first``..``steps - 1``, of each copy a transfer fills."""
        filled = {f for t in self.transfers for f in t.fills}
        needs: dict[tuple[ReplicaKey, int], set[int]] = {}
        for op, at in self.reads:
            o = self.graph.op(op)
            lag = 0 if o.kind is OpKind.TRAIN else self.graph.lag_of(op)
            vs = {v for s in range(first, steps)
                  if (v := read_version(o.kind, s, lag, first)) > first}
            for d, key in at if vs else ():
                if (key, d) in filled:
                    needs.setdefault((key, d), set()).update(vs)
        return needs

    def edges(self, steps: int, horizon: int | None = None) -> Unrolled:
        """The instances (op, step, chunk) of ``steps`` steps and their typed dependency
        edges (see the module doc); ``horizon``: a run of that many steps, whose weight
        syncs of versions nobody reads are left out."""
        return unroll(self.graph, steps, {op: self.chunks for op, _ in self.lanes},
                      carry=dict(self.carry), lanes=dict(self.lanes),
                      in_place=self.in_place, horizon=horizon, partly=dict(self.partly),
                      parts=dict(self.parts))

    def transfer_edges(self, u: Unrolled) -> tuple[Dep, ...]:
        """The typed edges of the weight transfers (:attr:`transfers`) among the instances
        of ``u`` (this graph's :meth:`edges`), each once, in the order the runtime takes
        them: a reader of a trained model also reads the version a transfer of its
        writer's step makes (its writer's, or that of the weight sync it reads: ``VERSION``,
        after the graph's version edges into it); a transfer reads its step's trained
        weights (``VERSION``) before the next step's trainer writes them (``ORDER``), and
        fills a copy after the readers of the version before read it (``ORDER``)."""
        by = {t.trainer: t for t in self.transfers}
        kinds = {o.name: o.kind for o in self.graph.ops}
        into: dict[Instance, list[Instance]] = defaultdict(list)
        for d in u.deps:
            if d.kind is DepKind.VERSION:
                into[d.dst].append(d.src)
        out = []
        for dst, srcs in into.items():
            made = [s for src in srcs for s in (src, *(
                into.get(src, ()) if kinds[src.op] is OpKind.SYNC_WEIGHTS else ()))]
            out += [Dep(Instance(by[s.op].op, s.step), dst, DepKind.VERSION, by[s.op].model)
                    for s in made if s.op in by and Instance(by[s.op].op, s.step) != dst]
        reads = defaultdict(list)          # reader op -> the version edges from a trainer
        for e in self.graph.version_edges:
            if e.writer in by and kinds[e.reader] is not OpKind.SYNC_WEIGHTS:
                reads[e.reader].append(e)
        for i in u.instances:
            t = by.get(i.op)
            if t is not None:
                out.append(Dep(i, Instance(t.op, i.step), DepKind.VERSION, t.model))
                if i.step > 0:
                    out.append(Dep(Instance(t.op, i.step - 1), i, DepKind.ORDER, t.model))
            for e in reads.get(i.op, ()):
                t = by[e.writer]
                v = read_version(kinds[i.op], i.step, e.lag)
                out.append(Dep(i, Instance(t.op, v), DepKind.ORDER, t.model))
        return tuple(dict.fromkeys(out))

    def rewrite_edges(self, u: Unrolled) -> tuple[Dep, ...]:
        """A copy's writer after the writer of its version before (``ORDER``), among the
        instances of ``u`` and their transfers: each copy has one writer op, a trained copy
        its train op, any other the transfers of its model (:attr:`transfers`), so its
        writer of step ``s`` comes after that op's of ``s - 1``, on each device both write
        the copy."""
        by = {t.trainer: t for t in self.transfers}
        out = []
        for i in u.instances:
            t = by.get(i.op)
            if t is not None and i.step > 0:
                out += [Dep(Instance(op, i.step - 1), Instance(op, i.step), DepKind.ORDER,
                            t.model) for op in (t.trainer, t.op)]
        return tuple(out)

    def collective_order(self, u: Unrolled, transfers: Iterable[Instance] = ()
                         ) -> tuple[Instance, ...]:
        """The one order of collectives (see the module doc): the instances of ``u`` (this
        graph's :meth:`edges`) and the weight transfers that run (``transfers``: instances of
        :attr:`Transfer.op`, those whose calls a run has) in one topological order over
        :meth:`edges`, :meth:`transfer_edges` and :meth:`rewrite_edges`, ties by (step, the
        op's place in :attr:`op_order`, chunk). Each device runs its gangs in its share of
        it: one order on every device, so no two ranks of two gangs wait on each other."""
        nodes = tuple(dict.fromkeys((*u.instances, *transfers)))
        into: dict[Instance, list[Instance]] = defaultdict(list)
        for d in (*u.deps, *self.transfer_edges(u), *self.rewrite_edges(u)):
            into[d.dst].append(d.src)        # edges from an instance not in nodes: ignored
        place = {op: n for n, op in enumerate(self.op_order)}
        return topological(nodes, lambda i: into.get(i, ()),
                           key=lambda i: (i.step, place[i.op], i.chunk))

    def gang_order(self, u: Unrolled, transfers: Iterable[Instance] = ()
                   ) -> dict[tuple[Instance, str], int]:
        """(instance, gang) -> its place in the one order of collectives: the instances in
        :meth:`collective_order`, the gangs of one instance in :data:`GANGS`' order (an
        op's ranks, then a transfer's exports and loads, then its pushes)."""
        n = len(GANGS)
        return {(i, g): k * n + r for k, i in enumerate(self.collective_order(u, transfers))
                for r, g in enumerate(GANGS)}

    def fused(self) -> Placed:
        """The fused view of this value: the plan's fused stages (:attr:`fusion`) as one op
        each, on the placement of the first (its graph :func:`rpeg.plan.passes.fused_graph`
        of :attr:`graph`, the graph itself where the plan fuses nothing), lowered from the
        same placements by the passes the simulator prices (:data:`PRICED`): a pure
        function of the value's graph, fusion, placements and responses (set before any
        pass), the graph the cost model times (a fused op's stages back to back, one call).
        :func:`rpeg.plan.simulate.simulate` prices it; the runtime calls the stages one by
        one and packs them into one task (``rpeg.runtime.core.fusion``). A value not
        lowered from placements (built by hand: no :attr:`placements`) is its own view."""
        return self._fused if self.placements else self

    @functools.cached_property
    def _fused(self) -> Placed:
        """:meth:`fused`, derived once (not part of the value)."""
        graph = fused_graph(self.graph, self.fusion)
        by_first = dict(zip((o.stages[0] for o in _placed_ops(self.graph)), self.placements,
                            strict=True))
        return _lowered(graph, self.responses, lambda o: by_first[o.stages[0]], PRICED, (),
                        self.placements if graph is self.graph else None)

    def by_round(self) -> Placed:
        """This placed graph with a generate op's chunks of a round (one on each of its
        blocks, side by side: :func:`~rpeg.plan.oplayout.rounds_of`) as one instance on
        all its devices, the rounds of each block in order: what the simulator prices, the
        cost model pricing a round as one chunk of the step's responses."""
        chunks = max(self.chunks, 1)
        rounds = max((-(-chunks // k) for _, k in self.lanes), default=chunks)
        width = max(1, chunks // rounds)               # chunks a round, one a block
        # a round shares a replica where one of its chunks does
        partly = {pair: frozenset(r for r in range(rounds) if any(
            c % n in blocks for c in range(r * width, min((r + 1) * width, chunks))))
            for pair, (n, blocks) in self.partly}
        # a split pass's parts, one on each block side by side, are one instance too
        return attrs.evolve(
            self, chunks=rounds, lanes=tuple((op, 1) for op, _ in self.lanes), parts=(),
            in_place=self.in_place - {pair for pair, some in partly.items() if not some},
            partly=tuple((pair, (rounds, some)) for pair, some in partly.items()
                         if 0 < len(some) < rounds))


def _moves(transfers: tuple[Transfer, ...], engines: tuple, needs: dict | None = None
           ) -> tuple[Move, ...]:
    """:meth:`Placed.moves` of ``transfers`` (``engines``: :attr:`Placed.engine_syncs`);
    ``needs``: (copy, device) -> the versions the run reads of it, or None: a steady
    step's, every copy filled (version -1)."""
    loads, pushes = [], []
    for t in transfers:
        # fills sorted by (copy, device): a vLLM engine's own copy, pushed, is one run
        engine = engine_key(t.model)
        lo = bisect.bisect_left(t.fills, (engine,))
        hi = bisect.bisect_right(t.fills, (engine, math.inf), lo)
        loaded, pushed_to = t.fills[:lo] + t.fills[hi:], t.fills[lo:hi]
        if needs is None:
            by_version = {-1: loaded} if loaded else {}
            pushed = [-1] if pushed_to else []
        else:
            by_version = defaultdict(list)
            for f in loaded:
                for v in needs.get(f, ()):
                    by_version[v].append(f)
            pushed = sorted(set().union(*(needs.get(f, ()) for f in pushed_to)))
        loads += [Move(t.model, t.op, v, LOADS, t.sources, tuple(sorted(zip(
            map(itemgetter(1), fs), map(itemgetter(0), fs), strict=True))))
            for v, fs in by_version.items()]
        if pushed:
            lay = dict(engines)[t.model]
            hosts = tuple((h, engine) for h in push_hosts(lay))
            pushes += [Move(t.model, t.op, v, PUSH, lay.senders, hosts) for v in pushed]
    return tuple(sorted(loads, key=lambda m: (m.model, m.version))) + tuple(
        sorted(pushes, key=lambda m: m.model))


Placing = Callable[[object], object]         # graph op -> the placement of its stage


def _trainer_and_reader(graph: Graph, model: str | None):
    train = next((o for o in graph.ops if o.kind is OpKind.TRAIN and o.writes_model == model),
                 None)
    reader = next((o for o in graph.ops if o.kind is OpKind.GENERATE
                   and o.reads_model == model), None)
    return train, reader


def chunks(p: Placed, placement_of: Placing) -> Placed:
    return attrs.evolve(p, chunks=chunks_per_step(p.graph, placement_of, p.responses))


def layouts(p: Placed, placement_of: Placing) -> Placed:
    streamed = streamed_ops(p.graph)
    trainers = {o.writes_model: placement_of(o) for o in p.graph.ops
                if o.kind is OpKind.TRAIN and o.writes_model}
    out = []
    for op in p.graph.ops:
        if op.kind is OpKind.SYNC_WEIGHTS:
            train, reader = _trainer_and_reader(p.graph, op.reads_model)
            devices = sync_calls(placement_of(train), placement_of(reader)) \
                if train is not None and reader is not None else ()
            out.append((op.name, OpLayout(devices, everywhere=True, collective=True)))
        else:
            out.append((op.name, _op_layout(op, placement_of(op), trainers.get(op.reads_model),
                                            p.chunks, op.name in streamed, p.responses)))
    return attrs.evolve(p, layouts=tuple(out), streamed=streamed, parts=tuple(
        (op, lay.parts) for op, lay in out if lay.parts))


@functools.lru_cache(maxsize=4096)
def _op_layout(op, place, trainer, chunks: int, streamed: bool, responses: int) -> OpLayout:
    """The layout of ``op`` placed as ``place`` (``trainer``: its model's trainer's
    placement, or None): a pure function of these, so a plan that moves another op finds
    it again, the one instance of its value (the copies' memos keyed by it find it by
    identity)."""
    gathered = gathers_in_place(op, trainer, place, chunks)
    parts = split_parts(op, place, trainer, chunks, streamed, batch=responses)
    return op_layout(op, place, streamed, gathered, parts)


def engine_syncs(p: Placed, placement_of: Placing) -> Placed:
    out = []
    for op in p.graph.ops:
        if op.kind is OpKind.TRAIN and op.writes_model:
            readers = [placement_of(o) for o in p.graph.ops if o.kind is OpKind.GENERATE
                       and o.reads_model == op.writes_model]
            out.append((op.writes_model, engine_sync_layout(placement_of(op), readers)))
    return attrs.evolve(p, engine_syncs=tuple(out))


def streams(p: Placed, placement_of: Placing) -> Placed:
    gens = [(op.name, stream_of(placement_of(op))) for op in p.graph.ops
            if op.kind is OpKind.GENERATE]
    in_place, partly = _shared_replicas(p, placement_of)
    return attrs.evolve(p, lanes=tuple((n, lanes) for n, (lanes, _) in gens),
                        carry=tuple((n, c) for n, (_, c) in gens if c),
                        in_place=in_place, partly=partly)


def _shared_replicas(p: Placed, placement_of: Placing):
    """((writer, reader) whose reader reads, on some device it runs on, the very replica its
    writer writes (:func:`rpeg.graph.unroll.unroll`'s ``in_place``), the copy a call reads
    being :func:`rpeg.plan.copies.copies`' (the runtime's key of it): a train op's weights
    where the reader reads them in place (:func:`~rpeg.plan.oplayout.reads_in_place`, or
    runs on their ZeRO-3 shards, :func:`~rpeg.plan.oplayout.gathers_in_place`; a reader of
    a weight sync so reads its trainer's), a weight sync's copy where it loads it (a device
    of its calls and the reader's), and the weights a weight sync sends where they are (a
    device of its senders and the trainer's); the ``partly`` of :class:`Placed`: a reader
    of trained weights in place on some of its blocks, a copy of its own on the others,
    whose trainer waits for its chunks on the former alone: the write-after-read edges
    the runtime orders each device's writer by, ``rpeg.runtime.lowering.ordering``)."""
    lays = p._layout_of
    behind = {e.reader: e.writer for e in p.graph.version_edges
              if p.graph.op(e.reader).kind is OpKind.SYNC_WEIGHTS}
    out, partly = set(), {}
    for e in p.graph.version_edges:
        writer, reader = p.graph.op(e.writer), p.graph.op(e.reader)
        if OpKind.SYNC_WEIGHTS in (writer.kind, reader.kind) \
                and not _devices(lays[e.writer]).isdisjoint(lays[e.reader].devices):
            out.add((e.writer, e.reader))          # the sync's copy, or what it sends
        if reader.kind is OpKind.SYNC_WEIGHTS:
            continue
        if writer.kind is OpKind.SYNC_WEIGHTS:
            writer = p.graph.op(behind[e.writer]) if e.writer in behind else None
        if writer is None:
            continue
        lay = p.layout(e.reader)
        n = len(lay.blocks) if lay.chunked else 1
        if _gathers(p, writer, reader):
            sharing = frozenset(range(n))
        elif not any_in_place(placement_of(writer), placement_of(reader)):
            continue
        else:                                     # the blocks its chunks read them in place on
            sharing = _sharing(placement_of(writer), placement_of(reader), lay, n)
        if sharing:
            out.add((writer.name, e.reader))     # reads the trained weights where they are
        if 0 < len(sharing) < n:
            partly[(writer.name, e.reader)] = (n, sharing)
    return frozenset(out), tuple(sorted(partly.items(), key=lambda x: x[0]))


@functools.lru_cache(maxsize=4096)
def _devices(lay: OpLayout) -> frozenset[int]:
    """``lay``'s devices as a set (memoised: a layout is asked about in every plan that
    keeps it)."""
    return frozenset(lay.devices)


@functools.lru_cache(maxsize=4096)
def _sharing(writer, reader, lay: OpLayout, n: int) -> frozenset[int]:
    """The blocks of ``lay`` (``n`` of them) on some device of which a reader placed as
    ``reader`` reads the weights its writer placed as ``writer`` writes in place (a pure
    function of the three: a plan that moves another op finds it again)."""
    return frozenset(b for b in range(n)
                     if any(reads_in_place_on(writer, reader, lay.devices_of(b))))


def transfers(p: Placed, placement_of: Placing) -> Placed:
    return attrs.evolve(p, transfers=tuple(
        Transfer(o.writes_model, o.name, transfer_of(o.writes_model)) for o in p.graph.ops
        if o.kind is OpKind.TRAIN and o.writes_model))


def replicas(p: Placed, placement_of: Placing) -> Placed:
    """The copy each op's calls read on each device (:func:`rpeg.plan.copies.copies`), and
    every copy on every device (:class:`Resident`): split over the tensor-parallel block of
    the calls reading it there (one layout a copy: a reader splitting it another way reads
    a copy of its own), a vLLM engine's own on its host spanning the engine's block, the
    trained copy on its train op's devices."""
    held = copies(p, placement_of)
    homes = {o.writes_model: frozenset(placement_of(o).devices) for o in p.graph.ops
             if o.kind is OpKind.TRAIN and o.writes_model}
    found: dict[tuple[ReplicaKey, int], Resident] = {}
    for op, at in held.reads.items():       # the trainer first, then its readers in order
        lay = p.layout(op)
        hosts = {b[0]: b for b in lay.blocks} if lay.per_block else {}
        for d, group in lay.members(p.chunks):
            key = at[d]
            if (key, d) not in found:
                found[(key, d)] = Resident(key, d, group, hosts.get(d, ()) if key.engine
                                           else (), d in homes.get(key, ()),
                                           op if key.engine else "")
    return attrs.evolve(
        p, reads=tuple((op, tuple(sorted(at.items()))) for op, at in held.reads.items()),
        replicas=tuple(found[k] for k in sorted(found)))


def fills(p: Placed, placement_of: Placing) -> Placed:
    """Each weight transfer's sending devices (the trainer's,
    :func:`~rpeg.cost.engine_sync.sync_senders`) and every copy it fills: a copy of its
    model some op reads (:func:`rpeg.plan.copies.copies`) off the trainer's devices, or on
    them but split another way, or a vLLM engine's own -- every copy of :attr:`Placed.replicas`
    that is not the trained one, by key and device."""
    if not p.transfers:
        return p
    held = copies(p, placement_of)
    out = []
    for t in p.transfers:
        place = placement_of(p.graph.op(t.trainer))
        read = tuple(r for r in (_read_by_key(b, t.model, p.graph) for b in held.backbones)
                     if r)
        out.append(Transfer(t.model, t.trainer, t.op,
                            sync_senders(place.devices, place.tp, place.zero),
                            _filled(read, t.model, place)))
    return attrs.evolve(p, transfers=tuple(out))


@functools.lru_cache(maxsize=1024)
def _read_by_key(part, model: str, graph: Graph) -> tuple:
    """(copy, the devices reading it) of the ops of one backbone's copies
    (:class:`rpeg.plan.copies.BackboneCopies`) reading ``model``, of ``graph`` (whose ops
    the part's are): a pure function of the three, memoised (the part by its identity,
    which the memo keeps alive: bounded)."""
    if not part.reads:
        return ()
    model_of = _model_of(graph)
    if all(model_of.get(op) == model for op in part.reads):
        # all its ops read the model: every key they read, where some reads it
        return tuple((k, frozenset(ds)) for k, ds in part.firsts.items() if ds)
    at_key: dict[ReplicaKey, set[int]] = {}       # copy -> the devices reading it
    for op, at in part.reads.items():
        if model_of.get(op) != model:
            continue
        keys = set(at.values())
        if len(keys) == 1:
            at_key.setdefault(keys.pop(), set()).update(at)
            continue
        for k, grp in groupby(sorted(at.items(), key=itemgetter(1)), itemgetter(1)):
            at_key.setdefault(k, set()).update(map(itemgetter(0), grp))
    return tuple((k, frozenset(ds)) for k, ds in at_key.items())


@functools.lru_cache(maxsize=64)
def _model_of(graph: Graph) -> dict[str, str | None]:
    """Op of ``graph`` -> the model it reads (read-only: shared between callers)."""
    return {o.name: o.reads_model for o in graph.ops}


@functools.lru_cache(maxsize=1024)
def _filled(read: tuple, model: str, place) -> tuple[tuple[ReplicaKey, int], ...]:
    """(copy, device) of every copy a transfer of trained ``model`` (its trainer placed as
    ``place``) fills: those ``read`` (:func:`_read_by_key` of each backbone's copies) reads,
    the trained copy off its trainer's devices alone, by key and device."""
    at_key: dict[ReplicaKey, set[int]] = {}
    for pairs in read:
        for key, ds in pairs:
            at_key.setdefault(key, set()).update(ds)
    if model in at_key:                     # the trained copy: off its devices alone
        at_key[model].difference_update(place.devices)
    out: list[tuple[ReplicaKey, int]] = []
    for key in sorted(at_key):
        out += zip(repeat(key), sorted(at_key[key]))
    return tuple(out)


def collectives(p: Placed, placement_of: Placing) -> Placed:
    """The op order by which ties in the one order of collectives go
    (:meth:`Placed.collective_order`): the graph's op order, each transfer's op (one not
    the graph's already) just after its trainer."""
    ops = p.graph.topo_order()
    by = {t.trainer: t.op for t in p.transfers if t.op not in ops}   # else the graph's place
    return attrs.evolve(p, op_order=tuple(x for op in ops for x in (op, by.get(op))
                                          if x is not None))


def _gathers(p: Placed, writer, reader) -> bool:
    """Whether ``reader`` runs on its trainer ``writer``'s ZeRO-3 shards, on every rank
    (its layout, :func:`~rpeg.plan.oplayout.gathers_in_place`)."""
    return writer.kind is OpKind.TRAIN and reader.kind is not OpKind.TRAIN \
        and p.layout(reader.name).everywhere


# what the simulator prices (rpeg.plan.evaluate.Evaluator.placed), then what the runtime
# also reads: its replicas, what its transfers fill and its order of collectives
PRICED = (chunks, layouts, engine_syncs, streams, transfers)
PASSES = PRICED + (replicas, fills, collectives)
# what the task count reads (rpeg.plan.tasks.layouts_of): each op's layout and the weight
# transfers' gangs (Placed.moves); the fills read the copies rule, not the replicas pass
COUNTED = (chunks, layouts, engine_syncs, transfers, fills)


def lower(graph: Graph, plan, responses: int, placement_of: Placing | None = None, *,
          passes: tuple[Callable, ...] = PASSES) -> Placed:
    """``graph`` (the plan's step graph, its ops unfused: ``plan_graph(..., fused=False)``)
    placed by ``plan``: each op on its stage's placement (``placement_of``: op -> placement,
    where a caller checks them; else the plan's placement of the op's first stage), the
    plan's fusion kept as data (:attr:`Placed.fusion`, priced through :meth:`Placed.fused`);
    ``responses``: those a step generates. The one value the simulator, the runtime's
    lowering and ``rpeg verify`` take. ``passes``: the first of :data:`PASSES` a caller
    needs (the simulator's, :data:`PRICED`; a search pricing each proposal's calls needs
    only their layouts and chunks), or :data:`COUNTED`."""
    assert passes in (PASSES[:len(passes)], COUNTED), \
        "passes run in order, each on those before"
    placement_of = placement_of or (lambda o: plan.placement(o.stages[0]))
    return _lowered(graph, responses, placement_of, passes,
                    plan.fusion if plan is not None else ())


def _lowered(graph: Graph, responses: int, placement_of: Placing, passes: tuple[Callable, ...],
             fusion: tuple[tuple[str, ...], ...], at: tuple | None = None) -> Placed:
    """:func:`lower`, its fusion given (``at``: the placements of its ops, when known)."""
    at = at or _placements(graph, placement_of)
    if at is None:                       # an op without a placement: as the passes find it
        p = Placed(graph, responses, fusion=fusion)
        for step in passes:
            p = step(p, placement_of)
        return p
    # the passes are pure functions of the graph, the responses and the placements of its
    # ops: what each prefix of them made is kept, so the memory walk, the simulator and the
    # task count lowering the same plan share the passes they have in common (the value's
    # key, its placements' tuple, hashed once a call: the prefixes are looked up under it)
    base = (id(graph), responses, at, fusion)
    made = _LOWERED.get(base)
    if made is None:
        if len(_LOWERED) > 256:            # some 8 prefixes each: bounded
            _LOWERED.clear()
        made = _LOWERED[base] = {}
    p = None
    for n in range(len(passes), 0, -1):
        p = made.get(passes[:n])
        if p is not None:
            break
    else:
        n, p = 0, Placed(graph, responses, fusion=fusion, placements=at)
    for k in range(n, len(passes)):
        p = made[passes[:k + 1]] = passes[k](p, placement_of)
    return p


# (id of the graph, responses, the placements of its ops) -> passes run -> the placed graph
# (which holds the graph: its id names no other while the entry is kept)
_LOWERED: dict[tuple, dict[tuple, Placed]] = {}


def _placements(graph: Graph, placement_of: Placing) -> tuple | None:
    """The placement of each op of ``graph`` but its weight syncs (the ops the passes ask
    ``placement_of`` about, :func:`_placed_ops`); None if one has none, or its check refuses
    it (the passes then raise what they raise)."""
    try:
        return tuple(placement_of(o) for o in _placed_ops(graph))
    except Exception:  # noqa: BLE001 — refused as the passes find it, not here
        return None


def _placed_ops(graph: Graph):
    """The ops of ``graph`` with a placement of their own: all but its weight syncs."""
    return (o for o in graph.ops if o.kind is not OpKind.SYNC_WEIGHTS)


__all__ = ["COUNTED", "GANGS", "LOADS", "PASSES", "PRICED", "PUSH", "RANKS", "Move", "Placed",
           "Resident", "Transfer", "chunks", "collectives", "engine_syncs", "fills", "layouts",
           "lower", "push_hosts", "replicas", "streams", "transfer_of", "transfers"]
