"""Every precondition of the registry's functions and of the sections is a rule with a
golden error (or warning): tests/fixtures/errors/rules/NAME.rpeg breaks rule NAME alone, and
``rpeg check`` says so at the text that breaks it, as NAME.golden holds
(``RPEG_UPDATE_GOLDEN=1`` rewrites them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rpeg.errors import SpecError
from rpeg.spec import check_file
from rpeg.spec.checks import SECTION_CHECKS, SECTION_RULES
from rpeg.spec.functions import FUNCTIONS
from rpeg.spec.rules import CHECKS

RULES = Path(__file__).resolve().parents[1] / "fixtures" / "errors" / "rules"


def all_rules() -> dict[str, str]:
    """Each rule's name and what it says, from the registry and the sections."""
    out = {r.name: r.doc for r in SECTION_RULES}
    for fn in FUNCTIONS:
        for r in fn.rules:
            assert out.get(r.name, r.doc) == r.doc, f"two rules named {r.name}"
            out[r.name] = r.doc
    return out


def test_every_rule_has_a_golden():
    names = set(all_rules())
    fixtures = {p.stem for p in RULES.glob("*.rpeg")}
    assert names - fixtures == set(), "rules without a golden error"
    assert fixtures - names == set(), "goldens of no rule"


def test_every_rule_has_one_check():
    """A rule is declared (the registry, the sections) and checked (by name) apart: each
    name has a check, each check a rule, and none is both a function's and a section's."""
    assert set(CHECKS).isdisjoint(SECTION_CHECKS)
    assert set(all_rules()) == set(CHECKS) | set(SECTION_CHECKS)


def _diagnostic(name: str) -> str:
    try:
        checked = check_file(f"{name}.rpeg")
    except SpecError as e:
        return e.render() + "\n"
    return "".join(w.render() + "\n" for w in checked.warnings)


@pytest.mark.parametrize("name", sorted(all_rules()))
def test_a_broken_rule_is_said_where_it_breaks(name, monkeypatch):
    monkeypatch.chdir(RULES)
    got = _diagnostic(name)
    golden = RULES / f"{name}.golden"
    if os.environ.get("RPEG_UPDATE_GOLDEN"):
        golden.write_text(got, encoding="utf-8")
    warning = all_rules()[name].startswith("warning") or "(warning)" in all_rules()[name]
    assert got.startswith(f"{name}.rpeg:") and (" warning: " if warning else " error: ") in \
        got.splitlines()[0], got
    assert got == golden.read_text(encoding="utf-8")


def test_the_reference_lists_each_function_s_rules():
    from rpeg.spec.reference import reference
    text = reference()
    for fn in FUNCTIONS:
        for r in fn.rules:
            assert r.doc.split(":")[0][:40] in " ".join(text.split()), (fn.name, r.name)


@pytest.mark.parametrize(("engine", "warned"), [("vllm", True), ("auto", True),
                                                 ("torch", False)])
def test_top_p_warns_where_vllm_may_sample(engine, warned, tmp_path):
    """The torch engine's logprobs are the nucleus's own (no warning); vLLM's, or the
    planner's choice, may be the full distribution's."""
    text = (RULES / "top_p_engine.rpeg").read_text().replace("engine = vllm",
                                                             f"engine = {engine}")
    (tmp_path / "rewards.py").write_text((RULES / "rewards.py").read_text())
    (tmp_path / "case.rpeg").write_text(text)
    found = check_file(tmp_path / "case.rpeg").warnings
    assert any("top_p" in w.message for w in found) is warned
