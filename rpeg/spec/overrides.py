"""Command-line overrides of a pipeline, in the dotted style Hydra users know.

    $ rpeg run spec.rpeg workload.steps=20 model.actor.optimizer.lr=1e-5 stage.rollout.temperature=0.7

    >>> o = parse_overrides(["workload.steps=20", "model.actor.optimizer.lr=1e-5"])
    >>> [x.path for x in o]
    [('workload', 'steps'), ('model', 'actor', 'optimizer', 'lr')]

Each override sets one key, written as it would be in the spec (a number with its unit, a
"string", a name, a call or a list): ``workload.KEY``, ``eval.KEY``, ``log.KEY``,
``model.NAME.KEY``, ``model.NAME.optimizer.ARG`` (and ``.lora.ARG``), ``stage.NAME.ARG``
(a keyword of the stage's call) and ``staleness.STAGE``. They apply to the pipeline with its
``extend`` chain resolved, and then it is checked like any spec: a mistake is an error at
``command line:N:COL``, the N-th override and the column in it, with the override and a
caret.
"""

from __future__ import annotations

import attrs

from rpeg.errors import Span, SpecError, did_you_mean
from rpeg.spec import ast
from rpeg.spec.vocabulary import override_hint

WHERE = "command line"
ROOTS = ("workload", "eval", "log", "model", "stage", "staleness")
_CALL_KEYS = ("optimizer", "lora")


@attrs.frozen
class Override:
    path: tuple[str, ...]
    value: ast.Value
    text: str                       # as typed
    line: int                       # its position among the overrides, from 1
    spans: tuple[Span, ...] = ()    # where each part of the path is


def source_text(overrides: list[str] | tuple[str, ...]) -> str:
    """What an override error's excerpt shows: the overrides one per line."""
    return "\n".join(overrides)


def parse_overrides(texts) -> tuple[Override, ...]:
    """The overrides, each once: a key given twice is an error (as in a spec), not the last
    one silently winning."""
    out = tuple(_parse(t, n) for n, t in enumerate(texts, 1))
    first: dict[tuple[str, ...], Override] = {}
    for o in out:
        if o.path in first:
            key = ".".join(o.path)
            raise SpecError(f"override '{key}' is given twice", Span(WHERE, o.line, 1),
                            notes=[("first given here", Span(WHERE, first[o.path].line, 1))],
                            hint=f"give {key} once")
        first[o.path] = o
    return out


def _parse(text: str, line: int) -> Override:
    from rpeg.spec.parser import parse_text

    if "=" not in text:
        raise SpecError(f"an override must be KEY=VALUE, not '{text}'", Span(WHERE, line, 1),
                        hint="for example workload.steps=20 or model.actor.optimizer.lr=1e-5")
    key, value = text.split("=", 1)
    spans, col = [], 1
    parts = key.split(".")
    for part in parts:
        spans.append(Span(WHERE, line, col, line, col + max(len(part), 1)))
        if not part.isidentifier():
            raise SpecError(f"an override's key must be names joined by '.', not '{key}'",
                            spans[-1])
        col += len(part) + 1
    if parts[0] not in ROOTS:
        raise SpecError(f"an override must start with {', '.join(ROOTS)}, not '{parts[0]}'",
                        spans[0], hint=override_hint(key) or did_you_mean(parts[0], ROOTS))
    prefix = "profile _ { v = "
    try:
        tree = parse_text(prefix + value + " }", WHERE)
    except SpecError as e:
        at = max(e.span.col - len(prefix), 1) if e.span and e.span.line == 1 else 1
        hint = e.hint
        if not value.startswith('"') and any(c in value for c in "./\\"):
            hint = (f"a path or other text is a string, in quotes (and the shell's quotes "
                    f"around them): {key}='\"{value}\"'")
        raise SpecError(f"the value of override '{key}' must be a spec value: {e.message}",
                        Span(WHERE, line, len(key) + 1 + at), hint=hint) from None
    entries = tree.items[0].block.entries
    if len(entries) != 1 or not isinstance(entries[0], ast.Assign):
        raise SpecError(f"the value of override '{key}' must be one value, not '{value}'",
                        Span(WHERE, line, len(key) + 2))
    shift = len(key) + 1 - len(prefix)
    return Override(tuple(parts), _moved(entries[0].value, line, shift), text, line,
                    tuple(spans))


