"""Which copies of each backbone's weights a plan keeps, on which devices, and which copy
each op reads there: one rule, by which the runtime keys its op calls' replicas
(``rpeg.runtime.lowering.instances.build_calls``) and the cost model prices what stays
resident between stages (:meth:`rpeg.plan.evaluate.Evaluator.copies`).

    >>> from rpeg.graph import Graph, Op
    >>> from rpeg.plan.lower import lower
    >>> from rpeg.plan.model import StagePlacement
    >>> P = StagePlacement.of
    >>> from rpeg.spec.model import Engine, OpKind
    >>> g = Graph("g", (Op("rollout", OpKind.GENERATE, reads_model="actor", stages=("rollout",)),
    ...                 Op("train", OpKind.TRAIN, reads_model="actor", writes_model="actor",
    ...                    stages=("train",))), (), (), ("actor",), ("actor",))
    >>> def held(**place):
    ...     at = lambda o: place[o.name]
    ...     return copies(lower(g, None, 8, at), at)
    >>> h = held(rollout=P("rollout", (0, 1), dp=2), train=P("train", (0, 1), dp=2, zero=3))
    >>> [(c.key, c.devices, c.trained) for c in h.held], h.key_of("rollout", 1)
    ([('actor', (0, 1), True), ('actor~whole', (0, 1), False)], 'actor~whole')
    >>> h = held(rollout=P("rollout", (0, 1), dp=2, engine=Engine.VLLM),
    ...          train=P("train", (0, 1), dp=2, zero=2))
    >>> [(c.key, c.devices, c.trained) for c in h.held]
    [('actor', (0, 1), True), ('actor~vllm', (0, 1), False)]
    >>> h = held(rollout=P("rollout", (0,)), train=P("train", (0, 1), dp=2))
    >>> [(c.key, c.devices, c.trained) for c in h.held], h.key_of("rollout", 0)
    ([('actor', (0, 1), True)], 'actor')

A forward on its ZeRO-3 trainer's ranks, in a step streaming one chunk, reads the trained
copy itself (each rank's shards, gathered layer by layer as it runs):

    >>> g = Graph("g", g.ops + (Op("old_lp", OpKind.FORWARD, reads_model="actor",
    ...                            stages=("old_lp",)),), (), (), ("actor",), ("actor",))
    >>> h = held(rollout=P("rollout", (0,)), train=P("train", (0, 1), dp=2, zero=3),
    ...          old_lp=P("old_lp", (0, 1), dp=2, zero=3))
    >>> [(c.key, c.devices) for c in h.held], h.key_of("old_lp", 1)
    ([('actor', (0, 1)), ('actor~whole', (0,))], 'actor')

A train op keeps its backbone's trained copy (the backbone's own key) on every device it
runs on. On each device where an op reading a model runs a call (its layout's
:meth:`~rpeg.plan.oplayout.OpLayout.members`), it reads (:func:`copy_key`):

* a vLLM engine's own copy (``actor~vllm``) where its engine serves one
  (:func:`rpeg.cost.engine_sync.serves_copy`: also beside a ZeRO-2 trainer, whose weights
  FSDP2 holds);
* on a device its trainer holds, the trained copy where it reads that in place
  (:func:`rpeg.plan.oplayout.reads_in_place`), or where it runs on every rank of the
  trainer's ZeRO-3 shards, gathering each layer as it runs it
  (:func:`rpeg.plan.oplayout.gathers_in_place`: its layout a call on every rank), else a
  second copy split as the op splits it (``actor~tp0-1``; ``actor~whole``: unsplit),
  ZeRO-3 shards included: a per-chunk pass never runs on the trainer's shards, which only
  all its ranks gather together;
* elsewhere the backbone's own key.

A copy has one layout on a device: the first op to read a key there (its trainer, then
the readers in the graph's topological order) lays it out, and a later reader splitting
it another way reads a second copy; every rank of a tensor-parallel block reads the same
copy. Each copy is held as the placement that first lays it out holds it (:class:`Copy`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import attrs

from rpeg.cost.engine_sync import serves_copy
from rpeg.graph.ids import Backbone, ReplicaKey, engine_key, variant_key
from rpeg.plan.oplayout import all_in_place, reads_in_place_on
from rpeg.spec.model import OpKind


@attrs.frozen
class Copy:
    """One copy of a backbone's weights, on the devices holding it laid out alike."""

    key: ReplicaKey
    devices: tuple[int, ...]          # ascending (a vLLM engine's: every worker's device)
    placement: object                 # the StagePlacement laying it out (the trainer's, or
                                      # the first reader's there)
    trained: bool                     # the trained copy: gradients and optimizer state too


