"""A plan's step graph placed on its devices (``rpeg.plan.lower``): each pass checked by a
verifier of what it adds, on the shipped pipelines under plans of several shapes, and the
runtime's op calls lying where the placed graph says."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpeg.cost.engine_sync import engine_hosts_of, serves_copy, sync_refusal, sync_senders
from rpeg.graph import DepKind, Instance
from rpeg.graph.unroll import CARRY, STREAM
from rpeg.graph.versions import read_version
from rpeg.plan.lower import COUNTED, LOADS, PASSES, PRICED, PUSH, Placed, lower, transfer_of
from rpeg.plan.oplayout import (
    blocks_of,
    gathers_in_place,
    reads_in_place,
    rounds_of,
    stream_chunks,
)
from rpeg.plan.staleness import step_graph
from rpeg.resources import shipped
from rpeg.runtime.calibrate.simulated import scaled
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan
from rpeg.spec import load
from rpeg.spec.model import Engine, OpKind
from tests.runtime.test_copies_priced import disaggregated


def _vllm(plan, tp: int = 1):
    return attrs.evolve(plan, placements=tuple(
        p.changed(engine=Engine.VLLM, tp=tp, dp=len(p.devices) // tp)
        if p.stage == "rollout" else p for p in plan.placements))


def _plans():
    tiny, grpo = load(shipped("pipelines", "tiny_ppo.rpeg")), load(shipped("pipelines",
                                                                            "tiny_grpo.rpeg"))
    ppo8b = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    carried = split_plan(grpo, 2, dp=2, chunks=4, staleness=0)
    carried = attrs.evolve(carried, placements=tuple(
        attrs.evolve(p, carry=1) if p.stage == "rollout" else p for p in carried.placements))
    # the rollout on devices 0-1, its trainer on device 1: in place there, a copy on 0
    partly = split_plan(tiny, 2, staleness=1)
    partly = attrs.evolve(partly, placements=tuple(
        p.changed(devices=(0, 1), dp=2) if p.stage == "rollout" else
        p.changed(devices=(1,), dp=1) if p.stage == "actor_step" else p
        for p in partly.placements), model_homes=(("actor", (1,)),) + tuple(
            h for h in partly.model_homes if h[0] != "actor"))
    return {"tiny ppo, split": (tiny, split_plan(tiny, 2, staleness=1)),
            "tiny ppo, partly in place": (tiny, partly),
            "tiny grpo, carried, dp 2": (grpo, carried),
            "tiny grpo, chunked, dp 2": (grpo, split_plan(grpo, 2, dp=2, chunks=4)),
            "tiny ppo, one device": (tiny, split_plan(tiny, 1)),
            "ppo 8b x8, vLLM beside": (ppo8b, _vllm(scaled(split_plan(ppo8b, 1, staleness=0), 8))),
            "ppo 8b x16, vLLM at tp 2": (ppo8b, _vllm(scaled(split_plan(ppo8b, 2), 8), 2)),
            # the critic's whole copy beside its ZeRO-3 trainer filled by a transfer the
            # graph syncs nothing by
            "ppo 8b x8, vLLM at tp 2 apart, ZeRO-3": (ppo8b, disaggregated(ppo8b, 8, zero=3,
                                                                        gen_tp=2))}


PLANS = _plans()


def _verify_layouts(p: Placed, plan) -> None:
    names = [o.name for o in p.graph.ops]
    assert [n for n, _ in p.layouts] == names
    assert {o.name for o in p.graph.ops if o.kind is OpKind.GENERATE} <= p.streamed
    for op in p.graph.ops:
        lay = p.layout(op.name)
        if op.kind is OpKind.SYNC_WEIGHTS:
            train = next(o for o in p.graph.ops if o.kind is OpKind.TRAIN
                         and o.writes_model == op.reads_model)
            src = plan.placement(train.stages[0])
            assert lay.devices[:len(sync_senders(src.devices, src.tp, src.zero))] == \
                sync_senders(src.devices, src.tp, src.zero)
            continue
        place = plan.placement(op.stages[0])
        assert lay.devices == place.devices
        trainer = next((plan.placement(o.stages[0]) for o in p.graph.ops
                        if o.kind is OpKind.TRAIN and o.writes_model == op.reads_model), None)
        gathered = gathers_in_place(op, trainer, place, p.chunks)
        assert lay.everywhere == (op.kind is OpKind.TRAIN or gathered)
        assert not gathered or lay.devices == trainer.devices
        assert lay.per_block == (op.kind is OpKind.GENERATE and place.engine is Engine.VLLM)


def _verify_chunks(p: Placed, plan) -> None:
    gens = [plan.placement(o.stages[0]) for o in p.graph.ops if o.kind is OpKind.GENERATE]
    assert p.chunks == max(stream_chunks(g.chunks, len(g.devices) // g.tp, p.responses)
                           for g in gens)
    assert all(p.chunks >= len(g.devices) // g.tp for g in gens)


def _verify_engine_syncs(p: Placed, plan) -> None:
    for model, lay in p.engine_syncs:
        train = next(o for o in p.graph.ops if o.kind is OpKind.TRAIN and o.writes_model == model)
        src = plan.placement(train.stages[0])
        gens = [plan.placement(o.stages[0]) for o in p.graph.ops
                if o.kind is OpKind.GENERATE and o.reads_model == model]
        assert {b[0] for b in lay.group + lay.local} == {
            h for g in gens for h in engine_hosts_of(g) if serves_copy(src, g, h)}
        assert sync_refusal(lay) is None


def _verify_streams(p: Placed, plan) -> None:
    gens = [o for o in p.graph.ops if o.kind is OpKind.GENERATE]
    assert [n for n, _ in p.lanes] == [o.name for o in gens]
    for o in gens:
        assert dict(p.lanes)[o.name] == len(p.layout(o.name).blocks)
        assert dict(p.carry).get(o.name, 0) == plan.placement(o.stages[0]).carry
    edges = {(e.writer, e.reader) for e in p.graph.version_edges}
    for writer, reader in p.in_place:          # a version edge, or a trainer behind a sync
        assert (writer, reader) in edges or any((writer, s) in edges and (s, reader) in edges
                                                for s, _ in p.layouts)
        w, r = p.graph.op(writer), p.graph.op(reader)
        if w.kind is OpKind.TRAIN and r.kind is not OpKind.SYNC_WEIGHTS:
            t, place = plan.placement(w.stages[0]), plan.placement(r.stages[0])
            assert any(reads_in_place(t, place, d) for d in place.devices) \
                or p.layout(reader).everywhere
        else:
            assert set(p.layout(writer).devices) & set(p.layout(reader).devices)
    # a reader sharing the trained replica on some of its blocks: those blocks
    for (writer, reader), (n, blocks) in p.partly:
        assert (writer, reader) in p.in_place and 0 < len(blocks) < n
        lay = p.layout(reader)
        t, place = plan.placement(p.graph.op(writer).stages[0]), \
            plan.placement(p.graph.op(reader).stages[0])
        assert n == len(lay.blocks) and blocks == {b for b in range(n) if any(
            reads_in_place(t, place, d) for d in lay.devices_of(b))}
    partly = dict(p.partly)
    # the typed edges: a stream within one block, a carry to the next step on it, a write
    # after the reads of the version before on the replica both use (on its blocks sharing
    # it, where it shares it on some)
    for d in p.edges(4).of_kind(DepKind.ORDER):
        if d.data in (STREAM, CARRY):
            lay = p.layout(d.dst.op)
            assert d.src.op == d.dst.op and lay.devices_of(d.src.chunk) == \
                lay.devices_of(d.dst.chunk)
            assert d.dst.step - d.src.step == (d.data == CARRY)
            assert d.data == STREAM or dict(p.carry)[d.dst.op] > 0
        else:
            assert (d.dst.op, d.src.op) in p.in_place
            n, blocks = partly.get((d.dst.op, d.src.op), (1, {0}))
            assert d.src.chunk % n in blocks


def _verify_replicas(p: Placed, plan) -> None:
    trainers = {o.writes_model: plan.placement(o.stages[0]) for o in p.graph.ops
                if o.kind is OpKind.TRAIN and o.writes_model}
    held = {(r.key, r.device): r for r in p.replicas}
    assert len(held) == len(p.replicas)
    assert list(p.replicas) == sorted(p.replicas, key=lambda r: (r.key, r.device))
    assert {op for op, _ in p.reads} == {o.name for o in p.graph.ops if o.reads_model
                                        and o.kind is not OpKind.SYNC_WEIGHTS}
    read = set()
    for op, at in p.reads:
        o, lay = p.graph.op(op), p.layout(op)
        assert o.reads_model and o.kind is not OpKind.SYNC_WEIGHTS
        members = dict(lay.members(p.chunks))
        assert dict(at).keys() == members.keys()     # a copy on every device of its calls
        for d, key in at:
            assert key.backbone == o.reads_model
            assert o.kind is not OpKind.TRAIN or key == o.reads_model
            r = held[(key, d)]            # one layout a copy: every reader splits it alike
            assert r.group == members[d], (op, key, d)
            read.add((key, d))
    assert read == held.keys()                     # every copy is read, where it lies
    for r in p.replicas:
        trainer = trainers.get(r.key)
        assert r.trained == (trainer is not None and r.device in trainer.devices)
        if r.key.engine:                             # an engine's own: its block, from its host
            assert r.engine[0] == r.device and r.engine in {
                b for op, _ in p.lanes for b in p.layout(op).blocks}
        else:
            assert r.engine == ()


def _verify_transfers(p: Placed, plan) -> None:
    trainers = {o.name: o.writes_model for o in p.graph.ops
                if o.kind is OpKind.TRAIN and o.writes_model}
    assert [(t.trainer, t.model, t.op) for t in p.transfers] == \
        [(n, m, transfer_of(m)) for n, m in trainers.items()]
    by_op = {t.op: t for t in p.transfers}
    u = p.edges(5)
    graph_versions = {(d.src, d.dst) for d in u.of_kind(DepKind.VERSION)}
    syncs = {o.name for o in p.graph.ops if o.kind is OpKind.SYNC_WEIGHTS}
    kinds = {o.name: o.kind for o in p.graph.ops}
    lags = {(e.writer, e.reader): e.lag for e in p.graph.version_edges}
    edges = p.transfer_edges(u)
    assert len(set(edges)) == len(edges)
    for d in edges:
        if d.kind is DepKind.VERSION and d.dst.op in by_op and d.src.op in trainers:
            # a transfer reads its own step's trained weights
            assert by_op[d.dst.op].trainer == d.src.op and d.src.step == d.dst.step
        elif d.kind is DepKind.VERSION:
            # a reader reads the version its writer's step's transfer makes: the writer's
            # version edge into it, or into the weight sync it reads
            t = by_op[d.src.op]
            made = Instance(t.trainer, d.src.step)
            assert (made, d.dst) in graph_versions or any(
                (made, s) in graph_versions and (s, d.dst) in graph_versions
                for s, _ in graph_versions if s.op in syncs)
            assert d.data == t.model
        elif d.dst.op in trainers:
            # the trainer writes after the transfer of the step before read its weights
            assert by_op[d.src.op].trainer == d.dst.op and d.dst.step == d.src.step + 1
        else:
            # a transfer fills a copy after the readers of the version before read it
            t = by_op[d.dst.op]
            assert read_version(kinds[d.src.op], d.src.step, lags[(t.trainer, d.src.op)]) \
                == d.dst.step
    # every step's trainer hands its weights to its transfer
    made = {(d.src, d.dst) for d in edges if d.kind is DepKind.VERSION}
    assert all((i, Instance(by_op[transfer_of(trainers[i.op])].op, i.step)) in made
               for i in u.instances if i.op in trainers)
    # a copy's writer after its writer of the version before: its trainer's or its
    # transfers' step before, for every step of a trainer
    rewrites = p.rewrite_edges(u)
    for d in rewrites:
        assert d.kind is DepKind.ORDER and d.src == attrs.evolve(d.dst, step=d.dst.step - 1)
        assert d.dst.op in trainers and trainers[d.dst.op] == d.data or \
            d.dst.op in by_op and by_op[d.dst.op].model == d.data
    assert len(rewrites) == 2 * sum(1 for i in u.instances if i.op in trainers and i.step)


def _verify_fills(p: Placed, plan) -> None:
    for t in p.transfers:
        src = plan.placement(p.graph.op(t.trainer).stages[0])
        assert t.sources == sync_senders(src.devices, src.tp, src.zero)
        # a copy of its model read off the trainer's devices, or on them split another way
        assert set(t.fills) == {(key, d) for _, at in p.reads for d, key in at
                                if key.backbone == t.model
                                and (d not in src.devices or key != t.model)}
        assert list(t.fills) == sorted(t.fills)
        hosts = {b[0] for b in p.engine_sync(t.model).group + p.engine_sync(t.model).local}
        assert {d for key, d in t.fills if key.engine} == hosts


def _verify_collectives(p: Placed, plan) -> None:
    # the graph's op order, each transfer's op not the graph's just after its trainer
    ops = p.graph.topo_order()
    assert [o for o in p.op_order if o in ops] == list(ops)
    for t in p.transfers:
        if t.op not in ops:
            assert p.op_order[p.op_order.index(t.trainer) + 1] == t.op
    assert len(p.op_order) == len(set(p.op_order)) == len(set(ops) | {t.op for t in p.transfers})
    # the one order of collectives: every instance and transfer once, after every edge's
    # source, and of those ready, the least (step, op order, chunk) next
    u = p.edges(3)
    moved = [Instance(t.op, s) for t in p.transfers for s in range(2)]
    order = p.collective_order(u, moved)
    assert set(order) == set(u.instances) | set(moved) and len(order) == len(set(order))
    into: dict = {}
    for d in (*u.deps, *p.transfer_edges(u), *p.rewrite_edges(u)):
        into.setdefault(d.dst, set()).add(d.src)
    place = {i: n for n, i in enumerate(order)}
    key = {op: n for n, op in enumerate(p.op_order)}
    for n, i in enumerate(order):
        assert all(place[s] < n for s in into.get(i, ()) if s in place), i
        ready = [j for j in order[n:] if all(place[s] < n for s in into.get(j, ()) if s in place)]
        assert min(ready, key=lambda j: (j.step, key[j.op], j.chunk)) == i


VERIFY = {"chunks": _verify_chunks, "layouts": _verify_layouts,
          "engine_syncs": _verify_engine_syncs, "streams": _verify_streams,
          "transfers": _verify_transfers, "replicas": _verify_replicas,
          "fills": _verify_fills, "collectives": _verify_collectives}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_each_pass_adds_what_its_verifier_checks(name):
    pipeline, plan = PLANS[name]
    graph = step_graph(pipeline, plan)
    placed = Placed(graph, pipeline.workload.prompts * pipeline.workload.samples)
    place = lambda o: plan.placement(o.stages[0])        # noqa: E731
    assert [f.__name__ for f in PASSES] == list(VERIFY)
    for step in PASSES:
        placed = step(placed, place)
        VERIFY[step.__name__](placed, plan)
    synced = any(lay.group or lay.local for _, lay in placed.engine_syncs)
    assert synced == ("vLLM at tp" in name)   # beside whole weights: updated in memory
    sent = set()
    # the runtime lays its op calls out where the placed graph says
    for c in build_calls(pipeline, plan, 3):
        if c.kind is OpKind.SYNC_WEIGHTS and c.op not in dict(placed.layouts):
            # a transfer the graph syncs nothing by: one of the placed graph's
            assert c.op in {t.op for t in placed.transfers}
            sent.add(c.op)
        elif c.kind is OpKind.SYNC_WEIGHTS:
            assert c.device in placed.layout(c.op).devices or c.role == "load"
        else:
            assert c.device in placed.layout(c.op).devices_of(c.chunk) or c.kind is OpKind.TRAIN
    assert bool(sent) == ("ZeRO-3" in name)


def test_a_caller_lowers_only_as_far_as_it_reads():
    pipeline, plan = PLANS["ppo 8b x16, vLLM at tp 2"]
    graph = step_graph(pipeline, plan)
    whole = lower(graph, plan, 512)
    first = lower(graph, plan, 512, passes=PASSES[:2])
    assert (first.layouts, first.chunks) == (whole.layouts, whole.chunks)
    assert first.engine_syncs == () and whole.engine_syncs
    # the simulator's: all it prices, without the runtime's replicas
    priced = lower(graph, plan, 512, passes=PRICED)
    assert attrs.evolve(whole, reads=(), replicas=(), op_order=(), transfers=tuple(
        attrs.evolve(t, sources=(), fills=()) for t in whole.transfers)) == priced
    assert priced.replicas == () and whole.replicas


@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_run_reading_no_new_version_transfers_nothing(name):
    """A run of one step reads the versions it starts with: no transfer fills a copy."""
    pipeline, plan = PLANS[name]
    calls = build_calls(pipeline, plan, 1)
    assert calls and not [c.id for c in calls if c.kind is OpKind.SYNC_WEIGHTS]


@pytest.mark.parametrize("name", sorted(PLANS))
def test_the_simulators_rounds_are_the_runtimes_chunks_collapsed(name):
    """A round of a generate op's chunks (``Placed.by_round``) is a chunk on each of its
    blocks, side by side, and the instances and edges the simulator prices are the
    runtime's with the chunks of a round as one (a round partly in place waits for its
    trainer through the weight sync its other chunks wait for)."""
    pipeline, plan = PLANS[name]
    placed = lower(step_graph(pipeline, plan), plan,
                   pipeline.workload.prompts * pipeline.workload.samples)
    lanes = {k for _, k in placed.lanes}
    assert len(lanes) == 1                         # one generate op, or all on as many blocks
    blocks = lanes.pop()
    rounds = placed.by_round()
    assert rounds.chunks == -(-placed.chunks // blocks) == \
        rounds_of(plan.placement(placed.lanes[0][0]), placed.chunks)
    assert placed.chunks % blocks == 0             # whole rounds
    for op, _ in placed.lanes:
        lay = placed.layout(op)
        for r in range(rounds.chunks):
            on = [lay.devices_of(c) for c in range(r * blocks, (r + 1) * blocks)]
            assert len(set(on)) == blocks          # side by side, on every block

    def collapsed(i):
        return attrs.evolve(i, chunk=i.chunk // blocks) if i.op in placed.streamed else i

    ran, priced = placed.edges(4, horizon=4), rounds.edges(4, horizon=4)
    assert {collapsed(i) for i in ran.instances} == set(priced.instances)
    ran_deps = {(collapsed(d.src), collapsed(d.dst), d.kind, d.data) for d in ran.deps
                if collapsed(d.src) != collapsed(d.dst)}
    priced_deps = {(d.src, d.dst, d.kind, d.data) for d in priced.deps}
    assert priced_deps <= ran_deps
    into: dict = {}
    for d in priced.deps:
        into.setdefault(d.dst, set()).add(d.src)

    def before(i, seen):
        for j in into.get(i, ()):
            if j not in seen:
                seen.add(j)
                before(j, seen)
        return seen

    assert all(a in before(b, set()) for a, b, _, _ in ran_deps - priced_deps)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(factor=st.integers(1, 3), chunks=st.integers(1, 7), staleness=st.integers(0, 1))
def test_any_rollout_streams_whole_rounds_of_its_blocks(factor, chunks, staleness):
    """The runtime's generate calls of a step are whole rounds, a chunk on each block: the
    chunks asked rounded up to as many on each block (never more than its responses)."""
    pipeline = load(shipped("pipelines", "tiny_grpo.rpeg"))
    plan = scaled(split_plan(pipeline, 2, staleness=staleness), factor)
    plan = attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, chunks=chunks) if p.stage == "rollout" else p for p in plan.placements))
    responses = pipeline.workload.prompts * pipeline.workload.samples
    placed = lower(step_graph(pipeline, plan), plan, responses)
    blocks, rounds = blocks_of(plan.placement("rollout")), placed.by_round().chunks
    assert placed.chunks == rounds * blocks
    assert rounds == min(-(-chunks // blocks), max(1, responses // blocks))
    lay, calls = placed.layout("rollout"), build_calls(pipeline, plan, 2)
    for step in range(2):
        mine = [c for c in calls if c.op == "rollout" and c.step == step]
        for r in range(rounds):
            got = sorted(lay.blocks.index(next(b for b in lay.blocks if c.device in b))
                         for c in mine if c.chunk // blocks == r)
            assert got == list(range(blocks))       # one chunk on each block


@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_steady_steps_transfers_are_the_runtimes_gangs(name):
    """The weight transfers the task count lays out (``Placed.moves()``, a steady step's)
    are the runtime's calls of a version of a run, gang by gang, device by device in call
    order: the one function both read (the runtime's by the versions its calls read)."""
    pipeline, plan = PLANS[name]
    graph = step_graph(pipeline, plan)
    place = lambda o: plan.placement(o.stages[0])        # noqa: E731
    counted = lower(graph, plan, pipeline.workload.prompts * pipeline.workload.samples, place,
                    passes=COUNTED)
    step = 1                                   # version 2, read in a run of 6 steps
    ran: dict[tuple, list[int]] = {}
    for c in build_calls(pipeline, plan, 6):
        if c.step == step and c.role in ("export", "load", "send", "recv"):
            gang = PUSH if c.role in ("send", "recv") else LOADS
            ran.setdefault((c.op, gang), []).append(c.device)
    assert {(m.op, m.gang): list(m.devices) for m in counted.moves()} == ran
