"""The control plane's share of the host's cores: the tasks a step dispatches (counted as
the runtime fuses them), charged where the devices are the host's cores and nowhere else."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from rpeg.cli.calibrate import _control_fit_line
from rpeg.cost import control as K
from rpeg.cost.calibrate import control_residuals, fit_control, with_dispatch
from rpeg.cost.profiles import builtin_cluster, cluster_of, load_profile, profile_text
from rpeg.errors import CostError
from rpeg.plan.evaluate import Evaluator
from rpeg.runtime.core import fusion as F
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan
from rpeg.spec import load

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"
HOST_TERMS = ("control_call_s", "client_task_s", "client_arg_s", "client_worker_s",
              "scheduler_task_s", "scheduler_arg_s", "scheduler_worker_s",
              "scheduler_heartbeat_s")


def _chunks(plan, n):
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, chunks=n) if p.stage == "rollout" else p for p in plan.placements))


def _shared(pipeline, staleness):
    """The placement the planner picks for the tiny pipelines on two CPU devices: generation
    and the frozen reference on device 0, the shared actor-critic trained on device 1."""
    plan = split_plan(pipeline, 2, staleness=staleness, share=True)
    where = {"rollout": (0,), "ref_lp": (0,), "scores": (0,)}
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, devices=where.get(p.stage, (1,))) for p in plan.placements))


def _tasks(pipeline, plan, cluster) -> int:
    ev = Evaluator(pipeline, cluster)
    graph = ev.graph(plan)
    return ev.dask_tasks(plan, graph, ev.timings(plan, graph)[0])


def _runtime_tasks(pipeline, plan) -> int:
    """Tasks of one steady step as the runtime's fusion packs them, nothing in flight done."""
    calls = build_calls(pipeline, plan, 10)
    return len(F.fuse([c for c in calls if c.step == 6], F.consumers_of(calls), lambda d: False))


CASES = [  # pipeline, plan, chunks
    ("tiny_ppo", "shared", 1), ("tiny_ppo", "shared", 2), ("tiny_ppo", "shared", 3),
    ("tiny_ppo", "shared sync", 2), ("tiny_ppo", "split", 1), ("tiny_ppo", "split", 2),
    ("tiny_ppo", "split", 3), ("tiny_grpo", "shared", 1), ("tiny_grpo", "shared", 2),
    ("tiny_grpo", "shared", 3), ("tiny_grpo", "split", 1),
]


@pytest.mark.parametrize("name,kind,chunks", CASES)
def test_the_model_counts_the_tasks_the_runtime_dispatches(name, kind, chunks):
    pipeline = load(PIPELINES / f"{name}.rpeg")
    plan = {"shared": lambda: _shared(pipeline, 1), "shared sync": lambda: _shared(pipeline, 0),
            "split": lambda: split_plan(pipeline, 2, staleness=1)}[kind]()
    plan = _chunks(plan, chunks)
    assert _tasks(pipeline, plan, builtin_cluster("local_cpu")) == _runtime_tasks(pipeline, plan)


def test_one_device_runs_a_step_as_one_task():
    """Everything on one worker: each call's inputs are in its task or in the task before,
    so a whole step is one task (measured: 0.96 a step; the first steps take more)."""
    pipeline = load(PIPELINES / "tiny_ppo.rpeg")
    assert _tasks(pipeline, split_plan(pipeline, 1, staleness=0),
                  builtin_cluster("local_cpu")) == 1


def test_control_time_is_charged_only_where_devices_share_the_host_cores():
    pipeline = load(PIPELINES / "tiny_ppo.rpeg")
    cpu = builtin_cluster("local_cpu")
    assert cpu.gpu.host_cores > 0
    # the devices' contention aside: the work it slows is the simulator's (test_simulate)
    cpu = attrs.evolve(cpu, gpu=attrs.evolve(cpu.gpu, concurrency_slowdown=1.0))
    plans = {n: _chunks(_shared(pipeline, 1), n) for n in (1, 3)}

    def control(cluster, plan):
        ev = Evaluator(pipeline, cluster)
        graph = ev.graph(plan)
        return ev.control_time(plan, graph, ev.timings(plan, graph)[0])

    # more tasks, more control-plane CPU; exactly the profile's terms over its cores
    t1, t3 = control(cpu, plans[1]), control(cpu, plans[3])
    n1, n3 = _tasks(pipeline, plans[1], cpu), _tasks(pipeline, plans[3], cpu)
    g = cpu.gpu
    assert t1 == pytest.approx((2 * g.control_step_s + n1 * g.control_task_s)
                               / (g.host_cores - 3 * g.control_idle))
    assert t3 - t1 == pytest.approx((n3 - n1) * g.control_task_s
                                    / (g.host_cores - 3 * g.control_idle))
    # the step's prediction carries it, and says so: against the same cluster with a
    # control plane that costs next to nothing; the idle cluster's CPU runs through the
    # whole step, the time the control plane takes included
    free = attrs.evolve(cpu, gpu=attrs.evolve(
        cpu.gpu, host_cores=0.0, **{f: 1e-12 for f in HOST_TERMS}))
    idle = attrs.evolve(cpu, gpu=attrs.evolve(g, control_idle=0.03))
    for cluster in (cpu, idle):
        ev = Evaluator(pipeline, cluster)
        priced = ev.evaluate(plans[1]).plan
        work = Evaluator(pipeline, free).evaluate(plans[1]).step_time_s
        step = priced.predicted.step_time_s
        saves = ev.checkpoint_share(dict(priced.predicted.op_times)["checkpoint"])   # not simulated
        charged = K.shared_cores_cpu(cluster.gpu, 2, n1, step - saves) / g.host_cores
        assert step == pytest.approx(work + charged)
        assert priced.predicted.control_s == pytest.approx(charged, abs=1e-6)
    assert charged > t1
    assert priced.predicted.tasks_per_step == n1
    assert f"({n1} Dask tasks a step" in str(priced)
    assert Evaluator(pipeline, free).evaluate(plans[1]).plan.predicted.control_s < 1e-6
    # a GPU's host CPUs are not its devices: it pays the client's and the scheduler's time
    # on a host of their own instead (rpeg.cost.control), with the shipped CPU profile's terms
    gpus = cluster_of("h100", 8)
    assert gpus.gpu.host_cores == 0.0
    plan = split_plan(pipeline, 2, staleness=1)
    ev = Evaluator(pipeline, gpus)
    graph = ev.graph(plan)
    timings = ev.timings(plan, graph)[0]
    terms, whose = K.terms_of(gpus.gpu)
    assert whose == "local_cpu" and terms.measured
    expect = K.control_time(terms, ev.dispatch(plan, graph, timings), 0.0).charged_s
    assert control(gpus, plan) == pytest.approx(expect) and expect > 0


