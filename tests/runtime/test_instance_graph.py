"""The runtime executes the placed graph (``rpeg.plan.lower``): for the shipped tiny pipelines
under plans of every shape (synchronous, stale, carried, fused, chunked, tensor parallel,
split, data parallel, shared backbone, the planner's), for vLLM engines beside their trainer
and with copies of their own, and for plans drawn at random, the op calls realise
``Placed.edges``, the instances and typed edges its one unrolling gives:

* every call is one device's share of one of its instances, on the devices it gives that
  instance, and every instance but a weight sync (which runs only where some reader needs
  a copy) has calls;
* the calls' data dependencies are exactly its data edges;
* the calls wait, through one another, for every version and ordering edge (an edge from a
  weight sync that moves nothing is one from what the sync would wait for);
* the calls keep no order those edges do not imply, but the one order of collectives on
  common devices (gloo/NCCL need one order of them on every device);

and the simulator prices the same value (``Evaluator.placed``: ``lower`` of the plan's
unfused graph, the runtime's, its fusion as data), through its fused view
(``Placed.fused``), whose invariants are checked here: the value's instances and edges with
each group of fused stages seen as one op -- its data edges, its stream order, and its
write-after-read edges from the one in-place rule.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpeg.graph import DepKind, Instance
from rpeg.plan.compile import compile_plan
from rpeg.plan.evaluate import Evaluator, settle_batching
from rpeg.plan.lower import PRICED, Placed, lower
from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.plan.staleness import staleness_problem
from rpeg.runtime.calibrate.simulated import scaled
from rpeg.runtime.lowering.instances import build_calls, placed_for
from rpeg.runtime.lowering.joins import JOIN
from rpeg.runtime.placement import split_plan
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Engine, OpKind

STEPS = 5
PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
LOCAL = PIPELINES / "clusters" / "local_cpu.rpeg"


def _carry(plan: Plan, n: int) -> Plan:
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, carry=n) if p.stage == "rollout" else p for p in plan.placements))


def _tp(pipeline, staleness: int = 0) -> Plan:
    """Actor, critic and reference split over devices 0-1 (tp 2); the rest on device 0."""
    places = []
    for s in pipeline.stages:
        if s.target in ("actor", "critic", "ref") and s.kind.value != "compute":
            places.append(StagePlacement.of(s.name, (0, 1), dp=1, tp=2,
                                         chunks=2 if s.kind.value == "generate" else 1))
        else:
            places.append(StagePlacement.of(s.name, (0,)))
    return Plan(pipeline.name, "test", 2, tuple(places),
                model_homes=(("actor", (0, 1)), ("critic", (0, 1))),
                staleness=tuple((st, min(k, staleness)) for st, k in pipeline.staleness),
                strategy=Strategy.MANUAL)


def _partly_in_place(pipeline) -> Plan:
    """The rollout on devices 0-1, one step stale, its trainer on device 1 alone: on
    device 1 it reads the trained weights in place (the trainer's next write waits for
    it), on device 0 a copy a weight sync loads."""
    plan = split_plan(pipeline, 2, staleness=1)
    actor = {s.name for s in pipeline.stages if s.target == "actor"}
    return attrs.evolve(plan, placements=tuple(
        p.changed(devices=(0, 1), dp=2) if p.stage == "rollout"
        else p.changed(devices=(1,), dp=1) if p.stage in actor else p
        for p in plan.placements), model_homes=(("actor", (1,)),) + tuple(
            h for h in plan.model_homes if h[0] != "actor"))


def _in_place_beside_a_copy(pipeline) -> Plan:
    """Actor and critic one backbone, trained on device 0, the rollout there reading it in
    place (one step stale: no weight sync of the graph's, priced or run), and the values
    split over devices 0-1 (dp 2): on device 1 they read a copy the backbone's transfers
    load, whose op bears the elided sync's name."""
    plan = split_plan(pipeline, 2, share=True, staleness=1)
    return attrs.evolve(plan, placements=tuple(
        p.changed(devices=(0, 1), dp=2) if p.stage == "values"
        else p.changed(devices=(0,), dp=1) for p in plan.placements),
        model_homes=(("actor+critic", (0,)),))


PLANS = {
    "sync, split": lambda p: split_plan(p, 2, staleness=0),
    "stale, split": lambda p: split_plan(p, 2, staleness=1),
    "stale, one device": lambda p: split_plan(p, 1),
    "carried, split": lambda p: _carry(split_plan(p, 2, staleness=0), 1),
    "carried, one device": lambda p: _carry(split_plan(p, 1, staleness=0), 1),
    "chunked x4, dp 2": lambda p: split_plan(p, 2, dp=2, chunks=4, staleness=0),
    "fused": lambda p: attrs.evolve(split_plan(p, 1, staleness=0),
                                    fusion=(("ref_lp", "scores"),)),
    "shared backbone": lambda p: split_plan(p, 2, share=True, staleness=1)
    if p.shares else split_plan(p, 2),
    "tensor parallel": lambda p: _tp(p, staleness=1),
    "the planner's": lambda p: compile_plan(p, load_cluster(LOCAL)),
    "partly in place": _partly_in_place,
    "in place beside a copy": _in_place_beside_a_copy,
}


def closure(edges) -> dict:
    """Instance -> every instance it waits for through ``edges`` (pairs before -> after)."""
    before: dict = {}
    for a, b in edges:
        before.setdefault(b, set()).add(a)
    memo: dict = {}

    def up(i):
        if i not in memo:
            memo[i] = set()
            for a in before.get(i, ()):
                memo[i] |= {a} | up(a)
        return memo[i]

    return {i: frozenset(up(i)) for i in {e[1] for e in edges}}


def _gang(call) -> bool:
    """A rank of a collective, or the join its gang waits through."""
    return call.collective or call.role == JOIN


def assert_realises_placed(pipeline, plan, steps: int = STEPS) -> None:
    calls = build_calls(pipeline, plan, steps)
    placed = placed_for(pipeline, plan)
    u = placed.edges(steps, horizon=steps)
    table = {c.id: c for c in calls}
    instances = set(u.instances)
    ran = {c.instance for c in calls}
    syncs = {o.name for o in placed.graph.ops if o.kind is OpKind.SYNC_WEIGHTS}
    # the transfers into copies no weight sync of the graph fills (a forward reader's, priced
    # inside it): instances of their own op, ordered by the placed graph's transfer edges
    own = {t.op for t in placed.transfers} - {o.name for o in placed.graph.ops}

    # every call a share of an instance, on its devices; every instance but a sync runs
    assert {i for i in ran if i.op not in own} <= instances, \
        sorted(str(i) for i in ran - instances if i.op not in own)
    assert {i for i in instances if i.op not in syncs} <= ran
    for c in calls:
        if c.kind is not OpKind.SYNC_WEIGHTS:
            assert c.device in placed.layout(c.op).devices_of(c.chunk), c.id

    # the calls' data dependencies are the data edges
    data = {(table[d].instance, c.instance) for c in calls for d in c.deps
            if table[d].instance != c.instance}
    assert data == {(d.src, d.dst) for d in u.of_kind(DepKind.DATA)}

    # every version and ordering edge is kept by the calls' waits
    order, collective = set(), set()
    for c in calls:
        for d in c.after:
            a, b = table[d].instance, c.instance
            if a != b:
                both = _gang(table[d]) and _gang(c)
                (collective if both and (a, b) not in data else order).add((a, b))
    waits = closure(data | order | collective)
    into: dict = {}
    for d in u.deps:
        into.setdefault(d.dst, []).append(d.src)

    def sources(i) -> set:           # a sync that moves nothing: what it would wait for
        return {i} if i in ran else {s for j in into.get(i, ()) for s in sources(j)}

    missed = sorted(f"{d.src} -> {d.dst}" for d in u.deps if d.dst in ran
                    for s in sources(d.src) if s not in waits.get(d.dst, ()))
    assert not missed, missed
    # ... and keep no order the edges do not imply, but the collectives' one order
    implied = closure({(d.src, d.dst) for d in (*u.deps, *placed.transfer_edges(u),
                                                 *placed.rewrite_edges(u))})
    extra = sorted(f"{a} -> {b}" for a, b in order if a not in implied.get(b, ()))
    assert not extra, extra


@pytest.mark.parametrize("shape", sorted(PLANS))
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_runtime_executes_the_placed_graph(shape, name, ppo, grpo):
    pipeline = _tiny(name, shape, ppo, grpo)
    assert_realises_placed(pipeline, PLANS[shape](pipeline))


def _tiny(name: str, shape: str, ppo, grpo):
    """The tiny pipeline ``name`` for a plan of ``shape`` (skipped where it has none)."""
    if shape in ("tensor parallel", "in place beside a copy") and name == "grpo":
        pytest.skip("tiny_grpo has no critic to split beside the actor")
    return {"ppo": ppo, "grpo": grpo}[name]


def assert_prices_placed(pipeline, plan, cluster, steps: int = STEPS) -> None:
    """The simulator prices the runtime's placed value, through its fused view."""
    ev = Evaluator(pipeline, cluster)
    settled = settle_batching(pipeline, plan, cluster)
    graph = ev.graph(settled)
    timings, _ = ev.timings(settled, graph)
    placed, runtime = ev.placed(settled), placed_for(pipeline, settled)
    # one value: the same graph, fusion, placements and responses (all its passes read; the
    # simulator's lowered by none of them, the runtime's by all)
    assert placed == Placed(runtime.graph, runtime.responses, fusion=runtime.fusion,
                            placements=runtime.placements)
    view = placed.fused()                 # ... and one fused view of it
    assert view == runtime.fused() and view.graph is graph and not view.fusion
    assert view == attrs.evolve(lower(graph, settled, runtime.responses, passes=PRICED),
                                fusion=())        # the fused graph lowered as it stands
    if not settled.fusion:                # the value's own passes where nothing is fused
        assert view == lower(runtime.graph, settled, runtime.responses, passes=PRICED)
    # the chunks both stream; the simulator prices them round by round (a chunk on every
    # block side by side), and the cost model prices each generate op's chunks so
    assert view.chunks == runtime.chunks
    rounds = view.by_round()
    for o in graph.ops:
        if o.kind is OpKind.GENERATE:
            assert len(timings[o.name].chunk_ends) == (rounds.chunks if rounds.chunks > 1
                                                       else 0)
    priced = rounds.edges(steps, horizon=steps)
    ran = runtime.by_round().edges(steps, horizon=steps)
    op_of = {s: o.name for o in graph.ops for s in (o.name,) + o.stages}

    def seen(i):
        return Instance(op_of.get(i.op, i.op), i.step, i.chunk)

    def synced(u, i):
        return u.graph.op(i.op).kind is OpKind.SYNC_WEIGHTS

    # the fused view's instances: the value's, each group of fused stages one op
    assert set(priced.instances) == {seen(i) for i in ran.instances}

    def edges(u, kinds):
        return {(seen(d.src), seen(d.dst), d.kind) for d in u.deps if d.kind in kinds
                and seen(d.src) != seen(d.dst)}

    # ... and its data, stream, write-after-read and version edges: the value's
    assert edges(priced, {DepKind.DATA, DepKind.ORDER, DepKind.VERSION}) == \
        edges(ran, {DepKind.DATA, DepKind.ORDER, DepKind.VERSION})


@pytest.mark.parametrize("shape", sorted(PLANS))
@pytest.mark.parametrize("name", ["ppo", "grpo"])
def test_the_simulator_prices_the_runtimes_placed_graph(shape, name, ppo, grpo):
    pipeline = _tiny(name, shape, ppo, grpo)
    assert_prices_placed(pipeline, PLANS[shape](pipeline), load_cluster(LOCAL))


def _vllm(plan: Plan, tp: int = 1) -> Plan:
    return attrs.evolve(plan, placements=tuple(
        p.changed(engine=Engine.VLLM, tp=tp, dp=len(p.devices) // tp)
        if p.stage == "rollout" else p for p in plan.placements))


@pytest.mark.parametrize("shape", ["beside its trainer, x8", "its own copy at tp 2, x16"])
def test_vllm_engines_and_their_copies_execute_the_placed_graph(shape):
    ppo8b = load(PIPELINES / "ppo_llama8b.rpeg")
    plan = _vllm(scaled(split_plan(ppo8b, 1, staleness=0), 8)) if "x8" in shape \
        else _vllm(scaled(split_plan(ppo8b, 2), 8), 2)
    assert_realises_placed(ppo8b, plan, 4)


_PIPES = {n: load(PIPELINES / f"tiny_{n}.rpeg") for n in ("ppo", "grpo")}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(_PIPES)), devices=st.sampled_from([1, 2]),
       dp=st.sampled_from([1, 2]), chunks=st.integers(1, 5), staleness=st.integers(0, 2),
       carry=st.integers(0, 1), share=st.booleans(), steps=st.integers(2, 6))
