"""rpeg show: a run's summary and pictures; a plan's memory and Gantt pictures."""

from __future__ import annotations

import json
import shutil

from rpeg.cli import main


def _nonempty(path, magic: bytes) -> None:
    assert path.exists(), path
    data = path.read_bytes()
    assert len(data) > 2000 and data.startswith(magic), path


def test_show_prints_what_ran_where_and_how_fast(run_a, capsys):
    assert main(["show", str(run_a), "--plots"]) == 0
    out = capsys.readouterr().out
    assert f"run {run_a.name}: ok, 3 of 3 steps" in out
    assert "strategy split for local_cpu" in out
    assert "device 0  tcp://127.0.0.1:" in out and "rollout" in out
    assert "step time: predicted" in out and "measured" in out and "measured / predicted" in out
    assert "responses: " in out and "declared 10.5 (workload gen_len)" in out
    assert "the plan priced at the measured lengths: " in out
    assert "verification: verified" in out and "- ok" in out
    assert "https://ui.perfetto.dev" in out and str(run_a / "trace.json") in out
    assert "reward" in out
    for name in ("timeline", "memory", "curves"):
        _nonempty(run_a / "plots" / f"{name}.png", b"\x89PNG")
        _nonempty(run_a / "plots" / f"{name}.svg", b"<?xml")
        assert str(run_a / "plots" / f"{name}.png") in out


def test_show_says_where_the_cpu_went(run_b, capsys):
    """A run of `rpeg run`'s runner accounts its CPU per step: ops, the device workers
    outside ops, the client (the cluster here is not rpeg's own, so not 'and scheduler')."""
    assert main(["show", str(run_b)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "CPU per step (steps " in x)
    assert "ops " in line and "device workers outside ops" in line and "Dask tasks a step" in line
    assert "client and scheduler" not in line


def test_show_json_and_a_failed_verification(run_a, tmp_path, capsys):
    assert main(["show", str(run_a), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["verification"]["ok"] is True and data["id"]
    broken = tmp_path / "broken"
    shutil.copytree(run_a, broken)
    trace = json.loads((broken / "trace.json").read_text())
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("name") != "actor_step"]
    (broken / "trace.json").write_text(json.dumps(trace))
    assert main(["show", str(broken)]) == 1
    assert "missing" in capsys.readouterr().out


def test_show_plan_writes_memory_and_gantt(run_a, tmp_path, capsys):
    import attrs

    from rpeg.runtime.rundir.serial import plan_from_json

    pipelines = run_a.parents[0]
    plan = plan_from_json((run_a / "plan.json").read_text())
    root = __import__("pathlib").Path(__file__).resolve().parents[2] / "pipelines"
    plan = attrs.evolve(plan, spec_path=str(root / "tiny_ppo.rpeg"),
                        cluster_path=str(root / "clusters" / "local_cpu.rpeg"))
    path = tmp_path / "plan.json"
    plan.save(path)
    assert main(["show", str(path), "--plots"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan tiny_ppo on local_cpu (2 devices, strategy split")
    for name in ("plan-gantt", "plan-memory"):
        _nonempty(tmp_path / f"{name}.png", b"\x89PNG")
        _nonempty(tmp_path / f"{name}.svg", b"<?xml")
    assert pipelines.exists()


def test_show_missing_directory_is_a_message(tmp_path, capsys):
    assert main(["show", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "must be a run directory or a plan file" in err and "Traceback" not in err
