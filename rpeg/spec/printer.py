"""The canonical form of a .rpeg file: ``rpeg fmt``.

    >>> from rpeg.spec.parser import parse_text
    >>> src = "pipeline p\\nstage  rollout=generate( actor,prompts )->responses  # go\\n"
    >>> print(fmt(parse_text(src, "p.rpeg")), end="")
    pipeline p
    stage rollout = generate(actor, prompts) -> responses  # go

The form depends on the syntax tree, the comments and the blank lines only:
``parse(fmt(x)) == parse(x)`` (the tree, ignoring positions) and
``fmt(fmt(x)) == fmt(x)``. Rules:

- one statement per line, four-space indentation, single spaces around
  ``=``, ``:``, ``->``, ``<=`` and after commas;
- numbers exactly as written, with one space before a unit (``25 GB/s``);
  strings re-escaped (``\\\\``, ``\\"``, ``\\n``, ``\\t``, ``\\r``, ``\\uXXXX``);
- runs of similar lines are aligned: stage and model names, block keys, the
  ``->`` of stage outputs and trailing comments; one line much longer than the
  rest of its run (an outlier) is left out of the alignment instead of
  pushing every other line right;
- ``model`` blocks and sections such as ``link gpu { ... }`` stay on one line
  when they have at most four plain entries, no comments and fit in 100
  columns; workload, cluster and profile blocks always take one line per entry;
- a call that does not fit in 100 columns is wrapped, continuation lines
  aligned after its ``(``;
- blank lines between statements are kept (runs collapse to one); comments
  stay with the statement they precede or trail; a comment inside a
  statement that is reflowed moves to the line before it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

import attrs

from rpeg.spec import ast

WIDTH = 100
INDENT = "    "
INLINE_MAX_ENTRIES = 4

__all__ = ["fmt", "format_text", "quote", "value_text", "WIDTH"]


def format_text(text: str, path: str = "<string>") -> str:
    """Parse ``text`` and return its canonical form (raises SpecError on a syntax error)."""
    from rpeg.spec.parser import parse_text
    return fmt(parse_text(text, path))


def fmt(f: ast.File) -> str:
    """The canonical text of a parsed file, comments included; '' for an empty file."""
    lines = _Printer(f).file()
    return _render(lines)


# --- values --------------------------------------------------------------------------------

_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def quote(s: str) -> str:
    """A string literal the parser reads back as ``s``."""
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 or ch in "\u2028\u2029":
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def number_text(n: ast.Number) -> str:
    return n.text + (("" if n.unit == "%" else " ") + n.unit if n.unit else "")


def value_text(v: ast.Value) -> str:
    """A value on one line, as the canonical form writes it."""
    if isinstance(v, ast.Number):
        return number_text(v)
    if isinstance(v, ast.Str):
        return quote(v.value)
    if isinstance(v, ast.Ident):
        return v.value
    if isinstance(v, ast.Range):
        return f"{v.low.text}..{v.high.text}"
    if isinstance(v, ast.ListValue):
        return "[" + ", ".join(value_text(x) for x in v.items) + "]"
    if isinstance(v, ast.Call):
        return f"{v.func.value}(" + ", ".join(_call_parts(v)) + ")"
    raise TypeError(f"not a value: {v!r}")


def _call_parts(c: ast.Call) -> list[str]:
    return [value_text(a) for a in c.args] + [f"{k.key.value} = {value_text(k.value)}"
                                              for k in c.kwargs]


def _wrapped(prefix: str, v: ast.Value, suffix: str = "") -> list[str]:
    """``prefix + v + suffix``, on one line if it fits, else a call wrapped after its '('."""
    one = prefix + value_text(v) + suffix
    if len(one) <= WIDTH or not isinstance(v, ast.Call) or not (v.args or v.kwargs):
        return [one]
    parts = _call_parts(v)
    head = prefix + v.func.value + "("
    lines: list[str] = []
    cur = head
    for n, p in enumerate(parts):
        piece = p + ("," if n < len(parts) - 1 else ")" + suffix)
        if cur == head:
            cur += piece
        elif len(cur) + 1 + len(piece) <= WIDTH:
            cur += " " + piece
        else:
            lines.append(cur)
            cur = " " * len(head) + piece
    lines.append(cur)
    return lines


# --- alignment ------------------------------------------------------------------------------

def align_width(widths: list[int]) -> int:
    """The column a run of widths aligns to. An outlier -- more than 8 wider than the next
    widest and more than 1.5 times the median -- stays out rather than push the run right."""
    if not widths:
        return 0
    s = sorted(widths)
    med = statistics.median_low(s)
    while len(s) > 1 and s[-1] - s[-2] > 8 and s[-1] > 1.5 * med:
        s.pop()
    return s[-1]


# --- comments attached to nodes ------------------------------------------------------------

def _block_of(node) -> ast.Block | None:
    if isinstance(node, (ast.WorkloadDecl, ast.ModelDecl, ast.ClusterDecl, ast.ProfileDecl,
                         ast.Section, ast.Place, ast.EvalDecl, ast.LogDecl)):
        return node.block
    return None


class _Attached:
    """Which comment goes where: before a node, after it, after a '{', or before a '}'."""

    def __init__(self, f: ast.File) -> None:
        self.leading: dict[int, list[ast.Comment]] = defaultdict(list)
        self.trailing: dict[int, ast.Comment] = {}
        self.opening: dict[int, ast.Comment] = {}
        self.footer: dict[int, list[ast.Comment]] = defaultdict(list)
        self.root = id(f)
        for c in sorted(f.comments, key=lambda c: (c.line, c.col)):
            self._attach(c, f.items, id(f), None)

    def _attach(self, c: ast.Comment, nodes, container: int, block: ast.Block | None) -> None:
        line = c.line
        if not c.own_line:
            ending = [n for n in nodes if n.span.end_line == line]
            if ending:
                self._trail(ending[-1], c)
                return
        inside = [n for n in nodes if n.span.line <= line <= n.span.end_line]
        if inside:
            node = inside[-1]
            blk = _block_of(node)
            if blk is not None and blk.span.line <= line and (
                    blk.span.line < line or not c.own_line):
                here = [e for e in blk.entries if e.span.line <= line <= e.span.end_line]
                if blk.span.line == line and not here and not c.own_line:
                    if id(blk) in self.opening:
                        self.leading[id(node)].append(c)
                    else:
                        self.opening[id(blk)] = c
                    return
                self._attach(c, blk.entries, id(blk), blk)
                return
            self.leading[id(node)].append(c)
            return
        after = [n for n in nodes if n.span.line > line]
        if after:
            self.leading[id(after[0])].append(c)
        else:
            self.footer[container].append(c)

    def _trail(self, node, c: ast.Comment) -> None:
        if id(node) in self.trailing:              # cannot happen with one comment per line
            self.leading[id(node)].append(c)
        else:
            self.trailing[id(node)] = c

    def has_any(self, block: ast.Block) -> bool:
        """True if any comment sits in ``block`` (or in a block nested in it)."""
        if id(block) in self.opening or self.footer.get(id(block)):
            return True
        for e in block.entries:
            if self.leading.get(id(e)) or id(e) in self.trailing:
                return True
            inner = _block_of(e)
            if inner is not None and self.has_any(inner):
                return True
        return False


# --- the printer --------------------------------------------------------------------------

@attrs.define
class _Line:
    code: str
    comment: str | None = None      # a trailing comment


BLANK = _Line("")


class _Printer:
    def __init__(self, f: ast.File) -> None:
        self.f = f
        self.src = f.source.split("\n") if f.source else []
        self.notes = _Attached(f)

    # blank lines in the source between two lines (exclusive)
    def _blank_between(self, a: int | None, b: int) -> bool:
        if a is None or not self.src:
            return False
        return any(not self.src[i].strip() for i in range(a, min(b - 1, len(self.src))))

    def file(self) -> list[_Line]:
        out: list[_Line] = []
        self._sequence(self.f.items, id(self.f), "", out)
        return out

    def _sequence(self, nodes, container: int, indent: str, out: list[_Line]) -> None:
        """Emit nodes with their comments and kept blank lines; align runs of similar lines.

        ``prev`` starts unset, so no blank line ever follows an opening '{' or starts the file.
        """
        prev: int | None = None
        plan: list[tuple[object, list[tuple[bool, ast.Comment]], bool]] = []
        for n in nodes:
            lead = []
            for c in self.notes.leading.get(id(n), ()):
                lead.append((self._blank_between(prev, c.line), c))
                prev = max(prev or 0, c.line)
            blank = self._blank_between(prev, n.span.line)
            plan.append((n, lead, blank))
            prev = max(prev or 0, n.span.end_line)
        widths = self._alignment(plan)
        for n, lead, blank in plan:
            for b, c in lead:
                if b and out and out[-1] is not BLANK:
                    out.append(BLANK)
                out.append(_Line(indent + c.text))
            if blank and out and out[-1] is not BLANK:
                out.append(BLANK)
            lines = self._node(n, indent, widths.get(id(n), {}))
            trail = self.notes.trailing.get(id(n))
            if trail is not None:
                lines[-1].comment = trail.text
            out.extend(lines)
        for c in self.notes.footer.get(container, ()):
            if self._blank_between(prev, c.line) and out and out[-1] is not BLANK:
                out.append(BLANK)
            out.append(_Line(indent + c.text))
            prev = c.line

    # --- alignment of runs ----------------------------------------------------------------

    def _alignment(self, plan) -> dict[int, dict[str, int]]:
        """Per node, the widths it pads to: 'name' (stage/model/reward/staleness names),
        'key' (block keys), 'call' (stage calls before '->'), 'section'. A run of one kind
        ends at a blank line (before a node or before its comments)."""
        runs: list[list[object]] = []
        run_kind = None
        for n, lead, blank in plan:
            kind = self._run_kind(n)
            if kind is None or kind != run_kind or blank or any(b for b, _ in lead):
                runs.append([])
            if kind is not None:
                runs[-1].append(n)
            run_kind = kind
        out: dict[int, dict[str, int]] = defaultdict(dict)
        for run in runs:
            if not run:
                continue
            first = run[0]
            if isinstance(first, (ast.Assign, ast.Flag)):
                keys = [n for n in run if isinstance(n, ast.Assign)]
                w = align_width([len(n.key.value) for n in keys])
                for n in keys:
                    out[id(n)]["key"] = w
            elif isinstance(first, ast.Section):
                w = align_width([len(self._section_head(n)) for n in run])
                for n in run:
                    out[id(n)]["section"] = w
            else:
                names = [len(self._item_name(n)) for n in run]
                w = align_width(names)
                for n in run:
                    out[id(n)]["name"] = w
                if isinstance(first, ast.StageDecl):
                    self._align_arrows(run, w, out)
        return out

    def _align_arrows(self, run, name_w: int, out) -> None:
        heads = {}
        for s in run:
            if not s.outputs:
                continue
            head = self._stage_head(s, name_w) + value_text(s.call)
            tail = " -> " + ", ".join(o.value for o in s.outputs)
            if len(head) + len(tail) <= WIDTH:
                heads[id(s)] = len(head)
        if not heads:
            return
        w = align_width(list(heads.values()))
        for s in run:
            if id(s) in heads and heads[id(s)] <= w:
                out[id(s)]["call"] = w

    @staticmethod
    def _run_kind(n) -> str | None:
        if isinstance(n, ast.Assign):
            return "assign"
        if isinstance(n, ast.Flag):
            return "assign"          # a flag sits in a run of keys without breaking it
        if isinstance(n, ast.Section):
            return f"section {n.kind.value}"
        if isinstance(n, ast.ToolDecl):
            return n.keyword
        return {ast.StageDecl: "stage", ast.ModelDecl: "model", ast.RewardDecl: "reward",
                ast.Staleness: "staleness"}.get(type(n))

    @staticmethod
    def _item_name(n) -> str:
        if isinstance(n, ast.Staleness):
            return n.stage.value
        return n.name.value

    @staticmethod
    def _section_head(s: ast.Section) -> str:
        return s.kind.value + (f" {s.name.value}" if s.name is not None else "")

    # --- one node ---------------------------------------------------------------------------

    def _node(self, n, indent: str, widths: dict[str, int]) -> list[_Line]:
        name_w = widths.get("name", 0)
        if isinstance(n, ast.PipelineDecl):
            return [_Line(f"{indent}pipeline {n.name.value}")]
        if isinstance(n, ast.Extend):
            return [_Line(f"{indent}extend {quote(n.path.value)}")]
        if isinstance(n, ast.WorkloadDecl):
            return self._with_block(f"{indent}workload", n.block, indent, inline_ok=False)
        if isinstance(n, ast.EvalDecl):
            return self._with_block(f"{indent}eval", n.block, indent, inline_ok=False)
        if isinstance(n, ast.LogDecl):
            return self._with_block(f"{indent}log", n.block, indent, inline_ok=False)
        if isinstance(n, ast.ModelDecl):
            head = f"{indent}model {n.name.value:<{name_w}} : {n.preset.value}"
            if n.source is not None:
                head += f"({quote(n.source.value)})"
            if n.block is None:
                return [_Line(head)]
            return self._with_block(head, n.block, indent, inline_ok=True)
        if isinstance(n, ast.RewardDecl):
            return [_Line(x) for x in _wrapped(f"{indent}reward {n.name.value:<{name_w}} = ",
                                               n.call)]
        if isinstance(n, ast.ToolDecl):
            return [_Line(x) for x in _wrapped(
                f"{indent}{n.keyword} {n.name.value:<{name_w}} = ", n.call)]
        if isinstance(n, ast.StageDecl):
            return self._stage(n, indent, name_w, widths.get("call"))
        if isinstance(n, ast.Staleness):
            return [_Line(f"{indent}staleness {n.stage.value:<{name_w}} <= "
                          f"{value_text(n.bound)}")]
        if isinstance(n, ast.Share):
            return [_Line(f"{indent}share " + ", ".join(x.value for x in n.names))]
        if isinstance(n, ast.Colocate):
            return [_Line(f"{indent}colocate " + ", ".join(x.value for x in n.names))]
        if isinstance(n, ast.Place):
            head = f"{indent}place {n.stage.value} on gpus {value_text(n.gpus)}"
            if n.block is None:
                return [_Line(head)]
            return self._with_block(head, n.block, indent, inline_ok=True)
        if isinstance(n, ast.ClusterDecl):
            return self._with_block(f"{indent}cluster {n.name.value}", n.block, indent, False)
        if isinstance(n, ast.ProfileDecl):
            return self._with_block(f"{indent}profile {n.name.value}", n.block, indent, False)
        if isinstance(n, ast.Assign):
            key = f"{indent}{n.key.value:<{widths.get('key', 0)}} = "
            return [_Line(x) for x in _wrapped(key, n.value)]
        if isinstance(n, ast.Flag):
            return [_Line(f"{indent}{n.key.value}")]
        if isinstance(n, ast.Section):
            head = f"{indent}{self._section_head(n):<{widths.get('section', 0)}}"
            return self._with_block(head, n.block, indent, inline_ok=True)
        raise TypeError(f"not a statement: {n!r}")

    @staticmethod
    def _stage_head(s: ast.StageDecl, name_w: int) -> str:
        return f"stage {s.name.value:<{name_w}} = "

    def _stage(self, s: ast.StageDecl, indent: str, name_w: int, call_w: int | None):
        head = indent + self._stage_head(s, name_w)
        tail = (" -> " + ", ".join(o.value for o in s.outputs)) if s.outputs else ""
        one = head + value_text(s.call)
        if len(one) + len(tail) <= WIDTH:
            if call_w is not None and tail:
                one = one.ljust(len(indent) + call_w)
            return [_Line(one + tail)]
        return [_Line(x) for x in _wrapped(head, s.call, tail)]

    def _with_block(self, head: str, block: ast.Block, indent: str,
                    inline_ok: bool) -> list[_Line]:
        if not block.entries and not self.notes.has_any(block):
            return [_Line(head + " { }")]
        if inline_ok and self._inline_ok(block):
            line = head + " " + self._inline(block)
            if len(line) <= WIDTH:
                return [_Line(line)]
        opening = self.notes.opening.get(id(block))
        out = [_Line(head + " {", opening.text if opening else None)]
        self._sequence(block.entries, id(block), indent + INDENT, out)
        out.append(_Line(indent + "}"))
        return out

    def _inline_ok(self, block: ast.Block) -> bool:
        return (len(block.entries) <= INLINE_MAX_ENTRIES
                and not any(isinstance(e, ast.Section) for e in block.entries)
                and not self.notes.has_any(block))

    def _inline(self, block: ast.Block) -> str:
        parts = []
        for e in block.entries:
            if isinstance(e, ast.Assign):
                parts.append(f"{e.key.value} = {value_text(e.value)}")
            else:
                parts.append(e.key.value)
        return "{ " + "; ".join(parts) + " }"


def _render(lines: list[_Line]) -> str:
    """Join lines, aligning trailing comments: one column per run of lines at one indentation
    with no blank or comment-only line between them (lines without a comment do not break it)."""
    while lines and lines[-1] is BLANK:
        lines.pop()
    columns: dict[int, int] = {}
    run: list[int] = []

    def close() -> None:
        widths = [len(lines[i].code.rstrip()) for i in run if lines[i].comment is not None]
        col = align_width(widths) + 2 if widths else 0
        for i in run:
            columns[i] = col
        run.clear()

    for i, x in enumerate(lines):
        code = x.code.rstrip()
        breaks = x is BLANK or code.lstrip().startswith("#") or (
            run and _indent(lines[run[-1]].code) != _indent(code))
        if breaks:
            close()
        if x is not BLANK and not code.lstrip().startswith("#"):
            run.append(i)
    close()
    text = []
    for i, x in enumerate(lines):
        code = x.code.rstrip()
        if x.comment is None:
            text.append(code)
        else:
            col = columns.get(i, 0)
            text.append((code.ljust(col) if len(code) < col else code + "  ") + x.comment)
    return "\n".join(text) + "\n" if text else ""


def _indent(code: str) -> int:
    return len(code) - len(code.lstrip(" "))
