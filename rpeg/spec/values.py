"""Turning written values into meaning: integers, units, names, calls.

    >>> from rpeg.spec.parser import parse_text
    >>> v = parse_text("cluster c { x = 25 GB/s }").items[0].block.entries[0].value
    >>> quantity(v, "bytes/s", "x")
    25000000000.0

Every conversion names the key it is for, so a wrong value reads as
``bandwidth must be a bandwidth such as 25 GB/s, not 25 (no unit)``.
"""

from __future__ import annotations

import math

import attrs

from rpeg.errors import Span, SpecError
from rpeg.spec import ast

# unit -> (dimension, factor to SI base)
_BYTES = {"B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15,
          "KiB": 2.0**10, "MiB": 2.0**20, "GiB": 2.0**30, "TiB": 2.0**40, "PiB": 2.0**50}
UNITS: dict[str, tuple[str, float]] = {}
for _u, _f in _BYTES.items():
    UNITS[_u] = ("bytes", _f)
    UNITS[_u + "/s"] = ("bytes/s", _f)
UNITS.update({"FLOPS": ("flops", 1.0), "KFLOPS": ("flops", 1e3), "MFLOPS": ("flops", 1e6),
              "GFLOPS": ("flops", 1e9), "TFLOPS": ("flops", 1e12), "PFLOPS": ("flops", 1e15),
              "ns": ("s", 1e-9), "us": ("s", 1e-6), "ms": ("s", 1e-3), "s": ("s", 1.0),
              "min": ("s", 60.0), "h": ("s", 3600.0), "%": ("fraction", 0.01)})

EXAMPLES = {"bytes": "80 GB", "bytes/s": "25 GB/s", "flops": "700 TFLOPS", "s": "5 us",
            "fraction": "10%"}
DIMENSION_NAMES = {"bytes": "a size", "bytes/s": "a bandwidth", "flops": "a throughput",
                   "s": "a duration", "fraction": "a share"}

# Hard limits: a spec describing more than this is refused before anything is sized by it.
MAX_INT = 10**7


@attrs.frozen
class Fn:
    """A call written as a value: ``adam(lr = 1e-6)``, ``ppo_clip(0.2)``."""

    name: str
    args: tuple[object, ...] = ()
    kwargs: tuple[tuple[str, object], ...] = ()

    def get(self, key: str, default: object = None, position: int | None = None) -> object:
        for k, v in self.kwargs:
            if k == key:
                return v
        if position is not None and position < len(self.args):
            return self.args[position]
        return default

    def __str__(self) -> str:
        parts = [_fmt(a) for a in self.args] + [f"{k} = {_fmt(v)}" for k, v in self.kwargs]
        return f"{self.name}({', '.join(parts)})"


def _fmt(v: object) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


def describe(v: ast.Value) -> str:
    """A value as the user wrote it, for messages."""
    if isinstance(v, ast.Number):
        return v.text + (("" if v.unit == "%" else " ") + v.unit if v.unit else "")
    if isinstance(v, ast.Str):
        return f'"{v.value}"'
    if isinstance(v, ast.Ident):
        return v.value
    if isinstance(v, ast.Call):
        return f"{v.func.value}(...)"
    if isinstance(v, ast.Range):
        return f"{v.low.text}..{v.high.text}"
    return "a list"


def kind_of(v: ast.Value) -> str:
    return {ast.Number: "a number", ast.Str: "a string", ast.Ident: "a name", ast.Call: "a call",
            ast.Range: "a range", ast.ListValue: "a list"}[type(v)]


def integer(v: ast.Value, key: str, *, minimum: int = 0, maximum: int = MAX_INT) -> int:
    if not isinstance(v, ast.Number):
        raise SpecError(f"{key} must be an integer, not {kind_of(v)} ({describe(v)})", v.span)
    if v.unit is not None:
        raise SpecError(f"{key} must be a plain integer, not {describe(v)}", v.span,
                        hint=f"{key} has no unit; write {v.text}")
    digits = v.text.lstrip("+-")
    if digits.isdigit() and (len(digits) > 18 or not math.isfinite(v.value)):
        # a whole number too long for a float: say which way it is out of range, and do not
        # echo thousands of digits back
        negative = v.text.startswith("-")
        bound = f"at least {minimum:,}" if negative else f"at most {maximum:,}"
        raise SpecError(f"{key} must be {bound}, not a {len(digits):,}-digit number "
                        f"({v.text[:12]}...)", v.span,
                        hint="rpeg refuses sizes beyond what any cluster runs")
    if not v.is_int:
        raise SpecError(f"{key} must be an integer, not {_cut(v.text)}", v.span)
    n = int(v.value)
    if n < minimum:
        raise SpecError(f"{key} must be at least {minimum}, not {n}", v.span)
    if n > maximum:
        raise SpecError(f"{key} must be at most {maximum:,}, not {n:,}", v.span)
    return n


def _cut(text: str, width: int = 24) -> str:
    return text if len(text) <= width else f"{text[:width]}... ({len(text):,} characters)"


