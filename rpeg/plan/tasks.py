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
runtime lays its calls out by); a weight sync's on the devices sending and receiving
(:func:`rpeg.plan.oplayout.sync_calls`), as :func:`rpeg.plan.lower.lower` places them. The
calls pack into tasks by :class:`rpeg.plan.packing.Packer` (the runtime's fusion packs its
calls by it), fed with instances: a call's dependencies are the tasks of the first ranks
of the instances it reads, and a gang of ``JOIN_MIN`` ranks or more waits through one join
call (``rpeg.runtime.lowering.joins``), a task of its own by :meth:`Packer.join
<rpeg.plan.packing.Packer.join>`, the rule the runtime's fusion places its join calls by,
on the gang's first device, where the gang reads its inputs. Nothing of a step in flight
counts as finished (the runtime submits a step ahead), so this is the count with the least
fusion. The futures counted are those of data, version and stream edges, and one for each
gang a member's device ran before (the order of collectives); the runtime passes a few
more ordering ones.

What the Packer is fed here still differs from the runtime's feed in three ways, not yet
one function both sides call: the grain (here an instance, a gang's ranks through
:meth:`Packer.gang`; there one call per rank); the dependencies (here the instances' data,
version and stream edges, a generate op's chunks in order on each of its blocks; there
every call's data and ordering edges); and which reads end a task (here a data reader whose
first two devices, or a large gang's join's one, are not the instance's first; there any
call on another device depending on it, ordering ones included).
``tests/plan/test_tasks.py`` checks the counts equal to the runtime's fusion over split
plans scaled past ``JOIN_MIN`` ranks (a property test) and at 64 devices.
"""

from __future__ import annotations

import bisect
import functools

import attrs

from rpeg.cost.control import JOIN_MIN, Dispatch
from rpeg.graph import Graph
from rpeg.plan.lower import PASSES, Placed, lower
from rpeg.plan.oplayout import OpLayout
from rpeg.plan.packing import Packer
from rpeg.plan.simulate import OpTiming, prepared
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
        for o in graph.ops if o.kind is OpKind.GENERATE))
    # a step far enough in for its inputs to come from steady steps (lag + 2 back), and
    # the steps after it that read its outputs (lag + 1 on)
    lag = max((e.lag for e in graph.version_edges), default=0)
    last = min(steps // 2, lag + 2)
    if not warm and last == lag + 2:
        last = lag + 1
    return prepared(streamed, last + lag + 2), last


def dispatch_per_step(graph: Graph, layouts: dict[str, OpLayout], chunks: int = 1,
                      steps: int = 6, together: tuple[tuple[str, ...], ...] = (),
                      replay: bool = False) -> Dispatch:
    """The calls, tasks and futures of one steady step of ``graph`` laid out by ``layouts``
    (op name -> :class:`OpLayout`), its generate ops streaming ``chunks`` chunks a step;
    ``together``: the plan's fused stages, whose calls of a chunk share a task.

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
    # by (op, chunk): each instance's devices, those reading its inputs (the first two, or
    # a large gang's join's: another device reads the output of an instance's first rank
    # when it runs there), whether it is a gang, and its ranks on its first device; looked
    # up per layout, not per instance
    laid = {op: laid_out(lay) for op, lay in layouts.items()}
    task: dict[int, int] = {}                    # instance -> the task of its first rank
    pack = Packer(together)

    def batch(step: int) -> tuple[int, int, int]:
        """Pack one step's calls, as the runtime does when the step enters its window:
        (calls, tasks, futures)."""
        first, calls, order = len(pack.waits), 0, 0
        place, read_elsewhere = pack.place, pack.read_elsewhere
        for k, op, chunk, inputs, readers in _rows(prep, step)[0]:
            at = laid[op]
            ds, _, gang, at_head, gangs = at[chunk % len(at)]
            deps = {task[i] for i in inputs if i in task}
            head = ds[0]
            elsewhere = False
            for reader, rc in readers:
                at = laid[reader]
                two = at[rc % len(at)][1]         # one device or two, never none
                if two[0] != head or two[-1] != head:
                    elsewhere = True
                    break
            if gangs:                             # a weight sync's gangs, one by one
                for g in gangs:
                    calls += len(g)
                    if len(g) >= JOIN_MIN:
                        calls += 1
                        order += len(g)
                        ranks = pack.gang(g, step, {pack.join(deps)}, named=False)
                    else:
                        order += len(g) ** 2
                        ranks = pack.gang(g, step, deps)
                    if k not in task:
                        task[k] = ranks[0]
                        if elsewhere:
                            read_elsewhere(g[0], ranks[0], step, chunk, op)
                continue
            calls += len(ds)
            if gang:                              # the ranks start together
                if len(ds) >= JOIN_MIN:           # waiting through a join, a task of its own
                    calls += 1
                    order += len(ds)              # each member on the gang before it there
                    ranks = pack.gang(ds, step, {pack.join(deps)}, named=False)
                else:                             # each member waits for the gang before
                    order += len(ds) ** 2         # it on each member's device
                    ranks = pack.gang(ds, step, deps)
                for i in at_head:
                    task[k] = ranks[i]
                    if elsewhere:
                        read_elsewhere(head, ranks[i], step, chunk, op)
                continue
            for dev in ds:                        # each call placed after the one before
                gi = place(dev, step, chunk, op, deps, deps)
                if dev == head:
                    task[k] = gi
                    if elsewhere:
                        read_elsewhere(dev, gi, step, chunk, op)
        if step < last:                 # only the steady step's futures are counted
            return calls, len(pack.waits) - first, order
        return calls, len(pack.waits) - first, sum(map(len, pack.waits[first:])) + order

    if alone:                                        # each read through a task of its own
        task.update((i, ("before", i)) for i in before)
    else:
        for step in range(last):                     # the tasks the step's inputs come from
            batch(step)
    calls, tasks, args = batch(last)
    used = {d for lay in layouts.values() for d in lay.devices}
    return Dispatch(len(used), calls, tasks, args)


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
    names = {d: i for i, d in enumerate(dict.fromkeys(
        d for _, lay in ordered for ds in (lay.devices, *lay.gangs) for d in ds))}
    out = []
    for op, lay in ordered:
        devices = tuple(map(names.__getitem__, lay.devices))
        gangs = tuple(tuple(map(names.__getitem__, g)) for g in lay.gangs)
        out.append((op, lay if devices == lay.devices and gangs == lay.gangs
                    else attrs.evolve(lay, devices=devices, gangs=gangs)))
    return tuple(out)


