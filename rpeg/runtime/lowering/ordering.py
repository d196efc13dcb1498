"""The weight transfers and ordering edges of a plan's op calls: passes over the calls
:func:`rpeg.runtime.lowering.instances.build_calls` lays out, each adding what keeps a run exact.

    >>> calls = _add_syncs(calls, homes, trained)                            # doctest: +SKIP
    >>> _order_versions(calls, homes, frozen)                                # doctest: +SKIP

* weight transfers: an export/load gang (or a send/receive one into a vLLM engine's copy)
  for every version read off the trainer's devices (``_add_syncs``);
* versions: a reader after the writer of its version, a writer after the readers of the
  version before, on the same device (``_order_versions``);
* (streams: each device's chunks of a generate op in order are the placed graph's stream
  edges, ``rpeg.plan.lower.Placed.edges``, which ``build_calls`` adds itself;)
* collectives: one global order of the gangs on every device (``_order_collectives``); an
  engine on a sending device is loaded by that send, in process, and its receive comes
  after it (``_order_pushes``).
"""

from __future__ import annotations

from collections import defaultdict

from rpeg.cost.engine_sync import sync_refusal, sync_senders
from rpeg.errors import PlanError
from rpeg.graph.ids import OpId
from rpeg.graph.order import Cycle, topological
from rpeg.runtime.lowering.joins import join_gang
from rpeg.runtime.lowering.replicas import (
    EXPORT,
    LOAD,
    RECV,
    SEND,
    base_of,
    engine_key,
    is_engine_key,
)
from rpeg.spec.model import OpKind


def ranks_together(kind: OpKind, world: int) -> bool:
    """Whether an op's calls on ``world`` data-parallel ranks run collectives together: a
    train op's, and a pass on its trainer's ZeRO-3 shards (each layer gathered by all)."""
    return world > 1 and kind is not OpKind.GENERATE


