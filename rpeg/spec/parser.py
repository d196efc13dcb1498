"""Text to syntax tree, with syntax errors a person can read.

    >>> f = parse_text("pipeline demo\\nstaleness rollout <= 1\\n", "demo.rpeg")
    >>> [type(i).__name__ for i in f.items]
    ['PipelineDecl', 'Staleness']
    >>> parse_text("pipeline\\n", "bad.rpeg")
    Traceback (most recent call last):
    rpeg.errors.SpecError: bad.rpeg:1:9: error: expected a name after 'pipeline', not end of line
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import gc
import hashlib
import os
import re
import stat
import sys
from collections.abc import Iterator
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from rpeg.errors import Span, SpecError, did_you_mean
from rpeg.resources import grammar_path
from rpeg.spec import ast

GRAMMAR_PATH = grammar_path()

MAX_SOURCE_BYTES = 4 * 1024 * 1024
MAX_NESTING = 64                     # brackets inside brackets; real specs use 2 or 3

_OPEN = {"LPAR", "LSQB"}
_CLOSE = {"RPAR", "RSQB"}


class _TooDeep(Exception):
    def __init__(self, tok: Token) -> None:
        super().__init__("nesting")
        self.tok = tok


class _Separators:
    """Post-lexer: newlines inside () and [] vanish; runs of separators become one."""

    always_accept = ("_SEP",)

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        depth = 0
        last: Token | None = None
        for tok in stream:
            if tok.type == "_SEP":
                if depth > 0 or last is None or last.type == "_SEP":
                    continue
            elif tok.type in _OPEN:
                depth += 1
                if depth > MAX_NESTING:
                    raise _TooDeep(tok)
            elif tok.type in _CLOSE:
                depth = max(0, depth - 1)
            last = tok
            yield tok
        if last is not None and last.type != "_SEP":
            yield Token.new_borrow_pos("_SEP", "\n", last)


@functools.cache
def _lark() -> Lark:
    grammar = GRAMMAR_PATH.read_text(encoding="utf-8")
    return Lark(
        grammar,
        parser="lalr",
        lexer="contextual",
        postlex=_Separators(),
        propagate_positions=True,
        maybe_placeholders=True,
        lexer_callbacks={"COMMENT": _collect_comment},
        cache=_parser_cache(grammar),
    )


def _parser_cache(grammar: str) -> str | bool:
    """Where the analysed grammar (LALR tables) is kept between runs: a file in the
    user's cache directory, so that every command skips the ~30 ms of building them.
    Lark keys the file on the grammar's text, its options, its own version and Python's,
    and rebuilds it when any differs; an unreadable or half-written file is rebuilt too.
    The file is named by the grammar's hash, so checkouts with different grammars do not
    overwrite each other's. No cache (False) where the directory cannot be made."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "rpeg")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError:
        return False
    digest = hashlib.sha256(grammar.encode("utf-8")).hexdigest()[:16]
    py = "{}{}".format(*sys.version_info[:2])
    return os.path.join(folder, f"grammar-{digest}-py{py}.lark")


_comments: list[Token] = []


def _collect_comment(tok: Token) -> Token:
    _comments.append(tok)
    return tok


def parse_file(path: str | Path) -> ast.File:
    """Read and parse one .rpeg file; every failure is a SpecError naming the file.

    The size and kind of file are checked with ``stat`` before anything is read, so a
    huge file is refused without reading it and a pipe or device never blocks.
    """
    p = Path(path)
    where = Span(str(p), 0, 0)
    try:
        st = p.stat()
        if stat.S_ISDIR(st.st_mode):
            raise SpecError(f"'{p}' is a directory, not a .rpeg file", where)
        if not stat.S_ISREG(st.st_mode):
            raise SpecError(f"'{p}' is not a regular file (a pipe, socket or device)", where,
                            hint="pass the path of a .rpeg text file")
        if st.st_size > MAX_SOURCE_BYTES:
            raise _too_big(st.st_size, str(p))
        with p.open("rb") as fh:
            raw = fh.read(MAX_SOURCE_BYTES + 1)
    except FileNotFoundError:
        raise SpecError(f"no such file '{p}'", where) from None
    except IsADirectoryError:
        raise SpecError(f"'{p}' is a directory, not a .rpeg file", where) from None
    except OSError as e:
        loop = "symbolic links on this path lead back to themselves; point them at a .rpeg " \
            "file" if e.errno == errno.ELOOP else None
        raise SpecError(f"cannot read '{p}': {e.strerror or e}", where, hint=loop) from None
    return parse_bytes(raw, str(p))


