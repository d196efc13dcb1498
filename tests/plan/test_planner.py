"""Search, baselines and compile_plan: feasibility, determinism, errors."""

from __future__ import annotations

import re

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpeg.cost.profiles import cluster_of
from rpeg.errors import PlanError
from rpeg.plan import (
    Evaluator,
    Plan,
    SearchOptions,
    Strategy,
    compile_plan,
    compile_report,
    recompile,
)
from rpeg.plan.baselines import colocated, realloc, split
from rpeg.plan.choices import model_stages
from rpeg.plan.edit import Context
from rpeg.plan.search import Moves, staleness_caps
from rpeg.plan.space import Limits
from rpeg.spec import Engine, load, load_cluster

from .conftest import EVERY_ENGINE, ROOT

QUICK = SearchOptions(seed=3, iterations=300, patience=200, limits=EVERY_ENGINE)


def _fits(plan, pipeline, cluster) -> bool:
    """Price the plan again from scratch: every device within its memory."""
    r = Evaluator(pipeline, cluster).evaluate(attrs.evolve(plan, predicted=None))
    return r.feasible and max(r.plan.predicted.peak_memory) <= cluster.gpu.memory


def test_local_cpu_plan_with_the_default_budget_is_sensible(tiny, local_cpu):
    """The default options, as ``rpeg compile`` and ``rpeg run`` search (how fast that is,
    benchmarks/planner.py measures; a test asserts no duration)."""
    plan = compile_plan(tiny, local_cpu, options=SearchOptions(limits=Limits.runtime()))
    assert plan.num_devices == 2 and plan.strategy is Strategy.SEARCH
    assert {p.stage for p in plan.placements} == {s.name for s in tiny.stages}
    assert all(p.engine is Engine.TORCH for p in plan.placements)
    assert plan.predicted.step_time_s > 0 and _fits(plan, tiny, local_cpu)
    assert plan.inconsistency() is None


def test_same_seed_same_plan(tiny, local_cpu):
    a = compile_plan(tiny, local_cpu, options=attrs.evolve(QUICK, seed=11))
    b = compile_plan(tiny, local_cpu, options=attrs.evolve(QUICK, seed=11))
    assert a == b and a.to_json() == b.to_json()


def test_a_plan_records_its_search_and_is_remade_from_its_file(tiny, local_cpu, tmp_path):
    opts = attrs.evolve(QUICK, seed=5, iterations=120)
    plan = compile_plan(tiny, local_cpu, options=opts)
    assert plan.search.options == opts and not plan.search.time_capped
    assert plan.search.proposals == compile_report(tiny, local_cpu, options=opts).search.iterations
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back == plan and back.search.options.limits == EVERY_ENGINE
    again = recompile(back, str(tmp_path / "p.json"))
    assert again.plan.to_json() == plan.to_json()
    # rpeg's runtime declares engine caps and what it lacks: those come back as they were
    runtime = compile_plan(tiny, local_cpu, options=attrs.evolve(opts, limits=Limits.runtime()))
    assert Plan.from_json(runtime.to_json()) == runtime
    assert Plan.from_json(runtime.to_json()).search.options.limits == Limits.runtime()


def test_the_time_cap_stops_the_search_and_says_so(tiny, local_cpu):
    """A zero cap stops every walk at its first proposal: a walk's start comes back (a
    baseline, or one carrying responses over), marked."""
    r = compile_report(tiny, local_cpu, options=attrs.evolve(QUICK, time_cap_s=0.0))
    assert r.search.time_capped and r.plan.search.time_capped
    assert not r.plan.search.reproducible and r.search.improved == 0
    assert r.plan.predicted.step_time_s <= min(ev.step_time_s for _, ev in r.baselines if ev)
    assert not compile_plan(tiny, local_cpu, options=QUICK).search.time_capped


def test_a_plan_without_its_search_options_is_not_remade(tiny, local_cpu):
    plan = attrs.evolve(compile_plan(tiny, local_cpu, options=QUICK), search=None)
    with pytest.raises(PlanError, match="must record the search options"):
        recompile(plan, "p.json")


