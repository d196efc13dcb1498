"""rpeg diff on two run directories: inputs, spec and plan differences, then consequences."""

from __future__ import annotations

import json
import shutil

from rpeg.cli import main
from rpeg.experiments import diff_runs


def test_diff_runs_explains_staleness_change(run_a, run_b, tmp_path):
    d = diff_runs(run_a, run_b, plot_dir=tmp_path)
    assert d.changed
    assert [w for w, _, _ in d.inputs] == ["plan"]
    assert not d.spec.changed                      # same spec, the plan lowered staleness
    assert ("staleness rollout", "1", "0") in d.plan.structure
    text = d.text()
    assert "staleness rollout: 1 -> 0" in text
    for label in ("predicted step time", "measured step time", "predicted peak memory",
                  "final reward"):
        assert label in text
    assert d.sentence.startswith("staleness rollout 1 -> 0: predicted step time ")
    assert "peak memory" in d.sentence
    png = tmp_path / f"compare-{run_a.name}.png"
    assert png.exists() and png.stat().st_size > 5000
    assert (tmp_path / f"compare-{run_a.name}.svg").stat().st_size > 5000


def test_cli_diff_runs_json_and_exit_status(run_a, run_b, tmp_path, capsys):
    assert main(["diff", str(run_a), str(run_b), "--json"]) == 1     # writes nothing
    assert not list((run_b / "plots").glob("compare-*")) and \
        json.loads(capsys.readouterr().out)["pictures"] == []
    assert main(["diff", str(run_a), str(run_b), "--json", "--plots"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["changed"] is True
    c = data["consequences"]
    assert c["predicted step time"]["a"] > 0 and c["measured step time"]["b"] > 0
    assert data["predicted_cost"].startswith("staleness rollout 1 -> 0")
    assert any(p.endswith(".png") for p in data["pictures"])
    same = tmp_path / "again"
    shutil.copytree(run_a, same)
    assert main(["diff", str(run_a), str(same)]) == 0
    out = capsys.readouterr().out
    assert "inputs: the same spec, plan, cluster and code" in out