def _too_big(size: int, path: str) -> SpecError:
    return SpecError(f"file is {size:,} bytes; a .rpeg file may be at most "
                     f"{MAX_SOURCE_BYTES:,}", Span(path, 0, 0),
                     hint="a spec describes a pipeline; data belongs in the dataset file")


def parse_bytes(raw: bytes, path: str) -> ast.File:
    if len(raw) > MAX_SOURCE_BYTES:
        raise _too_big(len(raw), path)
    if b"\x00" in raw:
        # said at the first one: a stray byte (in a comment, say) is found and deleted there
        raise SpecError("a .rpeg file must be text, not binary: it holds a NUL byte (0x00) "
                        "here", _byte_at(raw, raw.index(b"\x00"), path),
                        hint="delete the stray byte" if
                        raw.count(b"\x00") <= 16 else "this looks like a binary file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"file is not valid UTF-8 text: byte 0x{raw[e.start]:02x} here",
                        _byte_at(raw, e.start, path),
                        hint="save the file as UTF-8 (a Latin-1 editor writes é as 0xe9)"
                        ) from None
    return parse_text(text, path)


def _byte_at(raw: bytes, at: int, path: str) -> Span:
    """Where byte ``at`` of a file's bytes is: its line, and its column in characters."""
    line = raw[:at].count(b"\n") + 1
    return Span(path, line, len(raw[raw.rfind(b"\n", 0, at) + 1: at].decode("utf-8", "replace")) + 1)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while a spec is parsed and checked: they make
    millions of small objects and no cycles to collect, and every collection of the older
    generations walks all of them -- with it running, checking a 4 MB spec took 2.5 times
    as long, growing faster than the spec (reference counting still frees what is dropped)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def parse_text(text: str, path: str = "<string>") -> ast.File:
    """Parse source text into an ``ast.File``; raises SpecError with a caret position."""
    with gc_paused():
        return _parse_text(text, path)


def _parse_text(text: str, path: str) -> ast.File:
    if text.startswith("\ufeff"):
        text = text[1:]
    _comments.clear()
    try:
        tree = _lark().parse(text)
    except UnexpectedInput as e:
        raise _syntax_error(e, text, path) from None
    except _TooDeep as e:
        raise SpecError(f"brackets nest more than {MAX_NESTING} deep", Span(
            path, e.tok.line, e.tok.column), hint="a spec value is a number, name, string, "
            "call or list; nothing needs this depth") from None
    except RecursionError:
        raise SpecError("input nests too deeply", Span(path, 1, 1)) from None
    # lark counts lines by '\n' only; str.splitlines would also split on \f, \x1c, \u2028 ...
    lines = text.split("\n") if _comments else []
    comments = tuple(_comment(tok, lines) for tok in _comments)
    _comments.clear()
    items = tuple(_Build(path).item(child) for child in tree.children)
    return ast.File(path=path, items=items, comments=comments, source=text)


_SIMPLE_ESCAPES = {"\\": "\\", '"': '"', "n": "\n", "t": "\t", "r": "\r"}


