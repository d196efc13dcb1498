"""The control plane priced on a GPU cluster (``rpeg.cost.control``): the client's and the
Dask scheduler's time on what a step dispatches, charged to the step, seen by the planner
and printed by ``rpeg compile``."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import attrs
import pytest

from rpeg.cli import main
from rpeg.cost import control as K
from rpeg.cost.profiles import builtin_cluster
from rpeg.plan.evaluate import Evaluator
from rpeg.resources import shipped
from rpeg.runtime.calibrate.simulated import scaled
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

ROOT = Path(__file__).resolve().parents[2]
TERMS = K.ControlTerms(call_s=20e-6, client_task_s=300e-6, client_arg_s=30e-6,
                       client_worker_s=100e-6, scheduler_task_s=1e-3, scheduler_arg_s=100e-6,
                       scheduler_worker_s=300e-6, heartbeat_s=100e-6)


@pytest.mark.parametrize("name", ["rpeg.cost.control", "rpeg.plan.tasks",
                                  "rpeg.runtime.lowering.joins"])
def test_module_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_more_tasks_futures_or_workers_cost_more_and_the_slower_thread_is_charged():
    base = K.Dispatch(devices=64, calls=300, tasks=250, args=600)
    t = K.control_time(TERMS, base, step_s=20.0)
    assert t.charged_s == max(t.client_s, t.scheduler_s)
    for more in (dict(tasks=500), dict(args=1200), dict(devices=128), dict(calls=600)):
        bigger = K.control_time(TERMS, attrs.evolve(base, **more), step_s=20.0)
        assert bigger.charged_s >= t.charged_s and (bigger.client_s > t.client_s
                                                    or bigger.scheduler_s > t.scheduler_s)
    # Dask spaces heartbeats so that about 200 a second arrive, however many workers
    assert K.heartbeats_per_s(100_000) < 201 < K.heartbeats_per_s(2048) + 20


def test_a_profile_without_terms_takes_the_shipped_hosts():
    gh200 = builtin_cluster("gh200_64").gpu
    terms, whose = K.terms_of(attrs.evolve(gh200, client_task_s=0.0, scheduler_task_s=0.0))
    assert whose == "local_cpu" and terms == K.ControlTerms.of(builtin_cluster("local_cpu").gpu)
    # a term written alone replaces the shipped host's one, the others stay (they were 0,
    # and the control plane's time fell from 0.8 to 0.26 s); a whole set is the profile's
    own = attrs.evolve(gh200, scheduler_task_s=2e-3)
    host = K.ControlTerms.of(builtin_cluster("local_cpu").gpu)
    assert K.terms_of(own) == (attrs.evolve(host, scheduler_task_s=2e-3),
                               f"{gh200.name} and local_cpu")
    beats = attrs.evolve(gh200, scheduler_heartbeat_s=0.5)
    assert K.terms_of(beats)[0] == attrs.evolve(host, heartbeat_s=0.5)
    whole = _gpu_cluster().gpu
    assert K.terms_of(whole) == (TERMS, whole.name)


def _gpu_cluster(terms=TERMS):
    c = builtin_cluster("gh200_64")
    fields = {"control_call_s": terms.call_s, "scheduler_heartbeat_s": terms.heartbeat_s,
              **{f.name: getattr(terms, f.name) for f in attrs.fields(K.ControlTerms)
                 if f.name not in ("call_s", "heartbeat_s")}}
    return attrs.evolve(c, gpu=attrs.evolve(c.gpu, **fields))


def test_the_step_on_a_gpu_cluster_pays_the_control_plane_and_more_chunks_pay_more():
    pipeline = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    plan = scaled(split_plan(pipeline, 2, chunks=2, dp=2, staleness=1), 32)
    cluster = _gpu_cluster()
    ev = Evaluator(pipeline, cluster)
    got = ev.evaluate(plan, simulate_infeasible=True).plan.predicted
    assert got.control_s > 0 and got.tasks_per_step > 0
    graph = ev.graph(plan)
    d = ev.dispatch(plan, graph, ev.timings(plan, graph)[0])
    saves = ev.checkpoint_share(dict(got.op_times)["checkpoint"])    # the cuts' share: not simulated
    expect = K.control_time(TERMS, d, got.step_time_s - got.control_s - saves).charged_s
    assert got.control_s == pytest.approx(expect, rel=1e-3)
    # the same plan priced with no control plane: the step is shorter by what was charged
    free = Evaluator(pipeline, _gpu_cluster(K.ControlTerms(
        **{f.name: 1e-12 for f in attrs.fields(K.ControlTerms)})))
    bare = free.evaluate(plan, simulate_infeasible=True).plan.predicted
    assert got.step_time_s - bare.step_time_s == pytest.approx(got.control_s, rel=0.01)
    more = attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, chunks=4 * p.chunks) if p.stage == "rollout" else p
        for p in plan.placements))
    priced = ev.evaluate(more, simulate_infeasible=True).plan.predicted
    assert priced.tasks_per_step > got.tasks_per_step and priced.control_s > got.control_s


def test_compile_on_a_gpu_cluster_prints_the_control_planes_share(capsys, tmp_path):
    spec = str(ROOT / "pipelines" / "grpo_qwen7b.rpeg")
    cluster = str(ROOT / "pipelines" / "clusters" / "gh200_8.rpeg")
    assert main(["compile", spec, "--cluster", cluster, "--budget", "60", "--no-gantt",
                 "--seed", "0", "-o", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "is the control plane's time in its client and Dask scheduler" in out
    assert "Dask tasks a step" in out


def test_a_large_share_says_why_and_what_to_do():
    assert K.verdict(0.2, 27.0, 500, 64) is None
    why = K.verdict(20.0, 27.0, 50_000, 2048)
    assert "74.1%" in why and "cannot keep up" in why and "fewer chunks" in why


def test_one_join_rule_for_the_runtime_and_the_count():
    """Which gangs wait through a join is one function: the runtime's lowering, the packer
    and the count hold the same one, as they do which calls wait for which gangs before,
    and the count's floor takes a gang's calls from the count (no restated threshold)."""
    import ast
    from pathlib import Path

    from rpeg.cost import control
    from rpeg.plan import dispatchfloor, packing, tasks
    from rpeg.runtime.lowering import joins, ordering
    assert joins.join_of is packing.join_of is tasks.join_of is control.join_of
    assert ordering.gangs_before is tasks.gangs_before is control.gangs_before
    assert ordering.waiting_before is tasks.waiting_before is control.waiting_before
    assert dispatchfloor.gang_calls is tasks.gang_calls
    for module in (joins, packing, tasks, dispatchfloor):
        tree = ast.parse(Path(module.__file__).read_text())
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert "JOIN_MIN" not in named, f"{module.__name__} compares with JOIN_MIN itself"
