"""What a steady step asks of the control plane: the op calls the runtime lays a plan's
instances out as, the Dask tasks its fusion packs them into, and the futures those take.

    >>> from rpeg.graph import Graph, Op, DataEdge
    >>> from rpeg.spec.model import OpKind
    >>> g = Graph("toy", (Op("a", OpKind.FORWARD, outputs=("x",)),
    ...                   Op("b", OpKind.FORWARD, inputs=("x",), outputs=("y",)),
    ...                   Op("c", OpKind.FORWARD, inputs=("y",))),
    ...           (DataEdge("a", "b", "x"), DataEdge("b", "c", "y")), (), (), ())
    >>> one = {n: OpLayout((0,)) for n in "abc"}
    >>> dispatch_per_step(g, one).tasks
    1
    >>> d = dispatch_per_step(g, {"a": OpLayout((0,)), "b": OpLayout((1,)), "c": OpLayout((1,))})
    >>> d.calls, d.tasks, d.args
    (3, 2, 1)

The calls lie on their devices as :func:`rpeg.plan.oplayout.op_layout` says (the layout the
runtime lays its calls out by); a weight sync's as the runtime's transfers of its model
(:func:`transfer_gangs`: the placed graph's :meth:`~rpeg.plan.lower.Placed.moves`, which
the runtime adds its calls by: a gang of exports and loads to the copies its transfer
fills, and one of receives and sends into vLLM engines' own copies), a trained model's
transfers the graph has no weight sync for under an op of their own, after the step's
calls. The calls pack into tasks by
:class:`rpeg.plan.packing.Packer` (the runtime's fusion packs its calls by it), fed with
instances: a call's dependencies are the tasks of the first ranks of the instances it
reads, and a gang of ``JOIN_MIN`` ranks or more waits through one join call
(``rpeg.runtime.lowering.joins``), a task of its own by :meth:`Packer.join
<rpeg.plan.packing.Packer.join>`, the rule the runtime's fusion places its join calls by,
on the gang's first device, where the gang reads its inputs. Nothing of a step in flight
counts as finished (the runtime submits a step ahead), so this is the count with the least
fusion. The futures counted are those of data, version and stream edges, and for each
call of a gang waiting for the gangs before, one a gang before it
(:func:`~rpeg.cost.control.gangs_before`, by which the runtime chains each device's gangs
in the one order of collectives): in a steady step, one on every member's device, the
step before's, each rank standing for a device of its own (a weight sync's gang with an
export and a load on one device counts two there, where the runtime waits for the one
call before them); the runtime passes a few more ordering ones.

Both sides feed the Packer one way, :meth:`Packer.feed <rpeg.plan.packing.Packer.feed>`:
units (:class:`~rpeg.plan.packing.Unit`), each a call's or an instance's calls with the
units it depends on and whether another device reads it; the Packer places an instance's
calls, a gang's ranks (through a join where ``JOIN_MIN`` or more) and a read elsewhere alike
for each. The runtime's unit is one call (its dependencies: every data and ordering edge,
read elsewhere where a consumer runs on another device); the count's, one instance, its
devices at once (:class:`_Feed`: its dependencies the instances' data, version and stream
edges, a generate op's chunks in order on each of its blocks); an instance fed at once
packs as its calls fed one by one (``tests/plan/test_packing.py``). Which reads end a task
says :func:`~rpeg.plan.packing.is_read_elsewhere`, the fusion's rule too, asked of the
devices the calls waiting for an instance read on: a data reader's first two, or a large
gang's join's one, and those of a writer ordered after the readers of the replica it writes
(write after read, the placed graph's ``in_place`` and ``partly``: :func:`shared_of`, the
pairs :func:`rpeg.graph.unroll.write_after_read` says, by which the placed graph orders the
runtime's calls; a weight sync only where it fills a copy on the instance's first device:
:func:`rpeg.plan.lower.read_before`, by which the runtime matches a write to the reads on
its device, asked with the copy left out, one copy a device). An instance's reading
devices (its first two, or its join's) and a gang's ranks on its first device are no
rule of the runtime, whose calls each have one device: they are the count's unit, an
instance's devices cut to what the Packer asks of them (whether its readers run on one
device, and which, :func:`~rpeg.plan.packing.is_read_elsewhere`; which of its ranks share
its first device's task), so that an instance feeds the Packer in the time of one call.
Where a gang has a join and which of its calls wait for the gang before are
:func:`rpeg.cost.control.join_of` and :func:`~rpeg.cost.control.waiting_before`, the
functions the runtime makes and orders its gangs by (``tests/plan/test_gang_rules.py``).
``tests/plan/test_tasks.py`` checks the counts equal to the runtime's fusion over split
plans scaled past ``JOIN_MIN`` ranks, with vLLM weight syncs or not (a property test), at
64 devices, and on the shipped plans' shapes on GH200 clusters.
"""

