"""The workload's ``checkpoint_every``: read from the spec (10 when it sets none), refused
with its place and a caret when it is no count of steps, and written back as read."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.errors import SpecError
from rpeg.spec import check_file, load
from rpeg.spec.keys import MAX_STEPS, WORKLOAD
from rpeg.spec.lower import lower_pipeline
from rpeg.spec.model import CHECKPOINT_EVERY
from rpeg.spec.parser import parse_text

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ERRORS = FIXTURES / "errors"
EVERY = FIXTURES / "checkpoint"


def test_the_key_is_read_and_defaults_to_ten():
    assert load(EVERY / "every_50.rpeg").workload.checkpoint_every == 50
    assert load(EVERY / "every_0.rpeg").workload.checkpoint_every == 0
    assert load(EVERY / "every_default.rpeg").workload.checkpoint_every == CHECKPOINT_EVERY == 10
    assert WORKLOAD.param("checkpoint_every").default == CHECKPOINT_EVERY
    assert WORKLOAD.param("checkpoint_every").range_text() == f"[0, {MAX_STEPS}]"


@pytest.mark.parametrize("name", ["checkpoint_every_negative", "checkpoint_every_fraction",
                                  "checkpoint_every_word", "checkpoint_every_too_many"])
def test_a_value_that_is_no_count_of_steps_is_refused_at_it(name, monkeypatch):
    monkeypatch.chdir(ERRORS)
    with pytest.raises(SpecError) as info:
        check_file(f"{name}.rpeg")
    shown = info.value.render()
    assert shown.startswith(f"{name}.rpeg:4:24: error: checkpoint_every must be ")
    golden = ERRORS / f"{name}.golden"
    if os.environ.get("RPEG_UPDATE_GOLDEN"):
        golden.write_text(shown + "\n", encoding="utf-8")
    assert shown + "\n" == golden.read_text(encoding="utf-8")


def test_an_override_sets_it():
    from rpeg.spec.overrides import parse_overrides
    spec = load(EVERY / "every_50.rpeg", parse_overrides(["workload.checkpoint_every=7"]))
    assert spec.workload.checkpoint_every == 7


@settings(max_examples=40, deadline=None)
@given(st.integers(0, MAX_STEPS))
def test_every_count_in_range_reads_back(n):
    text = (EVERY / "every_50.rpeg").read_text().replace("checkpoint_every = 50",
                                                         f"checkpoint_every = {n}")
    pipeline, _ = lower_pipeline(parse_text(text, str(EVERY / "x.rpeg")))
    assert pipeline.workload.checkpoint_every == n
