"""The copies of each model's weights the cost model prices are the copies the runtime
makes: for the shipped pipelines on their clusters and the tiny ones on the local one,
under plans of every shape (split, colocated, data and tensor parallel, ZeRO 0/2/3
trainers and readers, vLLM engines beside a trainer or on devices of their own, readers on
part of a trainer's devices, a shared backbone, the planner's), every (copy, device) the
evaluator puts resident memory on is a replica the runtime's lowering creates there, the
trained ones trained, each split as the runtime splits it, and nothing more."""

from __future__ import annotations

import doctest
import re
from pathlib import Path

import attrs
import pytest
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

import rpeg.plan.copies
from rpeg.errors import PlanError
from rpeg.plan.compile import compile_plan
from rpeg.plan.evaluate import Evaluator, settle_batching
from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.runtime.lowering.context import RunContext
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.lowering.replicas import LOAD, base_of
from rpeg.runtime.placement import split_plan
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Engine, OpKind

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = ROOT / "pipelines"
CLUSTERS = PIPELINES / "clusters"


def priced(pipeline, cluster, plan) -> set[tuple[str, int, bool, int]]:
    """(key, device, trained, devices it is split over) of every copy the evaluator
    prices."""
    ev = Evaluator(pipeline, cluster)
    out = set()
    for h in ev.copies(settle_batching(pipeline, plan, cluster)):
        for d in h.devices:
            out.add((str(h.key), d, h.trained, h.placement.tp))
    return out


def made(pipeline, plan) -> set[tuple[str, int, bool, int]]:
    """The same of every replica the runtime's lowering creates (a vLLM engine's on each
    device its workers span)."""
    ctx = RunContext.create(pipeline, plan, build_calls(pipeline, plan, steps=3),
                            run_dir=".")
    return {(str(r.model), d, r.trainable, len(r.engine) or max(len(r.tp), 1))
            for r in ctx.replicas for d in r.engine or (r.device,)}


