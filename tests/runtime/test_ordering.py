"""The lowering's ordering passes (``rpeg.runtime.lowering.ordering.PASSES``), each followed
by a verifier of what it establishes, on the calls of the tiny pipelines under plans of
every shape (from step 0 and a resumed step) and of ppo_llama8b with vLLM engines on 8 GPUs
(``lowering_calls.py``'s cases), whose calls are the golden ones (their text's digest):

* ``add_syncs``: every version read off its trainer's devices has its sync (a load or an
  engine's receive of that version of that copy on the reader's device);
* ``order_versions``: every reader after the writer of its version, every writer after
  the readers of the version before, on the same device;
* ``order_streams``: each device's share of a generate op after its share before;
* ``order_collectives``: the members of a gang wait for the same calls, and on every device
  each gang waits for the one before it there: one order of gangs on every device, the
  placed graph's (``Placed.collective_order``: :func:`verify_one_order`, no rank of two
  gangs sharing devices meets them in two orders);
* ``order_pushes``: an engine's receive on a sending device after that send;
* ``settle``: each ordering edge once, none to the call itself.

Each pass returns new calls and keeps the ones it was given (their ids in their order).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections import defaultdict
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rpeg.errors import PlanError
from rpeg.graph.order import topological
from rpeg.runtime.lowering import ordering as O
from rpeg.runtime.lowering.instances import build_calls, lay_out, placed_for
from rpeg.runtime.lowering.joins import JOIN
from rpeg.runtime.lowering.replicas import RECV, SEND, base_of
from rpeg.runtime.placement import split_plan
from rpeg.spec.model import Engine, OpKind

HERE = Path(__file__).resolve().parent


def _cases():
    spec = importlib.util.spec_from_file_location("lowering_calls",
                                                  HERE / "lowering_calls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, list(module.cases())


GOLDEN, CASES = _cases()
DIGEST = "06f29d07a6bd2db57246cb06e3ae4143feafe79046f434b4481841b574b4ed02"


def test_the_lowerings_calls_are_the_golden_ones():
    """A change that means to change what runs updates the digest: diff the text
    (``python tests/runtime/lowering_calls.py``) before and after."""
    text = GOLDEN.dump()
    assert text.count("\n") > 5000                  # every case laid out
    assert hashlib.sha256(text.encode()).hexdigest() == DIGEST


def _reads_off_home(c, ctx) -> bool:
    """A call reading a version past the run's first of a copy its model's transfers fill
    (the placed graph's ``Transfer.fills``, checked in ``tests/plan/test_lower.py``)."""
    t = ctx.transfers.get(base_of(c.model))
    return t is not None and (c.model, c.device) in t.fills and c.version > ctx.first


def verify_syncs(calls, ctx) -> None:
    made = {(c.model, c.device, c.writes) for c in calls if c.role}
    missing = [c.id for c in calls if _reads_off_home(c, ctx)
               and (c.model, c.device, c.version) not in made]
    assert not missing, missing


def verify_versions(calls, ctx) -> None:
    writer = {(c.model, c.device, c.writes): c.id for c in calls if c.writes >= 0}
    readers = defaultdict(set)
    for c in calls:
        if c.version >= 0 and base_of(c.model) in ctx.transfers:
            readers[(c.model, c.device, c.version)].add(c.id)
    for c in calls:
        if c.version > ctx.first and base_of(c.model) in ctx.transfers:
            assert writer[(c.model, c.device, c.version)] in c.after, c.id
        if c.writes >= 0:
            assert readers[(c.model, c.device, c.writes - 1)] - {c.id} <= set(c.after), c.id
            before = writer.get((c.model, c.device, c.writes - 1))   # the copy's writer before
            assert before is None or before in c.after, c.id


def verify_streams(calls, ctx) -> None:
    at = {(c.op, c.step, c.chunk, c.device): c.id for c in calls if not c.role}
    for c in calls:
        src = ctx.streams.get((c.op, c.chunk)) if c.kind is OpKind.GENERATE else None
        if src is not None:
            before = at.get((src[0], c.step - src[2], src[1], c.device))
            assert before is None or before in c.after, c.id


def verify_one_order(calls, ctx) -> None:
    """No two ranks wait on each other in their collectives: on every device each gang's
    members there run after a member there of the gang before it (happens-before over the
    calls' deps and after, through joins), the gangs in the device's share of the placed
    graph's one order (``Placed.collective_order``, a total order of the gangs), so two
    gangs sharing devices meet in the same order on all of them."""
    index = {c.id: n for n, c in enumerate(calls)}
    table = {c.id: c for c in calls}
    below: dict[str, int] = {}                  # call -> its ancestors, as a bit set
    for cid in O._topo(calls):
        m = 0
        for d in table[cid].deps + table[cid].after:
            m |= below[d] | 1 << index[d]
        below[cid] = m
    gangs = O.gangs_of(calls)
    place = ctx.gang_order({c.instance for c in calls if c.role in O.TRANSFER_ROLES})
    rank = {k: place[(calls[at[0]].instance, k[3])] for k, at in gangs.items()}
    assert len(set(rank.values())) == len(rank)           # a total order of the gangs
    on: dict[int, dict[tuple, list]] = defaultdict(dict)  # device -> gang -> its members
    for key, at in gangs.items():
        assert len({calls[i].instance for i in at}) == 1, key
        for i in at:
            on[calls[i].device].setdefault(key, []).append(calls[i])
    for dev, here in on.items():
        keys = sorted(here, key=rank.get)
        for a, b in zip(keys, keys[1:], strict=False):
            for c in here[b]:
                assert any(below[c.id] >> index[m.id] & 1 for m in here[a]), (dev, a, c.id)


def verify_collectives(calls, ctx) -> None:
    verify_one_order(calls, ctx)
    table = {c.id: c for c in calls}

    def waits(c) -> set:                # what a call waits for, through its gang's join
        out = set()
        for d in c.deps + c.after:
            j = table[d]
            out |= set(j.deps + j.after) if j.role == JOIN else {d}
        return out

    gangs = O.gangs_of(calls)
    for at in gangs.values():
        own = {calls[i].id for i in at}
        assert len({frozenset(waits(calls[i]) - own) for i in at}) == 1, sorted(own)
    place = {cid: n for n, cid in enumerate(O._topo(calls))}
    on: dict[int, dict[tuple, list]] = defaultdict(dict)  # device -> gang -> its members
    for key, at in gangs.items():
        for i in at:
            on[calls[i].device].setdefault(key, []).append(calls[i])
    follows: dict[tuple, set] = defaultdict(set)      # gang -> the gangs just before it
    for here in on.values():
        keys = sorted(here, key=lambda k: min(place[c.id] for c in here[k]))
        for a, b in zip(keys, keys[1:], strict=False):
            for c in here[b]:                 # each waits for the gang before it there
                assert {m.id for m in here[a]} & waits(c), (a, c.id)
            follows[b].add(a)
    # one order of gangs on every device: the devices' orders together have no cycle
    topological(list(gangs), lambda k: sorted(follows[k], key=str))


def verify_pushes(calls, ctx) -> None:
    send = {(c.op, c.step, c.device): c.id for c in calls if c.role == SEND}
    for c in calls:
        if c.role == RECV and (c.op, c.step, c.device) in send:
            assert send[(c.op, c.step, c.device)] in c.after, c.id


def verify_settled(calls, ctx) -> None:
    for c in calls:
        assert c.id not in c.after and len(set(c.after)) == len(c.after), c.id
    assert len({c.id for c in calls}) == len(calls)


VERIFIERS = {O.add_syncs: verify_syncs, O.order_versions: verify_versions,
             O.order_streams: verify_streams, O.order_collectives: verify_collectives,
             O.order_pushes: verify_pushes, O.settle: verify_settled}


def test_every_pass_has_a_verifier():
    assert set(O.PASSES) == set(VERIFIERS) and len(O.PASSES) == len(VERIFIERS)


def _verified(pipeline, plan, steps: int, first: int):
    """The calls through every pass, each pass's verifier run after it."""
    calls, ctx = lay_out(pipeline, plan, steps, first=first)
    for run in O.PASSES:
        given = calls
        calls = run(given, ctx)
        assert [c.id for c in calls[:len(given)]] == [c.id for c in given], run.__name__
        VERIFIERS[run](calls, ctx)
    return calls


@pytest.mark.parametrize("first", [0, GOLDEN.RESUMED])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[t for t, _, _ in CASES])
def test_each_pass_establishes_its_property(case, first):
    _, pipeline, make = CASES[case]
    try:
        calls = _verified(pipeline, make(), GOLDEN.STEPS, first)
    except PlanError:
        pytest.skip("a shape this pipeline refuses")
    assert calls == build_calls(pipeline, make(), GOLDEN.STEPS, first=first)


