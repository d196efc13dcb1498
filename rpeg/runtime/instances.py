"""The plan, unrolled to what runs: one op call per (op, step, chunk or rank), on one device.

    >>> calls = build_calls(pipeline, plan, steps=2)                        # doctest: +SKIP
    >>> [c.id for c in calls][:3]                                            # doctest: +SKIP
    ['rollout/s0/c0', 'rollout/s0/c1', 'ref_lp/s0/c0']
    >>> by_id(calls)["rollout/s1/c0"].after                                  # doctest: +SKIP
    ('sync_actor/s0/load@0', 'rollout/s1/c0'...)

The step graph (``rpeg.graph``: ops, data edges, fused trainers, shared
backbones) is placed on the plan's devices and unrolled over steps:

* per-sample ops (forward, score, per-response compute) whose inputs stream in
  chunks run once per chunk, round-robin over their data-parallel blocks; group
  ops (``group_norm``, ``rloo``) and train wait for the whole step;
* a train op runs once per device: data-parallel rank ``i // tp``;
* with tp > 1 a stage's devices are blocks of tp; every device of a block runs
  the instance (ids of ranks > 0 end in ``/t<rank>``) and readers take rank 0's
  output;
* a vLLM generate stage runs one instance per tensor-parallel block, on its first
  device (the engine's own workers span the block). Its engine serves a copy of its
  own (``actor~vllm``) unless it runs at tp 1 beside the model's unsplit trained
  replica (then it is updated from that replica in memory). Such a copy gets each
  version it serves through collectives: a ``send`` on the trainer's first block
  (rank 0 broadcasts, the others gather their pieces) and a ``recv`` on each engine's
  device run as one gang (``backends.vllm_backend.sync``); a ``recv`` on a device that
  also sends starts the receive and returns, and that device's ``send`` follows it;
* a model's weights live on its home devices; a reader elsewhere gets them from a
  weight-sync op pair — ``export`` on the home (one per tp rank: its shard),
  ``load`` at the reader (joins the shards) — only for versions someone reads
  there. Readers on the home read in place: no sync, unless they split the model
  another way (then they read a copy ``model~tp<group>`` that a sync loads).

Every reader reads an exact version: ``max(0, step - k)`` (train: ``step``), with
``k`` the plan's staleness of the op. This is enforced by ordering edges
(``after``): a reader waits for the writer of its version, and the writer of
version v on a device waits for every reader of v - 1 there (write after read).
A generate op with partial rollouts (the plan's ``carry``) keeps the next steps'
responses in its engine between steps, so on each device its step s runs after
its step s - 1; its chunks may hold tokens up to ``carry`` versions older than
the version it reads. That buffer is checkpointed with the replica, so a resumed
run continues the same responses.
The ranks of an instance that runs collectives (data-parallel train ranks, a
tensor-parallel block) wait for the union of their dependencies and keep one
order per device, so gloo/NCCL collectives never interleave.
"""

from __future__ import annotations

from collections import defaultdict

import attrs

from rpeg.errors import PlanError
from rpeg.graph import Graph, chunk_counts
from rpeg.graph.order import Cycle, topological
from rpeg.graph.versions import read_version
from rpeg.plan.model import Plan
from rpeg.plan.staleness import staleness_problem, step_graph
from rpeg.spec.model import Engine, OpKind, Pipeline

EXPORT, LOAD = "export", "load"
SEND, RECV = "send", "recv"      # weight sync into a vLLM engine's copy, through collectives
VARIANT = "~"          # "actor~tp0-1": a second copy of actor on a device, split another way
ENGINE = "vllm"        # "actor~vllm": the copy a vLLM engine serves (its own devices, or tp > 1)


def base_of(key: str | None) -> str | None:
    """The backbone a replica key names (``actor~tp0-1`` -> ``actor``)."""
    return key.split(VARIANT)[0] if key else key


def engine_key(model: str) -> str:
    """The key of the copy of ``model`` a vLLM engine serves alone (``actor~vllm``)."""
    return model + VARIANT + ENGINE


