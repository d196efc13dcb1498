"""What a steady step asks of the control plane: the op calls the runtime lays a plan's
instances out as, the Dask tasks its fusion packs them into, and the futures those take.

    >>> from rpeg.graph import Graph, Op, DataEdge
    >>> from rpeg.spec.model import OpKind
    >>> g = Graph("toy", (Op("a", OpKind.FORWARD, outputs=("x",)),
    ...                   Op("b", OpKind.FORWARD, inputs=("x",), outputs=("y",)),
    ...                   Op("c", OpKind.FORWARD, inputs=("y",))),
    ...           (DataEdge("a", "b", "x"), DataEdge("b", "c", "y")), (), (), ())
    >>> one = {n: OpLayout((0,)) for n in "abc"}
    >>> dispatch_per_step(g, one).tasks
    1
    >>> d = dispatch_per_step(g, {"a": OpLayout((0,)), "b": OpLayout((1,)), "c": OpLayout((1,))})
    >>> d.calls, d.tasks, d.args
    (3, 2, 1)

The layout is the runtime's (``rpeg.runtime.lowering.instances``): a stage's devices are blocks of
``tp``; a streamed op's chunk c runs on block ``c mod blocks`` (every rank of it), a
vLLM engine's chunk on that block's first device alone, a train op on every device (one
data-parallel rank each), any other op on the first block; a weight sync on the devices
sending and receiving. Readers take the first rank's output. The fusion is the runtime's
(``rpeg.runtime.core.fusion``, the same rule on instances): a step's calls on one device share
a task while every input is in it, or in a task it already waits for; a call whose output
another device reads ends its task, but for the stages the plan fused with it; the ranks of a collective each start a task, and a
gang of ``JOIN_MIN`` ranks or more waits through one join call, a task of its own
(``rpeg.runtime.lowering.joins``). Nothing of a step in flight counts as finished (the runtime
submits a step ahead), so this is the count with the least fusion. The futures counted
are those of data, version and stream edges, and one for each gang a member's device ran
before (the order of collectives); the runtime passes a few more ordering ones.
"""

from __future__ import annotations

import bisect

import attrs

from rpeg.cost.control import JOIN_MIN, Dispatch
from rpeg.graph import Graph
from rpeg.plan.simulate import OpTiming, _placing, _prepare


