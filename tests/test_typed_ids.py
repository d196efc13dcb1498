"""Levels and identities are typed values: the code asks them questions, never compares
their text or number forms.

Every module of rpeg/ and backends/ is read with ``ast``: no comparison of a ZeRO level
(a name or attribute called ``zero``) with a number (``zero >= 3``: ask
``zero.shards_params``), and no backbone name split on ``+`` (``Backbone.members``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("rpeg", "backends") for p in (ROOT / d).rglob("*.py"))


def _is_zero(node: ast.AST) -> bool:
    name = node.id if isinstance(node, ast.Name) else \
        node.attr if isinstance(node, ast.Attribute) else ""
    return "zero" in name.lower()


def _is_number(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_is_number(e) for e in node.elts)
    return False


def zero_number_comparisons(source: str) -> list[int]:
    """Lines of ``source`` comparing a ZeRO level with a number (or numbers)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(map(_is_zero, operands)) and any(map(_is_number, operands)):
                out.append(node.lineno)
    return out


def plus_splits(source: str) -> list[int]:
    """Lines of ``source`` splitting a text on ``+``."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("split", "rsplit", "partition", "rpartition")
            and node.args and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == "+"]


def _found(check) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line}" for path in SOURCES
            for line in check(path.read_text(encoding="utf-8"))]


def test_no_zero_level_is_compared_with_a_number():
    assert _found(zero_number_comparisons) == []


@pytest.mark.parametrize("source", ["ok = p.zero >= 3", "ok = 3 <= zero", "ok = z.zero == 0",
                                    "ok = par.zero not in (0, 1, 2, 3)", "ok = zero < -1"])
def test_a_zero_number_comparison_is_seen(source):
    assert zero_number_comparisons(source) == [1]


@pytest.mark.parametrize("source", ["ok = p.zero.shards_params", "ok = p.zero is Zero.NONE",
                                    "ok = p.zero in limits.zero", "ok = p.tp >= 3"])
def test_asking_a_zero_level_is_not_a_comparison(source):
    assert zero_number_comparisons(source) == []


def test_no_name_is_split_on_plus():
    assert _found(plus_splits) == []


@pytest.mark.parametrize("source", ['ok = key.split("+")', "ok = name.rsplit('+', 1)",
                                    'ok = base_of(m).split("+")[0]'])
def test_a_split_on_plus_is_seen(source):
    assert plus_splits(source) == [1]
