"""Calls checked against the registry: keywords, their types and ranges, positions.

    >>> from rpeg.spec.parser import parse_text
    >>> call = parse_text("stage a = f(ppo_clip(0.2, clip_high = 0.28))").items[0].call
    >>> lower_call(function("ppo_clip"), call.args[0])
    Fn(name='ppo_clip', args=(), kwargs=(('clip', 0.2), ('clip_high', 0.28)))

A keyword's value is converted by its declared type and checked against its
declared range, so ``top_p = 1.5`` reads ``top_p must be in (0, 1], not 1.5`` at
the value. Values given by position become keywords (``ppo_clip(0.2)`` is
``ppo_clip(clip = 0.2)``); a keyword the function used to take says where it went.
"""

from __future__ import annotations

from rpeg.errors import Span, SpecError, did_you_mean
from rpeg.spec import ast
from rpeg.spec import values as V
from rpeg.spec.functions import by_category, find, function
from rpeg.spec.lengths import length
from rpeg.spec.model import Engine
from rpeg.spec.registry import Category, Function, Param, Type

MAX_INT = 1 << 21


def convert(p: Param, v: ast.Value) -> object:
    """A written value as ``p``'s type, checked against its range."""
    key = p.name
    if p.type is Type.INT:
        n = V.integer(v, key, minimum=-MAX_INT, maximum=MAX_INT)
        _check_range(p, n, v)
        return n
    if p.type is Type.REAL:
        x = V.real(v, key)
        _check_range(p, x, v)
        return float(x)
    if p.type is Type.BOOL:
        return V.name(v, key, ("true", "false")) == "true"
    if p.type is Type.CHOICE:
        value = V.name(v, key, p.choices)
        return Engine(value) if key == "engine" else value
    if p.type is Type.DATA:
        if not isinstance(v, ast.Ident):
            raise SpecError(f"{key} must be the name of data a stage produces, not "
                            f"{V.kind_of(v)} ({V.describe(v)})", v.span)
        return v.value
    if p.type is Type.STRING:
        return V.string(v, key)
    if p.type is Type.QUANTITY:
        x = V.quantity(v, p.unit, key)
        _check_range(p, x, v)
        return x
    if p.type is Type.NAME:
        return V.name(v, key)
    if p.type is Type.NAMES:
        return _names(v, key)
    if p.type is Type.LENGTH:
        return length(v, key)
    if p.type is Type.LATENCY:
        from rpeg.spec.tools import latency
        return latency(v, key)
    return lower_call(_callee(p, v), v)


def _names(v: ast.Value, key: str) -> tuple[str, ...]:
    """A list of names (``[calc, search]``), each once."""
    if not isinstance(v, ast.ListValue):
        raise SpecError(f"{key} must be a list of names such as [calc], not {V.kind_of(v)} "
                        f"({V.describe(v)})", v.span, hint=f"write {key} = [{V.describe(v)}]"
                        if isinstance(v, ast.Ident) else None)
    out: list[str] = []
    for item in v.items:
        name = V.name(item, key)
        if name in out:
            raise SpecError(f"{key} lists '{name}' twice", item.span)
        out.append(name)
    return tuple(out)


def _check_range(p: Param, x: float, v: ast.Value) -> None:
    if not p.in_range(x):
        raise SpecError(f"{p.name} must be {_range_words(p)}, not {V.describe(v)}", v.span,
                        hint=p.doc)


def _range_words(p: Param) -> str:
    if p.low is not None and p.high is not None:
        return f"in {p.range_text()}"
    text = p.range_text()
    if text.startswith(">="):
        return f"at least {text[3:]}"
    if text.startswith(">"):
        return f"greater than {text[2:]}"
    if text.startswith("<="):
        return f"at most {text[3:]}"
    return f"less than {text[2:]}"