@pytest.mark.parametrize("first", [0, GOLDEN.RESUMED])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[t for t, _, _ in CASES])
def test_every_device_meets_its_collectives_in_the_one_order(case, first):
    """The calls a run takes (every pass done): on every device its gangs in its share of
    the placed graph's one order of collectives, each after the one before it there."""
    _, pipeline, make = CASES[case]
    try:
        calls, ctx = lay_out(pipeline, make(), GOLDEN.STEPS, first=first)
    except PlanError:
        pytest.skip("a shape this pipeline refuses")
    verify_one_order(O.ordered(calls, ctx), ctx)


def test_each_verifier_rejects_calls_without_its_pass():
    """The verifiers can fail: each rejects its pass's input in some case (the property does
    not hold before the pass)."""
    rejected = set()
    for _, pipeline, make in CASES:
        try:
            calls, ctx = lay_out(pipeline, make(), GOLDEN.STEPS)
        except PlanError:
            continue
        for run in O.PASSES:
            try:
                VERIFIERS[run](calls, ctx)
            except AssertionError:
                rejected.add(run)
            calls = run(calls, ctx)
    assert rejected == set(O.PASSES)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["tiny_ppo", "tiny_grpo"]), devices=st.sampled_from([1, 2]),
       dp=st.sampled_from([1, 2]), chunks=st.integers(1, 4), staleness=st.integers(0, 2),
       share=st.booleans(), steps=st.integers(2, 6), first=st.integers(0, 2))