def unescape(raw: str, span: Span) -> str:
    """The value of a string literal's body: escapes \\\\ \\" \\n \\t \\r \\uXXXX."""
    if "\\" not in raw:
        return raw
    out: list[str] = []
    n = 0
    while n < len(raw):
        ch = raw[n]
        if ch != "\\":
            out.append(ch)
            n += 1
            continue
        esc = raw[n + 1] if n + 1 < len(raw) else ""
        at = Span(span.path, span.line, span.col + 1 + n)
        if esc in _SIMPLE_ESCAPES:
            out.append(_SIMPLE_ESCAPES[esc])
            n += 2
        elif esc == "u":
            digits = raw[n + 2: n + 6]
            if len(digits) != 4 or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise SpecError("\\u in a string must be followed by four hex digits", at)
            code = int(digits, 16)
            if 0xD800 <= code <= 0xDFFF:
                raise SpecError(f"\\u{digits} is a surrogate, not a character", at)
            out.append(chr(code))
            n += 6
        else:
            raise SpecError(f"unknown escape '\\{esc}' in a string", at,
                            hint='escapes are \\\\ \\" \\n \\t \\r \\uXXXX; write a backslash '
                                 "as \\\\ (or use '/' in paths)")
    return "".join(out)


def _comment(tok: Token, lines: list[str]) -> ast.Comment:
    line_text = lines[tok.line - 1] if lines else ""
    own = line_text[: tok.column - 1].strip() == ""
    return ast.Comment(str(tok).rstrip(), tok.line, tok.column, own)


# --- tree to AST ---------------------------------------------------------------

class _Build:
    def __init__(self, path: str) -> None:
        self.path = path

    def span(self, node) -> Span:
        if isinstance(node, Token):
            end_col = node.end_column if node.end_line == node.line else node.column + 1
            return Span(self.path, node.line, node.column, node.line, end_col or node.column + 1)
        m = node.meta
        if getattr(m, "empty", True):
            return Span(self.path, 0, 0)
        return Span(self.path, m.line, m.column, m.end_line, m.end_column)

    def ident(self, tok: Token) -> ast.Ident:
        return ast.Ident(str(tok), self.span(tok))

    def item(self, t: Tree):
        k, c, sp = t.data, t.children, self.span(t)
        if k == "pipeline":
            return ast.PipelineDecl(self.ident(c[0]), sp)
        if k == "extend":
            return ast.Extend(self.string(c[0]), sp)
        if k == "workload":
            return ast.WorkloadDecl(self.block(c[0]), sp)
        if k == "model":
            source = self.string(c[2].children[0]) if c[2] is not None else None
            return ast.ModelDecl(self.ident(c[0]), self.ident(c[1]),
                                 self.block(c[3]) if c[3] is not None else None, sp, source)
        if k == "evaluation":
            return ast.EvalDecl(self.block(c[0]), sp)
        if k == "logging":
            return ast.LogDecl(self.block(c[0]), sp)
        if k == "reward":
            return ast.RewardDecl(self.ident(c[0]), self.value(c[1]), sp)
        if k in ("tool", "environment"):
            return ast.ToolDecl(self.ident(c[0]), self.value(c[1]), sp,
                                environment=k == "environment")
        if k == "stage":
            outs = tuple(self.ident(x) for x in c[2].children) if c[2] is not None else ()
            return ast.StageDecl(self.ident(c[0]), self.value(c[1]), outs, sp)
        if k == "staleness":
            return ast.Staleness(self.ident(c[0]), self.value(c[1]), sp)
        if k == "share":
            return ast.Share(tuple(self.ident(x) for x in c[0].children), sp)
        if k == "colocate":
            return ast.Colocate(tuple(self.ident(x) for x in c[0].children), sp)
        if k == "place":
            return ast.Place(self.ident(c[0]), self.value(c[1]),
                             self.block(c[2]) if c[2] is not None else None, sp)
        if k == "cluster":
            return ast.ClusterDecl(self.ident(c[0]), self.block(c[1]), sp)
        if k == "profile":
            return ast.ProfileDecl(self.ident(c[0]), self.block(c[1]), sp)
        raise AssertionError(f"unhandled item {k}")

    def block(self, t: Tree) -> ast.Block:
        return ast.Block(tuple(self.entry(e) for e in t.children if e is not None), self.span(t))

    def entry(self, t: Tree):
        k, c, sp = t.data, t.children, self.span(t)
        if k == "assign":
            return ast.Assign(self.ident(c[0]), self.value(c[1]), sp)
        if k == "flag":
            return ast.Flag(self.ident(c[0]), sp)
        if k == "section":
            return ast.Section(self.ident(c[0]), None, self.block(c[1]), sp)
        if k == "named_section":
            return ast.Section(self.ident(c[0]), self.ident(c[1]), self.block(c[2]), sp)
        raise AssertionError(f"unhandled entry {k}")

    def string(self, tok: Token) -> ast.Str:
        value = unescape(str(tok)[1:-1], self.span(tok))
        if "\x00" in value:   # no file name, model name or reference holds one; paths choke on it
            raise SpecError("a string may not hold the NUL character (\\u0000)", self.span(tok))
        return ast.Str(value, self.span(tok))

    def value(self, t):
        if isinstance(t, Token):
            if t.type == "STRING":
                return self.string(t)
            return self.ident(t)
        k, c, sp = t.data, t.children, self.span(t)
        if k == "number":
            sign, num, unit = c
            text = (str(sign) if sign else "") + str(num)
            return ast.Number(float(text), text, str(unit) if unit else None, sp)
        if k == "string":
            return self.string(c[0])
        if k == "name":
            return self.ident(c[0])
        if k == "range":
            lo, hi = (ast.Number(float(x), str(x), None, self.span(x)) for x in c)
            return ast.Range(lo, hi, sp)
        if k == "list":
            return ast.ListValue(tuple(self.value(x) for x in c if x is not None), sp)
        if k == "call":
            args, kwargs = [], []
            for a in c[1:]:
                if a is None:
                    continue
                if isinstance(a, Tree) and a.data == "kwarg":
                    kwargs.append(ast.KwArg(self.ident(a.children[0]), self.value(a.children[1]),
                                            self.span(a)))
                else:
                    args.append(self.value(a))
            return ast.Call(self.ident(c[0]), tuple(args), tuple(kwargs), sp)
        raise AssertionError(f"unhandled value {k}")