def is_engine_key(key: str | None) -> bool:
    return bool(key) and key.endswith(VARIANT + ENGINE)


@attrs.frozen
class OpCall:
    """One op instance: everything a worker needs to run it, as plain data."""

    id: str
    op: str                                  # graph op: a stage, fused trainers, or sync_<model>
    kind: OpKind
    step: int
    device: int
    chunk: int = 0
    chunks: int = 1                          # instances of this op in a step (chunks or ranks)
    rank: int = 0
    world: int = 1                           # data-parallel degree
    tp_group: tuple[int, ...] = ()           # devices running this instance together (tp > 1;
                                             # a weight sync's senders and engine hosts)
    role: str = ""                           # sync ops: export | load
    gang: tuple[int, ...] = ()               # sync ops: every device of the weight transfer
    sources: tuple[int, ...] = ()            # sync ops: the trainer's devices that send
    fills: tuple[str, ...] = ()              # sync ops: copies on this device it loads
    model: str | None = None                 # backbone whose state the op reads or writes
    stages: tuple[str, ...] = ()             # spec stages it implements
    inputs: tuple[tuple[str, int], ...] = () # data name -> futures in ``deps``, in order
    deps: tuple[str, ...] = ()               # data dependencies (op ids), in argument order
    after: tuple[str, ...] = ()              # ordering dependencies (no data used)
    version: int = -1                        # parameter version read (-1: none)
    writes: int = -1                         # parameter version written (-1: none)
    bound: int = 0                           # the plan's staleness: version >= step - bound
    limit: int = 0                           # the spec's bound on it (carry included)
    carry: int = 0                           # generate: responses span up to carry + 1 steps
                                             # (a chunk's oldest token: step - bound - carry)

    @property
    def all_deps(self) -> tuple[str, ...]:
        return self.deps + self.after

    @property
    def collective(self) -> bool:
        """Runs collectives with other workers: a rank of a tensor-parallel block or of a
        data-parallel train op. Its ranks start together (``_order_collectives``)."""
        return bool(self.tp_group) or bool(self.gang) or (
            self.kind is OpKind.TRAIN and self.world > 1)


def graph_for(pipeline: Pipeline, plan: Plan) -> Graph:
    """The step graph with the plan's structural choices (staleness, sharing): the one the
    cost model priced (a stage the plan does not list is synchronous)."""
    return step_graph(pipeline, plan)