def test_stalled_walks_restart_and_stay_reproducible(grpo, a100_16):
    """Walks that stall start again from the start plan: still seeded, never worse."""
    opts = attrs.evolve(QUICK, stall=40, patience=0, iterations=240)
    a = compile_report(grpo, a100_16, options=opts)
    b = compile_report(grpo, a100_16, options=opts)
    assert a.plan == b.plan and a.search.trace == b.search.trace
    # one walk per cap, and one more adding partial rollouts above cap 0, each polished
    walked = a.search.iterations - a.search.polished
    assert walked == 240 * (2 * len(staleness_caps(grpo)) - 1)
    start = min(ev.step_time_s for _, ev in a.baselines if ev)
    assert a.plan.predicted.step_time_s <= start


def test_search_is_never_worse_than_a_baseline(grpo, a100_16):
    r = compile_report(grpo, a100_16, options=QUICK)
    for strategy, ev in r.baselines:
        if ev is not None:
            assert r.plan.predicted.step_time_s <= ev.step_time_s + 1e-9, strategy
            assert r.speedup(strategy) >= 1.0


def test_baselines_have_their_shapes(grpo, a100_16):
    ctx, ev = Context.of(grpo, a100_16, EVERY_ENGINE), Evaluator(grpo, a100_16)
    stages = model_stages(grpo)
    col = colocated(ctx, ev).best.plan
    assert all(col.placement(s).devices == tuple(range(16)) for s in stages)
    assert col.staleness == () and col.strategy is Strategy.COLOCATED
    sp = split(ctx, ev).best.plan
    gen = set(sp.placement("rollout").devices)
    train = set(sp.placement("actor_step").devices)
    assert not gen & train and not set(sp.placement("ref_lp").devices) & (gen | train)
    re = realloc(ctx, ev).best.plan
    assert re.staleness == () and re.strategy is Strategy.REALLOC
    for plan in (col, sp, re):
        assert _fits(plan, grpo, a100_16)


def test_baseline_strategy_returns_that_baseline(grpo, a100_16):
    plan = compile_plan(grpo, a100_16, Strategy.COLOCATED, QUICK)
    assert plan.strategy is Strategy.COLOCATED
    assert all(len(p.devices) == 16 for p in plan.placements)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck))
@given(gpn=st.sampled_from([2, 4, 8]), nodes=st.sampled_from([1, 2]),
       prompts=st.sampled_from([16, 64]), spec=st.sampled_from(["tiny_ppo", "tiny_grpo"]),
       seed=st.integers(0, 1000))
def test_every_returned_plan_fits_in_memory(gpn, nodes, prompts, spec, seed):
    pipeline = load(ROOT / f"pipelines/{spec}.rpeg")
    pipeline = attrs.evolve(pipeline, workload=attrs.evolve(pipeline.workload, prompts=prompts))
    cluster = cluster_of("a100", gpus_per_node=gpn, nodes=nodes)
    opts = attrs.evolve(QUICK, seed=seed, iterations=150)
    try:
        plan = compile_plan(pipeline, cluster, options=opts)
    except PlanError:
        return
    assert _fits(plan, pipeline, cluster)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck))
@given(gpus=st.sampled_from([(4, 2), (8, 1), (4, 4)]), seed=st.integers(0, 100))
def test_every_returned_8b_plan_fits_in_memory(ppo8b, gpus, seed):
    cluster = cluster_of("a100", gpus_per_node=gpus[0], nodes=gpus[1])
    try:
        plan = compile_plan(ppo8b, cluster, options=attrs.evolve(QUICK, seed=seed,
                                                                 iterations=150))
    except PlanError as e:
        assert "GB" in str(e)
        return
    assert _fits(plan, ppo8b, cluster)


def test_nothing_fits_names_model_op_and_what_helps(ppo8b):
    one = cluster_of("a100", gpus_per_node=1, nodes=1)
    with pytest.raises(PlanError) as e:
        compile_plan(ppo8b, one, options=QUICK)
    text = e.value.render()
    assert re.search(r"(actor|critic|ref) (training|generation|inference) \((\w+)\) alone, in "
                     r"its smallest layout, must fit in 72 GB per GPU \(80 GB less its 10% "
                     r"reserve\), not need [\d.]+ GB on "
                     r"GPU 0 running \w+ as dp 1, tp 1", text), text
    # what fills the GPU, by kind, and only help that is possible: one GPU has no tp to raise
    assert "weights" in text and "optimizer" in text and "grads" in text, text
    assert "add GPUs" in text and "raise tp" not in text, text