# --- syntax errors ---------------------------------------------------------------

_TERMINAL_NAMES = {
    "NAME": "a name", "PRESET": "a model preset", "NUMBER": "a number", "STRING": "a string",
    "UNIT": "a unit", "SIGN": "'-'", "_SEP": "end of line", "LBRACE": "'{'", "RBRACE": "'}'",
    "LPAR": "'('", "RPAR": "')'", "LSQB": "'['", "RSQB": "']'", "COMMA": "','", "EQUAL": "'='",
    "COLON": "':'", "__ANON_0": "'->'", "__ANON_1": "'<='", "__ANON_2": "'..'",
    "$END": "end of file",
}

_KEYWORDS = ("pipeline", "extend", "workload", "model", "reward", "tool", "environment", "stage",
             "staleness", "share", "colocate", "place", "eval", "log", "cluster", "profile")


def _describe_expected(expected: set[str]) -> str:
    names: list[str] = []
    kw = sorted(e.lower() for e in expected if e.lower() in _KEYWORDS or e in ("ON", "GPUS"))
    for e in sorted(expected):
        if e.lower() in _KEYWORDS or e in ("ON", "GPUS"):
            continue
        names.append(_TERMINAL_NAMES.get(e, _pretty_terminal(e)))
    if len(kw) >= 6:
        names.insert(0, "a statement (pipeline, model, stage, ...)")
    else:
        names = [f"'{k}'" for k in kw] + names
    names = list(dict.fromkeys(names))
    if len(names) == 1:
        return names[0]
    return ", ".join(names[:-1]) + " or " + names[-1]


def _pretty_terminal(name: str) -> str:
    try:
        pattern = _lark().get_terminal(name).pattern
        if pattern.type == "str":
            return f"'{pattern.value}'"
    except Exception:  # noqa: BLE001 — an unnamed terminal is only described less well
        pass
    return name.lower()


