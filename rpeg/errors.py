"""Errors and source positions shared by every layer.

    >>> span = Span("ppo.rpeg", 3, 7)
    >>> err = SpecError("unknown model 'critc'", span, hint="did you mean 'critic'?")
    >>> err.render(source="...")          # doctest: +SKIP
    ppo.rpeg:3:7: error: unknown model 'critc'
        stage v = forward(critc, responses) -> values
                          ^
    hint: did you mean 'critic'?

Every error a user can cause is an :class:`RpegError` (one subclass per layer)
carrying a :class:`Span`; the CLI renders it and exits 1. Anything else that
escapes is a bug in rpeg.
"""

from __future__ import annotations

import difflib
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import attrs


@attrs.frozen(order=True)
class Span:
    """Where something came from: file, 1-based line and column, and where it ends."""

    path: str
    line: int
    col: int
    end_line: int = 0
    end_col: int = 0

    def __str__(self) -> str:
        return f"{self.path}:{self.line}:{self.col}"


NOWHERE = Span("<builtin>", 0, 0)


class RpegError(Exception):
    """Root of every error rpeg reports to a user."""

    severity = "error"

    def __init__(
        self,
        message: str,
        span: Span | None = None,
        *,
        hint: str | None = None,
        notes: Iterable[tuple[str, Span]] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.span = span
        self.hint = hint
        self.notes = tuple(notes)

    def __str__(self) -> str:
        return printable(f"{self._where()}{self.severity}: {self.message}")

    @property
    def located(self) -> str:
        """The message with where it is, without the severity: for a line that reports
        the error as something else (``warning: skipping a damaged checkpoint: ...``)."""
        return f"{self._where()}{self.message}"

    def _where(self) -> str:
        """``FILE:LINE:COL: ``, or ``FILE: `` for a whole file: the headline names its file
        once, so nothing where the message already names it (``checkpoint file 'FILE'
        is missing``)."""
        if self.span is None:
            return ""
        if self.span.line:
            return f"{self.span}: "
        return "" if f"'{self.span.path}'" in self.message else f"{self.span.path}: "

    def render(self, source: str | None = None) -> str:
        """The full diagnostic: headline, source line with a caret, notes and hint."""
        lines = [str(self)]
        lines += _excerpt(self.span, source)
        for text, span in self.notes:
            lines.append(printable(f"{span}: note: {text}"))
            lines += _excerpt(span, None)
        if self.hint:
            lines.append(printable(f"hint: {self.hint}"))
        return "\n".join(lines)


class SpecError(RpegError):
    """The .rpeg text is malformed or inconsistent."""


class SpecWarning(SpecError):
    """Something a run will trip on that does not stop checking or planning."""

    severity = "warning"


class GraphError(RpegError):
    """The RPEG graph violates an invariant (a bug in a pass, or an impossible request)."""


class CostError(RpegError):
    """The cost model cannot price an op (unknown profile, impossible parallel degrees)."""


class PlanError(RpegError):
    """No plan can be made, or a plan file is unusable."""


class RuntimeFailure(RpegError):
    """A run failed in a way the user must act on (worker loss beyond recovery, bad run dir)."""


class BackendError(RpegError):
    """An execution backend is missing or refuses a configuration."""


def _excerpt(span: Span | None, source: str | None) -> list[str]:
    if span is None or span.line <= 0:
        return []
    text_lines = _lines(span.path) if source is None else source.split("\n")
    if text_lines is None:
        return []
    if span.line > len(text_lines):
        return []
    raw = text_lines[span.line - 1].rstrip("\r")
    if not raw.strip():
        return []                      # an empty line (or file): nothing to point at
    text = _shown(raw)
    # columns count a tab as one character; the caret goes where the tab-expanded text shows it
    col = len(_shown(raw[:span.col - 1]))
    width = 1
    if span.end_line == span.line and span.end_col > span.col:
        width = len(_shown(raw[:span.end_col - 1])) - col
    if len(text) > EXCERPT_WIDTH:
        # a very long line (generated or hostile input): show a window around the caret
        start = max(0, min(col - EXCERPT_WIDTH // 2, len(text) - EXCERPT_WIDTH))
        text = ("..." if start else "") + text[start:start + EXCERPT_WIDTH] + (
            "..." if start + EXCERPT_WIDTH < len(text) else "")
        col = col - start + (3 if start else 0)
        width = min(width, EXCERPT_WIDTH - (col - (3 if start else 0)))
    return ["    " + text, "    " + " " * col + "^" + "~" * max(width - 1, 0)]


EXCERPT_WIDTH = 120

# control characters but the line end: shown as escapes, so a file's bytes cannot move the
# terminal's cursor, clear it or retitle it when its line is echoed
_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x09), *range(0x0b, 0x20),
                                         *range(0x7f, 0xa0))}


def printable(text: str) -> str:
    """``text`` with its control characters (a line end aside) as ``\\xNN`` escapes, and
    cut in the middle past :data:`MESSAGE_CHARS` (a name 100,000 characters long, quoted in
    a message, is not printed whole)."""
    if len(text) > MESSAGE_CHARS:
        half = MESSAGE_CHARS // 2
        text = f"{text[:half]} ... ({len(text) - 2 * half:,} characters) ... {text[-half:]}"
    return text.translate(_CONTROL)


MESSAGE_CHARS = 2000


def _shown(raw: str) -> str:
    """A source line as an excerpt shows it: tabs expanded, control characters escaped."""
    return printable(raw.expandtabs(4))


def _lines(path: str) -> list[str] | None:
    """The lines of the file at ``path`` as the parser counts them (by '\\n' only:
    splitlines would also split on \\f, \\x1c, ...), read once while the file is unchanged:
    many diagnostics in one large file cost one read."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_EXCERPT_FILE:
            return None                 # a pipe would block; a huge record is not shown
        key = (path, st.st_size, st.st_mtime_ns)
        if key not in _LINES:
            text = Path(path).read_text(encoding="utf-8", errors="replace")
            _LINES.clear()
            _LINES[key] = text.split("\n")
        return _LINES[key]
    except (OSError, ValueError):
        return None


_LINES: dict[tuple[str, int, int], list[str]] = {}
MAX_EXCERPT_FILE = 64 << 20


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """A 'did you mean' hint for a misspelt name, or None."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else None
