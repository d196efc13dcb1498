"""Levels and identities are typed values: the code asks them questions, never compares
their text or number forms.

Every module of rpeg/ and backends/ is read with ``ast``: no comparison of a ZeRO level
(a name or attribute called ``zero``) with a number (``zero >= 3``: ask
``zero.shards_params``), and no backbone name split on ``+`` (``Backbone.members``); and the typed values keep the text forms plans, records and
traces write.
"""

from __future__ import annotations

import ast
import doctest
import importlib
import json
import pickle
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpeg.graph.ids import Backbone
from rpeg.runtime.lowering.replicas import CallRole, ReplicaKey, base_of
from rpeg.spec.kinds import Zero

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


# --- the typed values themselves --------------------------------------------------------

NAMES = st.text(st.sampled_from("abcz_-0123456789"), min_size=1, max_size=8)


@pytest.mark.parametrize("module", ["rpeg.spec.kinds", "rpeg.graph.ids", "rpeg.runtime.lowering.replicas"])
def test_worked_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted and result.failed == 0


@given(st.lists(NAMES, min_size=1, max_size=4))
def test_a_backbone_is_its_members_joined_and_gives_them_back(members):
    b = Backbone.of(members)
    assert b.members == tuple(members) and b.shared == (len(members) > 1)
    assert Backbone(str(b)).members == b.members and {str(b): 1}[b] == 1
    assert pickle.loads(pickle.dumps(b)) == b and type(pickle.loads(pickle.dumps(b))) is Backbone


@given(st.lists(NAMES, min_size=1, max_size=3), st.sampled_from(["", "vllm", "tp0-1", "whole"]))
def test_a_replica_key_gives_back_its_backbone_and_variant(members, variant):
    key = ReplicaKey.of(Backbone.of(members), variant)
    assert key.backbone.members == tuple(members) and key.variant == variant
    assert key.engine == (variant == "vllm") and base_of(key) == key.backbone


def test_zero_levels_nest_and_read_as_their_numbers():
    asks = [(z.shards_optimizer, z.shards_grads, z.shards_params) for z in Zero]
    assert asks == [(False, False, False), (True, False, False), (True, True, False),
                    (True, True, True)]
    assert [z.replicated for z in Zero] == [True, False, False, False]
    assert [z.keeps_gathered for z in Zero] == [False, False, True, False]
    assert [Zero.of(n) for n in range(4)] == list(Zero) and json.dumps([Zero.WEIGHTS]) == "[3]"
    for bad in (4, -1, True, "3", 2.0):
        with pytest.raises(ValueError, match="ZeRO level"):
            Zero.of(bad)


def test_a_call_role_reads_as_its_text():
    assert json.dumps([CallRole.EXPORT, CallRole.NONE]) == '["export", ""]'
    assert f"sync_actor/s0/{CallRole.RECV}@3" == "sync_actor/s0/recv@3"
    assert not CallRole.NONE and CallRole("load").reads_at_reader