def _found(tok: Token | None) -> str:
    if tok is None or tok.type == "$END":
        return "end of file"
    if tok.type == "_SEP":
        return "end of line"
    text = str(tok)
    return f"'{text[:40]}...'" if len(text) > 40 else f"'{text}'"


_AFTER = {
    "PIPELINE": "'pipeline'", "EXTEND": "'extend'", "MODEL": "'model'", "STAGE": "'stage'",
    "REWARD": "'reward'", "STALENESS": "'staleness'", "SHARE": "'share'", "CLUSTER": "'cluster'",
    "PROFILE": "'profile'", "COLOCATE": "'colocate'", "PLACE": "'place'", "WORKLOAD": "'workload'",
    "EVAL": "'eval'", "LOG": "'log'",
    "EQUAL": "'='", "COLON": "':'", "COMMA": "','",
}


def _syntax_error(e: UnexpectedInput, text: str, path: str) -> SpecError:
    line, col = max(e.line, 1), max(e.column, 1)
    hint = None
    if isinstance(e, UnexpectedCharacters):
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else ""
        if ch == '"':
            msg, hint = "unterminated string", "close the string with '\"' on the same line"
        else:
            msg = f"unexpected character {ch!r}"
            if e.allowed:
                msg += f"; expected {_describe_expected(set(e.allowed))}"
    elif isinstance(e, UnexpectedToken):
        tok = e.token
        if tok.type == "$END":
            line, col = _end_position(text)
        elif tok.type == "_SEP" and str(tok) == "\n" and tok.line:
            line, col = tok.line, tok.column
        prev = _previous_token(e)
        where = f" after {_AFTER[prev]}" if prev in _AFTER else ""
        expected = _accepted(e)
        msg = f"expected {_describe_expected(expected)}{where}, not {_found(tok)}"
        hint = _hint_for(expected, tok)
        word = _unit_written(text, tok) if prev == "NUMBER" and "UNIT" in expected else \
            _unit_glued(text, e, tok) if prev == "UNIT" else None
        if word:
            msg, hint = f"unknown unit '{word}' after a number", _unit_hint(word)
            if prev == "UNIT":                   # where the word starts: the unit read
                col = e.state.value_stack[-1].column  # type: ignore[union-attr]
    elif isinstance(e, UnexpectedEOF):
        line, col = _end_position(text)
        msg = f"unexpected end of file; expected {_describe_expected(set(e.expected))}"
    else:  # pragma: no cover — lark has no other kinds
        msg = "syntax error"
    notes = []
    pos = getattr(e, "pos_in_stream", None)
    if isinstance(e, UnexpectedToken) and e.token.type == "$END" or pos is None:
        pos = len(text)
    opened = unclosed_bracket(text, pos)
    if opened is not None and opened[1] < line:
        ch, o_line, o_col = opened
        notes.append((f"the '{ch}' opened here is not closed", Span(path, o_line, o_col)))
        hint = f"close the '{ch}' on line {o_line} with '{_CLOSER[ch]}'" + (
            f"; {hint}" if hint else "")
    return SpecError(msg, Span(path, line, col), hint=hint, notes=notes)


_CLOSER = {"(": ")", "[": "]"}


def unclosed_bracket(text: str, upto: int) -> tuple[str, int, int] | None:
    """The innermost ``(`` or ``[`` still open at offset ``upto`` of ``text``, as (bracket,
    line, column), strings and comments skipped; None when every one before is closed.
    (Inside them line ends do not end a statement, so an unclosed one on an earlier line
    makes the error surface lines later; a block's ``{`` spans lines by design.)"""
    stack: list[tuple[str, int, int]] = []
    line, line_start, i, n = 1, 0, 0, min(upto, len(text))
    while i < n:
        ch = text[i]
        if ch == "\n":
            line, line_start = line + 1, i + 1
        elif ch == "#":
            end = text.find("\n", i)
            i = n if end < 0 else end
            continue
        elif ch == '"':
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 2 if text[j] == "\\" else 1
            i = j + 1 if j < n and text[j] == '"' else j
            continue
        elif ch in _CLOSER:
            stack.append((ch, line, i - line_start + 1))
        elif ch in ")]":
            if stack and _CLOSER[stack[-1][0]] == ch:
                stack.pop()
        i += 1
    return stack[-1] if stack else None