def test_control_terms_are_fitted_and_round_trip_through_the_profile(tmp_path):
    # runs of different wall time a step: the idle cluster's CPU (measured, per process)
    # comes off before the per-device and per-task terms are fitted
    runs = [{"devices": d, "chunks": c, "tasks_per_step": n, "wall_per_step_s": w,
             "control_cpu_per_step_s": 0.01 * d + 0.004 * n + 0.025 * (d + 1) * w}
            for d, c, n, w in ((2, 1, 7, 0.1), (2, 3, 15, 0.12), (1, 1, 1, 0.4))]
    measured = {"runs": runs, "idle": {"cpu_per_process_s": 0.025}, "host_cores": 2}
    fit = fit_control(measured)
    assert fit["control_step_s"] == pytest.approx(0.01)
    assert fit["control_task_s"] == pytest.approx(0.004)
    assert fit["control_idle"] == 0.025
    assert fit_control({"runs": runs[:1], "host_cores": 2}) == {}      # two runs at least
    with pytest.raises(CostError, match="between 0 and 1"):
        fit_control({**measured, "idle": {"cpu_per_process_s": 1.5}})
    p = with_dispatch(builtin_cluster("local_cpu").gpu, {"dispatch_s": 0.002}, measured)
    # each run's own control CPU, as the fitted terms price it
    resid = dict(control_residuals(measured, p))
    assert set(resid) == {"control plane, 2 devices, 1 chunk", "control plane, 2 devices, "
                          "3 chunks", "control plane, 1 device, 1 chunk"}
    assert all(abs(r) < 1e-9 for r in resid.values()), resid
    # and what rpeg calibrate prints of them
    assert _control_fit_line(measured, p) == (
        "control plane runs, priced / measured - 1: 2 devices, 1 chunk +0%, 2 devices, "
        "3 chunks +0%, 1 device, 1 chunk +0%")
    assert _control_fit_line(None, p) == ""
    # without the idle term the per-device term takes the slow run's idle CPU and the
    # one-device run is priced over what it paid
    blind = with_dispatch(p, {"dispatch_s": 0.002}, {**measured, "idle": {}})
    assert blind.control_idle == 0.0 and blind.control_step_s > p.control_step_s
    path = tmp_path / "cpu.rpeg"
    path.write_text(profile_text(p))
    back = load_profile(path)
    for key in ("control_step_s", "control_task_s", "control_idle", "host_cores",
                "dispatch_s"):
        assert getattr(back, key) == pytest.approx(getattr(p, key)), key
    assert profile_text(p).count("control_task_s") == 1


@pytest.mark.slow
def test_control_plane_cpu_is_measured_from_real_runs():
    from rpeg.runtime.calibrate.dispatch import measure_control
    m = measure_control(steps=8)
    runs = {(r["devices"], r["chunks"]): r for r in m["runs"]}
    assert set(runs) == {(2, 1), (2, 3), (1, 1)}, m
    assert runs[(2, 3)]["tasks_per_step"] > runs[(2, 1)]["tasks_per_step"] \
        > runs[(1, 1)]["tasks_per_step"], m
    assert all(r["control_cpu_per_step_s"] > 0 for r in runs.values()), m
    # an idle cluster burns a little CPU per process per second: heartbeats, monitors
    assert 0 < m["idle"]["cpu_per_process_s"] < 1 and m["idle"]["processes"] == 3, m
    fit = fit_control(m)
    assert fit["control_task_s"] > 0 and fit["host_cores"] == m["host_cores"]
    assert fit["control_idle"] == m["idle"]["cpu_per_process_s"]
    # each one-chunk run's rollouts after the warm-up: their CPU and lengths, step by step
    gen = {r["run"]: r["rows"] for r in m["generate"]["runs"]}
    assert set(gen) == {"2x1", "1x1"}, m
    assert all(len(rows) == 3 * m["rounds"] for rows in gen.values()), m
    assert all(r["cpu_s"] > 0 and r["prompts"] == 32 for rows in gen.values() for r in rows)
