"""record.json: every input named by the hash of its bytes; predicted and measured figures."""

from __future__ import annotations

import hashlib
import json
import shutil

from rpeg.runtime.rundir.record import RECORD, read_record, steady_rows, write_record
from rpeg.runtime.rundir.tensorboard import tag, write_events


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_record_names_inputs_by_content_hash(run_a):
    rec = json.loads((run_a / RECORD).read_text())
    inputs = rec["inputs"]
    for key, name in (("spec", "spec.rpeg"), ("pipeline", "pipeline.json"), ("plan", "plan.json")):
        assert inputs[key]["file"] == name
        assert inputs[key]["sha256"] == _sha(run_a / name)
    assert inputs["spec"]["source"].endswith("pipelines/tiny_ppo.rpeg")
    assert inputs["cluster"]["name"] == "local_cpu"
    assert (run_a / "cluster.json").exists()
    assert len(inputs["cluster"]["sha256"]) == 64
    assert inputs["code"]["rpeg"]
    assert rec["status"] == "ok" and rec["steps"] == 3


def test_record_has_predicted_and_measured_step_time(run_a):
    rec = read_record(run_a)
    pr, me = rec["predicted"], rec["measured"]
    assert pr["step_time_s"] > 0 and pr["source"] == "cost model on local_cpu"
    assert len(pr["peak_memory"]) == 2 and 0 < max(pr["peak_memory"]) < pr["memory_capacity"]
    rows = [json.loads(x) for x in (run_a / "metrics.jsonl").read_text().splitlines()]
    steady = [r["step_time_s"] for r in steady_rows(rows)]
    assert min(steady) <= me["step_time_s"] <= max(steady)
    assert me["steps_done"] == 3
    # the responses' lengths against the declared ones, and the plan priced at them
    tokens = me["response_tokens"]
    assert tokens["steps"] == "1..2" and 1 <= tokens["mean"] <= tokens["longest"] <= 20
    assert tokens["declared"] == 10.5 and pr["at_measured_lengths_s"] > 0
    assert abs(rec["final"]["reward"] - sum(r["reward"] for r in rows) / 3) < 1e-9


def test_same_experiment_same_id_other_plan_other_id(run_a, run_b, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(run_a, copy)
    again = write_record(copy)          # the cluster and code recorded are the ones that ran
    assert again["id"] == read_record(run_a)["id"]
    assert read_record(run_b)["id"] != again["id"]
    assert read_record(run_b)["inputs"]["plan"]["sha256"] != again["inputs"]["plan"]["sha256"]
    assert read_record(run_b)["inputs"]["pipeline"] == again["inputs"]["pipeline"]


def test_directory_without_record_is_read_without_writing(run_a, tmp_path):
    copy = tmp_path / "killed"
    shutil.copytree(run_a, copy)
    (copy / RECORD).unlink()
    rec = read_record(copy)
    assert rec["inputs"]["plan"]["sha256"] == _sha(copy / "plan.json")
    assert not (copy / RECORD).exists()


def test_tensorboard_events_hold_the_metrics(run_a):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    files = list(run_a.glob("events.out.tfevents.*.rpeg"))
    assert len(files) == 1 and files[0].stat().st_size > 0
    assert read_record(run_a)["files"]["tensorboard"] == files[0].name
    acc = EventAccumulator(str(run_a))
    acc.Reload()
    rows = [json.loads(x) for x in (run_a / "metrics.jsonl").read_text().splitlines()]
    got = [(s.step, s.value) for s in acc.Scalars("reward")]
    assert [s for s, _ in got] == [r["step"] for r in rows]
    for (_, v), r in zip(got, rows, strict=True):
        assert abs(v - r["reward"]) < 1e-5
    numeric = {k for r in rows for k, v in r.items() if k != "step" and isinstance(v, float)}
    assert {tag(k) for k in numeric} <= set(acc.Tags()["scalars"])
    assert write_events(run_a) == files[0]            # rewriting gives the same one file
    assert list(run_a.glob("events.out.tfevents.*.rpeg")) == files


def test_tensorboard_absent_writes_nothing(run_a, tmp_path, monkeypatch):
    import rpeg.runtime.rundir.tensorboard as tb
    copy = tmp_path / "no_tb"
    shutil.copytree(run_a, copy)
    for f in copy.glob("events.out.tfevents.*"):
        f.unlink()
    monkeypatch.setattr(tb, "available", lambda: False)
    rec = write_record(copy)
    assert "tensorboard" not in rec["files"]
    assert not list(copy.glob("events.out.tfevents.*"))


def test_tensorboard_events_appear_as_steps_end(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rpeg.runtime.rundir.directory import RunDir

    rd = RunDir.create(tmp_path, "live", tmp_path / "live")
    rd.write_json("run.json", {"started": 1796000000.0})
    for step in range(3):
        rd.append_metrics({"step": step, "reward": 0.1 * step, "step_time_s": 0.5})
        acc = EventAccumulator(str(rd.path))
        acc.Reload()
        assert [s.step for s in acc.Scalars("reward")] == list(range(step + 1))
    files = list(rd.path.glob("events.out.tfevents.*.rpeg"))
    assert [f.name for f in files] == ["events.out.tfevents.1796000000.rpeg"]
    assert write_events(rd.path) == files[0]          # the end of the run rewrites it whole
    acc = EventAccumulator(str(rd.path))
    acc.Reload()
    assert [round(s.value, 6) for s in acc.Scalars("reward")] == [0.0, 0.1, 0.2]
