"""The registry and the backend's implementations agree, and nothing else matches names.

Every registry entry has an implementation in the torch backend and every implementation
an entry; every choice a keyword offers (KL estimators, loss aggregations, schedules) is
implemented; no module of rpeg or the backends compares a string with an algorithm's name
outside ``rpeg/spec/functions.py`` and the ``@implements`` that registers it.
"""

from __future__ import annotations

import doctest
import importlib
import io
import tokenize
from pathlib import Path

import pytest

from backends.torch_backend import advantages, losses, optim
from backends.torch_backend.algorithms import implementations
from rpeg.spec import functions as F
from rpeg.spec.registry import Category, Type

ROOT = Path(__file__).resolve().parents[2]
ALGORITHMS = (Category.ESTIMATOR, Category.LOSS, Category.REWARD, Category.OPTIMIZER)
# Where a name may be written: the registry itself, the example pipeline the cost model's
# doctests build in python (a spec's words, as a .rpeg file holds them), and the table of the
# names other systems use, which points at the registry's (words for a hint, matching nothing).
ALLOWED = {ROOT / "rpeg" / "spec" / "functions.py", ROOT / "rpeg" / "cost" / "examples.py",
           ROOT / "rpeg" / "spec" / "vocabulary.py"}


def test_every_entry_has_an_implementation_and_every_implementation_an_entry():
    names = {f.name for f in F.FUNCTIONS}
    implemented = set(implementations())
    assert names - implemented == set(), "registry entries without an implementation"
    assert implemented - names == set(), "implementations without a registry entry"


def test_every_choice_is_implemented():
    assert set(F.KL_ESTIMATORS) == set(advantages.KL_ESTIMATORS) == set(losses.KL_ESTIMATORS)
    assert set(F.AGGREGATIONS) == set(losses.AGGREGATIONS) == set(losses._AGGREGATE)
    assert set(F.SCHEDULES) == set(optim.SCHEDULES)
    for fn in F.FUNCTIONS:
        for p in fn.params:
            if p.type is Type.CALL:
                assert all(F.find(c) is not None for c in p.choices), (fn.name, p.name)


def test_every_keyword_is_documented_typed_and_ranged():
    for fn in F.FUNCTIONS:
        assert fn.doc, fn.name
        for p in fn.params:
            assert p.doc, (fn.name, p.name)
            if p.type in (Type.INT, Type.REAL):
                assert p.low is not None, (fn.name, p.name)       # a declared range
            if p.requires:
                assert fn.has(p.requires), (fn.name, p.name)
            if p.default is not None and p.type in (Type.INT, Type.REAL):
                assert p.in_range(p.default), (fn.name, p.name)


def _string_literals(path: Path):
    """(line, value, the source line) of every plain string literal in a python file that
    is not a dict's key (``{"python": platform.python_version()}`` names no algorithm)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(text).readline)
              if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT)]
    for tok, nxt in zip(tokens, tokens[1:] + tokens[-1:], strict=True):
        if nxt.string == ":":
            continue
        if tok.type == tokenize.STRING and tok.string[:1] in "\"'":
            try:
                value = eval(tok.string, {})          # a literal of our own source # noqa: S307
            except Exception:                          # noqa: BLE001
                continue
            yield tok.start[0], value, lines[tok.start[0] - 1]


def test_no_name_is_matched_outside_the_registry_and_its_implementations():
    # python("module:fn") names the user's own code (a reward, a tool, an environment): a
    # word of the language like `generate`, not an algorithm someone could match by name
    user_code = {f.name for c in (Category.TOOL, Category.ENVIRONMENT) for f in F.by_category(c)}
    names = {f.name for c in ALGORITHMS for f in F.by_category(c)} - user_code
    found = []
    for path in sorted((ROOT / "rpeg").rglob("*.py")) + sorted((ROOT / "backends").rglob("*.py")):
        if path in ALLOWED:
            continue
        for line, value, source in _string_literals(path):
            if value in names and not source.lstrip().startswith("@implements("):
                found.append(f"{path.relative_to(ROOT)}:{line}: {source.strip()}")
    assert not found, "algorithm names matched outside the registry:\n" + "\n".join(found)


@pytest.mark.parametrize("module", [
    "rpeg.spec.functions", "rpeg.spec.registry", "rpeg.spec.calls", "rpeg.spec.reference",
    "rpeg.spec.rules", "rpeg.spec.preconditions", "rpeg.spec.rewards",
    "backends.torch_backend.advantages", "backends.torch_backend.losses",
    "backends.torch_backend.optim", "backends.torch_backend.rewards",
    "backends.torch_backend.sampling", "backends.torch_backend.algorithms"])
def test_module_examples(module, monkeypatch):
    monkeypatch.chdir(ROOT)
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} example(s) failed in {module}"