def test_any_split_plan_realises_its_placed_graph(name, devices, dp, chunks, staleness, carry,
                                                  share, steps):
    pipeline = _PIPES[name]
    plan = split_plan(pipeline, devices, dp=min(dp, devices), chunks=chunks,
                      staleness=staleness, share=share and bool(pipeline.shares))
    if carry and not staleness_problem(pipeline, _carry(plan, carry)):   # within the bound
        plan = _carry(plan, carry)
    assert_realises_placed(pipeline, plan, steps)


GPU = ["dapo_qwen7b", "grpo_qwen7b", "ppo_async", "ppo_llama8b", "ppo_shared"]


@pytest.mark.parametrize("shape", ["split x8, torch", "split x8, vLLM tp 2",
                                   "partly in place x4, vLLM"])
@pytest.mark.parametrize("name", GPU)
def test_the_simulator_prices_the_runtimes_placed_graph_of_the_shipped_pipelines(shape, name):
    """The shipped GPU pipelines on a GH200 node: split plans grown to its 8 GPUs, their
    generation in vLLM engines with copies of their own, or partly beside the trainer."""
    pipeline = load(PIPELINES / f"{name}.rpeg")
    if shape == "split x8, torch":
        plan = scaled(split_plan(pipeline, 2, staleness=1, chunks=4), 4)
    elif shape == "split x8, vLLM tp 2":
        plan = _vllm(scaled(split_plan(pipeline, 2), 4), 2)
    else:
        plan = _vllm(scaled(_partly_in_place(pipeline), 2))
    assert_prices_placed(pipeline, plan, load_cluster(PIPELINES / "clusters" / "gh200_8.rpeg"),
                         steps=4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(_PIPES)), devices=st.sampled_from([1, 2]),
       dp=st.sampled_from([1, 2]), chunks=st.integers(1, 5), staleness=st.integers(0, 2),
       carry=st.integers(0, 1), share=st.booleans(), partly=st.booleans(),
       steps=st.integers(2, 6))
def test_any_split_plan_is_priced_as_placed(name, devices, dp, chunks, staleness, carry, share,
                                            partly, steps):
    pipeline = _PIPES[name]
    plan = split_plan(pipeline, devices, dp=min(dp, devices), chunks=chunks,
                      staleness=staleness, share=share and bool(pipeline.shares))
    if partly and devices == 2 and not plan.shared:
        plan = attrs.evolve(_partly_in_place(pipeline), staleness=plan.staleness)
    if carry and not staleness_problem(pipeline, _carry(plan, carry)):   # within the bound
        plan = _carry(plan, carry)
    assert_prices_placed(pipeline, plan, load_cluster(LOCAL), steps)