def test_nothing_fits_is_said_before_any_search(ppo8b, monkeypatch):
    """A stage that fits no block of the cluster alone is refused right after the layouts
    are enumerated: no baseline is built and no walk is made."""
    import rpeg.plan.compile as compile_module

    def never(*_a, **_k):
        raise AssertionError("searched a cluster nothing fits on")

    monkeypatch.setattr(compile_module, "run_baselines", never)
    monkeypatch.setattr(compile_module, "anneal", never)
    with pytest.raises(PlanError, match="alone, in its smallest layout"):
        compile_plan(ppo8b, cluster_of("a100", gpus_per_node=1, nodes=1), options=QUICK)


def test_missing_vllm_is_refused_at_compile(tmp_path, tiny, local_cpu):
    spec = (ROOT / "pipelines/tiny_ppo.rpeg").read_text().replace(
        "temperature = 1.0, max_len = 20", "temperature = 1.0, max_len = 20, engine = vllm"
    ).replace(": tiny {", ": tiny-vllm {")           # vLLM suits its heads; it is only missing
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    f = tmp_path / "v.rpeg"
    f.write_text(spec)
    pipeline = load(f)
    with pytest.raises(PlanError) as e:
        compile_plan(pipeline, local_cpu,
                     options=attrs.evolve(QUICK, limits=Limits(engines=frozenset({Engine.TORCH}))))
    assert "vllm" in str(e.value) and "rollout" in str(e.value)


def test_backend_limits_are_honoured(grpo, a100_16):
    limits = attrs.evolve(EVERY_ENGINE, max_tp=2, max_pp=1)
    plan = compile_plan(grpo, a100_16, options=attrs.evolve(QUICK, limits=limits))
    assert all(p.tp <= 2 and p.pp == 1 for p in plan.placements)


def test_staleness_stays_within_the_spec(grpo, a100_16):
    plan = compile_plan(grpo, a100_16, options=QUICK)
    for stage, k in plan.staleness:
        assert 0 <= k <= grpo.staleness_of(stage)


def _with(tmp_path, text: str, name: str = "hinted"):
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    f = tmp_path / f"{name}.rpeg"
    f.write_text((ROOT / "pipelines/grpo_qwen7b.rpeg").read_text() + "\n" + text + "\n")
    return load(f)


def test_place_and_colocate_hints_are_honoured(tmp_path, a100_16):
    pipeline = _with(tmp_path, "place rollout on gpus 0..7\ncolocate ref_lp, actor_step")
    plan = compile_plan(pipeline, a100_16, options=QUICK)
    assert plan.placement("rollout").devices == tuple(range(8))
    assert plan.placement("ref_lp").devices == plan.placement("actor_step").devices
    assert _fits(plan, pipeline, a100_16)


def test_place_outside_the_cluster_is_refused(tmp_path, a100_16):
    pipeline = _with(tmp_path, "place rollout on gpus 8..31")
    with pytest.raises(PlanError, match="must name GPUs in 0..15, not 8..31"):
        compile_plan(pipeline, a100_16, options=QUICK)


def test_plans_a_backend_cannot_run_are_refused(grpo, a100_16):
    from rpeg.plan import check_executable
    plan = compile_plan(grpo, a100_16, options=QUICK)
    check_executable(plan, EVERY_ENGINE)
    wide = next(p for p in plan.placements if p.tp * p.pp > 1 or p.dp > 1)
    with pytest.raises(PlanError, match="on this backend"):
        check_executable(plan, Limits(max_tp=1, max_pp=1, max_dp=1))
    vllm = attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, engine=Engine.VLLM) if p.stage == "rollout" else p
        for p in plan.placements))
    with pytest.raises(PlanError, match="engine"):
        check_executable(vllm, Limits(engines=frozenset({Engine.TORCH})))
    assert wide


