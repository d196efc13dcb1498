"""Command-line overrides (``rpeg run SPEC KEY=VALUE ...``): applied to the resolved
pipeline, checked like the spec, errors at ``command line:N:COL`` with the override shown."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.cli import main
from rpeg.errors import SpecError
from rpeg.spec import load
from rpeg.spec.overrides import parse_overrides

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "pipelines" / "tiny_ppo.rpeg"


def _load(*texts: str):
    return load(SPEC, parse_overrides(list(texts)))


def test_every_kind_of_override():
    p = _load("workload.steps=20", "model.actor.optimizer.lr=1e-5", "model.critic.dtype=fp32",
              "stage.rollout.temperature=0.7", "staleness.rollout=0",
              'eval.dataset="data/toy.jsonl"', "eval.every=5", "log.trackers=[mlflow]",
              "model.actor.lora.rank=4")
    assert p.workload.steps == 20 and p.model("actor").optimizer.lr == 1e-5
    assert p.model("critic").dtype == "fp32"
    assert p.stage("rollout").param("temperature") == 0.7
    assert p.staleness_of("rollout") == 0
    assert p.evaluation.every == 5 and p.log.trackers[0].value == "mlflow"
    assert p.model("actor").lora.rank == 4
    base = load(SPEC)
    assert base.model("actor").optimizer.betas == p.model("actor").optimizer.betas


@pytest.mark.parametrize("texts,where,message", [
    (["workload.steps=20", "model.actor.optimizer.lr=5"], (2, 26), "lr must be in (0, 1)"),
    (["workload.step=2"], (1, 10), "unknown key 'step' in the workload block"),
    (["model.actr.head=value"], (1, 7), "override names unknown model 'actr'"),
    (["stage.rollout.temperature=abc"], (1, 27), "temperature must be a number"),
    (["foo.x=1"], (1, 1), "an override must start with workload"),
    (["workload.steps"], (1, 1), "an override must be KEY=VALUE"),
    (['workload.steps="a'], (1, 16), "unterminated string"),
    (["stage.rollout=1"], (1, 7), "must name a stage and a key"),
    (["workload.seed=3", "workload.seed=4"], (2, 1), "override 'workload.seed' is given twice"),
])
def test_errors_point_at_the_override(texts, where, message):
    with pytest.raises(SpecError) as info:
        _load(*texts)
    err = info.value
    assert message in err.message, err.render()
    assert (err.span.path, err.span.line, err.span.col) == ("command line", *where)


def test_the_command_line_shows_the_override(capsys):
    assert main(["run", str(SPEC), "workload.steps=2", "model.actor.optimizer.lr=5"]) == 1
    err = capsys.readouterr().err
    assert "command line:2:26: error: lr must be in (0, 1), not 5\n" \
           "    model.actor.optimizer.lr=5\n" \
           "                             ^\n" in err, err


def test_an_unquoted_path_is_told_to_quote_it():
    with pytest.raises(SpecError) as info:
        _load("workload.dataset=data/nope.jsonl")
    assert info.value.hint == "a path or other text is a string, in quotes (and the shell's " \
                              "quotes around them): workload.dataset='\"data/nope.jsonl\"'"
