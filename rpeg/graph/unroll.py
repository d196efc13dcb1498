"""Unrolling the step graph over N steps: op instances and the dependencies between them.

    >>> u = unroll(graph, steps=3, chunks={"rollout": 2})           # doctest: +SKIP
    >>> u.deps_of(Instance("ref_lp", 1, 1))                          # doctest: +SKIP
    (Dep(src=Instance(op='rollout', step=1, chunk=1), kind=<DepKind.DATA: 'data'>), ...)

An instance is (op, step, chunk). Chunking a generate op into n chunks lets
per-sample consumers (forward, score, compute) start on chunk c as soon as it is
generated; a consumer that needs the whole batch (train) waits for every chunk.
Version dependencies cross steps: the reader at step s waits for the writer at
step s - 1 - lag (nothing before step 0: version 0 is the initial weights).
"""

from __future__ import annotations

import enum

import attrs

from rpeg.graph.ir import Graph
from rpeg.graph.versions import read_version, writer_step


class DepKind(enum.Enum):
    DATA = "data"
    VERSION = "version"


@attrs.frozen(order=True)
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
            deps = sorted(f"{d.src}" + ("~" if d.kind is DepKind.VERSION else "")
                          for d in self.deps if d.dst == inst)
            lines.append(f"  {inst}: {' '.join(deps) if deps else '-'}")
        return "\n".join(lines)


def chunk_counts(graph: Graph, chunks: dict[str, int]) -> dict[str, int]:
    """Chunk count of every op: generate ops as asked; per-sample consumers inherit it."""
    out: dict[str, int] = {}
    for name in graph.topo_order():
        op = graph.op(name)
        if name in chunks and chunks[name] > 1:
            out[name] = chunks[name]
            continue
        if op.per_sample:
            inherited = {out.get(p, 1) for p in graph.producers(name)} - {1}
            if len(inherited) == 1:
                out[name] = inherited.pop()
                continue
        out[name] = 1
    return out


def unroll(graph: Graph, steps: int, chunks: dict[str, int] | None = None) -> Unrolled:
    counts = chunk_counts(graph, chunks or {})
    order = graph.topo_order()
    instances = tuple(Instance(op, s, c) for s in range(steps) for op in order
                      for c in range(counts[op]))
    deps: list[Dep] = []
    for s in range(steps):
        for op in order:
            for c in range(counts[op]):
                dst = Instance(op, s, c)
                for e in graph.data_edges:
                    if e.dst != op:
                        continue
                    n_src = counts[e.src]
                    if n_src == 1:
                        deps.append(Dep(Instance(e.src, s, 0), dst, DepKind.DATA, e.data))
                    elif counts[op] == n_src:
                        deps.append(Dep(Instance(e.src, s, c), dst, DepKind.DATA, e.data))
                    else:
                        deps += [Dep(Instance(e.src, s, k), dst, DepKind.DATA, e.data)
                                 for k in range(n_src)]
                for e in graph.version_edges:
                    if e.reader != op:
                        continue
                    src_step = writer_step(graph.op(op).kind, s, e.lag)
                    if src_step >= 0:
                        deps.append(Dep(Instance(e.writer, src_step, 0), dst, DepKind.VERSION,
                                        e.model))
    return Unrolled(graph, steps, tuple(sorted(counts.items())), instances, tuple(deps))
