"""The checkpoint cadence a run uses is the one its plan is priced at: ``rpeg compile``
prices the spec's ``checkpoint_every``, ``rpeg run`` cuts at it, and ``--checkpoint-every N``
replaces it for the run and for the price of its plan (a plan file is priced again)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.runtime.plans import RunStrategy, plan_for_run
from rpeg.spec.overrides import parse_overrides

ROOT = Path(__file__).resolve().parents[2]
EVERY = ROOT / "tests" / "fixtures" / "checkpoint"
GH200 = ROOT / "pipelines" / "clusters" / "gh200_8.rpeg"
LOCAL = ROOT / "pipelines" / "clusters" / "local_cpu.rpeg"
LINE = re.compile(r"is checkpoints: (\d+) in (\d+) steps \(([^)]*)\)")


def _checkpoint_line(capsys, spec: Path, tmp_path) -> tuple[int, int, str]:
    assert main(["compile", str(spec), "--cluster", str(GH200), "--strategy", "colocated",
                 "-o", str(tmp_path / f"{spec.stem}.json")]) == 0
    found = LINE.search(capsys.readouterr().out)
    assert found, "compile prints no checkpoint line"
    return int(found[1]), int(found[2]), found[3]


@pytest.mark.parametrize("name, want", [
    ("every_default", (10, 100, "every 10 and the last")),
    ("every_50", (2, 100, "every 50 and the last")),
    ("every_0", (1, 100, "only the last")),
])
def test_compiles_checkpoint_line_follows_the_key(name, want, capsys, tmp_path):
    assert _checkpoint_line(capsys, EVERY / f"{name}.rpeg", tmp_path) == want


@pytest.fixture
def ran(monkeypatch):
    """``rpeg run``'s runners replaced by ones that record what they were given."""
    import rpeg.runtime
    import rpeg.runtime.dask.runner as runner
    got = []

    class Done:
        path, steps, wall_s, metrics = Path("nowhere"), 1, 0.0, []

    def resilient(pipeline, plan, options, spec_path=None, resilience=None, **kw):
        got.append((pipeline, plan, resilience.checkpoint_every))
        return Done()

    def single(pipeline, plan, options, spec_path=None, **kw):
        got.append((pipeline, plan, None))
        return Done()

    monkeypatch.setattr(runner, "run_resilient", resilient)
    monkeypatch.setattr(rpeg.runtime, "run_pipeline", single)
    return got


def _run(file: Path, *extra: str) -> list[str]:
    return ["run", str(file), "--cluster", str(LOCAL), "--strategy", "colocated",
            "--no-progress", *extra]


@pytest.mark.parametrize("flag, want", [((), 50), (("--checkpoint-every", "3"), 3),
                                        (("--checkpoint-every", "0"), None)])
def test_run_cuts_at_the_specs_cadence_or_the_flags_and_prices_that(flag, want, ran):
    assert main(_run(EVERY / "every_50.rpeg", *flag)) == 0
    (pipeline, plan, every), = ran
    assert every == want                        # None: one segment, cut at the end only
    cadence = int(flag[1]) if flag else 50
    assert pipeline.workload.checkpoint_every == cadence
    _, priced, _ = plan_for_run(EVERY / "every_50.rpeg", cluster=LOCAL,
                                strategy=RunStrategy.COLOCATED, checkpoint_every=cadence)
    assert plan.predicted.step_time_s == priced.predicted.step_time_s


def _compiled(spec: Path, cluster: Path, out: Path, capsys) -> Path:
    assert main(["compile", str(spec), "--cluster", str(cluster), "--strategy", "colocated",
                 "-o", str(out)]) == 0
    capsys.readouterr()
    return out


def test_a_plan_file_run_at_another_cadence_is_priced_again(ran, tmp_path, capsys):
    plan = _compiled(EVERY / "every_50.rpeg", LOCAL, tmp_path / "plan.json", capsys)
    compiled = json.loads(plan.read_text())["predicted"]["step_time_s"]
    assert main(["run", str(plan), "--no-progress"]) == 0
    assert main(["run", str(plan), "--no-progress", "--checkpoint-every", "1"]) == 0
    (kept, as_compiled, _), (moved, again, every) = ran
    assert kept.workload.checkpoint_every == 50 and moved.workload.checkpoint_every == 1
    assert as_compiled.predicted.step_time_s == pytest.approx(compiled, rel=1e-6)
    assert every == 1 and again.predicted.step_time_s > as_compiled.predicted.step_time_s
    _, want, _ = plan_for_run(EVERY / "every_50.rpeg", cluster=LOCAL,
                              strategy=RunStrategy.COLOCATED, checkpoint_every=1)
    assert again.predicted.step_time_s == pytest.approx(want.predicted.step_time_s, rel=1e-9)


def test_a_plan_file_whose_cluster_is_gone_says_its_price_is_another_cadences(
        ran, tmp_path, capsys):
    cluster = tmp_path / "local_cpu.rpeg"
    shutil.copy(LOCAL, cluster)
    shutil.copytree(LOCAL.parent / "profiles", tmp_path / "profiles")
    plan = _compiled(EVERY / "every_50.rpeg", cluster, tmp_path / "plan.json", capsys)
    cluster.unlink()
    assert main(["run", str(plan), "--no-progress", "--checkpoint-every", "5"]) == 0
    err = capsys.readouterr().err
    assert "warning: the plan's predicted step time prices a checkpoint every 50 steps" in err
    assert "this run cuts every 5 steps; its cluster file" in err
    (pipeline, _, every), = ran
    assert every == 5 and pipeline.workload.checkpoint_every == 5


def test_run_steps_prices_a_step_of_a_run_that_long(ran, tmp_path, capsys):
    """``--steps 3`` cuts at the end of step 3, not at 50 and 100: a step's share of the
    checkpoints is a third of one, and so is its price; a plan file is priced again."""
    spec = EVERY / "every_50.rpeg"
    assert main(_run(spec, "--steps", "3")) == 0
    assert main(_run(spec)) == 0
    (short, three, _), (whole, hundred, _) = ran
    assert (short.workload.steps, whole.workload.steps) == (3, 100)
    assert three.predicted.step_time_s > hundred.predicted.step_time_s
    _, want, _ = plan_for_run(spec, cluster=LOCAL, strategy=RunStrategy.COLOCATED,
                              overrides=parse_overrides(["workload.steps=3"]))
    assert three.predicted.step_time_s == want.predicted.step_time_s
    plan = _compiled(spec, LOCAL, tmp_path / "plan.json", capsys)
    assert main(["run", str(plan), "--no-progress", "--steps", "3"]) == 0
    assert ran[-1][1].predicted.step_time_s == pytest.approx(want.predicted.step_time_s,
                                                             rel=1e-9)
