"""The RPEG IR: golden text forms, the verifier after every pass, and hand-broken graphs."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import attrs
import pytest

from rpeg.errors import GraphError
from rpeg.graph import DataEdge, Graph, Op, VersionEdge, build, unroll, verify, verify_unrolled
from rpeg.graph.ir import SAME_STEP
from rpeg.graph.unroll import Dep, DepKind, Instance
from rpeg.spec import load
from rpeg.spec.model import OpKind

ROOT = Path(__file__).resolve().parents[2]
PIPELINES = sorted((ROOT / "pipelines").glob("*.rpeg"))
GOLDEN = Path(__file__).parent / "golden"
# Goldens are kept for these; a new pipeline gets one with RPEG_UPDATE_GOLDEN=1 and a line here.
GOLDEN_PIPELINES = ("grpo_qwen7b", "ppo_async", "ppo_llama8b", "ppo_shared", "tiny_grpo",
                    "tiny_ppo")
UPDATE = os.environ.get("RPEG_UPDATE_GOLDEN") == "1"


def _pipeline(name: str):
    return load(ROOT / "pipelines" / f"{name}.rpeg")


def golden_text(path: Path) -> str:
    """Every graph of one pipeline a golden file holds: separate, shared, and 2 steps."""
    p = load(path)
    parts = [str(build(p))]
    if p.shares:
        parts.append(str(build(p, share=True)))
    parts.append(str(unroll(build(p), 2)))
    return "\n\n".join(parts) + "\n"


@pytest.mark.parametrize("name", GOLDEN_PIPELINES)
def test_golden_text_form(name):
    text = golden_text(ROOT / "pipelines" / f"{name}.rpeg")
    golden = GOLDEN / f"{name}.txt"
    if UPDATE:
        golden.write_text(text, encoding="utf-8")
    assert text == golden.read_text(encoding="utf-8")


def test_text_form_is_deterministic():
    p = _pipeline("ppo_llama8b")
    assert str(build(p)) == str(build(p))


def _staleness_choices(p):
    """Every assignment of staleness within the spec's bounds (the search's structural moves)."""
    stages = [s for s, _ in p.staleness]
    ranges = [range(k + 1) for _, k in p.staleness]
    for combo in itertools.product(*ranges):
        yield dict(zip(stages, combo, strict=True))


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_verifier_passes_after_every_pass(path):
    """build (sharing on and off, each staleness choice) -> verify; unroll (chunks) -> verify."""
    p = load(path)
    generators = [s.name for s in p.stages if s.kind is OpKind.GENERATE]
    for share in (False, True):
        for chosen in _staleness_choices(p):
            g = verify(build(p, staleness=chosen, share=share))
            for steps, n in itertools.product((1, 3), (1, 2, 4)):
                verify_unrolled(unroll(g, steps, {s: n for s in generators}))


def test_staleness_outside_the_bound_is_refused():
    p = _pipeline("ppo_llama8b")
    with pytest.raises(GraphError, match="outside the spec's bound 0..1"):
        build(p, staleness={"rollout": 2})
    with pytest.raises(GraphError, match="outside the spec's bound 0..0"):
        build(p, staleness={"values": 1})


def test_sharing_merges_trainers_and_renames_models():
    g = build(_pipeline("ppo_llama8b"), share=True)
    assert g.has_op("actor_step+critic_step")
    assert g.op("actor_step+critic_step").writes_model == "actor+critic"
    assert g.shared == (("actor+critic", ("actor", "critic")),)
    assert g.op("values").reads_model == "actor+critic"


def test_staleness_is_a_version_edge_lag():
    g = build(_pipeline("ppo_async"))
    lags = {(e.writer, e.reader): e.lag for e in g.version_edges}
    assert lags[("sync_actor", "rollout")] == 2
    assert lags[("critic_step", "values")] == 1
    assert lags[("actor_step", "sync_actor")] == SAME_STEP
    u = unroll(g, 4)
    deps = {str(d.src) for d in u.deps_of(Instance("rollout", 3)) if d.kind is DepKind.VERSION}
    assert deps == {"sync_actor@0"}          # step 3 with lag 2 reads the version made at step 0


def test_chunks_stream_into_per_sample_consumers():
    g = build(_pipeline("ppo_llama8b"))
    u = verify_unrolled(unroll(g, 1, {"rollout": 4}))
    assert u.chunks_of("values") == 4 and u.chunks_of("actor_step") == 1
    deps = u.deps_of(Instance("values", 0, 2))
    assert [str(d.src) for d in deps if d.kind is DepKind.DATA] == ["rollout@0#2"]
    assert [str(d.src) for d in u.deps_of(Instance("rollout", 0, 2))] == ["rollout@0#1"]
    srcs = {str(d.src) for d in u.deps_of(Instance("actor_step", 0)) if d.data == "responses"}
    assert srcs == {"rollout@0", "rollout@0#1", "rollout@0#2", "rollout@0#3"}


# --- hand-broken graphs: the verifier names the broken rule ---------------------------------

@pytest.fixture
def good() -> Graph:
    return verify(build(_pipeline("ppo_llama8b")))


def _without(edges, **match):
    return tuple(e for e in edges if not all(getattr(e, k) == v for k, v in match.items()))


BROKEN = {
    "duplicate op": (lambda g: attrs.evolve(g, ops=g.ops + (g.op("adv"),)),
                     "op names must be unique"),
    "two writers": (lambda g: attrs.evolve(g, ops=tuple(
        attrs.evolve(o, outputs=o.outputs + ("scores",)) if o.name == "values" else o
        for o in g.ops)), "'scores' is written by"),
    "writes workload data": (lambda g: attrs.evolve(g, ops=tuple(
        attrs.evolve(o, outputs=o.outputs + ("prompts",)) if o.name == "adv" else o
        for o in g.ops)), "writes workload data 'prompts'"),
    "missing data edge": (lambda g: attrs.evolve(g, data_edges=_without(
        g.data_edges, src="scores", dst="adv")), "missing data edge scores -> adv"),
    "unproduced input": (lambda g: attrs.evolve(g, ops=tuple(
        attrs.evolve(o, inputs=o.inputs + ("ghost",)) if o.name == "adv" else o
        for o in g.ops)), "reads 'ghost', which no op writes"),
    "edge to unknown op": (lambda g: attrs.evolve(g, data_edges=g.data_edges + (
        DataEdge("rollout", "nowhere", "responses"),)), "names an op not in the graph"),
    "edge with wrong data": (lambda g: attrs.evolve(g, data_edges=g.data_edges + (
        DataEdge("rollout", "scores", "logprobs"),)), "does not match the ops"),
    "cycle in a step": (lambda g: attrs.evolve(
        g, ops=tuple(attrs.evolve(o, inputs=o.inputs + ("advantages",)) if o.name == "scores"
                     else o for o in g.ops),
        data_edges=g.data_edges + (DataEdge("adv", "scores", "advantages"),)),
        "data edges form a cycle inside one step"),
    "version edge for the wrong model": (lambda g: attrs.evolve(g, version_edges=tuple(
        attrs.evolve(e, model="critic") if e.reader == "rollout" else e
        for e in g.version_edges)), "is for 'critic'"),
    "generate reads the trainer directly": (lambda g: attrs.evolve(g, version_edges=tuple(
        attrs.evolve(e, writer="actor_step") if e.reader == "rollout" else e
        for e in g.version_edges)), "must read 'actor' through its weight-sync op"),
    "negative lag": (lambda g: attrs.evolve(g, version_edges=tuple(
        attrs.evolve(e, lag=-2) if e.reader == "values" else e
        for e in g.version_edges)), "lag -2 < 0"),
    "same-step lag off a sync": (lambda g: attrs.evolve(
        g, ops=g.ops + (Op("probe", OpKind.FORWARD, (), ("p",), reads_model="critic"),),
        version_edges=g.version_edges + (VersionEdge("critic", "critic_step", "probe", -1),)),
        "lag -1 (same step) is only for a train -> sync edge"),
    "reader without version edge": (lambda g: attrs.evolve(g, version_edges=_without(
        g.version_edges, reader="values")), "needs exactly one version edge, has 0"),
    "frozen reader with a version edge": (lambda g: attrs.evolve(
        g, version_edges=g.version_edges + (VersionEdge("ref", "actor_step", "ref_lp", 0),)),
        "is for 'ref'"),
    "generate without sync": (lambda g: attrs.evolve(
        g, ops=tuple(o for o in g.ops if o.kind is not OpKind.SYNC_WEIGHTS),
        version_edges=tuple(e for e in g.version_edges if "sync" not in e.reader
                            and "sync" not in e.writer)),
        "needs exactly one version edge, has 0"),
    "op names a merged model": (lambda g: attrs.evolve(
        g, shared=(("actor+critic", ("actor", "critic")),)), "merged into a shared backbone"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_verifier_catches_broken_graph(good, name):
    breaker, message = BROKEN[name]
    with pytest.raises(GraphError) as info:
        verify(breaker(good))
    assert message in info.value.message


def test_verifier_catches_broken_unrolled_graphs(good):
    u = unroll(good, 3)
    a, b = Instance("rollout", 0), Instance("values", 1)
    cases = {
        "crosses steps": attrs.evolve(u, deps=u.deps + (Dep(a, b, DepKind.DATA, "responses"),)),
        "breaks lag": attrs.evolve(u, deps=u.deps + (
            Dep(Instance("critic_step", 0), Instance("values", 2), DepKind.VERSION, "critic"),)),
        "unknown instance": attrs.evolve(u, deps=u.deps + (
            Dep(Instance("rollout", 9), b, DepKind.DATA, "responses"),)),
        "must be unique": attrs.evolve(u, instances=u.instances + (a,)),
        "dependency cycle": attrs.evolve(u, deps=u.deps + (
            Dep(Instance("adv", 0), Instance("rollout", 0), DepKind.DATA, "advantages"),)),
    }
    for message, broken in cases.items():
        with pytest.raises(GraphError, match=message):
            verify_unrolled(broken)


def test_an_op_is_a_value():
    o = Op("x", OpKind.COMPUTE, ("a",), ("b",))
    assert o == Op("x", OpKind.COMPUTE, ("a",), ("b",)) and o.per_sample


@pytest.mark.parametrize("path", PIPELINES, ids=lambda p: p.stem)
def test_verifier_passes_after_fusion(path):
    """The planner's fusion rewrite is a graph pass too: every pair it offers verifies."""
    passes = pytest.importorskip("rpeg.plan.passes")
    p = load(path)
    for share in (False, True):
        g = build(p, share=share)
        for pair in passes.fusable(g):
            fused = verify(passes.fuse(g, (pair,)))
            verify_unrolled(unroll(fused, 2, {"rollout": 2} if fused.has_op("rollout") else {}))
