"""The editor grammar is generated from the language and stays in step with it."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("gen_textmate", ROOT / "scripts" / "gen_textmate.py")
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)

COMMITTED = ROOT / "editors" / "rpeg.tmLanguage.json"


def test_committed_grammar_is_what_the_generator_writes():
    assert COMMITTED.read_text(encoding="utf-8") == gen.render(), \
        "editors/rpeg.tmLanguage.json is out of date: run python scripts/gen_textmate.py"
    assert gen.main(["--check"]) == 0


def _rule(name: str) -> re.Pattern:
    return re.compile(json.loads(COMMITTED.read_text())["repository"][name]["match"])


def test_every_keyword_of_the_grammar_is_highlighted():
    keywords, operators = gen.literals(gen.LARK.read_text())
    assert {"pipeline", "stage", "staleness", "share", "extend", "cluster"} <= set(keywords)
    for k in keywords:
        assert _rule("keyword").fullmatch(k)
    assert not _rule("keyword").search("stalenessx")
    for op in ("->", "<=", ".."):
        assert op in operators and _rule("operator").match(op)


def test_numbers_units_and_presets():
    m = _rule("number").search("bandwidth = 25 GB/s")
    assert m.group(1) == "25" and m.group(2) == "GB/s"
    assert _rule("number").search("lr = 1e-6").group(1) == "1e-6"
    assert [m.group(1) for m in _rule("number").finditer("place s on gpus 0..63")] == ["0", "63"]
    assert not _rule("number").search("model a : llama3.1-8b")
    assert _rule("preset").search("model a : llama3.1-8b").group(0).strip() == "llama3.1-8b"
    assert _rule("function").search("stage r = generate(actor, prompts)")
