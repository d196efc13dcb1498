"""The language reference, generated from the registry: what ``rpeg help functions`` prints.

    >>> print(signature(function("gae")))
    gae(scores..., values, [logprobs], [ref_logprobs]) -> advantages[, returns]
    >>> "clip_high" in reference()
    True

Every function, its inputs and outputs by role, its keywords with type, range,
default, unit and meaning, and how the cost model prices it -- from
``rpeg.spec.functions``, so the reference cannot disagree with what is checked,
priced and run. ``algorithms_markdown`` is README's list of algorithms (a test
keeps README equal to it).
"""

from __future__ import annotations

import textwrap

from rpeg.spec.functions import by_category, function
from rpeg.spec.registry import Category, Function, Param, Role, Target, Type
from rpeg.spec.values import DIMENSION_NAMES, EXAMPLES, UNITS

_SECTIONS = (
    (Category.STAGE, "Stage functions", "stage NAME = FUNCTION(target, inputs..., key = value) "
                                        "-> outputs"),
    (Category.ESTIMATOR, "Advantage estimators", "stage NAME = ESTIMATOR(inputs..., key = value) "
                                                 "-> outputs"),
    (Category.LOSS, "Losses", "train(MODEL, inputs..., loss = LOSS(key = value))"),
    (Category.REWARD, "Rewards", "reward NAME = KIND(...), read by score(NAME, responses)"),
    (Category.OPTIMIZER, "Optimizers", "model NAME : PRESET { optimizer = KIND(key = value) }"),
    (Category.TOOL, "Tools", "tool NAME = KIND(...), called by generate(MODEL, prompts, tools = "
                             "[NAME, ...])"),
    (Category.ENVIRONMENT, "Environments", "environment NAME = KIND(...), stepped by "
                                           "generate(MODEL, prompts, environment = NAME)"),
)
WIDTH = 96


def signature(fn: Function) -> str:
    """How a call of ``fn`` is written, with the roles of what it reads and writes."""
    if fn.category in (Category.LOSS, Category.OPTIMIZER, Category.REWARD, Category.TOOL,
                       Category.ENVIRONMENT):
        pos = [p for p in fn.positional]
        keys = [k for k in fn.keys if k not in pos]
        return f"{fn.name}({', '.join(pos + [k + ' = ...' for k in keys])})"
    args = [] if fn.target is Target.NONE else [_TARGET[fn.target]]
    for slot in fn.inputs:
        word = slot.role.value + ("..." if slot.many else "")
        args.append(word if slot.required else f"[{word}]")
    if fn.category is Category.STAGE and fn.kind is not None and fn.kind.value == "train":
        args.append("(what the loss reads)")
    outputs = fn.outputs
    if fn.outputs_from_head:
        out = " -> logprobs | ref_logprobs | values | scores (by the model's head)"
    elif outputs:
        out = " -> " + outputs[0].value + "".join(f"[, {r.value}]" for r in outputs[1:])
    else:
        out = ""
    return f"{fn.name}({', '.join(args)}){out}"


_TARGET = {Target.LM: "MODEL", Target.MODEL: "MODEL", Target.SCORER: "REWARD",
           Target.TRAINABLE: "MODEL"}


def kind_text(p: Param) -> str:
    """A key's type with its range and unit, as the reference prints it."""
    if p.type in (Type.CHOICE, Type.BOOL):
        kind = p.range_text()
    elif p.type is Type.CALL:
        kind = ("a loss: " if p.name == "loss" else "a call: ") + " | ".join(p.choices)
    elif p.type is Type.NAMES:
        kind = "a list of " + " | ".join(p.choices) if p.choices else p.type.value
    elif p.type is Type.FLAG:
        kind = "a flag"
    elif p.type is Type.QUANTITY:
        kind = f"{DIMENSION_NAMES[p.unit]} such as {EXAMPLES[p.unit]}"
        if p.low is not None and p.high is not None and p.low > 0:
            kind += f", {quantity_text(p.low, p.unit)} to {quantity_text(p.high, p.unit)}"
    else:
        kind = p.type.value + (f" {p.range_text()}" if p.range_text() else "")
    unit = f" ({p.unit})" if p.unit and p.type is not Type.QUANTITY else ""
    return kind + unit


def notes(p: Param) -> list[str]:
    """What else the reference says of a key: the inputs it needs, the key it needs, whether
    the cost model reads it, the stages it may pin."""
    out = []
    if p.needs:
        out.append("needs " + ", ".join(r.value for r in p.needs) + " as inputs"
                   if p.type is not Type.DATA else "names " + p.needs[0].value)
    if p.requires:
        out.append(f"only with {p.requires}")
    if p.priced:
        out.append("priced by the cost model")
    if p.applies:
        out.append("stages: " + ", ".join(p.applies))
    return out


