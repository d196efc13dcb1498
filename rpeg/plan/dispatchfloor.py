"""A lower bound of what a steady step asks of the control plane, without its fusion.

:func:`rpeg.plan.tasks.dispatch_per_step` packs a step's calls into Dask tasks call by
call, the costly part of pricing a plan on hundreds of devices. A search that only asks
whether a plan could be faster than another needs less: :func:`dispatch_floor` counts the
same step's calls exactly, and of its tasks and futures only those no packing changes: a
rank of a collective always starts a task of its own, a gang of ``JOIN_MIN`` ranks or
more has its join's, the first call of a step on a device that is no such rank starts a
task too (nothing of that step is open there yet), each of these tasks waits for at
least one future where its op reads data, and the futures order gangs on a device. So
each of its counts is no more than ``dispatch_per_step``'s and the control plane's time
priced from it (``rpeg.cost.control``, growing with each count) is no more than the
counted one.

    >>> from rpeg.graph import Graph, Op, DataEdge
    >>> from rpeg.plan.oplayout import OpLayout
    >>> from rpeg.plan.tasks import dispatch_per_step
    >>> from rpeg.spec.model import OpKind
    >>> g = Graph("toy", (Op("a", OpKind.FORWARD, outputs=("x",)),
    ...                   Op("b", OpKind.TRAIN, inputs=("x",))),
    ...           (DataEdge("a", "b", "x"),), (), (), ())
    >>> lay = {"a": OpLayout((0, 1)), "b": OpLayout((0, 1), everywhere=True, collective=True)}
    >>> dispatch_floor(g, lay), dispatch_per_step(g, lay)
    (Dispatch(devices=2, calls=3, tasks=3, args=6), Dispatch(devices=2, calls=3, tasks=3, args=6))
"""

from __future__ import annotations

import functools

from rpeg.cost.control import Dispatch
from rpeg.graph import Graph, chunk_counts
from rpeg.plan.tasks import devices_used, gang_calls, laid_out
from rpeg.spec.model import OpKind


def dispatch_floor(graph: Graph, layouts: dict, chunks: int = 1, steps: int = 6) -> Dispatch:
    """No more, count by count, than ``dispatch_per_step(graph, layouts, chunks, steps,
    together)`` for any ``together`` (see the module doc): the same steady step, whose
    instances are every op's chunks (:func:`rpeg.graph.chunk_counts`, as
    :func:`rpeg.graph.unroll` makes them in every step), found without unrolling."""
    streamed = {o.name: chunks for o in graph.ops if o.kind is OpKind.GENERATE} \
        if chunks > 1 else {}
    reads = {e.dst for e in graph.data_edges}
    calls = tasks = args = 0
    seen: set[int] = set()                         # devices with a call of the step so far
    parts = {op: lay.parts for op, lay in layouts.items() if lay.parts}   # split passes
    for op, n in chunk_counts(graph, streamed, parts).items():   # in the step's order
        fed = op in reads                          # a task it starts waits for its inputs
        c, t, a, firsts, devices = _op_floor(layouts[op], n, fed)
        calls, tasks, args = calls + c, tasks + t, args + a
        if firsts is None:                         # chunks of both kinds: in their order
            tasks, args = _mixed(laid_out(layouts[op]), n, fed, seen, tasks, args)
            continue
        before = len(seen)
        seen.update(devices)
        if firsts:                                 # a device's first call starts a task
            tasks += len(seen) - before
            args += fed * (len(seen) - before)
    ops = {o.name for o in graph.ops}
    for op, lay in layouts.items():                # transfers the graph has no op for
        for g in lay.gangs if op not in ops else ():
            k, a = _gang(len(g), False)
            calls, tasks, args = calls + k, tasks + k, args + a
    return Dispatch(devices_used(tuple(layouts.values())), calls, tasks, args)


@functools.lru_cache(maxsize=8192)
def _op_floor(lay, n: int, fed: bool) -> tuple:
    """(calls, tasks, futures, whether, the devices) of an op laid out as ``lay`` in a step
    of ``n`` chunks (``fed``: it reads data), as :func:`dispatch_floor` counts them but for
    the tasks of each device's first call of the step: those it starts are counted as the
    step's devices seen grow by ``devices`` where ``whether`` is true (the op's every
    instance a single call per device, no gang), none where it is false (every one a gang);
    None where its instances are of both kinds (counted chunk by chunk, in order: a gang's
    devices seen before a later chunk's). Memoised by the layout, whose hash is kept."""
    at = laid_out(lay)                             # chunk c on at[c mod len(at)]
    calls = tasks = args = 0
    devices: set[int] = set()
    kinds = set()
    for c, (ds, _, gang, _, gangs) in enumerate(at[:n]):
        # this and the chunks after it on the same devices (all seen from here on)
        times = len(range(c, n, len(at)))
        kinds.add(bool(gangs) or gang)
        for g in gangs:                            # a weight sync's gangs: each rank a task
            k, a = _gang(len(g), fed)
            calls, tasks, args = calls + k * times, tasks + k * times, args + a * times
            devices.update(g)
        if gangs:
            continue
        devices.update(ds)
        if gang:                                   # each rank starts a task
            k, a = _gang(len(ds), fed)
            calls, tasks, args = calls + k * times, tasks + k * times, args + a * times
        else:
            calls += len(ds) * times
    if len(kinds) > 1:
        return calls, tasks, args, None, ()
    return calls, tasks, args, kinds != {True}, frozenset(devices)


@functools.lru_cache(maxsize=1024)
def _gang(ranks: int, fed: bool) -> tuple[int, int]:
    """(the calls of a gang of ``ranks`` ranks, each a task of its own, and the futures its
    tasks wait for at least) as the count has them (:func:`rpeg.plan.tasks.gang_calls`):
    its ranks and its join, where it has one, and the futures ordering it; then each rank's
    future on the join and the join's on the gang's inputs (``fed``), or without a join
    each rank's on them."""
    calls, order = gang_calls(ranks)
    joined = calls > ranks
    return calls, order + (ranks + fed if joined else fed * ranks)


def _mixed(at: tuple, n: int, fed: bool, seen: set[int], tasks: int, args: int
           ) -> tuple[int, int]:
    """(tasks, futures) with those of the first calls of the step on each device of an op
    whose chunks (laid out as ``at``: :func:`laid_out`) are gangs and single calls both,
    in their order, ``seen`` growing by each chunk's devices."""
    for ds, _, gang, _, gangs in at[:n]:
        if gangs:
            for g in gangs:
                seen.update(g)
            continue
        before = len(seen)
        seen.update(ds)
        if not gang:                               # each device's first call: a task
            tasks += len(seen) - before
            args += fed * (len(seen) - before)
    return tasks, args


__all__ = ["dispatch_floor"]