def build_calls(pipeline: Pipeline, plan: Plan, steps: int, *, first: int = 0
                ) -> tuple[OpCall, ...]:
    """Every op instance of steps ``first``..``steps - 1``, in an order where dependencies
    come first (except write-after-read edges, which may point one staleness window ahead).

    ``first`` > 0: the run starts at that step with every replica at version ``first``
    (as step 0 starts with every replica at version 0): readers read no older version,
    and only newer ones are synced. A run extended past its end restarts so; and the
    calls of steps ``first + r`` onwards, ``r`` at least the steps any dependency
    reaches back (:func:`lookback`), are those of a run built from step 0."""
    graph = graph_for(pipeline, plan)
    problem = staleness_problem(pipeline, plan)
    if problem:                      # a hand-written plan: a carry past the staleness bound
        raise PlanError(problem, hint="lower the stage's carry or its staleness")
    frozen = {m.name for m in pipeline.models if m.frozen}
    bounds = dict(pipeline.staleness)
    homes = model_homes(pipeline, plan, graph)
    whole = _home_whole(graph, plan)
    n_chunks = _chunks(graph, plan, pipeline.workload.prompts * pipeline.workload.samples)
    chunked = _chunked_ops(graph)
    calls: list[dict] = []
    produced: dict[tuple[str, int], list[str]] = defaultdict(list)   # (op, step) -> ids by chunk
    for s in range(first, steps):
        for name in graph.topo_order():
            op = graph.op(name)
            if op.kind is OpKind.SYNC_WEIGHTS:
                continue
            place = _placement(plan, op, pipeline)
            layout, world = _layout(op, place, name in chunked, n_chunks)
            for idx, dev, rank, group in layout:
                cid = _id(name, s, idx, op.kind, len(layout), name in chunked)
                if group and op.kind is not OpKind.TRAIN and group.index(dev) > 0:
                    cid += f"/t{group.index(dev)}"          # a further rank of a tp group
                inputs, deps = _data_deps(graph, op, s, idx, name in chunked, produced, pipeline)
                model = op.reads_model
                if model and _engine_copy(op, place, dev, homes, whole):
                    model = engine_key(model)
                call = dict(id=cid, op=name, kind=op.kind, step=s, device=dev,
                            chunk=idx if name in chunked else 0,
                            chunks=n_chunks if name in chunked else len(layout),
                            rank=rank, world=world, tp_group=group, model=model,
                            stages=op.stages, inputs=inputs, deps=deps, after=[],
                            version=-1, writes=-1, bound=0, limit=0,
                            carry=place.carry if op.kind is OpKind.GENERATE else 0)
                members = op.reads_model.split("+") if op.reads_model else []
                if op.reads_model and not all(m in frozen for m in members):
                    lag = 0 if op.kind is OpKind.TRAIN else graph.lag_of(name)
                    call["version"] = read_version(op.kind, s, lag, first)
                    call["bound"] = lag
                    call["limit"] = max((bounds.get(st, 0) for st in op.stages), default=0)
                if op.kind is OpKind.TRAIN:
                    call["writes"] = s + 1
                calls.append(call)
                if rank == 0 and (not group or group[0] == dev):
                    produced[(name, s)].append(cid)       # what readers take: tp rank 0's
    trained = train_layouts(graph, plan)
    _split_layouts(calls, {m: p.zero >= 3 for m, p in trained.items()})
    calls = _add_syncs(calls, homes, trained, first)
    _order_versions(calls, homes, frozen, first)
    _order_chunks(calls)
    _order_collectives(calls)
    _order_pushes(calls)
    out = tuple(OpCall(**{**c, "inputs": tuple(c["inputs"]), "deps": tuple(c["deps"]),
                          "after": tuple(dict.fromkeys(a for a in c["after"] if a != c["id"]))})
                for c in calls)
    replica_layouts(out)                         # one layout per replica, or a PlanError
    return out


def lookback(pipeline: Pipeline, plan: Plan) -> int:
    """Steps back any op call's dependencies reach, at most: a reader of version
    ``s - k`` waits for its writer (and that writer's sync) of step ``s - k - 1``, a
    generate op with partial rollouts for its previous steps, a writer for readers of the
    version before. Calls built from ``first`` are exact from ``first + lookback``."""
    k = max((b for _, b in plan.staleness), default=0)
    k = max(k, max((b for _, b in pipeline.staleness), default=0))
    carry = max((p.carry for p in plan.placements), default=0)
    return k + carry + 3


def replica_layouts(calls) -> dict[tuple[str, int], tuple[int, ...]]:
    """(backbone, device) -> the tensor-parallel group its replica is split over. A replica
    has one layout: every op reading a model on a device must split it the same way."""
    out: dict[tuple[str, int], tuple[int, ...]] = {}
    who: dict[tuple[str, int], str] = {}
    for c in calls:
        if c.model is None or c.role:
            continue
        key = (c.model, c.device)
        if key in out and out[key] != c.tp_group:
            raise PlanError(f"stage '{c.op}' must split '{c.model}' on device {c.device} like "
                            f"'{who[key]}' does (tp group {list(out[key]) or 'none'}), not "
                            f"{list(c.tp_group) or 'unsplit'}",
                            hint="the torch runtime keeps one layout of a model per device: "
                                 "give the stages that read it there the same tp")
        out[key], who[key] = c.tp_group, c.op
    return {k: v for k, v in out.items() if len(v) > 1}


def by_id(calls) -> dict[str, OpCall]:
    return {c.id: c for c in calls}