@attrs.frozen(eq=False)
class BackboneCopies:
    """The copies of one backbone's weights and the copy each op reading it reads on each
    of its devices: a pure function of its trainer's and readers' placements and layouts
    (:func:`_backbone`, memoised), so a plan that moves an op reading another backbone
    finds it again, and the ops reading before (:attr:`before`) with it."""

    model: Backbone
    held: tuple[Copy, ...]
    # op -> device -> key (read-only: shared with every caller asking for the same copies)
    reads: dict[str, dict[int, ReplicaKey]] = attrs.field(repr=False)
    # :meth:`Copies.read_before` of this backbone's ops: found as its copies are laid out
    # (an op none of whose devices is the first to lay out the key it reads there)
    before: frozenset[str] = frozenset()
    # key -> the devices some op reads it on (-> the op first laying it out there), of
    # each key its ops read (read-only)
    firsts: dict[ReplicaKey, dict[int, int]] = attrs.field(factory=dict, repr=False)


@attrs.frozen(eq=False)
class Copies:
    """Every copy a plan keeps, and the copy each op reads on each of its devices."""

    held: tuple[Copy, ...]
    # op -> device -> key (read-only: shared with every caller asking for the same copies)
    reads: dict[str, dict[int, ReplicaKey]] = attrs.field(repr=False)
    backbones: tuple[BackboneCopies, ...] = attrs.field(default=(), repr=False)

    def key_of(self, op: str, device: int) -> ReplicaKey | None:
        """The copy ``op`` reads on ``device`` (None: it reads no model)."""
        return self.reads.get(op, {}).get(device)

    def read_before(self) -> frozenset[str]:
        """The ops reading only copies an op before them reads on the same devices (the
        trainer, then the readers in topological order): one copy on a device is filled
        once a version, by one load of the model's weight transfer
        (:func:`rpeg.plan.lower.fills`) or the graph's weight sync, however many ops read
        it, so only the first reader's fetch is priced (``OpTimings._reload``). A copy's
        key names its backbone and an op reads one backbone, so each backbone's ops are
        found apart (:attr:`BackboneCopies.before`)."""
        return frozenset().union(*(b.before for b in self.backbones))


def copy_key(op, place, device: int, trainer, group: tuple[int, ...]) -> ReplicaKey | None:
    """The key of the copy of its model an op placed as ``place`` reads on ``device`` (its
    tensor-parallel block there: ``group``; ``trainer``: the placement training the model,
    or None), before layouts are compared (see the module doc)."""
    return copy_keys(op, place, ((device, group),), trainer)[0]


def copy_keys(op, place, members, trainer) -> tuple[ReplicaKey | None, ...]:
    """:func:`copy_key` on each (device, group) of ``members`` (the trainer's devices and
    where the op reads in place looked up once, not once per device)."""
    model = op.reads_model
    if not model or op.kind is OpKind.TRAIN:
        return (ReplicaKey.maybe(model),) * len(members)
    held = _held(trainer) if trainer is not None else frozenset()
    on = tuple(d for d, _ in members if d in held)
    in_place = dict(zip(on, reads_in_place_on(trainer, place, on), strict=True)) if on else {}
    # whether a vLLM engine serves a copy of its own depends on a device only through
    # whether the trainer holds the model there: asked once for each, not once per device
    gen = op.kind is OpKind.GENERATE
    served_on = gen and bool(held) and serves_copy(trainer, place, next(iter(held)))
    served_off = gen and serves_copy(trainer, place, -1)
    return tuple(engine_key(model) if (served_on if d in held else served_off)
                 else variant_key(model, group) if d in in_place and not in_place[d]
                 else ReplicaKey(model) for d, group in members)


@functools.lru_cache(maxsize=4096)
def _held(trainer) -> frozenset[int]:
    """The trainer's devices, by the placement (its hash kept: not a tuple of thousands
    hashed again for every device asked about)."""
    return frozenset(trainer.devices)