def _callee(p: Param, v: ast.Value) -> Function:
    """The registry entry a call-valued keyword names (a loss)."""
    name = v.value if isinstance(v, ast.Ident) else v.func.value if isinstance(v, ast.Call) \
        else None
    span = v.span if isinstance(v, ast.Ident) else v.func.span if isinstance(v, ast.Call) \
        else v.span
    if name is None:
        raise SpecError(f"{p.name} must be one of {', '.join(p.choices)}, not {V.kind_of(v)} "
                        f"({V.describe(v)})", v.span)
    if name not in p.choices:
        raise SpecError(f"{p.name} must be one of {', '.join(p.choices)}, not '{name}'", span,
                        hint=did_you_mean(name, p.choices))
    return function(name)


def lower_call(fn: Function, v: ast.Value) -> V.Fn:
    """A call of ``fn`` (or its bare name) as a value: keywords by name, as written."""
    if isinstance(v, ast.Ident):
        return V.Fn(fn.name)
    assert isinstance(v, ast.Call)
    given = keywords(fn, v.args, v.kwargs, f"{fn.name}(...)")
    return V.Fn(fn.name, (), tuple((k, value) for k, (value, _) in given.items()))


def keywords(fn: Function, args, kwargs, where: str) -> dict[str, tuple[object, Span]]:
    """Positional values and keyword arguments of a call of ``fn`` -> {key: (value, span)}."""
    out: dict[str, tuple[object, Span]] = {}
    if len(args) > len(fn.positional):
        extra = args[len(fn.positional)]
        takes = (f"at most {len(fn.positional)} value(s) by position ("
                 f"{', '.join(fn.positional)})") if fn.positional else "keywords only"
        raise SpecError(f"{where} takes {takes}, not {len(args)}", extra.span,
                        hint="write the others as name = value: " + ", ".join(fn.keys))
    for key, value in zip(fn.positional, args, strict=False):
        out[key] = (convert(fn.param(key), value), value.span)
    for k in kwargs:
        key = k.key.value
        if not fn.has(key):
            moved = fn.moved_hint(key)
            if moved:
                raise SpecError(f"{where} takes no key '{key}'", k.key.span, hint=moved)
            raise V.unknown_key(k.key, fn.keys or ("(none)",), where)
        if key in out:
            raise SpecError(f"{key} is given twice", k.key.span,
                            hint="by position and by name" if key in fn.positional else None)
        out[key] = (convert(fn.param(key), k.value), k.value.span)
    for key, (_, span) in out.items():
        other = fn.param(key).requires
        if other and not fn.param(other).is_set(out.get(other, (None,))[0]):
            if other in out:                     # given, at the value that turns it off
                off = out[other][0]
                off = getattr(off, "value", off)
                raise SpecError(f"{key} does nothing with {other} = {off} in {where}",
                                span, hint=f"{other}: {fn.param(other).doc}")
            raise SpecError(f"{key} must come with {other} in {where}, not alone: without it, "
                            "it does nothing", span, hint=f"{other}: {fn.param(other).doc}")
    return out


def not_a_stage_function(name: str, span: Span) -> SpecError:
    """``stage x = ppo_clip(...)`` and friends: say what the name is and where it goes."""
    f = find(name)
    stage_names = [g.name for g in _stage_functions()]
    if f is not None:
        where = {Category.LOSS: f"a loss: train(MODEL, ..., loss = {name}(...))",
                 Category.REWARD: f"a reward: reward NAME = {name}(...), then score(NAME, ...)",
                 Category.OPTIMIZER: f"an optimizer: model NAME : PRESET {{ optimizer = "
                                     f"{name}(lr = ...) }}"}[f.category]
        return SpecError(f"unknown stage kind '{name}'", span, hint=f"{name} is {where}")
    return SpecError(f"unknown stage kind '{name}'", span, hint=did_you_mean(name, stage_names)
                     or "stage kinds: " + ", ".join(stage_names))


def _stage_functions():
    return by_category(Category.STAGE) + by_category(Category.ESTIMATOR)
