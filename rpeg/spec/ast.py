"""Syntax tree of a .rpeg file: what was written, with where it was written.

    >>> from rpeg.spec.parser import parse_text
    >>> f = parse_text("pipeline p\\nshare actor, critic\\n", "x.rpeg")
    >>> f.items[1]
    Share(names=(Ident(value='actor', ...), Ident(value='critic', ...)), ...)

Values are kept as written (numbers with their unit and source text) so the
canonical printer can reproduce them; meaning is given by ``rpeg.spec.lower``.
"""

from __future__ import annotations

import attrs

from rpeg.errors import NOWHERE, Span


def _span_field():
    return attrs.field(default=NOWHERE, eq=False, repr=False, order=False)


@attrs.frozen
class Ident:
    value: str
    span: Span = _span_field()


@attrs.frozen
class Number:
    value: float
    text: str                     # as written, sign included
    unit: str | None = None
    span: Span = _span_field()

    @property
    def is_int(self) -> bool:
        return self.unit is None and float(self.value).is_integer() and "." not in self.text \
            and "e" not in self.text.lower()


@attrs.frozen
class Str:
    value: str
    span: Span = _span_field()


@attrs.frozen
class Range:
    low: Number
    high: Number
    span: Span = _span_field()


@attrs.frozen
class ListValue:
    items: tuple[Value, ...]
    span: Span = _span_field()


@attrs.frozen
class Call:
    func: Ident
    args: tuple[Value, ...]
    kwargs: tuple[KwArg, ...]
    span: Span = _span_field()

    def kwarg(self, key: str) -> KwArg | None:
        return next((k for k in self.kwargs if k.key.value == key), None)


@attrs.frozen
class KwArg:
    key: Ident
    value: Value
    span: Span = _span_field()


Value = Number | Str | Ident | Call | Range | ListValue


# --- block entries -----------------------------------------------------------

@attrs.frozen
class Assign:
    key: Ident
    value: Value
    span: Span = _span_field()


@attrs.frozen
class Flag:
    key: Ident
    span: Span = _span_field()


@attrs.frozen
class Section:
    """``link node { ... }`` (kind ``link``, name ``node``) or ``extra { ... }`` (no name)."""

    kind: Ident
    name: Ident | None
    block: Block
    span: Span = _span_field()


Entry = Assign | Flag | Section


@attrs.frozen
class Block:
    entries: tuple[Entry, ...]
    span: Span = _span_field()


# --- top-level items ---------------------------------------------------------

@attrs.frozen
class PipelineDecl:
    name: Ident
    span: Span = _span_field()


@attrs.frozen
class Extend:
    path: Str
    span: Span = _span_field()


@attrs.frozen
class WorkloadDecl:
    block: Block
    span: Span = _span_field()


@attrs.frozen
class ModelDecl:
    """``model NAME : PRESET [block]``, or ``model NAME : hf("FOLDER") [block]`` (``preset``
    is then ``hf`` and ``source`` the folder)."""

    name: Ident
    preset: Ident
    block: Block | None
    span: Span = _span_field()
    source: Str | None = None


@attrs.frozen
class RewardDecl:
    name: Ident
    call: Call
    span: Span = _span_field()


@attrs.frozen
class ToolDecl:
    """``tool NAME = KIND(...)``, or ``environment NAME = KIND(...)`` (``environment``)."""

    name: Ident
    call: Call
    span: Span = _span_field()
    environment: bool = False

    @property
    def keyword(self) -> str:
        return "environment" if self.environment else "tool"


@attrs.frozen
class StageDecl:
    name: Ident
    call: Call
    outputs: tuple[Ident, ...]
    span: Span = _span_field()


@attrs.frozen
class Staleness:
    stage: Ident
    bound: Value
    span: Span = _span_field()


@attrs.frozen
class Share:
    names: tuple[Ident, ...]
    span: Span = _span_field()


@attrs.frozen
class Colocate:
    names: tuple[Ident, ...]
    span: Span = _span_field()


@attrs.frozen
class Place:
    stage: Ident
    gpus: Range
    block: Block | None = None        # the pinned layout: { dp = 2; tp = 1; zero = 3; ... }
    span: Span = _span_field()


@attrs.frozen
class EvalDecl:
    """``eval { dataset = "..."; every = N; samples = K; temperature = T }``."""

    block: Block
    span: Span = _span_field()


@attrs.frozen
class LogDecl:
    """``log { trackers = [wandb, mlflow]; samples = 4; project = "..." }``."""

    block: Block
    span: Span = _span_field()


@attrs.frozen
class ClusterDecl:
    name: Ident
    block: Block
    span: Span = _span_field()


@attrs.frozen
class ProfileDecl:
    name: Ident
    block: Block
    span: Span = _span_field()


Item = (PipelineDecl | Extend | WorkloadDecl | ModelDecl | RewardDecl | ToolDecl | StageDecl
        | Staleness
        | Share | Colocate | Place | EvalDecl | LogDecl | ClusterDecl | ProfileDecl)


@attrs.frozen
class Comment:
    text: str            # including the leading '#'
    line: int
    col: int
    own_line: bool       # alone on its line (vs trailing code)


@attrs.frozen
class File:
    path: str
    items: tuple[Item, ...]
    comments: tuple[Comment, ...] = attrs.field(default=(), eq=False)
    source: str = attrs.field(default="", eq=False, repr=False)