def _previous_token(e: UnexpectedToken) -> str | None:
    try:
        stack = e.state.value_stack  # type: ignore[union-attr]
    except AttributeError:
        return None
    if stack and isinstance(stack[-1], Token):
        return stack[-1].type
    return None


def _accepted(e: UnexpectedToken) -> set[str]:
    """The terminals that would really have been accepted (lark's set is a superset)."""
    try:
        return set(e.interactive_parser.accepts()) or set(e.expected)
    except Exception:  # noqa: BLE001 — fall back to lark's own list
        return set(e.expected)


def _hint_for(expected: set[str], tok: Token) -> str | None:
    if tok.type == "EQUAL" and "__ANON_1" in expected:
        return "write 'staleness STAGE <= K'"
    if any(k.lower() in _KEYWORDS for k in expected):
        return did_you_mean(str(tok), _KEYWORDS) or (
            "a file holds statements such as 'pipeline NAME', 'model NAME : PRESET', "
            "'stage NAME = KIND(...)'")
    if "_SEP" in expected and tok.type not in ("_SEP", "$END"):
        return "one statement per line, or separate them with ';'"
    return None


def _unit_written(text: str, tok: Token) -> str | None:
    """What stands where a number's unit would (``Gb/s`` in ``450 Gb/s``): the token and what
    is glued to it, on its line; None where that is no word (an operator, a bracket)."""
    start = getattr(tok, "start_pos", None)
    if start is None or tok.type in ("_SEP", "$END", "RBRACE", "RPAR", "RSQB", "COMMA"):
        return None
    m = re.match(r"[^\s;,{}()\[\]=#]+", text[start:])
    return m.group(0)[:40] if m and not m.group(0).startswith("..") else None


def _unit_glued(text: str, e: UnexpectedToken, tok: Token) -> str | None:
    """A unit and the letters glued after it (``10 steps``: a unit ``s`` read, ``teps``
    left): the word a user wrote for a unit; None where the token stands apart."""
    try:
        unit = e.state.value_stack[-1]  # type: ignore[union-attr]
    except (AttributeError, IndexError):
        return None
    if getattr(unit, "end_pos", None) != getattr(tok, "start_pos", -1):
        return None
    rest = _unit_written(text, tok)
    return str(unit) + rest if rest else None


def _unit_hint(word: str) -> str:
    """A unit a misspelt one may mean (case aside), else the units there are."""
    from rpeg.spec.values import UNITS
    if word.startswith("_") and word[1:].isdigit():
        return "write a number without separators: 1000, not 1_000"
    if re.fullmatch(r"[KMGTP]b(/s)?", word):         # bits: rpeg's units are bytes
        return (f"rpeg's units are bytes: a figure in {word} is an eighth of it in "
                f"{word.replace('b', 'B')} (400 Gb/s = 50 GB/s)")
    by_case = {u.lower(): u for u in UNITS}
    close = difflib.get_close_matches(word.lower(), list(by_case), n=1, cutoff=0.75)
    if close:
        return f"did you mean '{by_case[close[0]]}'?"
    return ("a number takes no unit, or one of: B, KB, MB, GB, TB (bytes; GiB and the like), "
            "GB/s (and the like), FLOPS, GFLOPS, TFLOPS, PFLOPS, ns, us, ms, s, min, h, %")


def _end_position(text: str) -> tuple[int, int]:
    lines = text.splitlines() or [""]
    return len(lines), len(lines[-1]) + 1