@functools.lru_cache(maxsize=8192)
def laid_out(lay: OpLayout) -> tuple[tuple, ...]:
    """Per chunk ``c`` of an op laid out as ``lay``, at ``c`` modulo the tuple's length
    (its chunks run on its blocks in turn, all on one block where not streamed): (the
    devices of its instance, or (-1,) where it has none; the devices reading its inputs,
    one or two, enough to tell whether all are one device: its first two, or the first
    alone for a gang of ``JOIN_MIN`` ranks or more, which reads them through its join
    there (``rpeg.runtime.lowering.joins``); whether it is a gang; its ranks on its first
    device, where a gang; a weight sync's gangs of calls, :attr:`OpLayout.gangs`, or
    ()). Memoised by the layout, whose hash
    is kept: a search lays the same ops out again and again."""
    tp = max(1, lay.tp)
    period = -(-len(lay.devices) // tp) if lay.chunked and not lay.everywhere else 1
    out = []
    for c in range(max(1, period)):
        own = lay.devices_of(c)
        ds = own or (-1,)
        gang = lay.collective and len(own) > 1
        # where it reads its inputs: a large gang through its join, on its first device
        if lay.gangs:                 # a weight sync's gangs: read where the first starts
            out.append((ds, lay.gangs[0][:1] if len(lay.gangs[0]) >= JOIN_MIN
                        else lay.gangs[0][:2], True, (0,), lay.gangs))
            continue
        out.append((ds, ds[:1] if gang and len(own) >= JOIN_MIN else ds[:2], gang,
                    tuple(i for i, d in enumerate(ds) if d == ds[0]) if gang else (), ()))
    return tuple(out)


_ROWS: dict[tuple[int, int], tuple] = {}


def _rows(prep, step: int) -> tuple[tuple[tuple, ...], frozenset[int]]:
    """(each instance of ``step`` of the prepared graph, in order: (its index, op, chunk,
    the instances whose outputs it takes, the (op, chunk) of those taking its outputs);
    the instances of steps before that it takes outputs from), cached per prepared graph."""
    hit = _ROWS.get((id(prep), step))
    if hit is not None and hit[0] is prep:
        return hit[1]
    inputs: list[list[int]] = [[] for _ in prep.instances]
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
               ) -> tuple[dict[str, OpLayout], int]:
    """Each op's :class:`~rpeg.plan.oplayout.OpLayout` under ``plan`` (``graph``: the plan's
    graph without fusion, whose ops the runtime calls one by one, placed by
    :func:`rpeg.plan.lower.lower`; ``timings``: where a weight sync with no trainer or no
    generate op runs), and the chunks a step streams. A weight sync's layout carries the
    gangs of calls the runtime moves its model's versions with (:func:`transfer_gangs`)."""
    placement_of = lambda o: plan.placement(o.stages[0])          # noqa: E731
    placed = lower(graph, plan, pipeline.workload.prompts * pipeline.workload.samples,
                   placement_of, passes=PASSES[:2])   # layouts, chunks: all a count reads
    out = dict(placed.layouts)
    gangs = transfer_gangs(placed, placement_of,
                           frozenset(m.name for m in pipeline.models if m.frozen))
    for op in graph.ops:
        if op.kind is not OpKind.SYNC_WEIGHTS:
            continue
        if not out[op.name].devices:
            out[op.name] = OpLayout(timings[op.name].devices, everywhere=True, collective=True)
        moved = gangs.get(op.reads_model)
        if moved:
            out[op.name] = attrs.evolve(out[op.name], gangs=moved)
    return out, placed.chunks


