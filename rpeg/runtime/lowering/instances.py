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
* a per-sample op at dp > 1 in a step that does not stream it runs split: a call on each
  of its blocks (``/c<part>``), each on its part of the whole batch its inputs make (the
  sequences divided as evenly as can be, in order), its readers reading every part in
  order (:func:`rpeg.plan.oplayout.split_parts`);
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
  another way or it is sharded (then they read a copy ``model~tp<group>`` that a sync
  loads); but a forward on exactly its ZeRO-3 trainer's ranks, in a step streaming one
  chunk, runs once a step on every rank (``/r<rank>``, a gang like a train op's) with the
  trainer's FSDP2 module, each layer gathered as it runs
  (:func:`rpeg.plan.oplayout.gathers_in_place`). Which copy every call reads is
  :func:`rpeg.plan.copies.copies`' rule, the one the cost model prices memory by, as the
  placed graph holds it (``rpeg.plan.lower.Placed.reads``).

Every reader reads an exact version: ``max(0, step - k)`` (train: ``step``), with
``k`` the plan's staleness of the op. This is enforced by ordering edges
(``after``): a reader waits for the writer of its version, and the writer of
version v on a device waits for every reader of v - 1 there (write after read): each
device's share of the placed graph's version and write-after-read edges.
Each device streams its share of a generate op's chunks in order (the placed graph's
stream edges, ``rpeg.plan.lower.Placed.edges``). A generate op with partial rollouts
(the plan's ``carry``) keeps the next steps' responses in its engine between steps, so
on each device its step s runs after its step s - 1; its chunks may hold tokens up to ``carry`` versions older than
the version it reads. That buffer is checkpointed with the replica, so a resumed
run continues the same responses.
The ranks of an instance that runs collectives (data-parallel train ranks, a
tensor-parallel block) wait for the union of their dependencies and keep one
order per device, so gloo/NCCL collectives never interleave.
"""

from __future__ import annotations

from collections import defaultdict

from rpeg.errors import PlanError
from rpeg.graph import DepKind, Graph, Instance
from rpeg.graph.ids import OpId
from rpeg.graph.versions import read_version
from rpeg.plan.lower import Placed, lower
from rpeg.plan.model import Plan
from rpeg.plan.oplayout import world_of
from rpeg.plan.staleness import staleness_problem
from rpeg.plan.structure import plan_graph
from rpeg.runtime.lowering.calls import OpCall
from rpeg.runtime.lowering.ordering import Ordering, ordered, version_steps
from rpeg.runtime.lowering.replicas import (
    ENGINE,
    EXPORT,
    LOAD,
    RECV,
    SEND,
    VARIANT,
    CallRole,
    ReplicaKey,
    base_of,
    engine_key,
    is_engine_key,
)
from rpeg.spec.model import OpKind, Pipeline


def graph_for(pipeline: Pipeline, plan: Plan) -> Graph:
    """The step graph with the plan's structural choices (staleness, sharing, no weight sync
    where every generate op reads the trained weights in place), unfused: the one every
    consumer of the plan's placed graph lowers (:func:`rpeg.plan.structure.plan_graph`; a
    stage the plan does not list is synchronous)."""
    return plan_graph(pipeline, plan, fused=False)


def build_calls(pipeline: Pipeline, plan: Plan, steps: int, *, first: int = 0
                ) -> tuple[OpCall, ...]:
    """Every op instance of steps ``first``..``steps - 1``, in an order where dependencies
    come first (except write-after-read edges, which may point one staleness window ahead).

    ``first`` > 0: the run starts at that step with every replica at version ``first``
    (as step 0 starts with every replica at version 0): readers read no older version,
    and only newer ones are synced. A run extended past its end restarts so; and the
    calls of steps ``first + r`` onwards, ``r`` at least the steps any dependency
    reaches back (:func:`lookback`), are those of a run built from step 0."""
    calls, ctx = lay_out(pipeline, plan, steps, first=first)
    # the weight transfers and ordering edges (rpeg.runtime.lowering.ordering's passes)
    return ordered(calls, ctx)


def lay_out(pipeline: Pipeline, plan: Plan, steps: int, *, first: int = 0
            ) -> tuple[tuple[OpCall, ...], Ordering]:
    """The op calls of steps ``first``..``steps - 1`` with their data dependencies, before
    the ordering passes (:data:`rpeg.runtime.lowering.ordering.PASSES`), and what those
    passes read."""
    graph = graph_for(pipeline, plan)
    problem = staleness_problem(pipeline, plan)
    if problem:                      # a hand-written plan: a carry past the staleness bound
        raise PlanError(problem, hint="lower the stage's carry or its staleness")
    frozen = {m.name for m in pipeline.models if m.frozen}
    bounds = dict(pipeline.staleness)
    model_homes(pipeline, plan, graph)         # the plan's homes hold its trainers, or a PlanError
    placed = placed_for(pipeline, plan, graph)
    held = {op: dict(at) for op, at in placed.reads}    # the copy each call reads (Placed.reads)
    n_chunks = placed.chunks
    # the placed graph's instances and dependency edges (Placed.edges): every call is one
    # device's share of an instance, reading what its data edges bring and streaming after
    # what its stream edges say (the same at every step: two steps' tell them all), and
    # waiting for the versions they read as its version edges say (those of the run's steps)
    edges = placed.edges(max(2, version_steps(graph, steps - first)))
    reads = _reads(edges)
    calls: list[OpCall] = []
    produced: dict[tuple[str, int], list[str]] = defaultdict(list)   # (op, step) -> ids by chunk
    for s in range(first, steps):
        for name in graph.topo_order():
            op = graph.op(name)
            if op.kind is OpKind.SYNC_WEIGHTS:
                continue
            place = _placement(plan, op, pipeline)
            lay = placed.layout(name)
            layout, world = lay.calls(n_chunks), world_of(op, lay)
            for one in layout:
                dev, group = one.device, one.group
                # a further rank of a tp group: its rank in the id
                tp_rank = group.index(dev) if group and op.kind is not OpKind.TRAIN else 0
                cid = _id(name, s, one.index, lay.everywhere, len(layout), lay.chunked,
                          tp_rank)
                inputs, deps = _data_deps(reads[(name, one.chunk)], s, produced)
                version, bound, limit = -1, 0, 0       # what version of a trained model it reads
                members = op.reads_model.members if op.reads_model else ()
                if op.reads_model and not all(m in frozen for m in members):
                    bound = 0 if op.kind is OpKind.TRAIN else graph.lag_of(name)
                    version = read_version(op.kind, s, bound, first)
                    limit = max((bounds.get(st, 0) for st in op.stages), default=0)
                calls.append(OpCall(
                    id=cid, op=name, kind=op.kind, step=s, device=dev, chunk=one.chunk,
                    chunks=lay.instances(n_chunks) if lay.chunked else len(layout),
                    parts=lay.parts, rank=one.rank,
                    world=world, tp_group=group, model=held.get(name, {}).get(dev),
                    stages=op.stages, inputs=tuple(inputs), deps=tuple(deps),
                    version=version, writes=s + 1 if op.kind is OpKind.TRAIN else -1, bound=bound,
                    limit=limit, carry=place.carry if op.kind is OpKind.GENERATE else 0))
                if one.rank == 0 and (not group or group[0] == dev):
                    produced[(name, s)].append(cid)       # what readers take: tp rank 0's
    return tuple(calls), Ordering.of(placed, first, edges, steps)


def placed_for(pipeline: Pipeline, plan: Plan, graph: Graph | None = None) -> Placed:
    """The plan's step graph (:func:`graph_for`) placed on its devices, each stage's placement
    checked against what the runtime executes: the value the calls are laid out from, the one
    the simulator prices (:func:`rpeg.plan.lower.lower`; its fusion as data, which the
    runtime's core packs tasks by)."""
    placed = lower(graph or graph_for(pipeline, plan), plan,
                   pipeline.workload.prompts * pipeline.workload.samples,
                   lambda o: _placement(plan, o, pipeline))
    for op in placed.graph.ops:
        place = _placement(plan, op, pipeline) if op.kind is not OpKind.SYNC_WEIGHTS else None
        if place is not None and op.reads_model and op.kind is not OpKind.TRAIN \
                and place.zero.shards_params and not placed.layout(op.name).everywhere:
            raise PlanError(f"stage '{op.stages[0]}' must read whole weights on the torch "
                            f"runtime, not ZeRO-{place.zero} shards: a pass reads shards only "
                            "on its trainer's ZeRO-3 devices, once a step (every rank "
                            "gathers each layer), and this one reads a whole copy",
                            hint="plan it with zero 0, or on its trainer's ZeRO-3 devices at "
                                 "tp 1 with its generate stages on one block, chunks = 1")
    return placed


def lookback(pipeline: Pipeline, plan: Plan) -> int:
    """Steps back any op call's dependencies reach, at most: a reader of version
    ``s - k`` waits for its writer (and that writer's sync) of step ``s - k - 1``, a
    generate op with partial rollouts for its previous steps, a writer for readers of the
    version before. Calls built from ``first`` are exact from ``first + lookback``."""
    k = max((b for _, b in plan.staleness), default=0)
    k = max(k, max((b for _, b in pipeline.staleness), default=0))
    carry = max((p.carry for p in plan.placements), default=0)
    return k + carry + 3


def by_id(calls) -> dict[str, OpCall]:
    return {c.id: c for c in calls}


def model_homes(pipeline: Pipeline, plan: Plan, graph: Graph) -> dict[str, tuple[int, ...]]:
    """Backbone -> devices holding its trained weights: its train op's devices. The plan's
    ``model_homes`` may list more (replicas kept for generation); they must include these."""
    homes: dict[str, tuple[int, ...]] = {}
    for op in graph.ops:
        if op.kind is OpKind.TRAIN and op.writes_model:
            members = op.writes_model.members
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
    for name in op.reads_model.members:
        dims = pipeline.model(name).dims
        for what, count in (("attention heads", dims.heads), ("KV heads", dims.kv_heads),
                            ("MLP width", dims.ffn)):
            if count % tp:
                raise PlanError(f"stage '{stage}': tp must divide the {count} {what} of model "
                                f"'{name}', not {tp}",
                                hint=f"use tp in {[d for d in range(1, count + 1) if count % d == 0]}")


def train_layouts(graph: Graph, plan: Plan) -> dict:
    """Backbone -> the placement of its training (how its home holds the weights)."""
    return {op.writes_model: _placement(plan, op) for op in graph.ops
            if op.kind is OpKind.TRAIN and op.writes_model}


def _reads(u) -> dict[tuple[str, int], list[tuple[str, Instance]]]:
    """(op, chunk) -> (datum, the instance making it) of each data edge into it within a
    step, in the op's input order (the order its arguments take)."""
    out: dict[tuple[str, int], list] = defaultdict(list)
    for d in u.deps:
        if d.kind is DepKind.DATA and d.dst.step == 0:
            out[(d.dst.op, d.dst.chunk)].append((d.data, d.src))
    return out


def _data_deps(edges, step: int, produced) -> tuple[list, list]:
    """(inputs as (datum, how many futures), the futures' op ids) of a call at ``step``: the
    output of tensor-parallel rank 0 of each instance its data edges come from."""
    inputs: list[tuple[str, int]] = []
    deps: list[str] = []
    for datum, src in edges:
        deps.append(produced[(src.op, step)][src.chunk])
        if inputs and inputs[-1][0] == datum:
            inputs[-1] = (datum, inputs[-1][1] + 1)
        else:
            inputs.append((datum, 1))
    return inputs, deps


def _id(name, step, idx, ranks: bool, n, is_chunked, tp_rank: int = 0) -> OpId:
    """A call's id: by chunk (streamed), by data-parallel rank (a call on every device: a
    train op, a pass on its trainer's ZeRO-3 shards), else the op's and step's."""
    if is_chunked:
        return OpId.of(name, step, chunk=idx, tp_rank=tp_rank)
    if ranks and n > 1:
        return OpId.of(name, step, rank=idx, tp_rank=tp_rank)
    return OpId.of(name, step, tp_rank=tp_rank)


# the replica keys and sync roles (rpeg.runtime.lowering.replicas) are also this module's
__all__ = ["ENGINE", "EXPORT", "LOAD", "RECV", "SEND", "VARIANT", "CallRole", "OpCall", "ReplicaKey",
           "base_of",
           "build_calls", "by_id", "engine_key", "graph_for", "is_engine_key", "lay_out",
           "lookback", "model_homes", "placed_for", "train_layouts"]
