"""Where a plan's op instances run: one rule, read by the runtime as it lays out its op
calls (``rpeg.runtime.lowering.instances``) and by the cost model as it counts them
(``rpeg.plan.tasks``).

    >>> from rpeg.graph import Op
    >>> from rpeg.plan.model import StagePlacement
    >>> from rpeg.spec.model import Engine, OpKind
    >>> gen = Op("rollout", OpKind.GENERATE, reads_model="actor", stages=("rollout",))
    >>> lay = op_layout(gen, StagePlacement.of("rollout", (0, 1, 2, 3), tp=2), streamed=True)
    >>> lay.devices_of(0), lay.devices_of(1), lay.devices_of(2)
    ((0, 1), (2, 3), (0, 1))
    >>> vllm = StagePlacement.of("rollout", (0, 1, 2, 3), tp=2, engine=Engine.VLLM)
    >>> [(c.chunk, c.device, c.group) for c in op_layout(gen, vllm, streamed=True).calls(3)]
    [(0, 0, ()), (1, 2, ()), (2, 0, ())]

A stage's devices are blocks of ``tp`` consecutive devices (for an op that reads a model:
one tensor-parallel group each); a streamed op's chunk ``c`` runs on block ``c mod
blocks``, on every device of it, but a vLLM engine's on that block's first device alone
(the engine's own workers span the block); a train op runs on every device (data-parallel
rank ``i // tp``); a pass or per-sample host op at dp > 1 in a step not streaming it runs
split (:func:`split_parts`): one call on each block, part ``b`` of the batch on block ``b``
(the batch's sequences divided as evenly as can be, in order; more blocks than sequences,
an empty part, is refused), its readers reading every part; any other op on the first
block. Readers take the output of an instance's first
device. The ranks of a tensor-parallel block or of a data-parallel train
op run collectives together.

Chunks a step streams (:func:`chunks_per_step`): each generate op's asked-for chunks,
rounded up so each of its blocks streams as many, never more per block than the responses
the emptiest block generates (whole groups, under dynamic sampling, leave some blocks
fewer than an even split: :func:`rpeg.graph.deal.emptiest_share`); ops streaming those chunks are the graph's per-sample readers of them
(:func:`streamed_ops`, :func:`rpeg.graph.chunk_counts`). A block's engine streams its own
share of the responses in its chunks, each as its responses finish; so the chunks of a
step come in rounds (:func:`rounds_of`), round ``j`` a chunk on every block, side by side,
each block's ``j``-th as they finish. A round is what the cost model prices as one chunk:
the ``j``-th slice of every replica's responses by when they finish
(:func:`rpeg.cost.stages.generation_chunks`). Fewer chunks asked than blocks stream one
round, as whole batches do: a chunk spanning blocks would wait for the slowest of them.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import attrs

from rpeg.cost.engine_sync import engine_hosts_of, serves_copy, sync_senders, tp_blocks
from rpeg.errors import PlanError
from rpeg.graph import Graph, chunk_counts
from rpeg.graph.deal import deal_group, emptiest_share
from rpeg.graph.ids import fused_name
from rpeg.spec.model import Engine, OpKind


@attrs.frozen
class Call:
    """One device's share of an op instance in a step."""

    chunk: int                        # the instance's chunk (0: not streamed)
    index: int                        # its place among the op's calls of a step
    device: int
    rank: int = 0                     # data-parallel rank (train)
    group: tuple[int, ...] = ()       # the tensor-parallel block running it together (tp > 1)