def _add_syncs(calls: list[dict], homes, trained: dict, first: int = 0,
               engines: dict | None = None) -> list[dict]:
    """Export/load pairs for every version of a trained model read off its home devices.

    One weight transfer per (model, version) runs as a collective over every device taking
    part (``gang``): the home devices that hold the weights (``sources``: the first
    tensor-parallel block, or every home device when ZeRO-3 shards the weights, which they
    gather together) and every device loading a copy (``fills``: the copies there). The
    first source broadcasts the weights, in buckets, to the devices that are not sources.
    A vLLM engine's own copy (an engine key) is pushed instead: per version, the same sources
    send (``SEND``) and every engine hosting a copy receives (``RECV``) in one group
    (``backends.vllm_backend.sync``), but for an engine sharing a device with a source,
    which that source loads in process (``engines``: model -> the layout of its sync,
    ``rpeg.cost.engine_sync.engine_sync_layout``; one ``sync_refusal`` refuses is a
    PlanError)."""
    needed: dict[tuple[str, int], set[int]] = defaultdict(set)
    for c in calls:
        key = c["model"]
        b = base_of(key)
        if b in homes and (c["device"] not in homes[b] or key != b) and c["version"] > first:
            needed[(key, c["device"])].add(c["version"])
    loads: dict[tuple[str, int], dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    pushes: dict[str, set[int]] = defaultdict(set)        # model -> versions its engines need
    for (copy, dev), versions in sorted(needed.items()):
        if is_engine_key(copy):
            pushes[base_of(copy)] |= versions
            continue
        for v in versions:
            loads[(base_of(copy), v)][dev].append(copy)
    out = list(calls)
    for (key, v), at in sorted(loads.items()):
        common = dict(op=f"sync_{key}", kind=OpKind.SYNC_WEIGHTS, step=v - 1, chunk=0,
                      chunks=1, rank=0, world=1, tp_group=(), stages=(), inputs=[], deps=[],
                      after=[], bound=0, gang=tuple(sorted(set(_sources(homes, trained, key))
                                                           | set(at))),
                      sources=_sources(homes, trained, key))
        for t, src in enumerate(common["sources"]):
            out.append(dict(common, id=OpId.of(f"sync_{key}", v - 1, role=EXPORT, tp_rank=t),
                            device=src, role=EXPORT, model=key, version=v, writes=-1,
                            fills=tuple(sorted(at.get(src, ())))))
        for dev, copies in sorted(at.items()):
            for copy in copies:
                out.append(dict(common, id=OpId.of(f"sync_{copy}", v - 1, role=LOAD, device=dev),
                                device=dev,
                                role=LOAD, model=copy, version=-1, writes=v,
                                fills=tuple(sorted(copies))))
    for key, versions in sorted(pushes.items()):
        lay = (engines or {})[key]
        senders = lay.senders
        hosts = sorted(b[0] for b in lay.group + lay.local)
        why = sync_refusal(lay)
        if why:
            raise PlanError(f"the weight sync of '{key}' must give every rank of its process "
                            f"group a device of its own, and {why}",
                            hint="host the engine on a sending device of the trainer (the "
                                 "first of its devices), or on devices of its own")
        group = tuple(sorted(set(senders) | set(hosts)))
        for v in sorted(versions):
            common = dict(op=f"sync_{key}", kind=OpKind.SYNC_WEIGHTS, step=v - 1, chunk=0,
                          chunks=1, rank=0, world=1, tp_group=group, stages=(), inputs=[],
                          deps=[], after=[], bound=0)
            for dev in hosts:             # every engine takes every version: one group
                out.append(dict(common, id=OpId.of(f"sync_{engine_key(key)}", v - 1, role=RECV,
                                                   device=dev),
                                device=dev, role=RECV, model=engine_key(key), version=-1,
                                writes=v))
            for t, src in enumerate(senders):
                out.append(dict(common, id=OpId.of(f"sync_{key}", v - 1, role=SEND, tp_rank=t),
                                device=src, role=SEND, model=key, version=v, writes=-1))
    return out


def _sources(homes, trained: dict, key: str) -> tuple[int, ...]:
    """The home devices that hold a trained model's weights for a transfer
    (``rpeg.cost.engine_sync.sync_senders``)."""
    p = trained[key]
    return sync_senders(homes[key], p.tp, p.zero)


def _order_versions(calls: list[dict], homes, frozen, first: int = 0) -> None:
    """Reader after the writer of its version; writer of v after readers of v - 1 (same device)."""
    writer: dict[tuple[str, int, int], str] = {}
    readers: dict[tuple[str, int, int], list[str]] = defaultdict(list)
    for c in calls:
        if c["writes"] >= 0:
            writer[(c["model"], c["device"], c["writes"])] = c["id"]
        if c["version"] >= 0 and base_of(c["model"]) in homes:
            readers[(c["model"], c["device"], c["version"])].append(c["id"])
    for c in calls:
        key, dev = c["model"], c["device"]
        if c["version"] > first and base_of(key) in homes:
            w = writer.get((key, dev, c["version"]))
            if w is None:
                raise PlanError(f"no op makes version {c['version']} of '{key}' on device {dev} "
                                f"for '{c['id']}'")
            c["after"].append(w)
        if c["writes"] >= 0:
            v = c["writes"]
            c["after"] += [r for r in readers.get((key, dev, v - 1), []) if r != c["id"]]
            if (key, dev, v - 1) in writer:
                c["after"].append(writer[(key, dev, v - 1)])


def _order_collectives(calls: list[dict]) -> None:
    """Calls that run collectives together (the ranks of a data-parallel train op, the ranks
    of a tensor-parallel group) form a gang. Each gang waits for the union of its members'
    dependencies, and on every device gangs run in one global order (a topological order
    of all calls), so gloo/NCCL collectives never interleave differently on two ranks.
    A large gang waits through one join call instead of copying all that into every
    member (``rpeg.runtime.lowering.joins``); the join is added to ``calls``."""
    gangs: dict[tuple, list[dict]] = defaultdict(list)
    for c in calls:
        if c.get("gang"):                  # a weight transfer: its exports and loads together
            gangs[(c["op"], c["step"], 0, "sync")].append(c)
        elif c["tp_group"] or ranks_together(c["kind"], c["world"]):
            role = c.get("role", "")
            gangs[(c["op"], c["step"], c["chunk"], "push" if role in (SEND, RECV) else role)
                  ].append(c)
    gangs = {k: v for k, v in gangs.items() if len(v) > 1}
    if not gangs:
        return
    joins: dict[tuple, dict] = {}
    for key, ranks in gangs.items():
        join = join_gang(ranks)
        if join is not None:
            joins[key] = join
            continue
        own = {r["id"] for r in ranks}
        union = list(dict.fromkeys(d for r in ranks for d in r["deps"] + r["after"]
                                   if d not in own))
        for r in ranks:
            r["after"] = [d for d in union if d not in r["deps"]]
    calls.extend(joins.values())
    gang_of = {r["id"]: k for k, ranks in gangs.items() for r in ranks}
    order = list(dict.fromkeys(gang_of[cid] for cid in _topo(calls) if cid in gang_of))
    last_on: dict[int, str] = {}
    for key in order:                        # gangs by their first member's place in the order
        ranks = gangs[key]
        # every member waits for the previous gang on each member's device: a rank that
        # starts never blocks in a collective whose partner still waits for other work
        before = list(dict.fromkeys(last_on[c["device"]] for c in ranks
                                    if c["device"] in last_on))
        for c in [joins[key]] if key in joins else ranks:
            c["after"] += before
        for c in ranks:
            last_on[c["device"]] = c["id"]


def _order_pushes(calls: list[dict]) -> None:
    """A device both sending a version and hosting an engine that takes it hosts an engine
    sharing a sending device, which the send loads in process (``sync_layout``): its
    ``recv`` comes after the ``send`` and only marks the version served."""
    send = {(c["op"], c["step"], c["device"]): c["id"] for c in calls if c.get("role") == SEND}
    for c in calls:
        if c.get("role") == RECV and (c["op"], c["step"], c["device"]) in send:
            c["after"].append(send[(c["op"], c["step"], c["device"])])


def _topo(calls: list[dict]) -> tuple[str, ...]:
    """Call ids in a dependency order; ties go to the earlier call in ``calls``."""
    table = {c["id"]: c for c in calls}
    try:
        return topological(list(table), lambda i: table[i]["deps"] + table[i]["after"])
    except Cycle as e:
        raise PlanError(f"the op calls must have no dependency cycle, and {e.stuck[:3]} "
                        "are in one") from None