def model_homes(pipeline: Pipeline, plan: Plan, graph: Graph) -> dict[str, tuple[int, ...]]:
    """Backbone -> devices holding its trained weights: its train op's devices. The plan's
    ``model_homes`` may list more (replicas kept for generation); they must include these."""
    homes: dict[str, tuple[int, ...]] = {}
    for op in graph.ops:
        if op.kind is OpKind.TRAIN and op.writes_model:
            members = op.writes_model.split("+")
            given = plan.home(op.writes_model) or plan.home(members[0])
            trained = _placement(plan, op).devices
            if given and not set(trained) <= set(given):
                raise PlanError(f"train op '{op.name}' must run on home devices of "
                                f"'{op.writes_model}' {tuple(given)}, not {trained}")
            homes[op.writes_model] = trained
    return homes


def _placement(plan: Plan, op, pipeline: Pipeline | None = None):
    for stage in op.stages or (op.name,):
        if not any(p.stage == stage for p in plan.placements):
            continue
        place = plan.placement(stage)
        why = _refusal(place, op)
        if why:
            key, text = why
            raise PlanError(f"stage '{stage}' must {text}", hint=_HINTS[key])
        if place.tp > 1 and op.reads_model:
            _check_tp(stage, place, op, plan, pipeline)
        return place
    raise PlanError(f"the plan must place stage '{op.name}', and it does not",
                    hint="recompile the plan for this pipeline")


_HINTS = {"pp": "the runtime executes data (dp) and tensor (tp) parallelism; plan with pp = 1",
          "zero": "plan with a ZeRO level the runtime declares",
          "tp": "plan the generate stage with a tp its engine declares",
          "recompute": "plan without recomputation", "offload": "plan without offload"}


def _refusal(place, op) -> tuple[str, str] | None:
    """(key, what) the runtime's declared capabilities refuse of a placement, or None."""
    from rpeg.plan.space import Limits
    limits = Limits.runtime()
    if place.pp > limits.max_pp:
        return "pp", (f"have pp = {limits.max_pp} on the torch runtime, not pp = {place.pp}"
                      + limits.because("pp"))
    if place.zero not in limits.zero:
        levels = ", ".join(str(z) for z in sorted(limits.zero))
        return "zero", (f"have zero in {levels} on the torch runtime, not {place.zero}"
                        + limits.because("zero"))
    if place.recompute and not limits.recompute:
        return "recompute", "have recompute off on the torch runtime" \
            + limits.because("recompute")
    if place.offload and not limits.offload:
        return "offload", "have offload off on the torch runtime" + limits.because("offload")
    if op.kind is OpKind.GENERATE and place.tp > limits.engine_max_tp(place.engine):
        return "tp", (f"have tp = {limits.engine_max_tp(place.engine)} with engine = "
                      f"{place.engine.value} on the torch runtime, not tp = {place.tp}")
    return None


def _check_tp(stage: str, place, op, plan: Plan, pipeline: Pipeline | None) -> None:
    """Refuse tensor-parallel degrees the torch backend cannot split the model by."""
    tp, n = place.tp, len(place.devices)
    if n % tp or n // tp != max(place.dp, 1):
        raise PlanError(f"stage '{stage}' must run on dp x tp = {place.dp} x {tp} devices, "
                        f"not {n} ({list(place.devices)})",
                        hint="give the stage dp * tp devices, or lower tp")
    if pipeline is None:
        return
    for name in op.reads_model.split("+"):
        dims = pipeline.model(name).dims
        for what, count in (("attention heads", dims.heads), ("KV heads", dims.kv_heads),
                            ("MLP width", dims.ffn)):
            if count % tp:
                raise PlanError(f"stage '{stage}': tp must divide the {count} {what} of model "
                                f"'{name}', not {tp}",
                                hint=f"use tp in {[d for d in range(1, count + 1) if count % d == 0]}")


