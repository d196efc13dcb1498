"""Levels and identities are typed values: the code asks them questions, never compares
their text or number forms.

Every module of rpeg/ and backends/ is read with ``ast``: no comparison of a ZeRO level
(a name or attribute called ``zero``) with a number (``zero >= 3``: ask
``zero.shards_params``), no backbone name split on ``+`` (``Backbone.members``) or searched
for it (``Backbone.shared``), no replica key split on ``~`` (``ReplicaKey.backbone``,
``ReplicaKey.variant``), no op id split on ``/`` or built by hand (``OpId.of``,
``OpId.step``), and no checkpoint key split on ``@`` (``ReplicaAt.key``,
``ReplicaAt.device``); and the typed values keep the text forms plans, records and traces
write.
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

from rpeg.graph.ids import Backbone, OpId, ReplicaAt
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


def splits_on(source: str, sep: str) -> list[int]:
    """Lines of ``source`` splitting a text on ``sep``."""
    return [node.lineno for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("split", "rsplit", "partition", "rpartition")
            and node.args and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == sep]


def plus_splits(source: str) -> list[int]:
    """Lines of ``source`` splitting a text on ``+``."""
    return splits_on(source, "+")


def name_texts(source: str) -> list[int]:
    """Lines of ``source`` splitting a text on ``~`` (a replica key's variant) or asking
    whether ``+`` or ``~`` is in one (a shared backbone, a variant: ``Backbone.shared``,
    ``ReplicaKey.variant``)."""
    out = splits_on(source, "~")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant) \
                and node.left.value in ("+", "~") \
                and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            out.append(node.lineno)
    return sorted(set(out))


ID_PARTS = ("/s", "/c", "/r", "/t")      # an op id's step, chunk, rank, tp rank: /s{step}


def op_id_texts(source: str) -> list[int]:
    """Lines of ``source`` splitting a text on ``/`` or ``@``, or building an op id's text
    by hand: an f-string with ``/s{...}`` (or ``/c``, ``/r``, ``/t``) in it."""
    out = splits_on(source, "/") + splits_on(source, "@")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.JoinedStr):
            for a, b in zip(node.values, node.values[1:], strict=False):
                if isinstance(a, ast.Constant) and isinstance(a.value, str) \
                        and a.value.endswith(ID_PARTS) and isinstance(b, ast.FormattedValue):
                    out.append(node.lineno)
    return sorted(set(out))


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


def test_no_replica_key_is_split_and_no_name_searched_for_its_separators():
    assert _found(name_texts) == []


@pytest.mark.parametrize("source", ['ok = key.split("~")', "ok = k.partition('~')[0]",
                                    'ok = "+" in model', "ok = '~' not in key"])
def test_a_replica_key_split_or_a_separator_search_is_seen(source):
    assert name_texts(source) == [1]


def test_no_op_id_or_checkpoint_key_is_split_or_built_by_hand():
    assert _found(op_id_texts) == []


@pytest.mark.parametrize("source", ['ok = call.id.split("/")', "ok = i.rpartition('/')",
                                    'ok = key.rsplit("@", 1)[0]', 'ok = f"{op}/s{step}"',
                                    'ok = f"{name}/s{s}/c{c}"', 'ok = cid + f"/t{rank}"'])
def test_an_op_id_split_or_built_by_hand_is_seen(source):
    assert op_id_texts(source) == [1]


@pytest.mark.parametrize("source", ['ok = f"sync_{key}"', 'ok = path.split(":")',
                                    'ok = OpId.of(name, step, chunk=c)'])
def test_an_op_name_or_another_split_is_not_an_op_id(source):
    assert op_id_texts(source) == []


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


IDS = st.builds(lambda op, step, which, n, role, device, tp: OpId.of(
    op, step, chunk=n if which == "c" else None, rank=n if which == "r" else None,
    role=role, device=device if role in ("load", "recv") else None, tp_rank=tp),
    st.one_of(NAMES, NAMES.map(lambda n: f"sync_{n}~tp0-1")), st.integers(0, 999),
    st.sampled_from("crn"), st.integers(0, 99),
    st.sampled_from(["", "export", "load", "send", "recv"]), st.integers(0, 63),
    st.integers(0, 7))


@given(IDS, st.booleans())
def test_an_op_id_is_its_fields_and_its_text_reads_back_as_them(i, joined):
    i = i.joined if joined else i
    again = OpId(str(i))
    assert type(str(i)) is str and again == i and {str(i): 1}[again] == 1
    assert (again.op, again.step, again.chunk, again.rank, again.role, again.device,
            again.tp_rank, again.join) == (i.op, i.step, i.chunk, i.rank, i.role, i.device,
                                           i.tp_rank, i.join)
    assert OpId.of(i.op, i.step, chunk=i.chunk, rank=i.rank, role=i.role, device=i.device,
                   tp_rank=i.tp_rank) == (i.removesuffix("/join") if i.join else i)
    assert pickle.loads(pickle.dumps(i)) == i and json.dumps([i]) == json.dumps([str(i)])


def test_op_ids_keep_the_text_runs_wrote():
    assert OpId.of("rollout", 0, chunk=1) == "rollout/s0/c1"
    assert OpId.of("actor_step", 2, rank=1) == "actor_step/s2/r1"
    assert OpId.of("rollout", 0, chunk=0, tp_rank=1) == "rollout/s0/c0/t1"
    assert OpId.of("sync_actor", 0, role=CallRole.EXPORT, tp_rank=1) == "sync_actor/s0/export/t1"
    assert OpId.of("sync_actor~vllm", 3, role=CallRole.RECV, device=2) \
        == "sync_actor~vllm/s3/recv@2"
    assert OpId("train/s0/r0").joined == "train/s0/r0/join" and OpId("adv/s4").step == 4


@given(st.lists(NAMES, min_size=1, max_size=3), st.sampled_from(["", "vllm", "tp0-1"]),
       st.integers(0, 4096))
def test_a_checkpoint_key_is_a_replica_key_and_a_device(members, variant, device):
    key = ReplicaKey.of(Backbone.of(members), variant)
    at = ReplicaAt.of(key, device)
    assert at == f"{key}@{device}" and ReplicaAt.parse(str(at)) == at
    assert at.key == key and at.device == device and at.key.backbone.members == tuple(members)


@pytest.mark.parametrize("text", ["actor", "actor@", "@3", "actor@x", "actor@-1", 3, None])
def test_a_checkpoint_key_without_a_device_is_none(text):
    assert ReplicaAt.parse(text) is None