def copies(placed, placement_of: Callable) -> Copies:
    """The copies of a plan's step graph placed as ``placed`` (:class:`rpeg.plan.lower.Placed`;
    ``placement_of``: graph op -> its placement), and which each op reads where."""
    held: list[Copy] = []
    reads: dict[str, dict[int, ReplicaKey]] = {}
    parts = []
    for model, t, readers in _models(placed.graph):
        train = (t, placement_of(t), placed.layout(t.name)) if t is not None else None
        mine = tuple((o, placement_of(o), placed.layout(o.name)) for o in readers)
        part = _backbone(model, train, mine, placed.chunks)
        held += part.held
        reads.update(part.reads)
        parts.append(part)
    return Copies(tuple(held), reads, tuple(parts))


@functools.lru_cache(maxsize=64)
def _models(graph) -> tuple[tuple[Backbone, object, tuple], ...]:
    """(backbone, its train op or None, the ops reading it in topological order) of each
    backbone ``graph`` trains or reads: its trained ones first."""
    trainers = {o.writes_model: o for o in graph.ops if o.kind is OpKind.TRAIN and o.writes_model}
    readers: dict[Backbone, list] = {}
    for name in graph.topo_order():
        o = graph.op(name)
        if o.reads_model and o.kind not in (OpKind.TRAIN, OpKind.SYNC_WEIGHTS):
            readers.setdefault(o.reads_model, []).append(o)
    return tuple((model, trainers.get(model), tuple(readers.get(model, ())))
                 for model in dict.fromkeys([*trainers, *readers]))


@functools.lru_cache(maxsize=4096)
def _backbone(model: Backbone, train, readers: tuple, chunks: int) -> BackboneCopies:
    """The copies of one backbone and which copy each op reads where: ``train``: (op,
    placement, layout) of its train op or None; ``readers``: those of the ops reading it, in
    topological order. Laid out by what the rule reads of the placements (:func:`_core`:
    a plan that changes another field of one, its microbatches or offload, say, finds the
    layout again), each copy held as the placement laying it out holds it."""
    held, reads, before, firsts = _laid_out(
        model, _cored(train) if train is not None else None, tuple(map(_cored, readers)),
        chunks)
    places = (train[1] if train is not None else None,) + tuple(p for _, p, _ in readers)
    return BackboneCopies(model, tuple(Copy(key, ds, places[n], n == 0) for key, ds, n in held),
                          reads, before, firsts)


def _cored(laid: tuple) -> tuple:
    """(op, placement, layout) with the placement as the copies rule reads it."""
    op, place, lay = laid
    return op, _core(place), lay


@functools.lru_cache(maxsize=4096)
def _core(place):
    """What the copies rule reads of a placement (its devices, tensor-parallel and pipeline
    degrees, ZeRO level and engine: :func:`copy_keys`, :func:`_keys`, through
    :func:`~rpeg.plan.oplayout.reads_in_place_on`, :func:`~rpeg.plan.oplayout.all_in_place`
    and :func:`~rpeg.cost.engine_sync.serves_copy`), every other field at its default."""
    return type(place).of("", place.devices, tp=place.tp, pp=place.pp, zero=place.zero,
                          engine=place.engine)