def _moved(node, line: int, shift: int):
    """``node`` with every span moved onto the override's line, ``shift`` columns along."""
    if isinstance(node, Span):
        return Span(WHERE, line, node.col + shift, line, node.end_col + shift)
    if isinstance(node, tuple):
        return tuple(_moved(x, line, shift) for x in node)
    if attrs.has(type(node)):
        changes = {}
        for f in attrs.fields(type(node)):
            v = getattr(node, f.name)
            if isinstance(v, (Span, tuple)) or attrs.has(type(v)):
                changes[f.name] = _moved(v, line, shift)
        return attrs.evolve(node, **changes)
    return node


# --- applying them to the resolved items ---------------------------------------------------------

def apply_overrides(items: tuple, overrides: tuple[Override, ...]) -> tuple:
    out = list(items)
    for o in overrides:
        out = _apply(out, o)
    return tuple(out)


def _apply(items: list, o: Override) -> list:
    root = o.path[0]
    if root in ("workload", "eval", "log"):
        kind = {"workload": ast.WorkloadDecl, "eval": ast.EvalDecl, "log": ast.LogDecl}[root]
        _arity(o, 2, f"{root}.KEY")
        at = next((n for n, i in enumerate(items) if isinstance(i, kind)), None)
        if at is None:
            items.append(kind(ast.Block((), o.spans[0]), o.spans[0]))
            at = len(items) - 1
        decl = items[at]
        items[at] = attrs.evolve(decl, block=_set(decl.block, o.path[1], o.value, o))
        return items
    if root == "staleness":
        _arity(o, 2, "staleness.STAGE")
        stage = ast.Ident(o.path[1], o.spans[1])
        new = ast.Staleness(stage, o.value, o.spans[0])
        at = next((n for n, i in enumerate(items)
                   if isinstance(i, ast.Staleness) and i.stage.value == o.path[1]), None)
        if at is None:
            items.append(new)
        else:
            items[at] = new
        return items
    kind = ast.ModelDecl if root == "model" else ast.StageDecl
    names = [i.name.value for i in items if isinstance(i, kind)]
    if len(o.path) < 3:
        raise SpecError(f"override '{o.text}' must name a {root} and a key: "
                        f"{root}.NAME.KEY=VALUE", o.spans[-1])
    name = o.path[1]
    if name not in names:
        raise SpecError(f"override names unknown {root} '{name}'", o.spans[1],
                        hint=did_you_mean(name, names) or f"{root}s: {', '.join(names)}")
    at = names.index(name)
    at = [n for n, i in enumerate(items) if isinstance(i, kind)][at]
    decl = items[at]
    if root == "stage":
        _arity(o, 3, "stage.NAME.ARG")
        items[at] = attrs.evolve(decl, call=_kwarg(decl.call, o.path[2], o.value, o))
        return items
    key = o.path[2]
    block = decl.block or ast.Block((), decl.span)
    if len(o.path) == 4 and key in _CALL_KEYS:
        current = next((e for e in block.entries if isinstance(e, ast.Assign)
                        and e.key.value == key), None)
        call = current.value if current is not None and isinstance(current.value, ast.Call) \
            else ast.Call(ast.Ident(_default_call(key), o.spans[2]), (), (), o.spans[2])
        value = _kwarg(call, o.path[3], o.value, o)
        items[at] = attrs.evolve(decl, block=_set(block, key, value, o, at_col=2))
        return items
    _arity(o, 3, "model.NAME.KEY")
    items[at] = attrs.evolve(decl, block=_set(block, key, o.value, o, at_col=2))
    return items


def _arity(o: Override, n: int, form: str) -> None:
    if len(o.path) != n:
        raise SpecError(f"override '{'.'.join(o.path)}' must be {form}=VALUE",
                        o.spans[min(n, len(o.path)) - 1])


def _set(block: ast.Block, key: str, value: ast.Value, o: Override, at_col: int = 1
         ) -> ast.Block:
    span = o.spans[at_col] if at_col < len(o.spans) else o.spans[-1]
    entry = ast.Assign(ast.Ident(key, span), value, span)
    entries = [e for e in block.entries
               if not ((e.kind if isinstance(e, ast.Section) else e.key).value == key)]
    return ast.Block(tuple(entries) + (entry,), block.span)


def _kwarg(call: ast.Call, key: str, value: ast.Value, o: Override) -> ast.Call:
    span = o.spans[-1]
    kw = ast.KwArg(ast.Ident(key, span), value, span)
    kwargs = tuple(k for k in call.kwargs if k.key.value != key) + (kw,)
    return attrs.evolve(call, kwargs=kwargs)


def _default_call(key: str) -> str:
    """The call a ``model.NAME.KEY.ARG`` override fills in when the model sets no ``KEY``."""
    if key == "optimizer":
        from rpeg.spec.functions import default_optimizer
        return default_optimizer().name
    return key                          # lora = lora(...)
