"""How a step's op calls pack into Dask tasks: one rule, run by the runtime as it submits
(``rpeg.runtime.core.fusion``) and by the cost model as it counts a step's tasks
(``rpeg.plan.tasks``).

    >>> p = Packer()
    >>> a = p.place(0, step=0, chunk=0, op="a", need=set(), deps=set())
    >>> p.place(0, step=0, chunk=0, op="b", need={a}, deps={a}) == a     # its input is in a
    True
    >>> p.read_elsewhere(0, a, step=0, chunk=0, op="b")                  # device 1 reads b
    >>> p.place(0, step=0, chunk=0, op="c", need={a}, deps={a}) == a     # a no longer open
    False

Calls come in submission order, dependencies first. A call joins the newest open task of
its device and step whose every unfinished dependency is in that task, or in a task it
already waits for, so joining never delays the calls before it; else, where another device
reads a call of the plan's fused stages (``Plan.fusion``), the task that call ended, for the
other stages fused with it and of its chunk; else it starts a task of its own, waiting for
its dependencies. A rank of a collective always starts a task: queued behind other work in
a task, it could hold back partners that already wait in the collective. A call whose
output another device reads ends its task for every other call (the reader must not wait
for the calls after it), but for the stages fused with it. A join (the one call through
which a large gang's ranks wait, ``rpeg.runtime.lowering.joins``) starts a task of its
own, open to no call (:meth:`Packer.join`): in a task, every rank of the gang would wait
for the calls before it there, and for any call joining it after.

Tasks are numbered from 0 as they start; a dependency is a task's number, or any other
hashable naming a task submitted before.

Both sides feed the Packer one way, :meth:`Packer.feed`: a sequence of :class:`Unit` s,
each one call (the runtime's: one device) or one instance's calls (the count's: its
devices, or a gang's ranks, at once), its step, chunk, op, the units it depends on, whether
it is a gang (a collective's ranks) or a join, and whether another device reads its
output; the branching on those is this one method's. An instance fed at once packs as its
calls fed one by one (``tests/plan/test_packing.py``):

    >>> task = {}
    >>> Packer().feed([Unit("a", (0, 1), 0, 0, "a", ()),                 # a call on each
    ...                Unit("b", (0,), 0, 0, "b", ("a",)),               # joins a's task
    ...                Unit("t", (0, 1), 0, 0, "train", ("a",), gang=True)], task)
    [0, 0, 2]
    >>> task                                 # the train ranks on tasks 2 and 3 of their own
    {'a': 0, 'b': 0, 't': 2}
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import NamedTuple

from rpeg.cost.control import join_of

_NONE: dict = {}                       # no task waits for any dependency there


class Unit(NamedTuple):
    """What one call, or one instance's calls, asks of the Packer (:meth:`Packer.feed`):
    the runtime feeds a unit per call (one device), the cost model's count one per op
    instance (its devices, or a gang's ranks, at once)."""

    key: Hashable | None          # names its task for the units after it (None: no name)
    devices: tuple[int, ...]      # a call on each in turn (a gang: its ranks)
    step: int
    chunk: int
    op: str
    inputs: tuple[Hashable, ...]  # the keys of the units it depends on
    gang: bool = False            # a collective's ranks, each starting a task
    elsewhere: bool = False       # another device reads its output (ends its task)
    read: tuple[int, ...] = (0,)  # a gang's ranks read elsewhere (indices into devices)
    join: bool = False            # a gang's join: a task of its own, open to no call


def is_read_elsewhere(device: int, readers: Iterable[int | None]) -> bool:
    """Whether an output written on ``device`` is read elsewhere (:attr:`Unit.elsewhere`,
    which ends the task writing it, so that its reader can start): a call waiting for it
    runs on another device. ``readers``: the device of each call waiting for it, over a
    data edge or an ordering one (a writer ordered after the readers of the replica it
    writes), None for a reader on several devices at once. The one rule both the
    runtime's fusion (a unit a call: its consumers' devices) and the cost model's count
    (a unit an instance: the devices its readers read on) say a unit read elsewhere by.

        >>> is_read_elsewhere(0, [0, 0]), is_read_elsewhere(0, [0, 1]), is_read_elsewhere(0, [])
        (False, True, False)
    """
    for d in readers:                  # a loop, not any(): the count asks per instance
        if d != device:
            return True
    return False


def _tasks_of(inputs: tuple[Hashable, ...], task: dict[Hashable, Hashable]) -> set[Hashable]:
    """The tasks of those of ``inputs`` placed (in ``task``), added in their order, found
    in one call where every one is placed (the count's: a train rank reads hundreds)."""
    try:
        return set(map(task.__getitem__, inputs))
    except KeyError:                   # some not placed: no dependency
        return {task[i] for i in inputs if i in task}


class Packer:
    """The tasks of calls packed so far (see the module doc)."""

    def __init__(self, together: Iterable[Iterable[str]] = ()) -> None:
        self.waits: list[set[Hashable]] = []          # task -> the tasks it waits for
        self._open: dict[tuple[int, int], list[int]] = {}          # (device, step) -> tasks
        self._sealed: dict[tuple[int, int], dict[int, tuple]] = {}  # -> task: (chunk, ops)
        # (device, step) -> a task -> the tasks started there waiting for it, and the tasks
        # a call read elsewhere closed: where a call may join is found among the few
        # tasks of its device that wait for one of its dependencies
        self._waiting: dict[tuple[int, int], dict[Hashable, list[int]]] = {}
        self._closed: set[int] = set()
        self._partners: dict[str, set[str]] = {}
        for names in together:
            names = tuple(names)
            for a in names:
                self._partners.setdefault(a, set()).update(set(names) - {a})

    def new(self, deps: set[Hashable]) -> int:
        """Start a task waiting for ``deps``, open to no call: its number."""
        self.waits.append(set(deps))
        return len(self.waits) - 1

    def join(self, deps: set[Hashable]) -> int:
        """The task of a gang's join waiting for ``deps``: one of its own, open to no call
        (the rule both the runtime's fusion and the cost model's count place a join by)."""
        return self.new(deps)

    def feed(self, units: Iterable[tuple], task: dict[Hashable, Hashable],
             outside: Callable[[Hashable], Hashable] | None = None,
             done: Callable[[Hashable], bool] | None = None) -> list[int]:
        """Place ``units`` in turn, each a :class:`Unit` (or a plain tuple of its fields,
        in order: the count builds hundreds a plan): the one way both the runtime's fusion
        and the cost model's count feed the Packer. ``task``: unit key -> its task, filled
        as units are placed and read for a unit's inputs (its dependencies are their
        tasks); an input not there is the task ``outside`` names (None: no dependency),
        finished where ``done`` says (None: nothing finished). The task of each unit, in
        order: the last of a gang's ranks ``read``, through which the unit is read.

        A unit's calls are placed on its devices in turn (:meth:`place`); a gang's ranks
        each start a task (:meth:`gang`), those of ``JOIN_MIN`` ranks or more waiting
        through a join of their own (:meth:`join`); a unit read ``elsewhere`` ends the
        task of its first call, or of its ranks ``read`` (:meth:`read_elsewhere`). A first
        call read elsewhere with nothing finished is placed and its task ended at once: the
        same tasks as :meth:`place`, then :meth:`read_elsewhere`, but a task it starts is
        closed as it opens, so it is entered neither among the tasks open there nor among
        those waiting for its dependencies (where a closed task is passed over: where a
        call may join is the newest open task fitting it, found alike)."""
        out = []
        place, opened, partners_of = self.place, self._open, self._partners
        waits, sealed_at = self.waits, self._sealed
        for key, devices, step, chunk, op, inputs, gang, elsewhere, read, joins in units:
            if outside is None:
                if len(inputs) == 1:              # most read one unit: found inline
                    i = inputs[0]
                    need = deps = {task[i]} if i in task else set()
                else:
                    need = deps = _tasks_of(inputs, task)
            else:
                deps = {task[i] if i in task else outside(i) for i in inputs}
                need = deps if done is None else \
                    {task[i] if i in task else outside(i) for i in inputs
                     if i in task or not done(i)}
            head = devices[0]
            if joins:                             # a gang's join: a task of its own
                g = self.join(deps)
            elif gang:
                if join_of(devices) is not None:  # waiting through a join, a task of its own
                    ranks = self.gang(devices, step, {self.join(deps)}, named=False)
                else:
                    ranks = self.gang(devices, step, deps)
                for i in read:
                    g = ranks[i]
                    if elsewhere:
                        self.read_elsewhere(head, g, step, chunk, op)
            else:
                if not elsewhere:
                    g = place(head, step, chunk, op, need, deps)
                elif need is deps:                # every dependency unfinished
                    at = (head, step)
                    here = opened.get(at)
                    g = self._fitting(at, here, deps) if here else None
                    if g is None:
                        sealed = sealed_at.get(at)
                        if sealed:
                            g = next((t for t, (c, ops) in reversed(sealed.items())
                                      if op in ops and c == chunk and self._fits(t, deps)),
                                     None)
                    if g is not None:
                        self.read_elsewhere(head, g, step, chunk, op)
                    else:
                        g = len(waits)            # a task of its own, closed at once
                        waits.append(deps)
                        if here is None:
                            opened[at] = []
                        partners = partners_of.get(op)
                        if partners:
                            sealed_at.setdefault(at, {})[g] = (chunk, partners)
                else:
                    g = place(head, step, chunk, op, need, deps)
                    self.read_elsewhere(head, g, step, chunk, op)
                if len(devices) > 1:              # each call placed after the one before
                    for dev in devices[1:]:
                        place(dev, step, chunk, op, need, deps)
            if key is not None:
                task[key] = g
            out.append(g)
        return out

    def place(self, device: int, step: int, chunk: int, op: str, need: set[Hashable],
              deps: set[Hashable], collective: bool = False) -> int:
        """The task a call of ``op`` (``step``, ``chunk``) on ``device`` runs in: ``need``,
        the tasks of its dependencies not yet finished; ``deps``, of all of them."""
        at = (device, step)
        here = self._open.get(at)
        if not collective:
            if here:
                g = self._fitting(at, here, need)
                if g is not None:
                    return g
            sealed = self._sealed.get(at)
            if sealed:
                g = next((t for t, (c, ops) in reversed(sealed.items())
                          if op in ops and c == chunk and self._fits(t, need)), None)
                if g is not None:
                    return g
        g = len(self.waits)                   # a task of its own
        self.waits.append(set(deps))
        if here is None:                      # :meth:`_open_all` of one device, inlined
            self._open[at] = [g]
        else:
            here.append(g)
        if deps:
            self._wait_for(at, g, deps)
        return g

    def gang(self, devices: tuple[int, ...], step: int, deps: set[Hashable],
             named: bool = True) -> list[int]:
        """The tasks of a collective's ranks on ``devices``, in order: each starts a task
        waiting for ``deps``, as ``place(..., collective=True)`` of each would.
        ``named=False``: no call names any of ``deps`` as a dependency (a join's ranks wait
        for the join alone), so no call looks for the tasks waiting for them."""
        first = len(self.waits)
        waits = set(deps)                    # one set for every rank's task: never changed
        self.waits.extend([waits] * len(devices))
        self._open_all(step, first, devices, waits if named else ())
        return list(range(first, len(self.waits)))

    def _open_all(self, step: int, first: int, devices: tuple[int, ...],
                  deps: set[Hashable] | tuple) -> None:
        """Tasks ``first``, ``first + 1``, ... are open to the calls of each of ``devices``
        in turn (at ``step``), each found among those waiting for ``deps`` there (none:
        ``()``)."""
        opened, wait_for = self._open, self._wait_for
        for g, device in enumerate(devices, first):
            at = (device, step)
            here = opened.get(at)
            if here is None:
                opened[at] = [g]
            else:
                here.append(g)
            if deps:
                wait_for(at, g, deps)

    def _wait_for(self, at: tuple[int, int], g: int, deps: set[Hashable]) -> None:
        """Task ``g``, open on ``at`` (device, step), is found there among those waiting for
        each of ``deps``."""
        waiting = self._waiting.get(at)
        if waiting is None:
            waiting = self._waiting[at] = {}
        for d in deps:
            w = waiting.get(d)
            if w is None:
                waiting[d] = [g]
            else:
                w.append(g)

    def read_elsewhere(self, device: int, task: int, step: int, chunk: int, op: str) -> None:
        """Another device reads a call of ``op`` in ``task``: it ends the task, but for the
        stages fused with ``op``."""
        here = self._open.get((device, step))
        if here:
            if here[-1] == task:               # most often the newest
                here.pop()
                self._closed.add(task)
            elif task in here:
                here.remove(task)
                self._closed.add(task)
        partners = self._partners.get(op)
        if partners:
            self._sealed.setdefault((device, step), {})[task] = (chunk, partners)

    def _fits(self, g: int, need: set[Hashable]) -> bool:
        """Whether task ``g`` holds or waits for each of ``need``: each is ``g`` or among
        those it waits for (set operations: a call may have hundreds of dependencies)."""
        waits = self.waits[g]
        return need <= waits or g in need and need - waits <= {g}

    def _fitting(self, at: tuple[int, int], here: list[int], need: set[Hashable]
                 ) -> int | None:
        """The newest task of ``here`` (open on ``at``: device, step) holding or waiting
        for every one of ``need``.

        A task that fits holds or waits for each dependency: it is that dependency, or one
        of the tasks of ``here`` waiting for it. Those of the dependency with the fewest
        are tried, newest first (``here`` lists its tasks as they started, numbers
        ascending; a dependency's waiters, likewise)."""
        if not here:
            return None
        if not need:
            return here[-1]
        waiting, closed = self._waiting.get(at, _NONE), self._closed
        if len(need) == 1:             # each task waiting for it fits: the newest open
            (d0,) = need
            for g in reversed(waiting.get(d0, ())):
                if g not in closed:
                    return g
            return d0 if d0 in here else None
        fewest: list[int] | tuple = ()
        d0, least = None, -1
        for d in need:                 # the first with the fewest, as need iterates
            w = waiting.get(d, ())
            if least < 0 or len(w) < least:
                fewest, d0, least = w, d, len(w)
                if not least:          # none fewer
                    break
        for g in reversed(fewest):
            if g not in closed and self._fits(g, need):
                return g
        if d0 in here:                 # older than every task waiting for it
            return d0 if self._fits(d0, need) else None
        return None


__all__ = ["Packer", "Unit", "is_read_elsewhere"]