@functools.lru_cache(maxsize=4096)
def _laid_out(model: Backbone, train, readers: tuple, chunks: int) -> tuple:
    """(the (key, devices, index of who lays it out: 0 the trainer, n the n-th reader) of
    each copy, :attr:`BackboneCopies.reads`, ``before`` and ``firsts``) of one backbone
    (see :func:`_backbone`; its placements as :func:`_core` keeps them).

    Each key's layouts and first layers are kept per key (device -> group, device -> the
    op laying it out), so a reader whose devices hold no layout of its key yet is entered
    whole (dict operations over its devices, no Python loop per device); only the devices
    where a layout of its key is already there are compared one by one."""
    layouts: dict[ReplicaKey, dict[int, tuple[int, ...]]] = {}   # the first layout there
    firsts: dict[ReplicaKey, dict[int, int]] = {}    # who lays it out there: 0 the trainer
    # (key, who) -> the devices it lays out first, in the order laid (a key's first layer)
    devices: dict[tuple[ReplicaKey, int], list[int]] = {}
    reads: dict[str, dict[int, ReplicaKey]] = {}
    before: list[str] = []            # the readers reading only copies read before
    trainer = None
    if train is not None:
        op, trainer, lay = train
        key = ReplicaKey(model)
        ds, groups, _ = _parts(lay, chunks)
        layouts[key] = dict(zip(ds, groups, strict=True))
        firsts[key] = dict.fromkeys(ds, 0)
        reads[op.name] = dict.fromkeys(ds, key)
        if ds:
            devices[(key, 0)] = list(ds)
    for n, (op, place, lay) in enumerate(readers, start=1):
        want = _wanted_by_key(model, op, place, lay, trainer, chunks)
        at = want.at()
        for key, ds, groups in want.by_key:
            laid = layouts.get(key)
            if laid is None:
                layouts[key] = dict(zip(ds, groups, strict=True))
            elif laid.keys().isdisjoint(ds):
                laid.update(zip(ds, groups, strict=True))
            else:                             # compared where a layout of it is there
                for d, group in zip(ds, groups, strict=True):
                    if laid.setdefault(d, group) != group:
                        at[d] = _variant(model, group)
        if want.grouped:
            split = {key for key in set(at.values()) if key.variant}
            for d, group in zip(want.devices, want.groups, strict=True) if split else ():
                # a block's ranks read one copy
                if group and at[d] not in split:
                    other = next((at[x] for x in group if at[x] in split), None)
                    if other is not None:
                        at[d] = other
        if not _first_layers(at, n, firsts, devices) and at:
            before.append(op.name)     # every copy it reads there, an op before it reads
        reads[op.name] = at
    # a vLLM engine's copy, read on its host, lies on every device its workers span
    out = []
    for (key, n), ds in devices.items():     # one copy per key and op laying it out
        if key.engine and n and readers[n - 1][2].per_block:
            span = _hosts(readers[n - 1][2])
            ds = [x for d in ds for x in span.get(d, (d,))]
        out.append((key, tuple(sorted(ds)), n))
    return tuple(out), reads, frozenset(before), firsts


def _first_layers(at: dict[int, ReplicaKey], n: int, firsts: dict, devices: dict) -> bool:
    """Record reader ``n``'s devices (``at``: device -> key) where it is the first to lay
    out its key: ``devices[(key, n)]``, the (key, n) entered in the order of each one's
    first such device in ``at``. Whether it is the first on some device (else an op before
    it reads each copy it reads, on the same device: :meth:`Copies.read_before`)."""
    keys = set(at.values())
    if len(keys) == 1:
        (key,) = keys
        first = firsts.get(key)
        if first is None:
            firsts[key] = dict.fromkeys(at, n)
            new = list(at)
        elif first.keys().isdisjoint(at):
            first.update(dict.fromkeys(at, n))
            new = list(at)
        else:
            new = [d for d in at if d not in first]
            first.update(dict.fromkeys(new, n))
        if new:
            devices[(key, n)] = new
        return bool(new)
    found: dict[ReplicaKey, list[int]] = {}
    for d, key in at.items():
        first = firsts.get(key)
        if first is None:
            first = firsts[key] = {}
        if d not in first:
            first[d] = n
            mine = found.get(key)
            if mine is None:
                found[key] = [d]
            else:
                mine.append(d)
    for key, new in found.items():
        devices[(key, n)] = new
    return bool(found)


@functools.lru_cache(maxsize=4096)
def _variant(model: Backbone, group: tuple[int, ...]) -> ReplicaKey:
    """:func:`~rpeg.graph.ids.variant_key`, built once per model and block."""
    return variant_key(model, group)


@attrs.frozen(eq=False)
class _Want:
    """A reader's wanted copies (:func:`_wanted`), arranged for :func:`_backbone`."""

    devices: tuple[int, ...]        # where it runs a call, in the order of its members
    groups: tuple[tuple[int, ...], ...]     # the tensor-parallel block of each
    keys: ReplicaKey | tuple[ReplicaKey, ...]   # the key each wants (one: all alike)
    by_key: tuple                   # (key, its devices, their blocks) per key, first first
    grouped: bool                   # some device runs in a tensor-parallel block

    @property
    def members(self) -> tuple:
        """(device, its block, its key) of each device."""
        keys = self.keys
        if isinstance(keys, ReplicaKey):
            return tuple((d, g, keys) for d, g in zip(self.devices, self.groups, strict=True))
        return tuple(zip(self.devices, self.groups, keys, strict=True))

    def at(self) -> dict[int, ReplicaKey]:
        """Device -> the key it wants (a new dict)."""
        if isinstance(self.keys, ReplicaKey):
            return dict.fromkeys(self.devices, self.keys)
        return dict(zip(self.devices, self.keys, strict=True))