def _layout(op, place, is_chunked: bool, n_chunks: int):
    """[(index, device, dp rank, tp group)] of one op's instances in a step, and the dp degree.

    A stage's devices are dp blocks of tp consecutive devices; every device of a block runs
    the instance (one tensor-parallel gang), rank 0 of the block gives its outputs.
    """
    devices = place.devices
    tp = place.tp if (op.reads_model and place.tp > 1) else 1
    blocks = [tuple(devices[i:i + tp]) for i in range(0, len(devices), tp)]
    gang = (lambda b: b) if tp > 1 else (lambda b: ())
    if _vllm(op, place):            # one instance per block: vLLM's own workers span it
        return [(c, blocks[c % len(blocks)][0], 0, ()) for c in range(n_chunks)], len(blocks)
    if op.kind is OpKind.TRAIN:
        return ([(r * tp + t, b[t], r, gang(b)) for r, b in enumerate(blocks)
                 for t in range(tp)], len(blocks))
    if is_chunked:
        world = len(blocks) if op.kind is OpKind.GENERATE else 1
        return ([(c, blocks[c % len(blocks)][t], 0, gang(blocks[c % len(blocks)]))
                 for c in range(n_chunks) for t in range(tp)], world)
    return [(0, blocks[0][t], 0, gang(blocks[0])) for t in range(tp)], 1


def train_layouts(graph: Graph, plan: Plan) -> dict:
    """Backbone -> the placement of its training (how its home holds the weights)."""
    return {op.writes_model: _placement(plan, op) for op in graph.ops
            if op.kind is OpKind.TRAIN and op.writes_model}


def _vllm(op, place) -> bool:
    return op.kind is OpKind.GENERATE and place.engine is Engine.VLLM


def _engine_copy(op, place, device: int, homes, whole: dict[str, bool]) -> bool:
    """Whether a generate instance on ``device`` reads a vLLM engine's own copy of its model:
    always with vLLM, except at tp 1 on a device holding the model's unsplit trained
    replica, which the engine beside it is updated from in memory."""
    if not _vllm(op, place):
        return False
    model = op.reads_model
    return not (place.tp == 1 and device in homes.get(model, ()) and whole.get(model, True))


def engine_hosts(calls) -> dict[str, tuple[int, ...]]:
    """Backbone -> the devices hosting a vLLM engine that serves its own copy of it."""
    out: dict[str, set[int]] = defaultdict(set)
    for c in calls:
        c = c if isinstance(c, dict) else attrs.asdict(c, recurse=False)
        if is_engine_key(c["model"]) and not c.get("role"):
            out[base_of(c["model"])].add(c["device"])
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _home_whole(graph: Graph, plan: Plan) -> dict[str, bool]:
    """Backbone -> whether each home device holds its plain whole weights between ops (tp 1,
    not laid out by FSDP2): what an engine beside it can be updated from in memory. A
    ZeRO-2 trainer holds them whole too, but as FSDP2's parameters: a vLLM engine started
    beside one ended its worker at the first train op, so it gets its own copy."""
    return {m: p.tp <= 1 and p.zero == 0 for m, p in train_layouts(graph, plan).items()}


