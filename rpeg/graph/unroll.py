"""Unrolling the step graph over N steps: op instances and the dependencies between them.

    >>> u = unroll(graph, steps=3, chunks={"rollout": 2})           # doctest: +SKIP
    >>> u.deps_of(Instance("ref_lp", 1, 1))                          # doctest: +SKIP
    (Dep(src=Instance(op='rollout', step=1, chunk=1), kind=<DepKind.DATA: 'data'>), ...)

An instance is (op, step, chunk). Chunking a generate op into n chunks lets
per-sample consumers (forward, score, compute) start on chunk c as soon as it is
generated; a consumer that needs the whole batch (train) waits for every chunk.
A pass split over its data-parallel blocks (``parts``: op -> count) runs as that many
instances (chunks), each reading all of its inputs and taking its share of the batch;
every reader of it reads all of them.
Version dependencies cross steps: the reader at step s waits for the writer at
step s - 1 - lag (nothing before step 0: version 0 is the initial weights).

Ordering dependencies (``ORDER``: no data passes) are what executing the graph needs
besides data and versions, the same for the simulator that prices it and the runtime
that runs it:

* a generate op's chunks stream in order: an op generating on ``lanes`` data-parallel
  blocks streams chunk c on block c mod lanes, after chunk c - lanes (its consumers'
  chunks are independent of each other);
* a carried stream (a generate op with partial rollouts, ``carry``) continues its
  previous step's responses: each block's first chunk of step s after its last of s - 1;
* write after read: the writer of version v + 1 of a replica (a train op's weights, or
  the copy a weight sync fills) after every reader of version v of it, so no reader sees
  a newer version than it was planned to read (with staleness a reader of step s + k may
  precede the writer of step s). Which readers share a replica with its writer is known
  once ops are placed: ``in_place`` holds those (writer, reader) version edges, and
  (trainer, reader) pairs of a reader of a weight sync that reads the trained weights
  where they are (the placed graph's rule, ``rpeg.plan.lower``); ``partly`` those of them
  whose reader shares the replica on some of its blocks only: (writer, reader) ->
  (blocks, the blocks sharing it), chunk c on block c mod blocks; the writer waits for
  the reader's chunks there alone, and those chunks wait for the trainer, not for the
  weight sync that loads a copy for the others.

``horizon``: the steps of the whole run (default: unbounded, as in a steady state). A
weight sync runs only for the versions some reader of the run reads, so the syncs of
versions nobody reads before the run ends are left out.
"""

from __future__ import annotations

import enum

import attrs

from rpeg.graph.ir import Graph
from rpeg.graph.versions import read_version, writer_step
from rpeg.spec.model import OpKind


class DepKind(enum.Enum):
    DATA = "data"
    VERSION = "version"
    ORDER = "order"           # no data: stream order, a carried stream, write after read


STREAM, CARRY = "stream", "carry"     # what an ORDER dep of a stream holds (else: the model)


MARK = {DepKind.DATA: "", DepKind.VERSION: "~", DepKind.ORDER: "^"}


@attrs.frozen(order=True, cache_hash=True)   # unrolled: each instance hashed once
class Instance:
    op: str
    step: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.op}@{self.step}" + (f"#{self.chunk}" if self.chunk else "")


@attrs.frozen
class Dep:
    src: Instance
    dst: Instance
    kind: DepKind
    data: str = ""            # the datum (data deps) or the model (version deps)


@attrs.frozen
class Unrolled:
    graph: Graph
    steps: int
    chunks: tuple[tuple[str, int], ...]
    instances: tuple[Instance, ...]
    deps: tuple[Dep, ...]

    def of_kind(self, kind: DepKind) -> tuple[Dep, ...]:
        return tuple(d for d in self.deps if d.kind is kind)

    def chunks_of(self, op: str) -> int:
        return dict(self.chunks).get(op, 1)

    def deps_of(self, inst: Instance) -> tuple[Dep, ...]:
        return tuple(d for d in self.deps if d.dst == inst)

    def version_read(self, inst: Instance) -> int | None:
        """The least parameter version this instance may read (None if it reads none)."""
        lag = None
        for e in self.graph.version_edges:
            if e.reader == inst.op:
                lag = e.lag
        if lag is None:
            return None
        return read_version(self.graph.op(inst.op).kind, inst.step, lag)

    def __str__(self) -> str:
        lines = [f"unrolled {self.graph.name} steps {self.steps}"]
        for inst in self.instances:
            deps = sorted(f"{d.src}{MARK[d.kind]}" for d in self.deps if d.dst == inst)
            lines.append(f"  {inst}: {' '.join(deps) if deps else '-'}")
        return "\n".join(lines)


