"""Fused dispatch: consecutive op calls of one device run as one Dask task.

    >>> groups = fuse(batch, consumers, device_of, is_done)                  # doctest: +SKIP
    >>> [[c.id for c in g] for g in groups]                                  # doctest: +SKIP
    [['rollout/s0/c0', 'rollout/s0/c1', 'ref_lp/s0/c0', ...], ['sync_actor/s0/export']]

On a local Dask cluster each task costs a few milliseconds of dispatch (client ->
scheduler -> worker -> scheduler -> client), as long as a tiny model's op. The
scheduling core still decides op by op *what may be submitted*; this module
only packs one batch of those submissions into tasks, by the rule the cost model counts
a step's tasks with (``rpeg.plan.packing``, fed through ``Packer.feed``, a unit a call,
where the count's unit is an instance): a call joins an open task of its device and
step where every dependency it has is in the task, in a task the task already waits for,
or finished (so joining never delays the ops before it); a call whose output another
device reads ends its task (this keeps generation on one worker overlapping training on
the other; :func:`~rpeg.plan.packing.is_read_elsewhere`, by which the count says it too),
but for the stages the plan fused with it; a gang's join starts a task of its
own, open to no call. The worker runs a group's calls in order and
records each op as its own trace event (``rpeg verify`` checks each op), so versions read
and written are exactly those of unfused execution.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs

from rpeg.plan.packing import Packer, Unit, is_read_elsewhere
from rpeg.runtime.lowering.instances import OpCall
from rpeg.runtime.lowering.replicas import CallRole


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
    batch = list(batch)
    where: dict[str, int] = {}                      # batch id -> its group
    tasks = Packer(together).feed(
        (Unit(call.id, (call.device,), call.step, call.chunk, call.op, call.all_deps,
              gang=not enabled or call.collective,
              elsewhere=is_read_elsewhere(call.device,
                                          (c.device for c in consumers.get(call.id, ()))),
              join=call.role is CallRole.JOIN) for call in batch),
        where, outside=lambda d: ("task", task_of(d)), done=is_done)
    groups: list[list[OpCall]] = []
    for call, gi in zip(batch, tasks, strict=True):
        if gi == len(groups):
            groups.append([])
        groups[gi].append(call)
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