@attrs.frozen(cache_hash=True)        # a key of the copies' memos: hashed once
class OpLayout:
    """How one op's instances lie on its devices (see the module doc)."""

    devices: tuple[int, ...]
    tp: int = 1                       # devices per block (tensor-parallel ranks)
    chunked: bool = False             # streamed: chunk c on block c mod blocks
    per_block: bool = False           # one call per block, on its first device (vLLM)
    everywhere: bool = False          # a call on every device (train ranks, weight syncs)
    collective: bool = False          # its calls on several devices run collectives
    # a weight sync's calls as the runtime lays them out: its gangs, each the devices of its
    # calls in order, its join (a gang of JOIN_MIN or more) on the first (:func:`rpeg.plan.
    # tasks.transfer_gangs`); (): one gang on ``devices``
    gangs: tuple[tuple[int, ...], ...] = ()
    fills: tuple[int, ...] = ()       # of those, the devices loading or receiving a copy
    # > 0: a step's one instance split into this many parts of its batch, part c on block c
    # (:func:`split_parts`; chunked then, its parts as its chunks)
    parts: int = 0

    @property
    def blocks(self) -> tuple[tuple[int, ...], ...]:
        return _tp_blocks(self)

    def devices_of(self, chunk: int) -> tuple[int, ...]:
        """The devices running an instance's calls, the one whose output readers take
        first."""
        if self.everywhere or not self.devices:
            return self.devices
        tp = max(1, self.tp)
        blocks = -(-len(self.devices) // tp)
        start = (chunk % blocks) * tp if self.chunked else 0
        return self.devices[start:start + (1 if self.per_block else tp)]

    def calls(self, chunks: int) -> tuple[Call, ...]:
        """Every call of the op in a step whose generate ops stream ``chunks`` chunks."""
        tp, group = max(1, self.tp), self._groups()
        if self.everywhere:
            return tuple(Call(0, i, d, i // tp, group.get(d, ())) for i, d in
                         enumerate(self.devices))
        return tuple(Call(c, c, d, 0, group.get(d, ()))
                     for c in range(self.instances(chunks)) for d in self.devices_of(c))

    def instances(self, chunks: int) -> int:
        """Instances of the op a step whose generate ops stream ``chunks`` chunks (its
        ranks' calls one instance)."""
        return self.parts or (chunks if self.chunked and not self.everywhere else 1)

    def members(self, chunks: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(device, its tensor-parallel block) of every device running a call of the op in
        a step whose generate ops stream ``chunks`` chunks, once each, in the order of
        :meth:`calls` (a streamed op's chunks past its blocks run on the same devices)."""
        return _members(self, chunks)

    def _members_uncached(self, chunks: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        tp, group = max(1, self.tp), self._groups()
        if self.everywhere:
            devices = self.devices
        else:                         # self.devices_of(c) of each chunk c < n, in turn
            blocks = -(-len(self.devices) // tp) if self.devices else 0
            n = min(self.parts or chunks, blocks) if self.chunked else 1
            devices = self.devices[:n * tp:tp] if self.per_block else self.devices[:n * tp]
        if not group:
            return tuple(zip(devices, itertools.repeat((), len(devices)), strict=True))
        return tuple(zip(devices, map(group.get, devices, itertools.repeat(())), strict=True))

    def _groups(self) -> dict[int, tuple[int, ...]]:
        """Device -> the tensor-parallel block its call runs with ({}: none, unsplit or one
        call per block), looked up once per question, not once per device."""
        return _layout_blocks(self) if block_together(self.tp, self.per_block) else {}


@functools.lru_cache(maxsize=4096)
def _members(layout: OpLayout, chunks: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """:meth:`OpLayout.members`, memoised: a search lays the same ops out again and again."""
    return layout._members_uncached(chunks)


def block_of(devices: tuple[int, ...], tp: int, device: int) -> tuple[int, ...]:
    """The tensor-parallel block of ``devices`` (blocks of ``tp``) that ``device`` runs in;
    () unsplit (tp 1)."""
    return () if tp <= 1 else _blocks(tuple(devices), tp)[device]


@functools.lru_cache(maxsize=1024)
def _blocks(devices: tuple[int, ...], tp: int) -> dict[int, tuple[int, ...]]:
    """Device -> its block of ``devices`` (read-only: shared between callers)."""
    return {d: b for b in tp_blocks(devices, tp) for d in b}


# By the layout or placement, whose hash is kept, not by its devices, which a tuple of
# thousands would hash again on every device's question.
@functools.lru_cache(maxsize=4096)
def _layout_blocks(layout: OpLayout) -> dict[int, tuple[int, ...]]:
    return _blocks(tuple(layout.devices), layout.tp)


@functools.lru_cache(maxsize=4096)
def _tp_blocks(layout: OpLayout) -> tuple[tuple[int, ...], ...]:
    return tp_blocks(layout.devices, layout.tp)


@functools.lru_cache(maxsize=4096)
def _placed_blocks(p, tp: int) -> dict[int, tuple[int, ...]]:
    return _blocks(tuple(p.devices), tp)


def reads_in_place(trainer, reader, device: int) -> bool:
    """Whether an op placed as ``reader`` reads, on ``device``, a trained model's weights
    where its trainer (placed as ``trainer``) keeps them, so that no weight sync moves them
    there: on one of the trainer's devices, split as the trainer splits them there (the same
    tensor-parallel block, or both unsplit), held whole between train ops (not ZeRO-3's
    shards, not pipeline stages), and not through a vLLM engine's own copy
    (:func:`rpeg.cost.engine_sync.serves_copy`). Any other reader there reads a second copy
    that a weight sync loads.

        >>> from rpeg.plan.model import StagePlacement
        >>> P = StagePlacement.of
        >>> t = P("train", (0, 1, 2, 3), dp=2, tp=2)
        >>> [reads_in_place(t, P("g", (0, 1), tp=2), d) for d in (0, 1)]
        [True, True]
        >>> reads_in_place(t, P("g", (1, 2), tp=2), 1), reads_in_place(t, P("g", (0,)), 0)
        (False, False)
    """
    return reads_in_place_on(trainer, reader, (device,))[0]


def reads_in_place_on(trainer, reader, devices) -> tuple[bool, ...]:
    """:func:`reads_in_place` on each of ``devices`` (the placements' blocks looked up once,
    not once per device)."""
    if trainer.zero.shards_params or max(trainer.pp, reader.pp) != 1:
        return (False,) * len(devices)
    held = _placed_blocks(trainer, 1)
    if not held:
        return (False,) * len(devices)
    # asked on the trainer's devices only, where an engine's copy of its own depends on
    # the placements alone: asked once, not once per device
    if serves_copy(trainer, reader, trainer.devices[0]):
        return (False,) * len(devices)
    mine = _placed_blocks(trainer, trainer.tp) if trainer.tp > 1 else None
    theirs = _placed_blocks(reader, reader.tp) if reader.tp > 1 else None
    return tuple(d in held
                 and (mine[d] if mine is not None else ())
                 == (theirs[d] if theirs is not None else ()) for d in devices)


def gathers_in_place(op, trainer, reader, chunks: int) -> bool:
    """Whether graph op ``op`` (a forward pass, placed as ``reader``) runs on its
    trainer's ZeRO-3 shards in place (``trainer``: the placement training its model, or
    None): on exactly the trainer's devices, in the same data-parallel group (both ZeRO-3,
    unsplit, one pipeline stage), once a step (``chunks``: the step streams one). Every
    rank then runs its share of the pass with the trainer's sharded module, which gathers
    each layer's weights over the group as it runs it (FSDP2's all-gather, as
    DeepSpeed-Chat's hybrid engine and verl's FSDP workers read their actor): no copy of
    its own, no weight sync. A pass per chunk on one block never runs on shards that only
    all the ranks gather together: it reads a copy of its own.

        >>> from rpeg.graph import Op
        >>> from rpeg.plan.model import StagePlacement
        >>> P = StagePlacement.of
        >>> fwd = Op("old_lp", OpKind.FORWARD, reads_model="actor", stages=("old_lp",))
        >>> t = P("train", (0, 1), dp=2, zero=3)
        >>> gathers_in_place(fwd, t, P("old_lp", (0, 1), dp=2, zero=3), 1)
        True
        >>> [gathers_in_place(fwd, t, P("old_lp", (0, 1), dp=2, zero=z), n)
        ...  for z, n in ((3, 2), (0, 1))]
        [False, False]
    """
    return (trainer is not None and op.kind is OpKind.FORWARD
            and chunks == 1 and len(reader.devices) > 1
            and trainer.zero.shards_params and reader.zero.shards_params
            and tuple(reader.devices) == tuple(trainer.devices)
            and trainer.tp == reader.tp == 1 and max(trainer.pp, reader.pp) == 1)


@functools.lru_cache(maxsize=4096)
def all_in_place(trainer, reader) -> bool:
    """Whether ``reader`` reads the trained weights in place on every device of its own
    (:func:`reads_in_place`): its weight sync moves nothing."""
    return all(reads_in_place_on(trainer, reader, tuple(reader.devices)))


@functools.lru_cache(maxsize=4096)
def any_in_place(trainer, reader) -> bool:
    """Whether ``reader`` reads the trained weights in place on some device of its own
    (:func:`reads_in_place`): there its trainer's next write waits for it."""
    return any(reads_in_place_on(trainer, reader, tuple(reader.devices)))


def ranks_together(kind: OpKind, world: int) -> bool:
    """Whether an op's calls on ``world`` data-parallel ranks run collectives together: a
    train op's, and a pass on its trainer's ZeRO-3 shards (each layer gathered by all).
    The one rule the runtime's calls say they are a gang's ranks by
    (``rpeg.runtime.lowering.calls.OpCall.collective``) and a layout says its instances
    are gangs by (:func:`op_layout`, which the cost model's count reads).

        >>> ranks_together(OpKind.TRAIN, 2), ranks_together(OpKind.GENERATE, 2)
        (True, False)
    """
    return world > 1 and kind is not OpKind.GENERATE


def block_together(tp: int, per_block: bool) -> bool:
    """Whether the calls of an instance on a tensor-parallel block of ``tp`` devices run
    collectives together: a call on each device of a block of two or more, not a vLLM
    engine's one call a block (``per_block``, whose own workers span the block). The one
    rule the runtime's calls carry their block by (:meth:`OpLayout.calls`' ``group``, an
    ``OpCall``'s ``tp_group``, by which ``rpeg.runtime.lowering.ordering.gangs_of`` makes
    the block a gang) and a layout says its instances are gangs by (:func:`op_layout`, which
    the cost model's count reads).

        >>> block_together(2, False), block_together(2, True), block_together(1, False)
        (True, False, False)
    """
    return tp > 1 and not per_block


def op_layout(op, place, streamed: bool, gathered: bool = False, parts: int = 0) -> OpLayout:
    """The layout of graph op ``op`` on its stage's placement ``place`` (``streamed``: it
    runs per chunk, :func:`streamed_ops`; ``gathered``: it runs on its trainer's ZeRO-3
    shards, :func:`gathers_in_place`, a call on every rank, as a train op; ``parts``: it
    runs split over its blocks, :func:`split_parts`)."""
    if gathered:
        return OpLayout(tuple(place.devices), everywhere=True, collective=True)
    tp = place.tp if op.reads_model and place.tp > 1 else 1
    vllm = op.kind is OpKind.GENERATE and place.engine is Engine.VLLM
    train = op.kind is OpKind.TRAIN
    # a train op's data-parallel ranks (world_of: its blocks), run together as its calls do
    # (a vLLM engine's op generates: its ranks never together, its block not either)
    ranks = -(-len(place.devices) // tp) if train else 1
    return OpLayout(tuple(place.devices), tp, chunked=streamed or parts > 1, per_block=vllm,
                    everywhere=train,
                    collective=block_together(tp, vllm) or ranks_together(op.kind, ranks),
                    parts=parts if parts > 1 else 0)


def world_of(op, layout: OpLayout) -> int:
    """An op's data-parallel degree: its blocks for a train or generate op, or a pass on
    every rank of its trainer's ZeRO-3 shards (:func:`gathers_in_place`), else 1."""
    return len(layout.blocks) if op.kind in (OpKind.TRAIN, OpKind.GENERATE) \
        or layout.everywhere else 1


def split_parts(op, place, trainer, chunks: int, streamed: bool = False,
                batch: int | None = None) -> int:
    """Parts graph op ``op``, a pass or per-sample host op placed as ``place`` at dp > 1,
    splits a step's batch into: one on each of its data-parallel blocks (``len(devices) /
    tp`` of a pass reading a model, else one a device), each a call on its share of the
    batch (its sequences divided as evenly as can be, in order), every reader reading all
    the parts; 0 where it does not split. A train or generate op splits its batch its own
    way, a pass on its trainer's ZeRO-3 shards (``trainer``: the placement training its
    model) runs on every rank (:func:`gathers_in_place`), a ``streamed`` op
    (:func:`streamed_ops`) in a step streaming ``chunks`` > 1 goes round its blocks chunk
    by chunk, and a group estimator needs the whole batch (one call, on its first block).
    The cost model prices every pass split over its data-parallel degree: as this runs.
    ``batch``: the sequences a step's batch holds (the responses it generates; None: not
    asked): a split into more parts than that is refused (PlanError), a part holding no
    sequence -- the search never proposes one (dp <= batch,
    :func:`rpeg.plan.space.layouts`), and a pinned or written plan asking for one is no plan
    the placed graph, the executor's parts and the cost model's pricing would agree on.

        >>> from rpeg.graph import Op
        >>> from rpeg.plan.model import StagePlacement
        >>> P = StagePlacement.of
        >>> fwd = Op("ref_lp", OpKind.FORWARD, reads_model="ref", stages=("ref_lp",))
        >>> split_parts(fwd, P("ref_lp", (0, 1), dp=2), None, 1)
        2
        >>> split_parts(fwd, P("ref_lp", (0, 1, 2, 3), dp=2, tp=2), None, 1)
        2
        >>> t = P("train", (0, 1), dp=2, zero=3)
        >>> [split_parts(fwd, P("ref_lp", (0, 1), dp=2, zero=3), t, 1),
        ...  split_parts(fwd, P("ref_lp", (0,)), None, 1),
        ...  split_parts(fwd, P("ref_lp", (0, 1), dp=2), None, 2, streamed=True)]
        [0, 0, 0]
        >>> split_parts(fwd, P("ref_lp", (0, 1, 2, 3), dp=4), None, 1, batch=2)
        Traceback (most recent call last):
        rpeg.errors.PlanError: error: stage 'ref_lp' must split a step's 2 sequences over at most 2 parts, not 4 (one per data-parallel block): a part would hold no sequence
    """
    if op.kind in (OpKind.TRAIN, OpKind.GENERATE, OpKind.SYNC_WEIGHTS) or place.dp <= 1 \
            or not op.per_sample or (streamed and chunks > 1) \
            or gathers_in_place(op, trainer, place, chunks):
        return 0
    blocks = len(place.devices) // (place.tp if op.reads_model and place.tp > 1 else 1)
    if batch is not None and blocks > max(batch, 1):
        stage = fused_name(op.stages) or op.name
        raise PlanError(f"stage '{stage}' must split a step's {batch} sequences over at most "
                        f"{batch} parts, not {blocks} (one per data-parallel block): a part "
                        "would hold no sequence",
                        hint=f"place it on at most {batch} data-parallel blocks, or generate "
                             "more responses a step (prompts x samples)")
    return blocks if blocks > 1 else 0


def first_block(place):
    """``place`` narrowed to its first data-parallel replica (its first
    ``len(devices) / dp`` devices, dp 1): where an op at dp > 1 that does not split its
    batch (:func:`split_parts`: a group estimator) runs its one call a step."""
    return place.changed(devices=tuple(place.devices[:len(place.devices) // place.dp]), dp=1)


@functools.lru_cache(maxsize=256)
def streamed_ops(graph: Graph) -> frozenset[str]:
    """Ops that run per chunk: generate, and the per-sample ops the graph streams
    (:func:`rpeg.graph.chunk_counts`, the rule the simulator prices). (Cached per graph, a
    value hashed once.)"""
    counts = chunk_counts(graph, {o.name: 2 for o in graph.ops if o.kind is OpKind.GENERATE})
    return frozenset(op for op, n in counts.items() if n > 1)


def stream_chunks(chunks: int, blocks: int, responses: int, group: int = 1) -> int:
    """Chunks a step streams from ``blocks`` generating blocks asked for ``chunks``: rounded
    up so each block streams as many, and never more per block than the responses the
    emptiest block generates (a chunk holds at least one; ``group``: the responses dealt
    to a block together, :func:`rpeg.graph.deal.dealt`).

        >>> stream_chunks(4, 512, 512), stream_chunks(16, 32, 512), stream_chunks(3, 2, 4)
        (512, 32, 4)
        >>> stream_chunks(2000, 100, 2048), stream_chunks(2000, 100, 2048, group=16)
        (2000, 1600)
    """
    per = min(-(-max(chunks, 1) // blocks), max(1, emptiest_share(responses, blocks, group)))
    return per * blocks


def blocks_of(place) -> int:
    """The data-parallel blocks a generate stage placed as ``place`` streams its chunks on
    (chunk ``c`` on block ``c mod blocks``)."""
    return max(1, len(place.devices) // max(place.tp, 1))


def rounds_of(place, chunks: int) -> int:
    """Rounds a generate stage placed as ``place`` streams a step's ``chunks`` chunks in
    (:func:`chunks_per_step`): in each, a chunk on every block of it (see the module doc).

        >>> from rpeg.plan.model import StagePlacement
        >>> P = StagePlacement.of
        >>> rounds_of(P("g", (0, 1, 2, 3)), 8), rounds_of(P("g", (0, 1, 2, 3), tp=2), 2)
        (2, 1)
    """
    return block_rounds(chunks, blocks_of(place))


def block_rounds(chunks: int, blocks: int, block: int = 0) -> int:
    """Chunks block ``block`` of ``blocks`` streams of a step's ``chunks`` (chunk ``c`` on
    block ``c mod blocks``; the first block the most): the pieces its engine splits its
    share of the responses into, its ``j``-th in round ``j``. The runtime's generate calls
    stream a block's share in these, the cost model prices the first block's
    (:func:`rounds_of`).

        >>> block_rounds(8, 4), block_rounds(6, 4, 1), block_rounds(6, 4, 2), block_rounds(1, 4)
        (2, 2, 1, 1)
    """
    return len(range(block, max(chunks, 1), max(blocks, 1))) or 1


def chunks_per_step(graph: Graph, placement_of: Callable, responses: int) -> int:
    """Chunks a step streams: the most any generate op of ``graph`` streams
    (:func:`stream_chunks`, in the groups it deals its responses in; ``placement_of``: op
    -> its placement)."""
    n = 1
    for o in graph.ops:
        if o.kind is OpKind.GENERATE:
            p = placement_of(o)
            n = max(n, stream_chunks(p.chunks, blocks_of(p), responses,
                                     deal_group(o.work[0]) if o.work else 1))
    return n


def stream_of(place) -> tuple[int, int]:
    """(data-parallel blocks streaming a generate op's chunks, steps it carries responses
    over) of a generate stage placed as ``place``: chunk ``c`` streams on block ``c mod
    blocks``, after chunk ``c - blocks`` (:func:`rpeg.graph.unroll`).

        >>> from rpeg.plan.model import StagePlacement
        >>> P = StagePlacement.of
        >>> stream_of(P("g", (0, 1, 2, 3), tp=2)), stream_of(P("g", (0,), carry=1))
        ((2, 0), (1, 1))
    """
    return blocks_of(place), place.carry


def fused_train(works, places):
    """(work, placement) a train op of several stages placed as ``places`` runs as (a
    shared backbone's: one combined loss, one optimizer step each minibatch): the first
    stage's, with the most minibatches, epochs and micro-batches any of them asks (a head
    left at the default of one minibatch does not undo the other's schedule); one stage's
    own. The runtime's train step runs it, the cost model prices it.

        >>> from rpeg.graph.work import Work
        >>> from rpeg.plan.model import StagePlacement
        >>> P = StagePlacement.of
        >>> from rpeg.spec.model import OpKind
        >>> w, p = fused_train((Work("a", OpKind.TRAIN, None, minibatches=4),
        ...                     Work("c", OpKind.TRAIN, None, epochs=2)),
        ...                    (P("a", (0,)), P("c", (0,), microbatches=2)))
        >>> w.stage, w.minibatches, w.epochs, p.stage, p.microbatches
        ('a', 4, 2, 'a', 2)
    """
    work, place = works[0], places[0]
    if len(works) == 1:
        return work, place
    minibatches, epochs = max(w.minibatches for w in works), max(w.epochs for w in works)
    micro = max(p.microbatches for p in places)
    if (minibatches, epochs) != (work.minibatches, work.epochs):
        work = attrs.evolve(work, minibatches=minibatches, epochs=epochs)
    if micro != place.microbatches:
        place = place.changed(microbatches=micro)
    return work, place


@functools.lru_cache(maxsize=4096)
def sync_calls(src, dst) -> tuple[int, ...]:
    """The devices of a weight sync's calls, one entry a call: the trainer's (``src``)
    devices that send (:func:`rpeg.cost.engine_sync.sync_senders`), then the reader's
    (``dst``) devices that receive (a vLLM engine's host per block, else every device)."""
    sources = sync_senders(src.devices, max(src.tp, 1), src.zero)
    readers = engine_hosts_of(dst) if dst.engine is Engine.VLLM else tuple(dst.devices)
    return tuple(sources) + tuple(readers)


__all__ = ["Call", "OpLayout", "all_in_place", "any_in_place", "block_of", "block_rounds",
           "blocks_of",
           "chunks_per_step", "first_block", "fused_train", "gathers_in_place", "op_layout",
           "reads_in_place", "reads_in_place_on", "rounds_of", "split_parts", "stream_chunks",
           "stream_of", "streamed_ops", "sync_calls", "world_of"]