def chunk_counts(graph: Graph, chunks: dict[str, int],
                 parts: dict[str, int] | None = None) -> dict[str, int]:
    """Chunk count of every op: generate ops as asked; a per-sample consumer all of whose
    producers stream in the same number of chunks streams too (one that also reads a
    whole-step output waits for the step). ``parts``: ops run as that many parts of their
    whole batch (a pass split over its data-parallel blocks), which streams nothing: their
    readers count as if they were one."""
    out: dict[str, int] = {}
    for name in graph.topo_order():
        op = graph.op(name)
        if name in chunks and chunks[name] > 1:
            out[name] = chunks[name]
            continue
        counts = {out[p] for p in graph.producers(name)}
        out[name] = counts.pop() if op.per_sample and len(counts) == 1 else 1
    return out | (parts or {})


def unroll(graph: Graph, steps: int, chunks: dict[str, int] | None = None, *,
           carry: dict[str, int] | None = None, horizon: int | None = None,
           in_place: frozenset[tuple[str, str]] = frozenset(),
           lanes: dict[str, int] | None = None,
           partly: dict[tuple[str, str], tuple[int, frozenset[int]]] | None = None,
           parts: dict[str, int] | None = None) -> Unrolled:
    """``steps`` steps of ``graph``: generate ops in ``chunks`` chunks streamed on ``lanes``
    blocks (op -> count, default 1), those in ``carry`` (op -> steps) continuing their
    responses across steps, readers in ``in_place`` sharing their writer's replica, ops in
    ``parts`` (op -> count) split into that many parts of their whole batch, each reading
    all of its inputs and read whole (every part); see the module doc."""
    made: dict[tuple[str, int, int], Instance] = {}   # each instance made once (hashed once)

    def inst(op: str, s: int, c: int = 0) -> Instance:
        i = made.get((op, s, c))
        if i is None:
            i = made[(op, s, c)] = Instance(op, s, c)
        return i

    counts, cells, edges = unroll_edges(graph, steps, inst, chunks, carry=carry,
                                        horizon=horizon, in_place=in_place, lanes=lanes,
                                        partly=partly, parts=parts)
    return Unrolled(graph, steps, tuple(sorted(counts.items())),
                    tuple(inst(*cell) for cell in cells), tuple(Dep(*e) for e in edges))


def unroll_edges(graph: Graph, steps: int, node, chunks: dict[str, int] | None = None, *,
                 carry: dict[str, int] | None = None, horizon: int | None = None,
                 in_place: frozenset[tuple[str, str]] = frozenset(),
                 lanes: dict[str, int] | None = None,
                 partly: dict[tuple[str, str], tuple[int, frozenset[int]]] | None = None,
                 parts: dict[str, int] | None = None
                 ) -> tuple[dict[str, int], list[tuple[str, int, int]], list[tuple]]:
    """What :func:`unroll` makes, with each instance named by ``node(op, step, chunk)``
    (an :class:`Instance`, or a number where a caller indexes them): (the chunk count of
    each op, the instances as (op, step, chunk) in step, graph and chunk order, the
    dependencies as (src, dst, :class:`DepKind`, datum) in :attr:`Unrolled.deps` order)."""
    parts = parts or {}
    counts = chunk_counts(graph, chunks or {}, parts)
    order = graph.topo_order()
    lags = {(e.writer, e.reader): e.lag for e in graph.version_edges}
    read: set[tuple[str, int]] = set()        # (sync op, step) whose version someone reads
    deps: list[tuple] = []
    into: dict[str, list] = {op: [] for op in order}          # each op's data edges in
    for e in graph.data_edges:
        into[e.dst].append(e)
    versions: dict[str, list] = {op: [] for op in order}      # ... and version edges in
    for e in graph.version_edges:
        versions[e.reader].append(e)
    kinds = {op: graph.op(op).kind for op in order}
    behind = {e.reader: e.writer for e in graph.version_edges
              if kinds[e.reader] is OpKind.SYNC_WEIGHTS}     # a weight sync -> its trainer
    partly = partly or {}
    data, version = DepKind.DATA, DepKind.VERSION
    # each op's data edges in as every chunk of every step reads them: (the source, its
    # chunks, whether chunk c reads the source's chunk c alone, the datum)
    sources = {op: [(e.src, counts[e.src], counts[op] == counts[e.src] and op not in parts
                     and e.src not in parts, e.data) for e in into[op]] for op in order}
    for s in range(steps):
        for op in order:
            # its version edges in, each with the step whose version it reads
            read_at = [(e, writer_step(kinds[op], s, e.lag)) for e in versions[op]]
            for c in range(counts[op]):
                dst = node(op, s, c)
                for src, n_src, alike, datum in sources[op]:
                    if n_src == 1:
                        deps.append((node(src, s, 0), dst, data, datum))
                    elif alike:
                        deps.append((node(src, s, c), dst, data, datum))
                    else:
                        deps += [(node(src, s, k), dst, data, datum) for k in range(n_src)]
                for e, src_step in read_at:
                    if src_step >= 0:
                        writer = _shared_writer(e.writer, op, c, behind, partly)
                        deps.append((node(writer, src_step, 0), dst, version, e.model))
                        read.add((writer, src_step))
    syncs = {o.name for o in graph.ops if o.kind is OpKind.SYNC_WEIGHTS}

    def runs(op: str, s: int) -> bool:          # a finite run syncs only versions it reads
        return op not in syncs or horizon is None or (op, s) in read

    cells = [(op, s, c) for s in range(steps) for op in order
             if runs(op, s) for c in range(counts[op])]
    order_deps = _ordering(kinds, graph.version_edges, steps, cells, counts, carry or {},
                           lags, in_place, lanes or {}, node, partly)
    if len(cells) < steps * sum(counts.values()):      # syncs left out: their edges too
        kept = {node(*cell) for cell in cells}
        deps = [d for d in deps if d[0] in kept and d[1] in kept]
        order_deps = [d for d in order_deps if d[0] in kept and d[1] in kept]
    # an ordering edge where an edge already runs adds nothing: looked for among the
    # edges into the few instances ordering edges reach
    ends = {d[1] for d in order_deps}
    linked = {(d[0], d[1]) for d in deps if d[1] in ends}
    for d in order_deps:
        if (d[0], d[1]) not in linked:
            linked.add((d[0], d[1]))
            deps.append(d)
    return counts, cells, deps