def real(v: ast.Value, key: str, *, minimum: float | None = None, positive: bool = False,
         maximum: float | None = None) -> float:
    if not isinstance(v, ast.Number):
        raise SpecError(f"{key} must be a number, not {kind_of(v)} ({describe(v)})", v.span)
    if v.unit is not None:
        raise SpecError(f"{key} must be a plain number, not {describe(v)}", v.span)
    x = v.value
    if not math.isfinite(x):
        raise SpecError(f"{key} must be a finite number, not {v.text}", v.span)
    if positive and x <= 0:
        raise SpecError(f"{key} must be positive, not {v.text}", v.span)
    if minimum is not None and x < minimum:
        raise SpecError(f"{key} must be at least {minimum:g}, not {v.text}", v.span)
    if maximum is not None and x > maximum:
        raise SpecError(f"{key} must be at most {maximum:g}, not {v.text}", v.span)
    return x


def quantity(v: ast.Value, dimension: str, key: str) -> float:
    """A number with a unit of ``dimension``, in SI base units; plain numbers for dimension ''."""
    if dimension == "":
        return real(v, key, minimum=0.0)
    if dimension == "fraction":
        return fraction(v, key)
    name = DIMENSION_NAMES[dimension]
    example = EXAMPLES[dimension]
    if not isinstance(v, ast.Number):
        raise SpecError(f"{key} must be {name} such as {example}, not {kind_of(v)} "
                        f"({describe(v)})", v.span)
    if v.unit is None:
        raise SpecError(f"{key} must be {name} such as {example}, not {v.text} (no unit)",
                        v.span, hint=f"add a unit: {v.text} {example.split()[1]}")
    dim, factor = UNITS[v.unit]
    if dim != dimension:
        raise SpecError(f"{key} must be {name} such as {example}, not {describe(v)} "
                        f"({DIMENSION_NAMES[dim]})", v.span)
    x = v.value * factor
    if x < 0 or not math.isfinite(x):
        raise SpecError(f"{key} must be a positive {name.split()[1]}, not {describe(v)}", v.span)
    return x


def fraction(v: ast.Value, key: str) -> float:
    """A share of a whole, at least 0 and below 1: ``10%`` or ``0.1``."""
    if isinstance(v, ast.Number) and v.unit == "%":
        x = v.value / 100
    elif isinstance(v, ast.Number) and v.unit is None:
        x = v.value
    else:
        raise SpecError(f"{key} must be a share such as 10% or 0.1, not {kind_of(v)} "
                        f"({describe(v)})", v.span)
    if not (math.isfinite(x) and 0 <= x < 1):
        raise SpecError(f"{key} must be a share from 0% up to below 100%, not {describe(v)}",
                        v.span)
    return x


def name(v: ast.Value, key: str, choices: tuple[str, ...] | None = None) -> str:
    if not isinstance(v, ast.Ident):
        if choices == ("true", "false"):
            raise SpecError(f"{key} must be true or false, not {kind_of(v)} ({describe(v)})",
                            v.span, hint=f"write {key} = true or {key} = false")
        if choices:
            raise SpecError(f"{key} must be one of {', '.join(choices)}, not {kind_of(v)} "
                            f"({describe(v)})", v.span)
        raise SpecError(f"{key} must be a name, not {kind_of(v)} ({describe(v)})", v.span)
    if choices is not None and v.value not in choices:
        from rpeg.errors import did_you_mean
        raise SpecError(f"{key} must be one of {', '.join(choices)}, not '{v.value}'", v.span,
                        hint=did_you_mean(v.value, choices))
    return v.value


def string(v: ast.Value, key: str) -> str:
    if not isinstance(v, ast.Str):
        raise SpecError(f"{key} must be a string in double quotes, not {kind_of(v)} "
                        f"({describe(v)})", v.span, hint=f'write {key} = "{describe(v)}"')
    return v.value


def plain(v: ast.Value, key: str) -> object:
    """A stage or loss argument: int, float, str (name or string), Fn, or tuple."""
    if isinstance(v, ast.Number):
        if v.unit is not None:
            raise SpecError(f"{key} takes no unit, not {describe(v)}", v.span)
        if not math.isfinite(v.value):
            raise SpecError(f"{key} must be a finite number, not {v.text}", v.span)
        return int(v.value) if v.is_int else v.value
    if isinstance(v, (ast.Ident, ast.Str)):
        return v.value
    if isinstance(v, ast.Call):
        return Fn(v.func.value, tuple(plain(a, key) for a in v.args),
                  tuple((k.key.value, plain(k.value, k.key.value)) for k in v.kwargs))
    if isinstance(v, ast.ListValue):
        return tuple(plain(x, key) for x in v.items)
    raise SpecError(f"{key} cannot be {kind_of(v)}", v.span)


def unknown_key(key: ast.Ident, allowed: tuple[str, ...], where: str) -> SpecError:
    """A key ``where`` does not take; the hint names rpeg's key for a name from another
    system (``rpeg.spec.vocabulary``), else the closest spelling, else what it takes."""
    from rpeg.errors import did_you_mean
    from rpeg.spec.vocabulary import foreign_hint
    return SpecError(f"unknown key '{key.value}' in {where}", key.span,
                     hint=foreign_hint(key.value, allowed) or did_you_mean(key.value, allowed)
                     or f"{where} takes: " + ", ".join(allowed))


def duplicate(kind: str, name_: str, span: Span, first: Span) -> SpecError:
    return SpecError(f"{kind} '{name_}' is defined twice", span,
                     notes=[("first defined here", first)],
                     hint="rename one of them, or delete the second")