def _chunks(graph: Graph, plan: Plan, responses: int) -> int:
    """Chunks per step: the plan's, rounded up so each generating device streams as many,
    and never more per device than the responses it generates (a chunk holds at least one)."""
    n = 1
    for o in graph.ops:
        if o.kind is OpKind.GENERATE:
            place = _placement(plan, o)
            d = len(place.devices) // max(place.tp, 1)           # dp blocks that stream
            per = min(-(-max(place.chunks, 1) // d), max(1, responses // d))
            n = max(n, per * d)
    return n


def _chunked_ops(graph: Graph) -> set[str]:
    """Ops that run per chunk: generate, and the per-sample ops the graph streams
    (:func:`rpeg.graph.chunk_counts`, the rule the simulator prices)."""
    streamed = chunk_counts(graph, {o.name: 2 for o in graph.ops if o.kind is OpKind.GENERATE})
    return {op for op, n in streamed.items() if n > 1}


def _data_deps(graph, op, step, chunk, is_chunked, produced, pipeline):
    names = list(op.inputs)
    if op.grouped and "responses" not in names:
        names.append("responses")                 # groups are read from the responses
    producer = {d: o.name for o in graph.ops for d in o.outputs}
    inputs, deps = [], []
    for d in names:
        src = producer.get(d)
        if src is None:
            continue                               # workload data (prompts): read on the worker
        ids = produced[(src, step)]
        chosen = [ids[chunk]] if is_chunked else list(ids)
        inputs.append((d, len(chosen)))
        deps += chosen
    return inputs, deps


def _id(name, step, idx, kind, n, is_chunked) -> str:
    if is_chunked:
        return f"{name}/s{step}/c{idx}"
    if kind is OpKind.TRAIN and n > 1:
        return f"{name}/s{step}/r{idx}"
    return f"{name}/s{step}"


def _split_layouts(calls: list[dict], sharded: dict[str, bool]) -> None:
    """A replica has one layout. Where an op reads a model on a device laid out differently
    from the model's layout there (the trainer's on its home devices, else the first
    reader's), it reads a second copy, ``model~tp<group>`` (``model~whole``: unsplit),
    which gets its weights by weight sync like a replica on another device (resharding).
    A trainer whose weights are sharded between ops (ZeRO-3) is read through such a copy
    on its own devices too."""
    primary: dict[tuple[str, int], tuple] = {}
    for c in calls:
        if c["kind"] is OpKind.TRAIN and c["model"]:
            primary.setdefault((c["model"], c["device"]),
                               (c["tp_group"], sharded.get(c["model"], False)))
    for c in calls:
        if c["model"] and not c.get("role"):
            key = (c["model"], c["device"])
            layout = primary.setdefault(key, (c["tp_group"], False))
            if layout != (c["tp_group"], c["kind"] is OpKind.TRAIN and layout[1]):
                g = c["tp_group"]
                c["model"] = c["model"] + VARIANT + (
                    "tp" + "-".join(map(str, g)) if g else "whole")
    copied = {(c["op"], c["step"], c["chunk"]): c["model"] for c in calls
              if c["tp_group"] and c["model"] and VARIANT in c["model"]}
    for c in calls:                        # every rank of a tp group reads the same copy
        if c["tp_group"] and (c["op"], c["step"], c["chunk"]) in copied:
            c["model"] = copied[(c["op"], c["step"], c["chunk"])]


def _add_syncs(calls: list[dict], homes, trained: dict, first: int = 0) -> list[dict]:
    """Export/load pairs for every version of a trained model read off its home devices.

    One weight transfer per (model, version) runs as a collective over every device taking
    part (``gang``): the home devices that hold the weights (``sources``: the first
    tensor-parallel block, or every home device when ZeRO-3 shards the weights, which they
    gather together) and every device loading a copy (``fills``: the copies there). The
    first source broadcasts the weights, in buckets, to the devices that are not sources.
    A vLLM engine's own copy (an engine key) is pushed instead: per version, the same sources
    send (``SEND``) and every engine hosting a copy receives (``RECV``) in one group
    (``backends.vllm_backend.sync``)."""
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
            out.append(dict(common, id=f"sync_{key}/s{v - 1}/{EXPORT}" + (f"/t{t}" if t else ""),
                            device=src, role=EXPORT, model=key, version=v, writes=-1,
                            fills=tuple(sorted(at.get(src, ())))))
        for dev, copies in sorted(at.items()):
            for copy in copies:
                out.append(dict(common, id=f"sync_{copy}/s{v - 1}/{LOAD}@{dev}", device=dev,
                                role=LOAD, model=copy, version=-1, writes=v,
                                fills=tuple(sorted(copies))))
    hosts = engine_hosts(calls)
    for key, versions in sorted(pushes.items()):
        senders = _sources(homes, trained, key)
        group = tuple(sorted(set(senders) | set(hosts[key])))
        for v in sorted(versions):
            common = dict(op=f"sync_{key}", kind=OpKind.SYNC_WEIGHTS, step=v - 1, chunk=0,
                          chunks=1, rank=0, world=1, tp_group=group, stages=(), inputs=[],
                          deps=[], after=[], bound=0)
            for dev in hosts[key]:        # every engine takes every version: one group
                out.append(dict(common, id=f"sync_{engine_key(key)}/s{v - 1}/{RECV}@{dev}",
                                device=dev, role=RECV, model=engine_key(key), version=-1,
                                writes=v))
            for t, src in enumerate(senders):
                out.append(dict(common, id=f"sync_{key}/s{v - 1}/{SEND}" + (f"/t{t}" if t else ""),
                                device=src, role=SEND, model=key, version=v, writes=-1))
    return out


def _sources(homes, trained: dict, key: str) -> tuple[int, ...]:
    """The home devices that hold a trained model's weights for a transfer: its first
    tensor-parallel block, or every home device when ZeRO-3 shards them."""
    p = trained[key]
    return tuple(homes[key]) if p.zero >= 3 else tuple(homes[key][:max(1, p.tp)])


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


def _order_chunks(calls: list[dict]) -> None:
    """Each device streams its share of a generate op's chunks (c, c + D, ...) from one
    stream: a chunk after the previous one of the same device. Under partial rollouts
    (carry > 0) the device's engine keeps the next steps' responses between steps, so its
    first chunk of step s also comes after its last chunk of step s - 1."""
    last: dict[tuple, str] = {}
    for c in calls:                                   # built step by step: s - 1 comes first
        if c["kind"] is OpKind.GENERATE:
            key = (c["op"], c["device"]) + (() if c.get("carry") else (c["step"],))
            if key in last:
                c["after"].append(last[key])
            last[key] = c["id"]


def _order_collectives(calls: list[dict]) -> None:
    """Calls that run collectives together (the ranks of a data-parallel train op, the ranks
    of a tensor-parallel group) form a gang. Each gang waits for the union of its members'
    dependencies, and on every device gangs run in one global order (a topological order
    of all calls), so gloo/NCCL collectives never interleave differently on two ranks."""
    gangs: dict[tuple, list[dict]] = defaultdict(list)
    for c in calls:
        if c.get("gang"):                  # a weight transfer: its exports and loads together
            gangs[(c["op"], c["step"], 0, "sync")].append(c)
        elif c["tp_group"] or (c["kind"] is OpKind.TRAIN and c["world"] > 1):
            role = c.get("role", "")
            gangs[(c["op"], c["step"], c["chunk"], "push" if role in (SEND, RECV) else role)
                  ].append(c)
    gangs = {k: v for k, v in gangs.items() if len(v) > 1}
    if not gangs:
        return
    for ranks in gangs.values():
        own = {r["id"] for r in ranks}
        union = list(dict.fromkeys(d for r in ranks for d in r["deps"] + r["after"]
                                   if d not in own))
        for r in ranks:
            r["after"] = [d for d in union if d not in r["deps"]]
    gang_of = {r["id"]: k for k, ranks in gangs.items() for r in ranks}
    order = list(dict.fromkeys(gang_of[cid] for cid in _topo(calls) if cid in gang_of))
    last_on: dict[int, str] = {}
    for key in order:                        # gangs by their first member's place in the order
        ranks = gangs[key]
        # every member waits for the previous gang on each member's device: a rank that
        # starts never blocks in a collective whose partner still waits for other work
        before = [last_on[c["device"]] for c in ranks if c["device"] in last_on]
        for c in ranks:
            c["after"] += before
        for c in ranks:
            last_on[c["device"]] = c["id"]


def _order_pushes(calls: list[dict]) -> None:
    """A device both sending a version and hosting an engine that receives it runs the
    ``recv`` (which then only starts the receive) before the ``send``: one worker thread
    cannot wait in both."""
    recv = {(c["op"], c["step"], c["device"]): c["id"] for c in calls if c.get("role") == RECV}
    for c in calls:
        if c.get("role") == SEND and (c["op"], c["step"], c["device"]) in recv:
            c["after"].append(recv[(c["op"], c["step"], c["device"])])


def _topo(calls: list[dict]) -> tuple[str, ...]:
    """Call ids in a dependency order; ties go to the earlier call in ``calls``."""
    table = {c["id"]: c for c in calls}
    try:
        return topological(list(table), lambda i: table[i]["deps"] + table[i]["after"])
    except Cycle as e:
        raise PlanError(f"the op calls must have no dependency cycle, and {e.stuck[:3]} "
                        "are in one") from None