def _shared_writer(writer: str, reader: str, chunk: int, behind: dict[str, str],
                   partly: dict[tuple[str, str], tuple[int, frozenset[int]]]) -> str:
    """The op a reader's chunk waits for the version it reads from: ``writer``, but the
    trainer behind a weight sync where the chunk reads the trained weights in place on a
    block sharing them (``partly``: the sync loads a copy for the reader's other blocks)."""
    trainer = behind.get(writer)
    some = partly.get((trainer, reader)) if trainer is not None else None
    return trainer if some is not None and chunk % some[0] in some[1] else writer


def _ordering(kinds: dict[str, OpKind], version_edges, steps: int, cells,
              counts: dict[str, int],
              carry: dict[str, int], lags: dict[tuple[str, str], int],
              in_place: frozenset[tuple[str, str]], lanes: dict[str, int], node,
              partly: dict[tuple[str, str], tuple[int, frozenset[int]]]) -> list[tuple]:
    """The ORDER dependencies of the module doc among ``cells`` (op, step, chunk): stream
    order, carried streams, write after read."""
    out: list[tuple] = []
    for op, s, c in cells:
        if kinds[op] is not OpKind.GENERATE:
            continue
        n, d = counts[op], max(1, lanes.get(op, 1))
        if c >= d:
            out.append((node(op, s, c - d), node(op, s, c), DepKind.ORDER, STREAM))
        elif carry.get(op, 0) > 0 and s > 0:
            last = node(op, s - 1, c + (n - 1 - c) // d * d)
            out.append((last, node(op, s, c), DepKind.ORDER, CARRY))
    war = write_after_read(kinds, version_edges, in_place, partly)
    for op, s, c in cells:
        for e, w, some in war.get(op, ()):
            if some is not None and c % some[0] not in some[1]:
                continue                      # a chunk on a block reading a copy of its own
            v = read_version(kinds[op], s, lags[(e.writer, e.reader)])
            # the writer of version v + 1 of that replica, where it is unrolled
            if v < steps and (w, v) != (op, s):
                out.append((node(op, s, c), node(w, v, 0), DepKind.ORDER, e.model))
    return out


def write_after_read(kinds: dict[str, OpKind], version_edges,
                     in_place: frozenset[tuple[str, str]],
                     partly: dict[tuple[str, str], tuple[int, frozenset[int]]]
                     ) -> dict[str, list[tuple]]:
    """Reader op -> (its version edge, the op writing the replica it shares, None or
    (blocks, the blocks sharing it) from ``partly``) of each write-after-read edge of the
    module doc, in version-edge order: whose next write waits for the reader's chunks
    (``kinds``: op -> its kind). The one rule :func:`unroll` orders writers by (so the
    runtime, ``rpeg.runtime.lowering.ordering``) and the cost model counts the calls
    waiting for a reader by (``rpeg.plan.tasks``).

        >>> from rpeg.graph.ir import VersionEdge
        >>> kinds = {"train": OpKind.TRAIN, "sync": OpKind.SYNC_WEIGHTS,
        ...          "gen": OpKind.GENERATE}
        >>> edges = (VersionEdge("actor", "train", "sync"), VersionEdge("actor", "sync", "gen"))
        >>> [(e.writer, w) for e, w, _ in write_after_read(kinds, edges,
        ...                                                 {("train", "gen")}, {})["gen"]]
        [('sync', 'train')]
    """
    # a weight sync's writer: a reader of the sync that reads the trained weights where they
    # are (the sync moves nothing to it) shares the trainer's replica
    behind = {e.reader: e.writer for e in version_edges
              if kinds[e.reader] is OpKind.SYNC_WEIGHTS}
    out: dict[str, list[tuple]] = {}
    for e in version_edges:
        for w in (e.writer, behind.get(e.writer)):
            if w is not None and (w, e.reader) in in_place:
                out.setdefault(e.reader, []).append((e, w, partly.get((w, e.reader))))
    return out