def test_any_split_plan_passes_every_verifier(name, devices, dp, chunks, staleness, share,
                                              steps, first):
    pipeline = GOLDEN.load(GOLDEN.PIPELINES / f"{name}.rpeg")
    plan = split_plan(pipeline, devices, dp=min(dp, devices), chunks=chunks,
                      staleness=staleness, share=share and bool(pipeline.shares))
    _verified(pipeline, plan, max(steps, first + 1), first)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["tiny_ppo", "tiny_grpo"]), apart=st.booleans(),
       devices=st.sampled_from([2, 4]), zero=st.sampled_from([0, 2, 3]),
       vllm=st.booleans(), steps=st.integers(2, 6), first=st.integers(0, 2))
def test_any_engine_plan_passes_every_verifier(name, apart, devices, zero, vllm, steps,
                                               first):
    """Plans with weight transfers and pushes into vLLM engines (beside the trainers or on
    devices of their own): every verifier, the one order of collectives among them."""
    pipeline = GOLDEN.load(GOLDEN.PIPELINES / f"{name}.rpeg")
    plan = GOLDEN.disaggregated(pipeline, devices, zero=zero) if apart else \
        GOLDEN.colocated(pipeline, devices, zero=zero,
                         engine=Engine.VLLM if vllm else Engine.TORCH)
    try:
        _verified(pipeline, plan, max(steps, first + 1), first)
    except PlanError:
        assume(False)                      # a shape the runtime refuses


@pytest.mark.parametrize("case", range(len(CASES)), ids=[t for t, _, _ in CASES])
@pytest.mark.parametrize("first", [0, 3])
def test_a_long_run_orders_versions_by_its_whole_placed_graph(case, first):
    """The version and write-after-read edges of a run longer than the steps the lowering
    unrolls (``version_steps``: those past them alike, one step on) are those of the whole
    run's placed graph."""
    _, pipeline, make = CASES[case]
    plan, steps = make(), first + 14
    try:
        calls, ctx = lay_out(pipeline, plan, steps, first=first)
    except PlanError:
        pytest.skip("a shape this pipeline refuses")
    assert ctx.steady >= 0                       # the steps past those unrolled are shifted
    placed = placed_for(pipeline, plan)
    edges = placed.edges(steps - first)
    versions, readers = O._version_edges(placed, edges, first)
    whole = attrs.evolve(ctx, versions=versions, readers=readers,
                         before=O._rewrites(placed, edges, first), steady=-1)
    synced = O.add_syncs(calls, ctx)
    assert O.order_versions(synced, ctx) == O.order_versions(synced, whole)


