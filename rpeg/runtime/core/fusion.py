"""Fused dispatch: consecutive op calls of one device run as one Dask task.

    >>> groups = fuse(batch, consumers, device_of, is_done)                  # doctest: +SKIP
    >>> [[c.id for c in g] for g in groups]                                  # doctest: +SKIP
    [['rollout/s0/c0', 'rollout/s0/c1', 'ref_lp/s0/c0', ...], ['sync_actor/s0/export']]

On a local Dask cluster each task costs a few milliseconds of dispatch (client ->
scheduler -> worker -> scheduler -> client), as long as a tiny model's op. The
scheduling core still decides op by op *what may be submitted*; this module
only packs one batch of those submissions into tasks. A call joins the open
group of its device when

* it belongs to the same step (a step's group finishing lets the next one start,
  so the device never waits for the client between steps), and
* every dependency it has is in the group, in a task the group already waits
  for, or finished — so joining never delays the ops before it.

A device may have several open groups (one per chunk, say); a call joins the
newest one it fits.

A call whose output another device reads closes its group: the reader must not
wait for the ops after it (this keeps generation on one worker overlapping
training on the other). The worker runs a group's calls in order and records
each op as its own trace event (``rpeg verify`` checks each op), so versions
read and written are exactly those of unfused execution.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable

import attrs

from rpeg.runtime.lowering.instances import OpCall


@attrs.frozen
class Group:
    """Calls run by one task, in order; ``keep``: ids whose outputs the task returns."""

    calls: tuple[OpCall, ...]
    keep: frozenset[str]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(c.id for c in self.calls)

    @property
    def device(self) -> int:
        return self.calls[0].device

    @property
    def external(self) -> tuple[str, ...]:
        """Dependencies outside the group, in first-use order."""
        own = set(self.ids)
        return tuple(dict.fromkeys(d for c in self.calls for d in c.all_deps if d not in own))


def consumers_of(calls: Iterable[OpCall]) -> dict[str, tuple[OpCall, ...]]:
    out: dict[str, list[OpCall]] = {}
    for c in calls:
        for d in c.all_deps:
            out.setdefault(d, []).append(c)
    return {k: tuple(v) for k, v in out.items()}


def fuse(batch: Iterable[OpCall], consumers: dict[str, tuple[OpCall, ...]],
         is_done: Callable[[str], bool], enabled: bool = True,
         task_of: Callable[[str], object] = lambda d: d,
         together: Iterable[Iterable[str]] = ()) -> list[Group]:
    """Pack ``batch`` (submission order, dependencies first) into groups; groups come in an
    order where a group depends only on earlier groups or on calls submitted before.
    ``task_of(id)`` names the task of a call submitted before (ops of one task count as
    one dependency: waiting for one of them is waiting for all). ``together``: the plan's
    fused stages (``Plan.fusion``), whose calls of one step and chunk on a device stay in
    one task even where another device reads the first (the plan priced them as one op,
    whose readers wait for the whole)."""
    groups: list[list[OpCall]] = []
    waits: list[set[object]] = []                  # tasks each group waits for
    where: dict[str, int] = {}                      # batch id -> its group
    open_: dict[int, list[int]] = defaultdict(list)   # device -> its open groups
    partners: dict[str, set[str]] = defaultdict(set)
    for names in together:
        for a in names:
            partners[a] |= set(names) - {a}
    # device -> groups closed but to the fusion partners of their last call: (step, chunk, ops)
    sealed: dict[int, dict[int, tuple]] = defaultdict(dict)

    def task(d: str) -> object:
        return ("group", where[d]) if d in where else task_of(d)

    def fits(call: OpCall, gi: int) -> bool:
        return call.step == groups[gi][0].step and all(
            where.get(d) == gi or task(d) in waits[gi] or (d not in where and is_done(d))
            for d in call.all_deps)

    for call in batch:
        here = open_[call.device]
        # a rank of a collective starts a task of its own: queued behind other work in a task,
        # it could hold back partners that already wait in the collective
        gi = None
        if enabled and not call.collective:
            gi = next((g for g in reversed(here) if fits(call, g)), None)
            if gi is None:
                gi = next((g for g, (step, chunk, ops) in reversed(sealed[call.device].items())
                           if call.op in ops and (call.step, call.chunk) == (step, chunk)
                           and fits(call, g)), None)
        if gi is None:
            groups.append([])
            waits.append({task(d) for d in call.all_deps})
            gi = len(groups) - 1
            here.append(gi)
        groups[gi].append(call)
        where[call.id] = gi
        if any(c.device != call.device for c in consumers.get(call.id, ())):
            if gi in here:
                here.remove(gi)                    # another device reads it: don't hold it back
            if partners.get(call.op):              # ... but for the stages fused with it
                sealed[call.device][gi] = (call.step, call.chunk, partners[call.op])
    out = []
    for g in groups:
        own = {c.id for c in g}
        # outputs read by a call of another task (ordering edges read nothing), and final ones
        keep = frozenset(c.id for c in g
                         if any(r.id not in own and c.id in r.deps
                                for r in consumers.get(c.id, ()))
                         or not consumers.get(c.id))
        out.append(Group(tuple(g), keep))
    return out


def submit(client, g: Group, futures: dict, worker: str, key: str):
    """Submit ``g`` as one Dask task pinned to ``worker``, prioritised by its step.

    Its arguments are the futures (``futures``: op id -> the future of its task) of the
    other tasks whose results the calls read, each passed once, and of the tasks they only
    wait for (ordering edges); an ordering dependency with no future finished before (an op
    before a checkpoint cut) and is not waited for."""
    from rpeg.runtime.dask import worker as W

    args: list = []
    index: dict[str, int] = {}
    own = set(g.ids)

    def arg(f) -> int:
        if f.key not in index:
            index[f.key] = len(args)
            args.append(f)
        return index[f.key]

    where = []
    for call in g.calls:
        where.append(tuple((-1, d) if d in own else (arg(futures[d]), d) for d in call.deps))
        for a in call.after:
            if a not in own and a in futures:
                arg(futures[a])
    # of two tasks ready on one worker the older step's runs first (Dask runs higher priority
    # first, and equal priorities in submission order): a step's cheap tail (a reward, say)
    # must not wait behind the next step's generation while another device waits for it
    return client.submit(W.run_group, g.calls, g.keep, tuple(where), *args, key=key,
                         workers=[worker], allow_other_workers=False, pure=False,
                         priority=-g.calls[0].step)