@functools.lru_cache(maxsize=4096)
def _parts(lay, chunks: int) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], bool]:
    """(devices, their blocks, whether any has a block) of ``lay``'s members."""
    members = lay.members(chunks)
    ds, groups = zip(*members, strict=True) if members else ((), ())
    assert len(set(ds)) == len(ds), "a layout's members are its devices once each"
    return ds, groups, any(groups)


@functools.lru_cache(maxsize=4096)
def _wanted_by_key(model: Backbone, op, place, lay, trainer, chunks: int) -> _Want:
    """The key of the copy each device of a reader placed as ``place`` (laid out as
    ``lay``) wants, before the layouts of the copies there are compared (see
    :func:`_wanted`): a pure function of the reader and its trainer, so a plan that moves
    another op finds it again; the keys built once each, one for all where all are alike."""
    ds, groups, grouped = _parts(lay, chunks)
    keys = _keys(model, op, place, lay, trainer, ds, groups)
    if isinstance(keys, ReplicaKey):
        by_key = ((keys, ds, groups),) if ds else ()
    else:
        split: dict[ReplicaKey, tuple[list, list]] = {}
        for d, g, k in zip(ds, groups, keys, strict=True):
            mine = split.get(k)
            if mine is None:
                split[k] = ([d], [g])
            else:
                mine[0].append(d)
                mine[1].append(g)
        by_key = tuple((k, tuple(x), tuple(y)) for k, (x, y) in split.items())
    return _Want(ds, groups, keys, by_key, grouped)


def _keys(model: Backbone, op, place, lay, trainer, ds: tuple[int, ...],
          groups: tuple) -> ReplicaKey | tuple[ReplicaKey, ...]:
    """:func:`copy_key` on each of ``ds`` (blocks ``groups``): one key where all are alike."""
    # on every device, the trained copy where it is read in place there, or where the op
    # runs on every rank of its trainer's ZeRO-3 shards (gathers_in_place)
    if trainer is not None and (all_in_place(trainer, place) or lay.everywhere):
        return ReplicaKey(model)
    # off its trainer's devices the key is the same on every device (device -1: none)
    elsewhere = copy_key(op, place, -1, trainer, ())
    held = _held(trainer) if trainer is not None else frozenset()
    if not held or held.isdisjoint(ds):
        return elsewhere
    on = tuple(d for d in ds if d in held)
    if not op.reads_model or op.kind is OpKind.TRAIN:   # the rule as it stands
        pairs = tuple((d, g) for d, g in zip(ds, groups, strict=True) if d in held)
        got = dict(zip(on, copy_keys(op, place, pairs, trainer), strict=True))
        return tuple(got.get(d, elsewhere) for d in ds)
    # on the trainer's devices: an engine's own copy (whether one is served there depends
    # on the placements alone), else the trained copy where read in place, else a second
    # copy split as the op splits it
    if op.kind is OpKind.GENERATE and serves_copy(trainer, place, next(iter(held))):
        engine = engine_key(model)
        if engine == elsewhere or len(on) == len(ds):
            return engine
        return tuple(engine if d in held else elsewhere for d in ds)
    own = ReplicaKey(model)
    in_place = dict(zip(on, reads_in_place_on(trainer, place, on), strict=True))
    return tuple(elsewhere if d not in held else own if in_place[d] else _variant(model, g)
                 for d, g in zip(ds, groups, strict=True))


@functools.lru_cache(maxsize=4096)
def _hosts(lay) -> dict[int, tuple[int, ...]]:
    """An engine's host -> the devices its workers span, of each block of ``lay``
    (read-only: shared between callers)."""
    return {b[0]: b for b in lay.blocks}


def _wanted(model: Backbone, op, place, lay, trainer, chunks: int) -> tuple:
    """(device, its tensor-parallel block, the key of the copy it wants) of every device
    where a reader placed as ``place`` (laid out as ``lay``) runs a call, before the
    layouts of the copies there are compared (:func:`_wanted_by_key`)."""
    return _wanted_by_key(model, op, place, lay, trainer, chunks).members


__all__ = ["BackboneCopies", "Copies", "Copy", "copies", "copy_key", "copy_keys"]