from __future__ import annotations

import bisect
import functools
from itertools import chain
from operator import itemgetter

import attrs

from rpeg.cost.control import Dispatch, gangs_before, join_of, waiting_before
from rpeg.graph import Graph
from rpeg.graph.unroll import write_after_read
from rpeg.plan.lower import COUNTED, Placed, lower, read_before, read_of, streams, transfer_of
from rpeg.plan.oplayout import OpLayout
from rpeg.plan.packing import Packer, is_read_elsewhere
from rpeg.plan.simulate import OpTiming, fed
from rpeg.spec.model import OpKind


def steady_step(graph: Graph, layouts: dict[str, OpLayout], chunks: int, steps: int,
                warm: bool = True):
    """(the unrolled graph, the steady step of it whose dispatch is counted). ``warm``: a
    step whose inputs come from steady steps, to pack the steps before it first; else the
    first step all of whose inputs are unrolled (what it reads, lag + 1 back, is there),
    one step less to unroll for a step packed alone."""
    # its generate ops' chunks streamed in order on each of their blocks, as the runtime
    # orders them (chunk c on block c mod blocks, after chunk c - blocks)
    streamed = Placed(graph, 0, chunks=chunks, lanes=tuple(
        (o.name, len(laid_out(layouts[o.name])) if o.name in layouts else 1)
        for o in graph.ops if o.kind is OpKind.GENERATE), parts=tuple(
        (op, lay.parts) for op, lay in sorted(layouts.items()) if lay.parts))
    # a step far enough in for its inputs to come from steady steps (lag + 2 back), and
    # the steps after it that read its outputs (lag + 1 on)
    lag = max((e.lag for e in graph.version_edges), default=0)
    last = min(steps // 2, lag + 2)
    if not warm and last == lag + 2:
        last = lag + 1
    return fed(streamed, last + lag + 2), last


def dispatch_per_step(graph: Graph, layouts: dict[str, OpLayout], chunks: int = 1,
                      steps: int = 6, together: tuple[tuple[str, ...], ...] = (),
                      replay: bool = False, shared: tuple = ()) -> Dispatch:
    """The calls, tasks and futures of one steady step of ``graph`` laid out by ``layouts``
    (op name -> :class:`OpLayout`), its generate ops streaming ``chunks`` chunks a step;
    ``together``: the plan's fused stages, whose calls of a chunk share a task;
    ``shared``: which readers share their writer's replica (:func:`shared_of`), whose
    writer the runtime orders after them.

    The steps before the steady one are packed only where the steady step could tell: it
    reads them through the tasks of the instances it takes inputs from, and tasks of
    another step are never open to its calls, so only which of those instances share a
    task matters. An instance of a gang (a collective on several devices) is read through
    its first rank's task, which the gang started for itself: a task no other instance is
    read through. So where the steady step reads only gangs of the steps before (the
    train ranks and weight syncs it reads across steps), each stands for a task of its
    own and the steady step is packed alone; elsewhere (or with ``replay``) the steps
    before are packed first, as the runtime does."""
    prep, last = steady_step(graph, layouts, chunks, steps, warm=replay)
    before = _rows(prep, last)[1]
    alone = not replay and all(_gang(layouts, prep.keys[i]) for i in before)
    if not (alone or replay):                    # the steps before packed first
        prep, last = steady_step(graph, layouts, chunks, steps)
    feed = _Feed.of(graph, layouts, shared)
    task: dict[int, int] = {}                    # instance -> the task of its first rank
    pack = Packer(together)

    def batch(step: int) -> tuple[int, int, int]:
        """Pack one step's calls, as the runtime does when the step enters its window:
        (calls, tasks, futures)."""
        first = len(pack.waits)
        units, calls, order = feed.units(prep, step)
        pack.feed(units, task)
        if step < last:                 # only the steady step's futures are counted
            return calls, len(pack.waits) - first, order
        return calls, len(pack.waits) - first, sum(map(len, pack.waits[first:])) + order

    if alone:                                        # each read through a task of its own
        task.update((i, ("before", i)) for i in before)
    else:
        for step in range(last):                     # the tasks the step's inputs come from
            batch(step)
    calls, tasks, args = batch(last)
    return Dispatch(devices_used(tuple(layouts.values())), calls, tasks, args)


@attrs.frozen
class _Feed:
    """What a step of a graph laid out by some layouts submits to the Packer, unit by unit
    (:meth:`units`), with what of it is the same at every step derived once (:meth:`of`)."""

    laid: dict           # op -> :func:`laid_out` of its layout
    alone_at: dict       # op -> :func:`_reading` of its layout
    # reader op -> (its writer, its blocks' chunks the writer waits for (None: all), per
    # chunk whether the writer's writes wait for its reads (None: all, :func:`_waited`))
    war: dict
    extra: list          # (trainer or None, the gangs of a transfer no op of the graph makes)
    extra_calls: int     # the calls of those gangs
    extra_order: int     # the futures ordering them

    @classmethod
    def of(cls, graph: Graph, layouts: dict[str, OpLayout], shared: tuple) -> _Feed:
        """The feed of ``graph`` laid out by ``layouts`` (``shared``: of
        :func:`shared_of`)."""
        # a trained model's transfers the graph has no weight sync for (a copy its readers
        # read beside a sharded trainer): their gangs after the step's calls, as the
        # runtime adds them, after their trainer
        trainer_of = {transfer_of(o.writes_model): o.name for o in graph.ops
                      if o.kind is OpKind.TRAIN and o.writes_model}
        ops = {o.name for o in graph.ops}
        extra = [(trainer_of.get(op), lay.gangs) for op, lay in layouts.items()
                 if op not in ops and lay.gangs]
        each = [gang_calls(len(g)) for _, gangs in extra for g in gangs]
        return cls(
            # by (op, chunk): each instance's devices, those reading its inputs (the first
            # two, or a large gang's join's: another device reads the output of an
            # instance's first rank when it runs there), whether it is a gang, and its
            # ranks on its first device; looked up per layout, not per instance
            {op: laid_out(lay) for op, lay in layouts.items()},
            # by (op, chunk): the one device reading its inputs, or None where two do
            {op: _reading(lay) for op, lay in layouts.items()},
            # a weight sync writes the copies on the devices it fills alone: its writes
            # wait for the reads there, and for no reader elsewhere
            {reader: [(w, some, _waited(layouts[reader], layouts[w].fills)
                       if layouts[w].gangs else None) for w, some in writers]
             for reader, writers in _write_after_read(graph, shared).items()},
            extra, sum(n for n, _ in each), sum(o for _, o in each))

    def units(self, prep, step: int) -> tuple[list[tuple], int, int]:
        """(each instance of ``step`` of the prepared graph as the Packer takes it, the
        fields of a :class:`~rpeg.plan.packing.Unit` in order (its index as the key, its
        devices, the step, chunk and op, the instances whose outputs it takes, whether it
        is a gang, whether another device reads it, its ranks read on its first device,
        not a join), a weight sync as one unit a gang, the first named and read; the
        step's calls; the futures ordering its gangs)."""
        laid, alone_at, war = self.laid, self.alone_at, self.war
        # by op, each chunk's layout and reading device at the chunk's own index (no modulo
        # an instance, nor a reader)
        laid_at = {op: _cycled(at, prep.counts.get(op, len(at))) for op, at in laid.items()}
        reading = {op: _cycled(one, prep.counts.get(op, len(one)))
                   for op, one in alone_at.items()}
        calls, order = self.extra_calls, self.extra_order
        out = []
        made: dict[str, int] = {}                 # op -> its last instance
        for k, op, chunk, inputs, readers in _rows(prep, step)[0]:
            ds, _, gang, at_head, gangs = laid_at[op][chunk]
            head = ds[0]
            # where the calls waiting for it read it: its readers (one device each, or None
            # for two), and the writers ordered after it (their instance: chunk 0)
            waiting = []
            for reader, rc in readers:
                waiting.append(reading[reader][rc])
            if op in war:
                for writer, some, reads in war[op]:
                    if (some is None or chunk % some[0] in some[1]) \
                            and (reads is None or reads[chunk % len(reads)]):
                        waiting.append(alone_at[writer][0])
            elsewhere = is_read_elsewhere(head, waiting)
            if gangs:                             # a weight sync's gangs, one by one,
                for g in gangs:                   # read through the first's first rank
                    n, o = gang_calls(len(g))
                    calls, order = calls + n, order + o
                    out.append((k, g, step, chunk, op, inputs, True, elsewhere, (0,), False))
                    k, elsewhere = None, False
                continue
            if gang:                              # the ranks start together
                n, o = gang_calls(len(ds))
                calls, order = calls + n, order + o
            else:                                 # a call on each device
                calls += len(ds)
            made[op] = k
            out.append((k, ds, step, chunk, op, inputs, gang, elsewhere, at_head, False))
        for trainer, gangs in self.extra:         # after the step's calls, their trainer
            inputs = (made[trainer],) if trainer in made else ()
            for g in gangs:
                out.append((None, g, step, 0, "", inputs, True, False, (0,), False))
        return out, calls, order


@functools.lru_cache(maxsize=1024)
def gang_calls(ranks: int) -> tuple[int, int]:
    """(the calls of a gang of ``ranks`` ranks, the futures ordering it): its ranks and its
    join, where it has one (:func:`~rpeg.cost.control.join_of`), and, for each of its calls
    waiting for the gang before (:func:`~rpeg.cost.control.waiting_before`), one future a
    gang before it (:func:`~rpeg.cost.control.gangs_before`): in a steady step, the step
    before's last gang on every member's device, another call on each (memoised by the
    ranks: the count asks of every gang it feeds)."""
    on = range(ranks)                     # the ranks' calls, standing for their devices
    join = join_of(on)
    return ranks + (join is not None), \
        len(waiting_before(on, join)) * len(gangs_before(on, {d: d for d in on}))


def _write_after_read(graph: Graph, shared: tuple) -> dict[str, list]:
    """Reader op -> (the writer op whose next write waits for its chunks, None or
    (blocks, those blocks whose chunks it waits for)) of each write-after-read edge of the
    placed graph whose readers share the replica their writer writes (``shared``:
    (``in_place``, ``partly``) of :func:`shared_of`): the ordering edges
    :func:`rpeg.graph.unroll.unroll` makes by :func:`~rpeg.graph.unroll.write_after_read`,
    found without unrolling: a reader read by its writer on another device ends its task,
    as a call the runtime orders a writer after."""
    if not shared or not shared[0]:
        return {}
    kinds = {o.name: o.kind for o in graph.ops}
    return {reader: [(w, some) for _, w, some in edges] for reader, edges in
            write_after_read(kinds, graph.version_edges, shared[0], dict(shared[1])).items()}


def _gang(layouts: dict[str, OpLayout], key: tuple[str, int]) -> bool:
    """Whether instance ``key`` (op, chunk) is a gang: a collective on several devices."""
    lay = layouts[key[0]]
    return lay.collective and len(lay.devices_of(key[1])) > 1


def relabelled(layouts: dict[str, OpLayout]) -> tuple[tuple[str, OpLayout], ...]:
    """``layouts`` (op -> layout) by op name, their devices renamed 0, 1, ... as they first
    appear: a key for :func:`dispatch_per_step`, which reads a device only as a name
    (where a call runs, whether two calls share a device), so that layouts alike but for
    the devices they use count the same.

        >>> [(op, lay.devices) for op, lay in relabelled({"b": OpLayout((4, 5)),
        ...                                               "a": OpLayout((6, 4), tp=2)})]
        [('a', (0, 1)), ('b', (1, 2))]
    """
    ordered = sorted(layouts.items())
    # each device's new name, as it first appears (dict keeps first insertion order)
    seen: list = []                                  # each op's devices, then its gangs'
    for _, lay in ordered:
        seen.append(lay.devices)
        seen.extend(lay.gangs)
    names = {d: i for i, d in enumerate(dict.fromkeys(chain.from_iterable(seen)))}
    rename = names.__getitem__
    out = []
    for op, lay in ordered:
        devices = tuple(map(rename, lay.devices))
        if lay.gangs or lay.fills:
            gangs = tuple(tuple(map(rename, g)) for g in lay.gangs)
            fills = tuple(map(rename, lay.fills))
        else:
            gangs, fills = lay.gangs, lay.fills
        out.append((op, lay if devices == lay.devices and gangs == lay.gangs
                    and fills == lay.fills
                    else OpLayout(devices, tp=lay.tp, chunked=lay.chunked,   # attrs.evolve's
                                  per_block=lay.per_block, everywhere=lay.everywhere,
                                  collective=lay.collective, gangs=gangs, fills=fills,
                                  parts=lay.parts)))
    return tuple(out)


@functools.lru_cache(maxsize=8192)
def laid_out(lay: OpLayout) -> tuple[tuple, ...]:
    """Per chunk ``c`` of an op laid out as ``lay``, at ``c`` modulo the tuple's length
    (its chunks run on its blocks in turn, all on one block where not streamed): (the
    devices of its instance, :meth:`OpLayout.devices_of`, which the runtime lays its calls
    out by (:meth:`OpLayout.calls`), or (-1,) where it has none; the devices reading its
    inputs, one or two, enough to tell whether all are one device: its first two, or its
    join's alone for a gang that has one (:func:`~rpeg.cost.control.join_of`, by which
    the runtime makes it, ``rpeg.runtime.lowering.joins``); whether it is a gang; its
    ranks on its first device, where a gang; a weight sync's gangs of calls,
    :attr:`OpLayout.gangs`, or ()). Memoised by the layout, whose hash is kept: a search
    lays the same ops out again and again."""
    # chunk c runs where the runtime lays it out, on block c mod blocks where streamed
    blocks = -(-len(lay.devices) // max(1, lay.tp))
    period = max(1, blocks) if lay.chunked and not lay.everywhere else 1
    out = []
    collective, gangs = lay.collective, lay.gangs
    for own in map(lay.devices_of, range(period)):
        ds = own or (-1,)
        # where it reads its inputs: a large gang through its join, on its first device
        if gangs:                     # a weight sync's gangs: read where the first starts
            join = join_of(gangs[0])
            out.append((ds, gangs[0][:2] if join is None else (join,), True, (0,), gangs))
            continue
        gang = collective and len(own) > 1
        join = join_of(own) if gang else None
        out.append((ds, ds[:2] if join is None else (join,), gang,
                    tuple(i for i, d in enumerate(ds) if d == ds[0]) if gang else (), ()))
    return tuple(out)


@functools.lru_cache(maxsize=8192)
def _waited(reader: OpLayout, fills: tuple[int, ...]) -> tuple[bool, ...]:
    """Per chunk as :func:`laid_out` of an op laid out as ``reader``: whether the writes of
    a weight sync filling copies on ``fills`` (its :attr:`OpLayout.fills`) wait for the
    instance's reads on its first device (:func:`rpeg.plan.lower.read_before`: a write
    waits for the reads of the copy it writes on its own device, here one copy a device
    and a steady step's version). Memoised by the layout and the devices: a search lays
    the same ops out again and again."""
    writes = frozenset(map(_write_on, fills))
    return tuple(map(writes.__contains__, map(_read_on, [at[0][0] for at in laid_out(reader)])))


@functools.cache
def _write_on(device: int) -> tuple:
    """The read a weight sync's write on ``device`` waits for (one copy a device, a steady
    step's version): asked of the rule once a device."""
    return read_before(None, device, 1)


@functools.cache
def _read_on(device: int) -> tuple:
    """An instance's read on ``device`` as a write finds it (one copy a device, the version
    before a steady step's write): asked of the rule once a device."""
    return read_of(None, device, 0)


@functools.lru_cache(maxsize=8192)
def _reading(lay: OpLayout) -> tuple:
    """Per chunk as :func:`laid_out`: the one device reading an instance's inputs, or None
    where two do (its devices reading them: one or two, never none)."""
    return tuple(two[0] if two[0] == two[-1] else None for _, two, _, _, _ in laid_out(lay))


_CYCLED: dict[tuple[int, int], tuple] = {}


def _cycled(per_chunk: tuple, chunks: int) -> tuple:
    """``per_chunk`` (chunk ``c`` at ``c`` modulo its length, as :func:`laid_out`) repeated
    to ``chunks`` chunks: each chunk's at its own index. Memoised by the tuple's identity
    (those of :func:`laid_out` and :func:`_reading`, memoised by the layout: a search lays
    the same ops out again and again), not hashing its hundreds of chunks."""
    hit = _CYCLED.get((id(per_chunk), chunks))
    if hit is not None and hit[0] is per_chunk:
        return hit[1]
    out = (per_chunk * -(-chunks // len(per_chunk)))[:max(chunks, len(per_chunk))]
    if len(_CYCLED) > 8192:
        _CYCLED.clear()
    _CYCLED[(id(per_chunk), chunks)] = (per_chunk, out)
    return out


@functools.lru_cache(maxsize=8192)
def _devices(lay: OpLayout) -> frozenset[int]:
    return frozenset(lay.devices)


@functools.lru_cache(maxsize=4096)
def devices_used(layouts: tuple[OpLayout, ...]) -> int:
    """How many devices ``layouts`` use, together (memoised: a search counts the same
    layouts again and again)."""
    if len(layouts) == 1:
        return len(_devices(layouts[0]))
    return len(frozenset().union(*map(_devices, layouts)))


_ROWS: dict[tuple[int, int], tuple] = {}


def _rows(prep, step: int) -> tuple[tuple[tuple, ...], frozenset[int]]:
    """(each instance of ``step`` of the prepared graph, in order: (its index, op, chunk,
    the instances whose outputs it takes, the (op, chunk) of those taking its outputs);
    the instances of steps before that it takes outputs from), cached per prepared graph."""
    hit = _ROWS.get((id(prep), step))
    if hit is not None and hit[0] is prep:
        return hit[1]
    inputs: list[list[int]] = [[] for _ in prep.fed]
    for k, ds in enumerate(prep.fed):
        for d in ds:
            inputs[d].append(k)
    lo = bisect.bisect_left(prep.step_of, step)
    hi = bisect.bisect_right(prep.step_of, step, lo)
    keys = prep.keys
    rows = tuple((k, *keys[k], tuple(inputs[k]),
                  tuple(dict.fromkeys(keys[c] for c in prep.fed[k])))   # readers, once each
                 for k in range(lo, hi))
    out = rows, frozenset(i for k in range(lo, hi) for i in inputs[k] if i < lo)
    if len(_ROWS) > 256:
        _ROWS.clear()
    _ROWS[(id(prep), step)] = (prep, out)
    return out


def layouts_of(pipeline, plan, graph: Graph, timings: dict[str, OpTiming]
               ) -> tuple[dict[str, OpLayout], int, Placed]:
    """Each op's :class:`~rpeg.plan.oplayout.OpLayout` under ``plan`` (``graph``: the plan's
    graph without fusion, whose ops the runtime calls one by one, placed by
    :func:`rpeg.plan.lower.lower`; ``timings``: where a weight sync with no trainer or no
    generate op runs), the chunks a step streams, and the placed graph (for
    :func:`shared_of`). A weight sync's layout carries the gangs of calls the runtime
    moves its model's versions with (:func:`transfer_gangs`); a trained model's transfers
    the graph has no weight sync for lie under their own op (:func:`transfer_of`)."""
    placement_of = _placing(plan)
    placed = lower(graph, plan, pipeline.workload.prompts * pipeline.workload.samples,
                   placement_of, passes=COUNTED)   # layouts, chunks, transfers: all it reads
    out = dict(placed.layouts)
    gangs = transfer_gangs(placed)
    for op in graph.ops:
        if op.kind is not OpKind.SYNC_WEIGHTS:
            continue
        if not out[op.name].devices:
            out[op.name] = OpLayout(timings[op.name].devices, everywhere=True, collective=True)
        moved = gangs.pop(op.reads_model, None)
        if moved:
            out[op.name] = attrs.evolve(out[op.name], gangs=moved[0], fills=moved[1])
    for model, moved in gangs.items():   # no weight sync of the graph: transfers of their own
        home = placement_of(next(o for o in graph.ops if o.writes_model == model)).devices
        out[transfer_of(model)] = OpLayout(tuple(home), everywhere=True, collective=True,
                                           gangs=moved[0], fills=moved[1])
    return out, placed.chunks, placed


def shared_of(placed: Placed, plan) -> tuple:
    """The ``shared`` of :func:`dispatch_per_step` of a plan placed as ``placed`` (what
    :func:`layouts_of` gives): the readers sharing the replica their writer writes, and
    the blocks of a reader sharing it on some alone (:func:`rpeg.plan.lower.streams`): the
    write-after-read edges the runtime's calls wait by."""
    p = streams(placed, _placing(plan))
    return p.in_place, p.partly


def _placing(plan):
    """Graph op -> its placement under ``plan`` (its first stage's)."""
    return lambda o: plan.placement(o.stages[0])


def transfer_gangs(placed: Placed) -> dict[str, tuple[tuple[tuple[int, ...], ...],
                                                     tuple[int, ...]]]:
    """Trained backbone -> (the gangs of calls that move each of its versions, each the
    devices of its calls in the runtime's order: the placed graph's
    :meth:`~rpeg.plan.lower.Placed.moves` of a steady step, every copy its transfer fills
    (:attr:`~rpeg.plan.lower.Transfer.fills`); the devices loading or receiving a copy).
    ``placed``: lowered by :data:`~rpeg.plan.lower.COUNTED`.

        >>> from rpeg.graph import Op
        >>> from rpeg.plan.model import StagePlacement
        >>> P = StagePlacement.of
        >>> from rpeg.spec.model import Engine
        >>> g = Graph("g", (Op("rollout", OpKind.GENERATE, reads_model="actor",
        ...                    stages=("rollout",)),
        ...                 Op("train", OpKind.TRAIN, reads_model="actor",
        ...                    writes_model="actor", stages=("train",))), (), (), ("actor",),
        ...           ("actor",))
        >>> place = {"rollout": P("rollout", (0, 1, 2), dp=3, engine=Engine.VLLM),
        ...          "train": P("train", (0, 1), dp=2, zero=3)}
        >>> transfer_gangs(lower(g, None, 8, lambda o: place[o.name], passes=COUNTED))
        {'actor': (((0, 1, 2, 0, 1),), (0, 1, 2))}
    """
    moves = placed.moves()
    out = {}
    for t in placed.transfers:
        mine = [m for m in moves if m.model == t.model]
        if mine:
            out[t.model] = (tuple(m.devices for m in mine), tuple(sorted(set().union(
                *(map(itemgetter(0), m.receivers) for m in mine)))))
    return out