def test_partition_can_train_two_models_side_by_side(ppo8b):
    """The partition move sometimes gives the actor's and the critic's training a part of
    the non-generating devices each (whole nodes), so they run concurrently."""
    cluster = load_cluster(ROOT / "pipelines/clusters/gh200_64.rpeg")
    pipeline = attrs.evolve(ppo8b, shares=())
    ctx = Context.of(pipeline, cluster, EVERY_ENGINE)
    start = colocated(ctx, Evaluator(pipeline, cluster)).best.plan
    moves = Moves(ctx, np.random.default_rng(3))
    apart = []
    for _ in range(60):
        plan = moves.partition(start)
        if plan is None:
            continue
        a, c = plan.placement("actor_step").devices, plan.placement("critic_step").devices
        gen = set(plan.placement("rollout").devices)
        if not set(a) & set(c):
            assert not (set(a) | set(c)) & gen
            assert len(a) % 4 == 0 and len(c) % 4 == 0 and a[0] % 4 == 0 and c[0] % 4 == 0
            assert plan.placement("values").devices == c        # the critic's forward too
            apart.append(plan)
    assert apart


def test_generation_never_streams_more_chunks_than_responses(tiny, local_cpu):
    """Four responses a step: a plan streaming them in 8 or 16 chunks would hold empty chunks."""
    small = attrs.evolve(tiny, workload=attrs.evolve(tiny.workload, prompts=2, samples=2))
    ctx_moves = Moves(Context.of(small, local_cpu, EVERY_ENGINE), np.random.default_rng(0))
    assert ctx_moves.chunk_counts == (1, 2, 4)
    for seed in range(3):
        plan = compile_plan(small, local_cpu, options=attrs.evolve(QUICK, seed=seed))
        assert all(p.chunks <= 4 for p in plan.placements), plan


def test_a_search_from_a_random_start_uses_no_baseline(grpo, a100_16):
    """Start.RANDOM: the walk starts from a random plan and never restarts from a baseline,
    so what it finds is the search's own; seeded like any search."""
    from rpeg.plan.options import Start
    from rpeg.plan.search import random_plan
    ctx = Context.of(grpo, a100_16, EVERY_ENGINE)
    drawn = random_plan(ctx, 4)
    assert drawn is not None and drawn == random_plan(ctx, 4) and drawn != random_plan(ctx, 5)
    assert {p.stage for p in drawn.placements} == {s.name for s in grpo.stages}
    opts = attrs.evolve(QUICK, start=Start.RANDOM, seed=4)
    r = compile_report(grpo, a100_16, options=opts)
    assert r.plan.search.options.start is Start.RANDOM and _fits(r.plan, grpo, a100_16)
    assert r.search.trace[0][1] == pytest.approx(score_of(drawn, grpo, a100_16))
    assert compile_report(grpo, a100_16, options=opts).plan == r.plan


def score_of(plan, pipeline, cluster) -> float:
    from rpeg.plan.search import score
    return score(Evaluator(pipeline, cluster).evaluate(plan, detail=False), cluster.gpu.memory)


def test_polish_takes_back_a_node_a_walk_gave_too_many(ppo8b):
    """A pass's block grown by a node over its neighbour's devices (the reference forward
    over the generation's node) is shrunk back by polish's fixed neighbourhood (no random
    draw): the split baseline again, or better."""
    from rpeg.plan.edit import options, put, repair
    from rpeg.plan.search import polish
    cluster = cluster_of("gh200", 4, 4)
    ctx, ev = Context.of(ppo8b, cluster, EVERY_ENGINE), Evaluator(ppo8b, cluster)
    start = split(ctx, ev).best
    devices = start.plan.placement("ref_lp").devices
    assert devices[0] >= cluster.gpus_per_node
    grown = tuple(range(devices[0] - cluster.gpus_per_node, devices[-1] + 1))
    plan = put(ctx, attrs.evolve(start.plan, predicted=None), "ref_lp", grown,
               options(ctx, "ref_lp", len(grown))[0])
    worse = ev.evaluate(repair(ctx, plan), detail=False)
    assert worse.feasible and worse.step_time_s > start.step_time_s
    best, tried = polish(ctx, ev, worse)
    assert best.feasible and best.step_time_s <= start.step_time_s + 1e-9
    assert 0 < tried <= 300
    again, _ = polish(ctx, Evaluator(ppo8b, cluster), worse)
    assert again.plan == best.plan