@attrs.frozen
class OpLayout:
    """How the runtime lays one op's instances out on its devices."""

    devices: tuple[int, ...]
    tp: int = 1                       # devices per block (tensor-parallel ranks)
    chunked: bool = False             # streamed: chunk c on block c mod blocks
    per_block: bool = False           # one call per block, on its first device (vLLM)
    everywhere: bool = False          # a call on every device (train ranks, weight syncs)
    collective: bool = False          # its calls on several devices run collectives

    def devices_of(self, chunk: int) -> tuple[int, ...]:
        """The devices running an instance's calls, the one whose output readers take
        first."""
        if self.everywhere or not self.devices:
            return self.devices
        tp = max(1, self.tp)
        blocks = -(-len(self.devices) // tp)
        start = (chunk % blocks) * tp if self.chunked else 0
        return self.devices[start:start + (1 if self.per_block else tp)]


def stream_chunks(chunks: int, blocks: int, responses: int) -> int:
    """Chunks a step streams from ``blocks`` generating blocks asked for ``chunks``: rounded
    up so each block streams as many, and never more per block than the responses it
    generates (a chunk holds at least one).

        >>> stream_chunks(4, 512, 512), stream_chunks(16, 32, 512), stream_chunks(3, 2, 4)
        (512, 32, 4)
    """
    per = min(-(-max(chunks, 1) // blocks), max(1, responses // blocks))
    return per * blocks


def steady_step(graph: Graph, layouts: dict[str, OpLayout], chunks: int, steps: int):
    """(the unrolled graph, the steady step of it whose dispatch is counted)."""
    where = {n: OpTiming(lay.devices, 0.0, (0.0,) * chunks if chunks > 1 and any(
        o.name == n and o.kind.value == "generate" for o in graph.ops) else ())
        for n, lay in layouts.items()}
    # a step far enough in for its inputs to come from steady steps (lag + 2 back), and
    # the steps after it that read its outputs (lag + 1 on)
    lag = max((e.lag for e in graph.version_edges), default=0)
    last = min(steps // 2, lag + 2)
    return _prepare(graph, last + lag + 2, _placing(graph, where)[0]), last


def dispatch_per_step(graph: Graph, layouts: dict[str, OpLayout], chunks: int = 1,
                      steps: int = 6, together: tuple[tuple[str, ...], ...] = ()) -> Dispatch:
    """The calls, tasks and futures of one steady step of ``graph`` laid out by ``layouts``
    (op name -> :class:`OpLayout`), its generate ops streaming ``chunks`` chunks a step;
    ``together``: the plan's fused stages, whose calls of a chunk share a task."""
    partners: dict[str, set[str]] = {}
    for names in together:
        for a in names:
            partners.setdefault(a, set()).update(set(names) - {a})
    prep, last = steady_step(graph, layouts, chunks, steps)
    insts = prep.instances
    inputs = _inputs(prep)
    runs: dict[int, tuple[int, ...]] = {}

    def run(k: int) -> tuple[int, ...]:
        if k not in runs:
            runs[k] = layouts[insts[k].op].devices_of(insts[k].chunk)
        return runs[k]

    task: dict[int, int] = {}                    # instance -> the task of its first rank
    groups: list[set[int]] = []                  # what each task waits for
    waiting: dict[int, list[int]] = {}           # task -> the tasks waiting for it

    def new_group(deps: set[int]) -> int:
        groups.append(deps)
        g = len(groups) - 1
        for d in deps:
            waiting.setdefault(d, []).append(g)
        return g

    def fitting(here: list[int], deps: set[int]) -> int | None:
        """The newest open group holding or waiting for every one of ``deps``."""
        if not deps:
            return here[-1] if here else None
        d0 = next(iter(deps))
        for g in sorted(set(waiting.get(d0, ())).union((d0,)).intersection(here),
                        reverse=True):
            if all(d == g or d in groups[g] for d in deps):
                return g
        return None

    def batch(step: int) -> tuple[int, int, int]:
        """Fuse one step's calls, as the runtime does when the step enters its window:
        (calls, tasks, futures)."""
        first, calls, order = len(groups), 0, 0
        open_: dict[int, list[int]] = {}
        sealed: dict[int, dict[int, tuple]] = {}   # closed but to fusion partners: (chunk, ops)
        lo = bisect.bisect_left(prep.step_of, step)
        for k in range(lo, bisect.bisect_right(prep.step_of, step, lo)):
            ds = run(k) or (-1,)
            deps = {task[i] for i in inputs[k] if i in task}
            gang = layouts[insts[k].op].collective and len(ds) > 1
            if gang and len(ds) >= JOIN_MIN:      # the join: a task of its own
                calls += 1
                deps = {new_group(deps)}
            # a gang waits for the gang before it on each member's device (each member does,
            # or its join): futures beyond the data's
            order += len(ds) if gang and len(ds) >= JOIN_MIN else len(ds) ** 2 if gang else 0
            # does another device read the instance's output (its first rank's)
            elsewhere = any(d != ds[0] for c in prep.fed[k] for d in run(c)[:2])
            for dev in ds:
                calls += 1
                here = open_.setdefault(dev, [])
                gi = None if gang else fitting(here, deps)
                if gi is None and not gang:
                    gi = next((g for g, (chunk, ops) in reversed(sealed.get(dev, {}).items())
                               if insts[k].op in ops and chunk == insts[k].chunk
                               and all(d == g or d in groups[g] for d in deps)), None)
                if gi is None:
                    gi = new_group(deps)
                    here.append(gi)
                if dev == ds[0]:
                    task[k] = gi
                    if elsewhere:
                        if gi in here:
                            here.remove(gi)
                        if insts[k].op in partners:
                            sealed.setdefault(dev, {})[gi] = (insts[k].chunk,
                                                              partners[insts[k].op])
        return calls, len(groups) - first, sum(len(g) for g in groups[first:]) + order

    for step in range(last):                         # the tasks the step's inputs come from
        batch(step)
    calls, tasks, args = batch(last)
    used = {d for lay in layouts.values() for d in lay.devices}
    return Dispatch(len(used), calls, tasks, args)


_INPUTS: dict[int, tuple] = {}


def _inputs(prep) -> list[list[int]]:
    """Instance -> the instances whose outputs it takes (cached per prepared graph)."""
    hit = _INPUTS.get(id(prep))
    if hit is not None and hit[0] is prep:
        return hit[1]
    inputs: list[list[int]] = [[] for _ in prep.instances]
    for k, ds in enumerate(prep.fed):
        for d in ds:
            inputs[d].append(k)
    if len(_INPUTS) > 64:
        _INPUTS.clear()
    _INPUTS[id(prep)] = (prep, inputs)
    return inputs


def layouts_of(pipeline, plan, graph: Graph, timings: dict[str, OpTiming]
               ) -> tuple[dict[str, OpLayout], int]:
    """Each op's :class:`OpLayout` under ``plan`` (``graph``: the plan's graph without
    fusion, whose ops the runtime calls one by one; ``timings``: where its weight syncs run),
    and the chunks a step streams."""
    from rpeg.graph import chunk_counts
    from rpeg.spec.model import Engine, OpKind

    streamed = {n for n, c in chunk_counts(graph, {o.name: 2 for o in graph.ops
                                                   if o.kind is OpKind.GENERATE}).items()
                if c > 1}
    responses = pipeline.workload.prompts * pipeline.workload.samples
    chunks = 1
    out: dict[str, OpLayout] = {}
    for op in graph.ops:
        if op.kind is OpKind.SYNC_WEIGHTS:
            out[op.name] = OpLayout(_sync_calls(plan, graph, op) or timings[op.name].devices,
                                    everywhere=True, collective=True)
            continue
        p = plan.placement(op.stages[0])
        tp = p.tp if op.reads_model and p.tp > 1 else 1
        vllm = op.kind is OpKind.GENERATE and p.engine is Engine.VLLM
        if op.kind is OpKind.GENERATE:
            chunks = max(chunks, stream_chunks(p.chunks, len(p.devices) // max(p.tp, 1),
                                               responses))
        train = op.kind is OpKind.TRAIN
        out[op.name] = OpLayout(p.devices, tp, chunked=op.name in streamed, per_block=vllm,
                                everywhere=train, collective=not vllm and (
                                    tp > 1 or (train and len(p.devices) > 1)))
    return out, chunks


def _sync_calls(plan, graph: Graph, op) -> tuple[int, ...]:
    """The devices of a weight sync's calls, one entry a call: the trainer's devices that
    send (its first tensor-parallel block; all of them under ZeRO-3), then the generating
    devices that receive (a vLLM engine's first device per block)."""
    from rpeg.spec.model import Engine, OpKind
    train = next((o for o in graph.ops if o.kind is OpKind.TRAIN
                  and o.writes_model == op.reads_model), None)
    reader = next((o for o in graph.ops if o.kind is OpKind.GENERATE
                   and o.reads_model == op.reads_model), None)
    if train is None or reader is None:
        return ()
    src, dst = plan.placement(train.stages[0]), plan.placement(reader.stages[0])
    sources = src.devices if src.zero >= 3 else src.devices[:max(src.tp, 1)]
    readers = dst.devices[::max(dst.tp, 1)] if dst.engine is Engine.VLLM else dst.devices
    return tuple(sources) + tuple(readers)
