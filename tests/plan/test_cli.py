"""``rpeg compile`` and ``rpeg simulate``: output, files, JSON, exit codes."""

from __future__ import annotations

import json

import pytest

from rpeg.cli import main

from .conftest import ROOT

TINY = str(ROOT / "pipelines/tiny_ppo.rpeg")
LOCAL = str(ROOT / "pipelines/clusters/local_cpu.rpeg")
QUICK = ["--iterations", "200", "--seed", "1"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("c") / "plan.json"
    rc = main(["compile", TINY, "--cluster", LOCAL, "-o", str(out), *QUICK])
    assert rc == 0
    return out


def test_compile_prints_summary_and_writes_plan_and_gantt(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["compile", TINY, "--cluster", LOCAL, "-o", str(out), *QUICK]) == 0
    text = capsys.readouterr().out
    for words in ("predicted step time", "generated tokens/s", "placement", "micro-batches",
                  "memory per GPU", "staleness:", "sharing:", "fusion:", "over colocated"):
        assert words in text, words
    assert out.exists() and out.with_suffix(".png").stat().st_size > 1000


def test_compile_json(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["compile", TINY, "--cluster", LOCAL, "-o", str(out), "--json", *QUICK]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["predicted"]["step_time_s"] > 0
    assert data["strategy"] == "search" and data["seed"] == 1
    assert set(data["baselines"]) == {"colocated", "split", "realloc"}
    assert json.loads(out.read_text())["predicted"]["step_time_s"] == data["predicted"][
        "step_time_s"]


@pytest.mark.parametrize("executor", [[], ["--any-executor"]])
@pytest.mark.parametrize("strategy", ["colocated", "split", "realloc"])
def test_compile_baseline_strategy(tmp_path, capsys, strategy, executor):
    """Every baseline has a plan on the local 2-device cluster, for the runtime or any
    executor (split: generation on one device, the models' training on the other)."""
    out = tmp_path / "p.json"
    rc = main(["compile", TINY, "--cluster", LOCAL, "-o", str(out), "--strategy", strategy,
               "--json", "--no-gantt", *executor])
    assert rc == 0, capsys.readouterr().err
    data = json.loads(capsys.readouterr().out)
    assert data["strategy"] == strategy and (data["runnable"] or executor)
    if strategy == "split":
        where = {p["stage"]: set(p["devices"]) for p in data["placements"]}
        assert not where["rollout"] & (where["actor_step"] | where["critic_step"])


def test_no_hint_suggests_what_the_command_already_does(tmp_path, capsys):
    """On one device nothing is split, for the runtime or any executor: the error says so,
    and its hint offers what would work, never the flag the command was given."""
    one = tmp_path / "one.rpeg"
    profile = ROOT / "pipelines/clusters/profiles/local_cpu.rpeg"
    one.write_text(open(LOCAL).read().replace("gpus_per_node  = 2", "gpus_per_node  = 1")
                   .replace('"profiles/local_cpu.rpeg"', f'"{profile}"'))
    for executor in ([], ["--any-executor"]):
        rc = main(["compile", TINY, "--cluster", str(one), "--strategy", "split", "--no-gantt",
                   "-o", str(tmp_path / "p.json"), *executor])
        err = capsys.readouterr().err
        assert rc == 1 and "split" in err and "hint:" in err, err
        hint = err[err.index("hint:"):]
        assert "--any-executor" not in hint and "split" not in hint, err


def test_compile_without_o_writes_plan_json_and_its_picture_here(tmp_path, capsys,
                                                                 monkeypatch):
    """The CLI contract: compile writes the plan and a Gantt picture; without -o, as
    plan.json and plan.png in the current directory."""
    monkeypatch.chdir(tmp_path)
    assert main(["compile", TINY, "--cluster", LOCAL, "--strategy", "colocated"]) == 0
    assert capsys.readouterr().out.endswith("\nwrote plan.json and plan.png\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json", "plan.png"]
    assert json.loads((tmp_path / "plan.json").read_text())["strategy"] == "colocated"


def test_compile_usage_and_input_errors(tmp_path, capsys):
    assert main(["compile", TINY, "--cluster", LOCAL, "--strategy", "fastest"]) == 2
    assert main(["compile", TINY]) == 2                              # --cluster is required
    assert main(["compile", str(tmp_path / "none.rpeg"), "--cluster", LOCAL]) == 1
    assert main(["compile", TINY, "--cluster", TINY]) == 1           # a pipeline, not a cluster
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_compile_plans_vllm_whatever_is_installed_and_run_refuses_it_where_it_is_not(
        tmp_path, capsys, monkeypatch):
    """The engines a plan may use are what rpeg's runtime declares, not what the planning
    machine has installed; `rpeg run`, which executes here, refuses an engine it lacks."""
    (tmp_path / "rewards.py").write_text((ROOT / "pipelines/rewards.py").read_text())
    f = tmp_path / "v.rpeg"
    f.write_text((ROOT / "pipelines/tiny_ppo.rpeg").read_text().replace(
        "max_len = 20)", "max_len = 20, engine = vllm)").replace(": tiny {", ": tiny-vllm {"))
    from backends import vllm_backend
    plans = []
    for found in (True, False):
        monkeypatch.setattr(vllm_backend, "available", lambda found=found: (found, "test"))
        out = tmp_path / f"p{found}.json"
        assert main(["compile", str(f), "--cluster", LOCAL, "-o", str(out), *QUICK]) == 0
        plans.append(out.read_text())
    assert plans[0] == plans[1] and '"engine": "vllm"' in plans[0]
    capsys.readouterr()
    rc = main(["run", str(tmp_path / "pFalse.json"), "--spec", str(f), "--steps", "1",
               "--no-progress", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 1 and "must use an installed engine, not 'vllm'" in err and "hint:" in err
    assert not (tmp_path / "run").exists()


def test_compile_nothing_fits(tmp_path, capsys):
    rc = main(["compile", str(ROOT / "pipelines/ppo_llama8b.rpeg"), "--cluster", LOCAL,
               "-o", str(tmp_path / "p.json"), *QUICK])
    assert rc == 1
    err = capsys.readouterr().err
    assert "GB per GPU" in err and "weights" in err
    # a checked hint, or what binds: the 2 local devices' tp cannot split the weights
    # further, and more devices add replicas
    assert "add GPUs" in err or "more GPUs add replicas, not room" in err, err


def test_simulate_draws_and_reports(compiled, tmp_path, capsys):
    png = tmp_path / "g.png"
    assert main(["simulate", str(compiled), "--steps", "6", "-o", str(png)]) == 0
    text = capsys.readouterr().out
    assert "predicted step" in text and "idle" in text
    assert png.stat().st_size > 1000
    assert main(["simulate", str(compiled), "--steps", "6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    plan = json.loads(compiled.read_text())
    assert data["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"], rel=0.25)
    ops = {e["op"] for e in data["events"]}
    assert "rollout" in ops and any(o.startswith("actor_step") for o in ops)
    # a weight sync is simulated where the generator reads a copy, not where it reads the
    # trained weights in place (nothing moves there)
    rollout = next(p for p in plan["placements"] if p["stage"] == "rollout")
    trainer = next(p for p in plan["placements"] if p["stage"] == "actor_step")
    in_place = rollout["devices"] == trainer["devices"] and rollout.get("tp", 1) == trainer.get(
        "tp", 1) and rollout.get("engine", "torch") != "vllm" and trainer.get("zero", 0) < 3
    assert any(o.startswith("sync_") for o in ops) is not in_place


def test_simulate_damaged_plan(tmp_path, capsys):
    f = tmp_path / "plan.json"
    f.write_text('{"schema_version": 1, "pipeline": 3}')
    assert main(["simulate", str(f)]) == 1
    err = capsys.readouterr().err
    assert str(f) in err and "error:" in err and "Traceback" not in err


def test_compile_twice_gives_byte_identical_plans(tmp_path, capsys):
    """The budget counts proposals: the same inputs and seed give the same file."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for out in (a, b):
        assert main(["compile", TINY, "--cluster", LOCAL, "-o", str(out), "--no-gantt",
                     "--budget", "150", "--seed", "0"]) == 0
    assert a.read_bytes() == b.read_bytes()
    search = json.loads(a.read_text())["search"]
    assert search["options"]["seed"] == 0 and search["options"]["iterations"] == 150
    assert search["options"]["limits"]["engines"] and search["time_capped"] is False
    assert "time cap" not in capsys.readouterr().out


def test_compile_patience_is_recorded_and_checked(tmp_path, capsys):
    """``--patience`` is the walks' patience, recorded with the search's options (so the plan
    is made again with it); 0 walks the whole budget, which here finds a plan no slower
    (a walk is the same stream of proposals, only longer: the same seed, the same plan)."""
    steps = {}
    for patience in ("0", "5"):
        out = tmp_path / f"p{patience}.json"
        assert main(["compile", TINY, "--cluster", LOCAL, "-o", str(out), "--no-gantt",
                     "--budget", "60", "--patience", patience]) == 0
        plan = json.loads(out.read_text())
        assert plan["search"]["options"]["patience"] == int(patience)
        steps[patience] = plan["predicted"]["step_time_s"]
    assert steps["0"] <= steps["5"] + 1e-12
    capsys.readouterr()
    assert main(["compile", TINY, "--cluster", LOCAL, "--patience", "-1", "--no-gantt",
                 "-o", str(tmp_path / "bad.json")]) == 2
    assert "--patience" in capsys.readouterr().err


def test_a_share_of_a_small_patience_is_never_no_patience():
    from rpeg.plan.compile import _patience
    from rpeg.plan.options import SearchOptions
    assert _patience(SearchOptions(patience=3), 0.25) == 1
    assert _patience(SearchOptions(patience=0), 0.25) == 0
    assert _patience(SearchOptions(patience=1000), 0.75) == 750


def test_compile_a_plan_remakes_it_from_what_it_records(compiled, tmp_path, capsys):
    capsys.readouterr()
    assert main(["compile", str(compiled), "--no-gantt"]) == 0
    out = capsys.readouterr().out
    assert f"the same plan as {compiled}" in out and "wrote" not in out
    # a plan the file does not match: a different seed was recorded than the one that made it
    data = json.loads(compiled.read_text())
    data["search"]["options"]["seed"] = 7
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    assert main(["compile", str(other), "--no-gantt", "-o", str(tmp_path / "new.json")]) == 1
    out = capsys.readouterr().out
    assert f"not the same plan as {other}" in out
    assert json.loads((tmp_path / "new.json").read_text())["seed"] == 7


def test_compile_says_when_its_time_cap_stopped_it(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["compile", TINY, "--cluster", LOCAL, "-o", str(out), "--no-gantt",
                 "--time-cap", "0", *QUICK]) == 0
    text = capsys.readouterr().out
    assert "note: the search stopped at its 0 s time cap" in text and "--time-cap" in text
    assert json.loads(out.read_text())["search"]["time_capped"] is True


def test_the_same_plan_whatever_vector_units_and_blas_kernels_price_it(tmp_path):
    """Another machine's CPU, as far as this one can pretend: numpy without AVX-512 or
    AVX2 kernels and OpenBLAS with older cores give the same plan.json, byte for byte."""
    import os
    import subprocess
    import sys
    kinds = {"here": {}, "avx2": {"NPY_DISABLE_CPU_FEATURES": "X86_V4 AVX512_ICL",
                                  "OPENBLAS_CORETYPE": "Haswell"},
             "sse4": {"NPY_DISABLE_CPU_FEATURES": "X86_V3 X86_V4 AVX512_ICL",
                      "OPENBLAS_CORETYPE": "Prescott"}}
    plans = {}
    for kind, env in kinds.items():
        out = tmp_path / f"{kind}.json"
        subprocess.run([sys.executable, "-m", "rpeg", "compile", TINY, "--cluster", LOCAL,
                        "-o", str(out), "--no-gantt", "--budget", "150"],
                       env={**os.environ, **env}, check=True, capture_output=True, timeout=600)
        plans[kind] = out.read_bytes()
    assert plans["avx2"] == plans["here"] and plans["sse4"] == plans["here"]