def default_text(p: Param) -> str:
    """A key's default as the reference prints it: a quantity in a readable unit."""
    if p.required:
        return "required"
    if p.type is Type.QUANTITY and isinstance(p.default, (int, float)) and not p.derived:
        return "default " + quantity_text(float(p.default), p.unit)
    return f"default {p.default_text()}"


def quantity_text(x: float, dimension: str) -> str:
    """``x`` SI base units of ``dimension`` in the largest unit that keeps it at least 1:
    ``quantity_text(2.5e10, "bytes/s")`` is ``'25 GB/s'``."""
    if x == 0:
        return f"0 {EXAMPLES[dimension].split()[1]}"
    if dimension == "bytes":             # a power of two's multiple: in its binary unit
        binary = [(f, u) for u, (d, f) in UNITS.items() if d == dimension
                  and u.endswith("iB") and x >= f and (x / f).is_integer()]
        if binary and not any(x >= f and (x / f).is_integer() for u, (d, f) in UNITS.items()
                              if d == dimension and not u.endswith("iB") and f > 1):
            factor, unit = max(binary)
            return f"{x / factor:g} {unit}"
    units = sorted(((f, u) for u, (d, f) in UNITS.items() if d == dimension
                    and not u.endswith(("iB", "iB/s")) and u not in ("min", "h")), reverse=True)
    factor, unit = next(((f, u) for f, u in units if x >= f), units[-1])
    return f"{x / factor:g} {unit}"


def param_lines(p: Param, indent: int = 6) -> list[str]:
    """One key or keyword: its name, type, default, then its meaning, wrapped."""
    default = default_text(p)
    head = f"{' ' * indent}{p.name:<14} {kind_text(p)}; {default}"
    said = notes(p)
    body = p.doc + (f" ({'; '.join(said)})" if said else "")
    return [head] + textwrap.wrap(body, WIDTH, initial_indent=" " * (indent + 15),
                                  subsequent_indent=" " * (indent + 15))


def facts(fn: Function) -> str:
    """What a function is beyond its keywords: its op, target, scope and pricing."""
    out = []
    if fn.kind is not None:
        out.append(f"op: {fn.kind.value}")
    if fn.target is not Target.NONE:
        out.append(f"first argument: {fn.target.value}")
    if fn.category is Category.ESTIMATOR:
        out.append(f"sees: {fn.scope.value} at a time" + (
            " (streams chunks)" if fn.scope.value == "sample" else " (waits for the step)"))
    if fn.min_samples > 1:
        out.append(f"needs samples >= {fn.min_samples}")
    if fn.trains is not None:
        out.append("trains a " + {"lm": "language model's", "value": "value"}.get(
            fn.trains.value, fn.trains.value) + " head")
    out.append(f"priced: {fn.pricing.value}")
    return "; ".join(out)


def describe(fn: Function) -> list[str]:
    lines = [f"  {signature(fn)}"]
    lines += textwrap.wrap(fn.doc, WIDTH, initial_indent="      ", subsequent_indent="      ")
    lines += textwrap.wrap(facts(fn), WIDTH, initial_indent="      ",
                           subsequent_indent="        ")
    for p in fn.params:
        lines += param_lines(p)
    for rule in fn.rules:
        lines += textwrap.wrap(f"must: {rule.doc} ({rule.name})", WIDTH,
                               initial_indent="      ", subsequent_indent="        ")
    for key, where in fn.moved:
        lines += textwrap.wrap(f"{key}: not here -- {where}", WIDTH,
                               initial_indent="      (", subsequent_indent="       ")
        lines[-1] += ")"
    return lines


def reference() -> str:
    """The whole language reference of functions, as ``rpeg help functions`` prints it."""
    lines = ["Functions of the .rpeg language (generated from rpeg/spec/functions.py).", "",
             "Data has a role, given by the function that produces it:"]
    for r in Role:
        lines += textwrap.wrap(r.what, WIDTH, initial_indent=f"  {r.value:<14} ",
                               subsequent_indent=" " * 17)
    for category, title, form in _SECTIONS:
        lines += ["", f"{title}: {form}", ""]
        for fn in by_category(category):
            lines += describe(fn) + [""]
    return "\n".join(lines).rstrip() + "\n"


def algorithms_markdown() -> str:
    """README's list of algorithms: estimators and losses, one line each."""
    out = []
    for category, title in ((Category.ESTIMATOR, "Advantage estimators"),
                            (Category.LOSS, "Losses")):
        out.append(f"{title}:")
        out.append("")
        for fn in by_category(category):
            keys = ", ".join(f"`{p.name}`" for p in fn.params)
            out.append(f"- `{fn.name}` — {fn.doc}" + (f" Keywords: {keys}." if keys else ""))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


__all__ = ["reference", "algorithms_markdown", "signature", "describe", "facts", "function",
           "param_lines", "kind_text", "notes", "default_text", "quantity_text"]
