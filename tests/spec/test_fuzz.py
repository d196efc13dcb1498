"""No input makes the front end crash or hang: a parsed result or an RpegError, nothing else.

Inputs are random text over the language's characters and tokens, and
mutations of the shipped pipelines (characters and tokens deleted, inserted,
duplicated and swapped). Every input that parses is also printed with
``fmt`` (which must round-trip), lowered (extend and rewards resolved against
the real pipelines folder) and, when it lowers, built into a graph -- which
must then succeed and pass the verifier: whatever ``rpeg check`` accepts, the
graph builder must accept too.
"""

from __future__ import annotations

import re
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rpeg.errors import RpegError
from rpeg.graph import build, verify
from rpeg.spec.lower import lower_pipeline
from rpeg.spec.parser import parse_bytes, parse_text
from rpeg.spec.printer import fmt
from rpeg.spec.resolve import FileKind, file_kind

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted(p for p in (ROOT / "pipelines").rglob("*.rpeg"))
SOURCES = {p: p.read_text(encoding="utf-8") for p in SHIPPED}
PIPELINES = [p for p in SHIPPED if "clusters" not in p.parts]

TOKENS = ["pipeline", "workload", "model", "stage", "reward", "staleness", "share", "colocate",
          "place", "on", "gpus", "extend", "cluster", "profile", "link", "frozen", "{", "}",
          "(", ")", "[", "]", "=", "->", "<=", ":", ",", ";", "..", "\n", " ", "#", '"', "\\",
          "-", "1", "0.5", "1e-6", "GB", "GB/s", "us", "TFLOPS", "actor", "critic", "prompts",
          "responses", "generate", "forward", "train", "score", "gae", "tiny", "llama3.1-8b",
          "python", '"rewards:exact_match"', "\t", "\r", "\x00", "é", "\u2028", "\x0c"]

# A generous deadline: it is there to catch a hang, not to time the parser on a busy machine.
DEADLINE_MS = 5000
FUZZ = settings(max_examples=150, deadline=DEADLINE_MS,
                suppress_health_check=[HealthCheck.too_slow])


def exercise(text: str, path: Path) -> None:
    """Everything a user's text goes through before planning; only RpegError may escape."""
    try:
        f = parse_text(text, str(path))
    except RpegError as e:
        assert_readable(e)
        return
    out = fmt(f)
    again = parse_text(out, str(path))
    assert again == f, "fmt changed the meaning"
    assert fmt(again) == out, "fmt is not idempotent"
    try:
        if file_kind(f) is not FileKind.PIPELINE:
            return
        pipeline, _ = lower_pipeline(f)
    except RpegError:
        return
    # a pipeline `rpeg check` accepts must make a valid graph: a GraphError here is a check gap
    for share in (False, True):
        verify(build(pipeline, share=share))


INTERNALS = re.compile(r"__ANON|\$END|_SEP|Token\(|Tree\(|[A-Z]{3,}_[A-Z]+|\bRPAR\b|\bLBRACE\b")


def assert_readable(e: RpegError) -> None:
    """A syntax error is labelled in the language's words, never with parser internals."""
    text = e.render(source="")
    words = re.sub(r"'[^']*'", "''", e.message)      # the user's own text, quoted, may be anything
    assert not INTERNALS.search(words), e.message
    assert "Traceback" not in text


def _tokens(text: str) -> list[str]:
    return re.findall(r'"(?:[^"\\\n]|\\.)*"|[A-Za-z_][\w.\-]*|\d+(?:\.\d+)?(?:e-?\d+)?|\s+|.',
                      text)


@st.composite
def mutated(draw) -> tuple[str, Path]:
    path = draw(st.sampled_from(SHIPPED))
    text = SOURCES[path]
    by_token = draw(st.booleans())
    parts: list[str] = _tokens(text) if by_token else list(text)
    for _ in range(draw(st.integers(1, 4))):
        if not parts:
            break
        i = draw(st.integers(0, len(parts) - 1))
        op = draw(st.sampled_from(["delete", "insert", "duplicate", "swap", "replace"]))
        if op == "delete":
            del parts[i]
        elif op == "insert":
            parts.insert(i, draw(st.sampled_from(TOKENS)))
        elif op == "duplicate":
            parts.insert(i, parts[i])
        elif op == "swap":
            j = draw(st.integers(0, len(parts) - 1))
            parts[i], parts[j] = parts[j], parts[i]
        else:
            parts[i] = draw(st.sampled_from(TOKENS))
    return "".join(parts), path


@FUZZ
@given(mutated())
def test_mutated_pipelines_give_a_result_or_a_clean_error(case):
    text, path = case
    exercise(text, path)


@FUZZ
@given(st.lists(st.sampled_from(TOKENS), max_size=40).map(" ".join))
def test_token_soup_gives_a_result_or_a_clean_error(text):
    exercise(text, PIPELINES[0])


@settings(max_examples=100, deadline=DEADLINE_MS)
@given(st.text(max_size=200))
def test_any_text_gives_a_result_or_a_clean_error(text):
    exercise(text, PIPELINES[0])


@settings(max_examples=60, deadline=DEADLINE_MS)
@given(st.binary(max_size=200))
def test_any_bytes_give_a_result_or_a_clean_error(raw):
    try:
        parse_bytes(raw, "fuzz.rpeg")
    except RpegError:
        pass


def test_deep_nesting_is_a_clean_error():
    for text in ("pipeline p\nreward r = f(" + "[" * 5000 + "]" * 5000 + ")\n",
                 "pipeline p\nreward r = " + "f(" * 3000 + ")" * 3000 + "\n"):
        try:
            exercise(text, PIPELINES[0])
        except RecursionError:  # pragma: no cover - the failure this test exists to catch
            raise AssertionError("deep nesting escaped as RecursionError") from None


def test_shipped_pipelines_pass_exercise():
    for path, text in SOURCES.items():
        exercise(text, path)
