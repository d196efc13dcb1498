"""The torch measurements behind `rpeg calibrate` and the accuracy benchmark."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

torch = pytest.importorskip("torch")

from backends.torch_backend import measure  # noqa: E402
from backends.torch_backend.measure_layouts import (  # noqa: E402
    dp_train_rows,
    run_layouts,
    tp_rows,
)
from rpeg.spec.presets import PRESETS  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_peak_memory_sees_a_large_allocation():
    with measure.PeakMemory() as mem:
        x = torch.ones(10_000_000)          # 40 MB
        x += 1
        del x
    assert 30e6 < mem.peak < 80e6


def test_ops_are_measured_with_latency_and_peak():
    measure.set_threads(1)
    rows = measure.measure_ops([dict(kind=k, dims=PRESETS["tiny"], batch=2, prompt_len=8,
                                     gen_len=4) for k in ("forward", "generate", "train")],
                               repeats=2)
    for r in rows:
        assert r["latency_s"] > 0 and r["wall_s"] > 0 and len(r["times_s"]) == 2
        assert r["peak_bytes"] >= 0


def test_timing_leaves_memory_to_a_clean_child():
    measure.set_threads(1)
    spec = dict(kind="train", dims=PRESETS["tiny"], batch=2, prompt_len=8, gen_len=4)
    row = measure.measure_ops([spec], repeats=2, memory=False)[0]
    assert row["peak_bytes"] is None and row["latency_s"] > 0 and row["faults"] >= 0
    (peak,) = measure.peaks_in_child([spec])
    assert 1e5 < peak < 1e8            # the tiny model, Adam state, activations


def test_specs_round_trip_through_json():
    import json
    spec = dict(kind="forward", dims=PRESETS["tiny"], batch=2, prompt_len=8, gen_len=4)
    assert measure.spec_from_json(json.loads(json.dumps(measure.spec_json(spec)))) == spec


def test_host_ops_run_the_executor_on_the_shipped_pipelines():
    rows = measure.host_ops(repeats=1)
    assert {r["function"] for r in rows} == {"reward", "gae", "group_norm"}
    assert len(rows) == len(measure.HOST_STAGES) * len(measure.HOST_SHAPES)
    big = {r["function"]: r["seconds"] for r in rows if r["batch"] == 128 and
           r["tokens"] == 128 * 20}
    small = {r["function"]: r["seconds"] for r in rows if r["batch"] == 16 and
             r["tokens"] == 16 * 4}
    assert all(big[f] > small[f] > 0 for f in big)
    assert 0 < measure.model_host_per_sample(samples=8, repeats=3) < 1e-3


def test_gemm_and_bandwidth_are_positive():
    assert measure.gemm_seconds(64, 64, 64, repeats=2) > 0
    assert measure.copy_bandwidth(8 * 2**20, repeats=2) > 1e8


def test_packed_ops_run_responses_of_varied_lengths_and_say_them():
    measure.set_threads(1)
    spec = dict(dims=PRESETS["tiny"], batch=8, prompt_len=8, gen_len=12, packed=True)
    for kind in ("forward", "train"):
        run = measure.op_runner(kind, **spec)
        run()
        assert len(run.lengths) == 8 and max(run.lengths) == 12 and min(run.lengths) < 12
    assert {m.get("packed", False) for m, _ in measure.calibration_specs()} == {False, True}
    with pytest.raises(ValueError, match="forward and train"):
        measure.op_runner("generate", **spec)


def test_unknown_op_kind_is_refused():
    with pytest.raises(ValueError, match="forward, generate, train"):
        measure.op_runner("sleep", PRESETS["tiny"], 1, 1, 1)


@pytest.mark.slow
def test_two_devices_run_with_the_allocator_asked_for():
    ops = [dict(dims=PRESETS["tiny"], batch=4, prompt_len=8, gen_len=4)]
    before = {k: os.environ.get(k) for k in measure.MALLOC_ENV}
    with measure.TwoDevices() as two:
        assert set(two.client.run(measure.allocator).values()) == {"worker"}
        (row,) = two.dp_train(ops, repeats=1)
        assert row["latency_s"] > 0 and row["peak_bytes"] is None
        # the calibration's model ops, timed in a worker's task thread
        (timed,) = two.timed_ops([dict(kind="forward", **ops[0])], repeats=2)
        assert timed["latency_s"] > 0 and len(timed["times_s"]) == 2
        # train ops data-parallel over the two under the runtime's DDP and FSDP2 layouts
        rows = dp_train_rows(two, [("tiny", PRESETS["tiny"], z, 4, 8, 4) for z in (0, 2)],
                             repeats=1)
        assert [(r["dp"], r["zero"], r["model"]) for r in rows] == [(2, 0, "tiny"),
                                                                     (2, 2, "tiny")]
        assert all(r["latency_s"] > 0 and r["wall_s"] > 0 for r in rows)
        # ops split over the two under the runtime's tensor parallelism (DTensor over gloo)
        rows = tp_rows(two, [(k, "tiny", PRESETS["tiny"], 4, 8, 4)
                             for k in ("forward", "generate", "train")], repeats=1)
        assert [(r["kind"], r["tp"]) for r in rows] == [("forward", 2), ("generate", 2),
                                                        ("train", 2)]
        assert all(r["latency_s"] > 0 and r["cpu_s"] > 0 for r in rows)
        assert len(rows[1]["lengths"]) == 4
        # a tensor-parallel train op: the ranks of a block train one share (of responses of
        # varied lengths here: fed different shares, they would meet at the blocks'
        # all-reduces with tensors of different shapes)
        op = dict(dims=attrs.asdict(PRESETS["tiny"]), batch=4, prompt_len=8,
                  lengths=[3, 9, 5, 12], zero=0, recompute=False, offload=False,
                  packed=False, microbatches=1, tp=2)
        res = two.run({"ops": [op], "repeats": 1}, run_layouts)
        assert all(r["ops"][0]["latency_s"] > 0 for r in res)
    with measure.TwoDevices(clean=True) as two:
        assert set(two.client.run(measure.allocator).values()) == {"clean"}
        assert two.dp_peaks(ops)[0] > 0
    assert {k: os.environ.get(k) for k in measure.MALLOC_ENV} == before   # restored


@pytest.mark.slow
def test_calibrate_writes_a_profile_that_loads(tmp_path):
    prof, clus = tmp_path / "cpu.rpeg", tmp_path / "local.rpeg"
    r = subprocess.run([sys.executable, "-m", "rpeg", "calibrate", "-o", str(prof), "--cluster",
                        str(clus), "--repeats", "2"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    from rpeg.spec import load_cluster
    c = load_cluster(clus)
    assert c.gpu.matmul_flops > 1e9 and c.num_gpus == 2 and c.links[0].bandwidth > 0
    # what Dask costs: the dispatch gap and the control plane's CPU, from real runs
    assert 0 < c.gpu.dispatch_s < 0.1 and c.gpu.host_cores >= 1
    assert c.gpu.control_task_s > 0
    # and on a host of its own: Dask's scheduler and client, rpeg's core
    assert c.gpu.scheduler_task_s > 0 and c.gpu.client_task_s > 0 and c.gpu.control_call_s > 0
    assert "control plane" in r.stderr
    # what a tensor-parallel layer adds, from ops split over the two workers
    assert c.gpu.tp_layer_overhead > 0 and "tensor-parallel ops" in r.stderr


@pytest.mark.slow
def test_calibrate_control_only_measures_a_gpu_profiles_control_plane_and_keeps_the_rest(
        tmp_path):
    from rpeg.cost.control import ControlTerms
    from rpeg.cost.profiles import load_profile
    prof = tmp_path / "gh200.rpeg"
    prof.write_text((ROOT / "pipelines" / "clusters" / "profiles" / "gh200.rpeg").read_text())
    before = load_profile(prof)
    assert not ControlTerms.of(before).measured
    r = subprocess.run([sys.executable, "-m", "rpeg", "calibrate", "--control-only", "-o",
                        str(prof)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    after = load_profile(prof)
    terms = ControlTerms.of(after)
    assert terms.scheduler_task_s > 0 and terms.client_task_s > 0 and terms.call_s > 0
    assert terms.heartbeat_s > 0 and terms.scheduler_worker_s > 0
    # the device's figures are the GPU's still; the cores it shares are none
    kept = attrs.evolve(after, **{f: getattr(before, f) for f in CONTROL_FIELDS})
    assert kept == before and after.host_cores == 0
    assert "--control-only at load" in prof.read_text().splitlines()[0]


CONTROL_FIELDS = ("control_call_s", "client_task_s", "client_arg_s", "client_worker_s",
                  "scheduler_task_s", "scheduler_arg_s", "scheduler_worker_s",
                  "scheduler_heartbeat_s")


@pytest.mark.slow
def test_quick_benchmark_prints_its_mape_last():
    r = subprocess.run([sys.executable, "benchmarks/cost_accuracy.py", "--quick"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    last = r.stdout.strip().splitlines()[-1]
    assert last.startswith("latency MAPE") and "memory MAPE" in last


def test_generated_responses_end_early_and_say_how_long_they_were():
    measure.set_threads(1)
    (row,) = measure.measure_ops([dict(kind="generate", dims=PRESETS["tiny"], batch=16,
                                       prompt_len=8, gen_len=20)], repeats=1, memory=False)
    lengths = row["lengths"]
    assert len(lengths) == 16 and lengths == sorted(lengths)
    assert 1 <= lengths[0] < lengths[-1] <= 20          # ends vary, as a run's do
