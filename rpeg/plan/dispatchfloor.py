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

from rpeg.cost.control import JOIN_MIN, Dispatch
from rpeg.graph import Graph, chunk_counts
from rpeg.plan.tasks import laid_out
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
    for op, n in chunk_counts(graph, streamed).items():   # in the step's order
        at = laid_out(layouts[op])                 # chunk c on at[c mod len(at)]
        fed = op in reads                          # a task it starts waits for its inputs
        for c, (ds, _, gang, _, gangs) in enumerate(at[:n]):
            # this and the chunks after it on the same devices (all seen from here on)
            times = len(range(c, n, len(at)))
            for g in gangs:                        # a weight sync's gangs: each rank a task
                calls += len(g) * times
                tasks += len(g) * times
                if len(g) >= JOIN_MIN:
                    calls += times
                    tasks += times
                    args += (2 * len(g) + fed) * times
                else:
                    args += (len(g) ** 2 + fed * len(g)) * times
                seen.update(g)
            if gangs:
                continue
            ranks = len(ds)
            calls += ranks * times
            if gang:                               # each rank starts a task
                tasks += ranks * times
                if ranks >= JOIN_MIN:              # and the join, a call and a task
                    calls += times
                    tasks += times
                    # the futures ordering gangs (one a rank), the ranks' on the join
                    args += (2 * ranks + fed) * times
                else:
                    args += (ranks ** 2 + fed * ranks) * times
                seen.update(ds)
                continue
            # each device's first call of the step starts a task (counted as a set grows)
            before = len(seen)
            seen.update(ds)
            tasks += len(seen) - before
            args += fed * (len(seen) - before)
    ops = {o.name for o in graph.ops}
    for op, lay in layouts.items():                # transfers the graph has no op for
        for g in lay.gangs if op not in ops else ():
            calls += len(g) + (len(g) >= JOIN_MIN)
            tasks += len(g) + (len(g) >= JOIN_MIN)
            args += 2 * len(g) if len(g) >= JOIN_MIN else len(g) ** 2
    used = set().union(*(lay.devices for lay in layouts.values()))
    return Dispatch(len(used), calls, tasks, args)


__all__ = ["dispatch_floor"]