def colocated(pipeline, n: int, *, zero: int = 0, reader_zero: int = 0,
              engine: Engine = Engine.TORCH, gen_tp: int = 1, readers: int = 0,
              reader_tp: int = 1, staleness: int = 0, gen_on: int = 0) -> Plan:
    """Every model stage on devices 0..n-1, trained models at ``zero``; forward stages on
    the first ``readers`` devices (0: all) at ``reader_tp`` and ``reader_zero`` (a trained
    model's; a frozen one's whole); the
    generate stage on ``engine`` at ``gen_tp``, on the first ``gen_on`` devices (0: all;
    one block: a step streams one chunk); the rest on device 0."""
    places = []
    every = tuple(range(n))
    for s in pipeline.stages:
        if s.kind is OpKind.GENERATE:
            gen = every[:gen_on or n]
            places.append(StagePlacement.of(s.name, gen, dp=len(gen) // gen_tp, tp=gen_tp,
                                         chunks=len(gen) // gen_tp, engine=engine))
        elif s.kind is OpKind.TRAIN:
            places.append(StagePlacement.of(s.name, every, dp=n, zero=zero))
        elif s.kind is OpKind.FORWARD:
            devs = every[:readers or n]
            frozen = pipeline.model(s.target).frozen      # a frozen model's pass: whole
            places.append(StagePlacement.of(s.name, devs, dp=len(devs) // reader_tp,
                                         tp=reader_tp, zero=0 if frozen else reader_zero))
        else:
            places.append(StagePlacement.of(s.name, (0,)))
    homes = tuple((m.name, every) for m in pipeline.models if not m.frozen)
    return Plan(pipeline.name, "test", n, tuple(places), model_homes=homes,
                staleness=tuple((st, min(k, staleness)) for st, k in pipeline.staleness),
                strategy=Strategy.MANUAL)


def disaggregated(pipeline, n: int, *, zero: int = 2, gen_tp: int = 1) -> Plan:
    """Generation (vLLM) on the first half of the devices, everything else on the second."""
    half = n // 2
    gen, rest = tuple(range(half)), tuple(range(half, n))
    places = []
    for s in pipeline.stages:
        if s.kind is OpKind.GENERATE:
            places.append(StagePlacement.of(s.name, gen, dp=half // gen_tp, tp=gen_tp,
                                         chunks=half // gen_tp, engine=Engine.VLLM))
        elif s.kind in (OpKind.TRAIN, OpKind.FORWARD):
            places.append(StagePlacement.of(s.name, rest, dp=len(rest),
                                         zero=zero if s.kind is OpKind.TRAIN else 0))
        else:
            places.append(StagePlacement.of(s.name, (half,)))
    homes = tuple((m.name, rest) for m in pipeline.models if not m.frozen)
    return Plan(pipeline.name, "test", n, tuple(places), model_homes=homes,
                staleness=tuple((st, min(k, 1)) for st, k in pipeline.staleness),
                strategy=Strategy.MANUAL)


GPU = {
    # a ZeRO-3 reader beside its ZeRO-3 trainer reads the trainer's shards in place, once a
    # step on every rank (per chunk: refused, test_a_zero3_pass_reading_a_copy_is_refused)
    "zero-3 readers gathering in place": lambda p: colocated(p, 8, zero=3, reader_zero=3,
                                                             gen_on=1),
    "zero-3 trainer, whole readers": lambda p: colocated(p, 8, zero=3),
    # a vLLM engine beside a ZeRO-2 trainer serves a copy of its own
    "vllm beside zero-2": lambda p: colocated(p, 8, zero=2, engine=Engine.VLLM),
    "vllm beside zero-0": lambda p: colocated(p, 8, zero=0, engine=Engine.VLLM),
    "vllm tp 2 beside zero-2": lambda p: colocated(p, 8, zero=2, engine=Engine.VLLM, gen_tp=2),
    "readers on half the trainer's devices": lambda p: colocated(p, 8, readers=4),
    "readers split tp 2": lambda p: colocated(p, 8, zero=2, reader_tp=2, gen_tp=2),
    "disaggregated vllm": lambda p: disaggregated(p, 8),
    "disaggregated vllm tp 2, zero-3": lambda p: disaggregated(p, 8, zero=3, gen_tp=2),
}


@pytest.mark.parametrize("shape", sorted(GPU))
@pytest.mark.parametrize("name", ["ppo_llama8b", "grpo_qwen7b", "dapo_qwen7b"])
def test_the_copies_priced_on_a_gpu_cluster_are_the_runtimes(name, shape):
    pipeline = load(PIPELINES / f"{name}.rpeg")
    cluster = load_cluster(CLUSTERS / "gh200_8.rpeg")
    plan = GPU[shape](pipeline)
    assert priced(pipeline, cluster, plan) == made(pipeline, plan)


def reloads(pipeline, cluster, plan) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    """((op, model) of every call reading a copy that a weight transfer the graph syncs
    nothing by fills, in the runtime's calls, but of an op reading only copies an op before
    it reads on the same devices (the trainer, then the graph's order: one fill of a copy a
    step, whoever reads it); the same of every op whose time the cost model prices with a
    fetch of that model's new weights, ``Evaluator._reload``)."""
    ev = Evaluator(pipeline, cluster)
    plan = settle_batching(pipeline, plan, cluster)
    graph = ev.graph(plan)
    syncs = {o.name for o in graph.ops if o.kind is OpKind.SYNC_WEIGHTS}
    trainer = {o.writes_model: o for o in graph.ops if o.kind is OpKind.TRAIN}
    calls = build_calls(pipeline, plan, steps=3)
    filled = {c.model for c in calls if c.kind is OpKind.SYNC_WEIGHTS
              and c.op not in syncs and c.role is LOAD}
    pairs: dict[str, set] = {}
    for c in calls:
        if c.kind is not OpKind.SYNC_WEIGHTS and c.model:
            pairs.setdefault(c.op, set()).add((c.device, c.model))
    order = [o.name for o in graph.ops if o.kind is OpKind.TRAIN] + list(graph.topo_order())
    seen: set = set()
    first = set()
    for op in dict.fromkeys(o for o in order if o in pairs):
        if not pairs[op] <= seen:
            first.add(op)
        seen |= pairs[op]
    read = {(c.op, str(base_of(c.model))) for c in calls
            if c.kind is not OpKind.SYNC_WEIGHTS and c.model in filled and c.op in first}
    walk = ev.walk(plan, graph)
    fetched = {(o.name, o.reads_model) for o in graph.ops if o.stages
               and ev._reload(o, plan.placement(o.stages[0]), trainer, plan, walk) > 0}
    return read, fetched


@pytest.mark.parametrize("shape", sorted(GPU))
@pytest.mark.parametrize("name", ["ppo_llama8b", "grpo_qwen7b"])
def test_the_weight_transfers_priced_are_the_runtimes(name, shape):
    """A weight transfer the runtime adds (``rpeg.plan.lower.Placed.transfers``) is priced
    in the time of the op reading the copy it fills, on that op's devices, after its
    trainer (the fetch :meth:`~rpeg.plan.evaluate.Evaluator.timings` adds), and a fetch is
    priced only where the runtime transfers: not to a reader of the trained weights in
    place (on part of the trainer's devices) nor on its ZeRO-3 shards."""
    pipeline = load(PIPELINES / f"{name}.rpeg")
    cluster = load_cluster(CLUSTERS / "gh200_8.rpeg")
    read, fetched = reloads(pipeline, cluster, GPU[shape](pipeline))
    assert read == fetched


def _tiny_vllm(tmp_path, name: str):
    """A tiny pipeline on the tiny-vllm preset, generating with vLLM."""
    text = (PIPELINES / f"{name}.rpeg").read_text()
    text = re.sub(r":\s*tiny\s*\{", ": tiny-vllm {", text)
    text = re.sub(r"(stage rollout\s*=\s*generate\([^)]*)\)", r"\1, engine = vllm)", text)
    (tmp_path / "p.rpeg").write_text(text)
    (tmp_path / "rewards.py").write_text((PIPELINES / "rewards.py").read_text())
    return load(tmp_path / "p.rpeg")


def _tp(pipeline) -> Plan:
    """Every model stage split over devices 0-1 (tp 2); the rest on device 0."""
    places = []
    for s in pipeline.stages:
        if pipeline.has_model(s.target or "") and s.kind is not OpKind.COMPUTE:
            places.append(StagePlacement.of(s.name, (0, 1), dp=1, tp=2,
                                         chunks=2 if s.kind is OpKind.GENERATE else 1))
        else:
            places.append(StagePlacement.of(s.name, (0,)))
    homes = tuple((m.name, (0, 1)) for m in pipeline.models if not m.frozen)
    return Plan(pipeline.name, "test", 2, tuple(places), model_homes=homes,
                strategy=Strategy.MANUAL)


LOCAL = {
    "split": lambda p: split_plan(p, 2, staleness=0),
    "stale, split": lambda p: split_plan(p, 2, staleness=1),
    "one device": lambda p: split_plan(p, 1),
    "dp 2": lambda p: split_plan(p, 2, dp=2, chunks=4, staleness=0),
    "shared backbone": lambda p: split_plan(p, 2, share=True, staleness=1)
    if p.shares else split_plan(p, 2),
    "tensor parallel": _tp,
    "zero-3 gathered in place": lambda p: colocated(p, 2, zero=3, reader_zero=3, gen_on=1),
    "readers on one of two": lambda p: colocated(p, 2, readers=1),
    "the planner's": lambda p: compile_plan(p, load_cluster(CLUSTERS / "local_cpu.rpeg")),
}


@pytest.mark.parametrize("shape", sorted(LOCAL))
@pytest.mark.parametrize("name", ["tiny_ppo", "tiny_grpo"])
def test_the_copies_priced_on_the_local_cluster_are_the_runtimes(name, shape):
    pipeline = load(PIPELINES / f"{name}.rpeg")
    plan = LOCAL[shape](pipeline)
    assert priced(pipeline, load_cluster(CLUSTERS / "local_cpu.rpeg"), plan) \
        == made(pipeline, plan)


@pytest.mark.parametrize("shape", sorted(LOCAL))
@pytest.mark.parametrize("name", ["tiny_ppo", "tiny_grpo"])
def test_the_weight_transfers_priced_on_the_local_cluster_are_the_runtimes(name, shape):
    pipeline = load(PIPELINES / f"{name}.rpeg")
    read, fetched = reloads(pipeline, load_cluster(CLUSTERS / "local_cpu.rpeg"),
                            LOCAL[shape](pipeline))
    assert read == fetched


@pytest.mark.parametrize("shape", ["vllm beside zero-2", "vllm beside zero-0",
                                   "disaggregated vllm"])
def test_the_copies_of_a_vllm_engine_priced_are_the_runtimes(shape, tmp_path):
    pipeline = _tiny_vllm(tmp_path, "tiny_grpo")
    plan = {"vllm beside zero-2": lambda p: colocated(p, 2, zero=2, engine=Engine.VLLM),
            "vllm beside zero-0": lambda p: colocated(p, 2, engine=Engine.VLLM),
            "disaggregated vllm": lambda p: disaggregated(p, 2)}[shape](pipeline)
    assert priced(pipeline, load_cluster(CLUSTERS / "local_cpu.rpeg"), plan) \
        == made(pipeline, plan)
    read, fetched = reloads(pipeline, load_cluster(CLUSTERS / "local_cpu.rpeg"), plan)
    assert read == fetched


def test_the_two_cases_once_priced_apart_now_hold_their_copies():
    """A ZeRO-3 values forward beside its ZeRO-3 critic reads the critic's shards in place
    (once a step); a vLLM engine beside a ZeRO-2 trainer serves its own copy; a tp-1 engine
    beside a ZeRO-0 trainer reads the trained weights in place."""
    pipeline = load(PIPELINES / "ppo_llama8b.rpeg")
    cluster = load_cluster(CLUSTERS / "gh200_8.rpeg")
    keys = {k for k, *_ in priced(pipeline, cluster, colocated(pipeline, 8, zero=3,
                                                                 reader_zero=3, gen_on=1))}
    assert "critic" in keys and "critic~whole" not in keys
    keys = {k for k, *_ in priced(pipeline, cluster, colocated(pipeline, 8, zero=2,
                                                                 engine=Engine.VLLM))}
    assert "actor~vllm" in keys
    keys = {k for k, *_ in priced(pipeline, cluster, colocated(pipeline, 8,
                                                                 engine=Engine.VLLM))}
    assert "actor~vllm" not in keys and "actor~whole" not in keys


@pytest.mark.parametrize("name", ["ppo_llama8b"])
def test_a_zero3_reader_on_its_trainers_ranks_reads_the_shards_in_place(name):
    """A forward beside its ZeRO-3 trainer, on the same ranks and once a step: a call on
    every rank reading the trained replica (its FSDP2 module gathers each layer), no copy
    of its own, no weight sync into one; the evaluator prices no copy either."""
    pipeline = load(PIPELINES / f"{name}.rpeg")
    plan = colocated(pipeline, 8, zero=3, reader_zero=3, gen_on=1)
    calls = build_calls(pipeline, plan, steps=3)
    readers = [s.name for s in pipeline.stages if s.kind is OpKind.FORWARD
               and not pipeline.model(s.target).frozen]
    assert readers
    for stage in readers:
        mine = [c for c in calls if c.op == stage and c.step == 1 and not c.role]
        model = pipeline.model(pipeline.stage(stage).target).name
        assert sorted(c.device for c in mine) == list(range(8))
        assert {str(c.model) for c in mine} == {model}
        assert sorted(c.rank for c in mine) == list(range(8))
        assert all(c.world == 8 and c.collective for c in mine)
    # the generation on one of the trainer's devices reads a whole copy of its own; nothing else
    assert {c.op for c in calls if c.model is not None and c.model.variant} \
        <= {"rollout", "sync_actor"}
    keys = {k for k, *_ in priced(pipeline, load_cluster(CLUSTERS / "gh200_8.rpeg"), plan)}
    assert {k for k in keys if "~" in k} == {"actor~whole"}, keys


@pytest.mark.parametrize("shape", ["per chunk", "frozen", "on part of the trainer's devices"])
def test_a_zero3_pass_reading_a_copy_is_refused(shape):
    """The torch runtime runs a pass on ZeRO-3 shards only where it reads its trainer's in
    place: one that would read a whole copy of its own (per chunk, of a frozen model, on
    some of the trainer's devices) is refused, never priced sharded and run whole."""
    pipeline = load(PIPELINES / "ppo_llama8b.rpeg")
    plan = {"per chunk": lambda p: colocated(p, 8, zero=3, reader_zero=3),
            "frozen": lambda p: attrs.evolve(p, placements=tuple(
                x.changed(zero=3) if x.stage == "ref_lp" else x for x in p.placements)),
            "on part of the trainer's devices": lambda p: colocated(
                p, 8, zero=3, reader_zero=3, gen_on=1, readers=4)}[shape]
    base = colocated(pipeline, 8, zero=3, gen_on=1)
    with pytest.raises(PlanError, match="must read whole weights on the torch runtime"):
        build_calls(pipeline, plan(base if shape == "frozen" else pipeline), steps=2)


def test_a_copy_costs_memory_where_it_is_held():
    """The engine's own copy beside a ZeRO-2 trainer adds its weights to those devices."""
    pipeline = load(PIPELINES / "grpo_qwen7b.rpeg")
    cluster = load_cluster(CLUSTERS / "gh200_8.rpeg")
    ev = Evaluator(pipeline, cluster)
    two = settle_batching(pipeline, colocated(pipeline, 8, zero=2, engine=Engine.VLLM), cluster)
    zero = settle_batching(pipeline, colocated(pipeline, 8, zero=0, engine=Engine.VLLM), cluster)
    engine = next(h for h in ev.copies(two) if h.key.engine)
    extra = ev.resident(engine.model, engine.placement, False)
    assert extra > 0 and engine.devices == tuple(range(8))
    with_copy = ev.resident_bytes(two, ev.graph(two))[0]
    trained_two = next(h for h in ev.copies(two) if h.trained)
    trained_zero = next(h for h in ev.copies(zero) if h.trained)
    without = ev.resident_bytes(zero, ev.graph(zero))[0] \
        - ev.resident(trained_zero.model, trained_zero.placement, True) \
        + ev.resident(trained_two.model, trained_two.placement, True)
    assert with_copy == pytest.approx(without + extra, rel=1e-12)


def test_worked_examples_run():
    result = doctest.testmod(rpeg.plan.copies)
    assert result.attempted and result.failed == 0


def test_each_device_of_a_layout_is_a_member_once_in_call_order():
    from rpeg.plan.oplayout import OpLayout
    for lay in (OpLayout((0, 1, 2, 3), 2, chunked=True), OpLayout((0, 1, 2, 3), 2),
                OpLayout((0, 1, 2, 3), 2, chunked=True, per_block=True),
                OpLayout((0, 1, 2, 3), 2, everywhere=True), OpLayout((4, 5, 6), chunked=True)):
        for chunks in (1, 2, 3, 8):
            calls = lay.calls(chunks)
            want = list(dict.fromkeys((c.device, c.group) for c in calls))
            assert list(lay.members(chunks)) == want



@pytest.fixture(scope="module")
def tiny_vllm_grpo(tmp_path_factory):
    return _tiny_vllm(tmp_path_factory.mktemp("spec"), "tiny_grpo")


def _block(draw, n: int, tp: int) -> tuple[int, ...]:
    """A run of devices of ``n``, a multiple of ``tp`` long."""
    size = draw(st.sampled_from([k for k in range(tp, n + 1, tp)]))
    start = draw(st.integers(0, n - size))
    return tuple(range(start, start + size))


@st.composite
def plans(draw, pipeline, vllm: bool):
    """A plan of ``pipeline`` on 2 or 4 devices with every model stage on a run of devices
    at tp 1 or 2, trainers at ZeRO 0, 2 or 3, forward stages whole or on ZeRO-3 shards, the
    generate stage on the torch engine or vLLM."""
    n = draw(st.sampled_from([2, 4]))
    places, homes = [], []
    for s in pipeline.stages:
        if not pipeline.has_model(s.target or "") or s.kind is OpKind.COMPUTE:
            places.append(StagePlacement.of(s.name, (draw(st.integers(0, n - 1)),)))
            continue
        tp = draw(st.sampled_from([1, 2]))
        devs = _block(draw, n, tp)
        if s.kind is OpKind.GENERATE:
            engine = draw(st.sampled_from([Engine.TORCH, Engine.VLLM])) if vllm else Engine.TORCH
            places.append(StagePlacement.of(s.name, devs, dp=len(devs) // tp, tp=tp,
                                         chunks=draw(st.sampled_from([1, 2, 4])),
                                         engine=engine))
        elif s.kind is OpKind.TRAIN:
            places.append(StagePlacement.of(s.name, devs, dp=len(devs) // tp, tp=tp,
                                         zero=draw(st.sampled_from([0, 2, 3]))))
            homes.append((s.target, devs))
        else:
            places.append(StagePlacement.of(s.name, devs, dp=len(devs) // tp, tp=tp,
                                         zero=draw(st.sampled_from([0, 3]))))
    staleness = draw(st.integers(0, 1))
    return Plan(pipeline.name, "test", n, tuple(places), model_homes=tuple(homes),
                staleness=tuple((st_, min(k, staleness)) for st_, k in pipeline.staleness),
                strategy=Strategy.MANUAL)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_the_copies_priced_for_any_plan_the_runtime_takes_are_the_runtimes(data, ppo,
                                                                           tiny_vllm_grpo):
    """For a random plan the runtime takes, the evaluator prices exactly its replicas."""
    pipeline, vllm = data.draw(st.sampled_from([(ppo, False), (tiny_vllm_grpo, True)]))
    plan = data.draw(plans(pipeline, vllm))
    try:
        runtime = made(pipeline, plan)
    except PlanError:
        reject()                   # a layout the runtime refuses (it says why)
    assert priced(pipeline, load_cluster(CLUSTERS / "local_cpu.rpeg"), plan) == runtime