def transfer_gangs(placed: Placed, placement_of, frozen: frozenset[str] = frozenset()
                   ) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Trained backbone -> the gangs of calls that move each of its versions to the copies
    its readers read off its trainer (:func:`rpeg.plan.copies.copies`), each the devices of
    its calls in the runtime's order (``rpeg.runtime.lowering.ordering.add_syncs``): the
    trainer's senders' exports then a load per copy on each device reading one (sorted by
    device); and, where a vLLM engine serves a copy of its own, a receive on each engine's
    host then the senders' sends (:func:`rpeg.cost.engine_sync.engine_sync_layout`).
    ``frozen``: models no trainer writes (a reader of those alone reads no version).

        >>> from rpeg.graph import Op
        >>> from rpeg.plan.model import StagePlacement as P
        >>> from rpeg.spec.model import Engine
        >>> g = Graph("g", (Op("rollout", OpKind.GENERATE, reads_model="actor",
        ...                    stages=("rollout",)),
        ...                 Op("train", OpKind.TRAIN, reads_model="actor",
        ...                    writes_model="actor", stages=("train",))), (), (), ("actor",),
        ...           ("actor",))
        >>> place = {"rollout": P("rollout", (0, 1, 2), dp=3, engine=Engine.VLLM),
        ...          "train": P("train", (0, 1), dp=2, zero=3)}
        >>> at = lambda o: place[o.name]
        >>> transfer_gangs(lower(g, None, 8, at, passes=PASSES[:2]), at)
        {'actor': ((2, 0, 1),)}
    """
    from rpeg.cost.engine_sync import engine_sync_layout, sync_senders
    from rpeg.plan.copies import copies

    graph = placed.graph
    trainers = {o.writes_model: o for o in graph.ops if o.kind is OpKind.TRAIN and o.writes_model}
    if not trainers:
        return {}
    homes = {m: placement_of(t) for m, t in trainers.items()}
    held = copies(placed, placement_of)
    loads: dict[str, dict[int, list]] = {}        # backbone -> device -> the copies it loads
    pushed: set[str] = set()                      # backbones whose engines serve a copy
    for op in graph.ops:
        model = op.reads_model
        if not model or op.kind in (OpKind.TRAIN, OpKind.SYNC_WEIGHTS) or model not in homes \
                or all(m in frozen for m in model.members):
            continue
        home = set(homes[model].devices)
        for d, _ in placed.layout(op.name).members(placed.chunks):
            key = held.key_of(op.name, d)
            if key is None or (d in home and key == model):
                continue
            if key.engine:
                pushed.add(model)
            else:
                at = loads.setdefault(model, {}).setdefault(d, [])
                if key not in at:
                    at.append(key)
    out: dict[str, tuple[tuple[int, ...], ...]] = {}
    for model, trainer in homes.items():
        gangs = []
        if model in loads:
            gangs.append(sync_senders(trainer.devices, trainer.tp, trainer.zero) + tuple(
                d for d, keys in sorted(loads[model].items()) for _ in keys))
        if model in pushed:
            lay = engine_sync_layout(trainer, [placement_of(o) for o in graph.ops
                                               if o.kind is OpKind.GENERATE
                                               and o.reads_model == model])
            gangs.append(tuple(sorted(b[0] for b in lay.group + lay.local)) + lay.senders)
        if gangs:
            out[model] = tuple(gangs)
    return out