def test_order_versions_reads_the_placed_graphs_edges():
    """A reader whose version edge the placed graph does not give has no writer: the pass
    takes the edges it orders by from the placed graph, not from the calls."""
    _, pipeline, make = CASES[0]
    calls, ctx = lay_out(pipeline, make(), GOLDEN.STEPS)
    synced = O.add_syncs(calls, ctx)
    with pytest.raises(PlanError, match="no op makes version"):
        O.order_versions(synced, attrs.evolve(ctx, versions={}))
    ordered = O.order_versions(synced, attrs.evolve(ctx, readers={}))
    with pytest.raises(AssertionError):              # no write after read
        verify_versions(ordered, ctx)
    ordered = O.order_versions(synced, attrs.evolve(ctx, before={}))
    with pytest.raises(AssertionError):              # no writer after the one before
        verify_versions(ordered, ctx)


def test_add_syncs_fills_the_copies_the_placed_graph_says():
    """The transfers' copies and sources are the placed graph's (``Transfer.fills``,
    ``Transfer.sources``): without them no call is added; from other devices, the
    exports move with them."""
    _, pipeline, make = next(c for c in CASES if c[0].endswith("tp 2, zero-3"))
    calls, ctx = lay_out(pipeline, make(), GOLDEN.STEPS)
    synced = O.add_syncs(calls, ctx)
    assert {c.role for c in synced[len(calls):]} >= {"export", "load", "send", "recv"}

    def placed(change):
        return attrs.evolve(ctx, placed=attrs.evolve(ctx.placed, transfers=tuple(
            attrs.evolve(t, **change(t)) for t in ctx.placed.transfers)))

    assert O.add_syncs(calls, placed(lambda t: {"fills": ()})) == calls
    moved = placed(lambda t: {"sources": t.sources[1:]})
    exports = {c.device for c in O.add_syncs(calls, moved) if c.role == "export"}
    assert exports and not exports & {t.sources[0] for t in ctx.transfers.values()}


def test_the_calls_and_the_workers_replicas_are_the_placed_graphs(monkeypatch):
    """Each call reads the copy ``Placed.reads`` names, and a run's context sets up the
    replicas ``Placed.replicas`` holds (those its calls read), with their layouts."""
    from rpeg.runtime.lowering import instances
    from rpeg.runtime.lowering.context import RunContext

    _, pipeline, make = next(c for c in CASES if c[0].endswith("vllm tp 2 beside zero-2"))
    plan = make()
    calls = build_calls(pipeline, plan, GOLDEN.STEPS)
    placed = placed_for(pipeline, plan)
    reads = {op: dict(at) for op, at in placed.reads}
    assert all(c.model == reads[c.op][c.device] for c in calls if not c.role and c.model)
    ctx = RunContext.create(pipeline, plan, calls, run_dir="")
    held = {(r.key, r.device): r for r in placed.replicas}
    assert {(r.model, r.device) for r in ctx.replicas} == held.keys()
    for r in ctx.replicas:
        h = held[(r.model, r.device)]
        assert (r.tp, r.engine, r.trainable) == (h.group, h.engine, h.trained)
    assert any(r.engine for r in ctx.replicas) and ctx.syncs
    real = instances.lower

    def whole_copies(*args, **kwargs):               # every op reads its backbone's own
        p = real(*args, **kwargs)
        return attrs.evolve(p, reads=tuple((op, tuple((d, k.backbone) for d, k in at))
                                           for op, at in p.reads))

    monkeypatch.setattr(instances, "lower", whole_copies)
    assert {c.model for c in build_calls(pipeline, plan, 2) if c.op == "rollout"} == {"actor"}
