"""A python reward's function, found by reading its source: where it is, and how it is called.

    >>> import ast
    >>> tree = ast.parse("def compute_score(data_source, solution_str, ground_truth, "
    ...                  "extra_info=None):\\n    return 1.0\\n")
    >>> form_of(tree.body[0].args, "rewards:compute_score")
    Signature(form=<RewardForm.PER_RESPONSE: 'response'>, columns=('data_source',))
    >>> tree = ast.parse("def f(prompts, responses, answers, difficulty):\\n    pass\\n")
    >>> form_of(tree.body[0].args, "rewards:f").columns
    ('difficulty',)

rpeg calls a reward in one of two forms, told apart by its parameters:

* ``f(prompts, responses, answers, **columns)``: once a batch, three lists, and the
  dataset's other columns by name (each parameter that names one);
* verl's ``compute_score(data_source, solution_str, ground_truth, extra_info=None)``
  (any function with a ``solution_str`` parameter): once a response, ``data_source`` and
  ``extra_info`` from the row's columns of those names, ``solution_str`` the response,
  ``ground_truth`` the answer (the workload's ``answer_field``), other parameters the
  row's columns by name. It returns a number, or a dict with its ``score``.

A parameter without a default that is not one of those names must be a column of the
dataset (``rpeg check`` reads the dataset's first rows to say so). Checking runs none of
the user's code: the module's source (the file the spec found, ``rpeg.spec.paths``) is
parsed, and a name bound otherwise than by
``def`` or a lambda (imported, or the result of a call) is taken as it comes.
"""

from __future__ import annotations

import ast as pyast
from pathlib import Path

import attrs

from rpeg.errors import Span, SpecError
from rpeg.spec.training import RewardForm

BATCH_ARGS = ("prompts", "responses", "answers")
# verl's compute_score: what rpeg passes each parameter (the rest: columns by name)
PER_RESPONSE_ARGS = {"data_source": "the row's data_source column",
                     "solution_str": "the response", "ground_truth": "the answer",
                     "extra_info": "the row's extra_info column", "prompt": "the prompt"}
FORMS = ("f(prompts, responses, answers, **columns), once a batch; or verl's "
         "compute_score(data_source, solution_str, ground_truth, extra_info=None), once a "
         "response")


@attrs.frozen
class Signature:
    form: RewardForm = RewardForm.BATCH
    columns: tuple[str, ...] = ()       # parameters without a default that name columns


class BadSignature(SpecError):
    """A reward that cannot take what rpeg passes (the ``reward_signature`` rule's error)."""


def reward_signature(source: str, module: str, function: str, span: Span) -> Signature:
    """The reward's form, from the source of its module (the file ``rpeg.spec.paths.
    find_python`` found where the spec names it); BadSignature at ``span`` when it cannot
    take what rpeg passes."""
    try:
        tree = pyast.parse(Path(source).read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError):
        return Signature()               # find_python said why when the spec was loaded
    bound = _bindings(tree)
    node = bound.get(function)
    if node is None:
        return Signature()               # find_python said so when the spec was loaded
    ref = f"{module}:{function}"
    if isinstance(node, pyast.AsyncFunctionDef):
        raise BadSignature(f"reward {ref} must be a plain function, not async: rpeg calls it and "
                        "reads the numbers it returns", span, hint="define it with def")
    if isinstance(node, pyast.FunctionDef):
        args = node.args
    elif isinstance(node, pyast.Lambda):
        args = node.args
    elif isinstance(node, (pyast.Constant, pyast.List, pyast.Tuple, pyast.Dict, pyast.Set,
                           pyast.JoinedStr, pyast.ListComp, pyast.DictComp, pyast.SetComp)):
        raise BadSignature(f"reward {ref} must be a function, and '{function}' is bound to a "
                        f"{_kind(node)} ({source}:{node.lineno})", span,
                        hint=f"define def {function}(prompts, responses, answers): ...")
    else:
        return Signature()               # imported, or made by a call: known when it runs
    return form_of(args, ref, span)


def form_of(args: pyast.arguments, ref: str, span: Span | None = None) -> Signature:
    """How a function with ``args`` is called (see the module doc), or a SpecError."""
    positional = [a.arg for a in args.posonlyargs + args.args]
    defaults = len(args.defaults)
    required = positional[:len(positional) - defaults]
    kw_required = [a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True)
                   if d is None]
    names = positional + [a.arg for a in args.kwonlyargs]
    rest = (["*" + args.vararg.arg] if args.vararg else []) + \
        (["**" + args.kwarg.arg] if args.kwarg else [])
    takes = f"({', '.join(names + rest)})"
    if "solution_str" in names:
        if args.posonlyargs:
            raise BadSignature(f"reward {ref} must take its parameters by name (rpeg passes "
                            f"verl's by name), not positionally only: it takes {takes}", span,
                            hint="drop the '/' from its parameters")
        # data_source and extra_info are columns too: without a default, the rows need them
        columns = tuple(n for n in required + kw_required
                        if n not in ("solution_str", "ground_truth", "prompt"))
        return Signature(RewardForm.PER_RESPONSE, columns)
    if len(positional) < len(BATCH_ARGS) and args.vararg is None:
        raise BadSignature(f"reward {ref} must take what rpeg passes, {FORMS}; it takes {takes}",
                        span, hint=f"def {ref.split(':')[1]}(prompts, responses, answers=None, "
                                   "**columns)")
    extra = required[len(BATCH_ARGS):]
    only_positional = [a.arg for a in args.posonlyargs][len(BATCH_ARGS):]
    stuck = [n for n in extra if n in only_positional]
    if stuck:
        raise BadSignature(f"reward {ref} must take its fourth and later parameters by name (a "
                        f"column each), not positionally only: {', '.join(stuck)}", span)
    return Signature(RewardForm.BATCH, tuple(extra + kw_required))


def _kind(node) -> str:
    return {pyast.Constant: "constant", pyast.List: "list", pyast.Tuple: "tuple",
            pyast.Dict: "dict", pyast.Set: "set", pyast.JoinedStr: "string"}.get(
                type(node), "value")


def _bindings(tree: pyast.Module) -> dict[str, object]:
    """Top-level names: the def, the lambda or value assigned, an import (last one wins)."""
    out: dict[str, object] = {}
    for n in tree.body:
        if isinstance(n, (pyast.FunctionDef, pyast.AsyncFunctionDef, pyast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, pyast.Assign):
            for t in n.targets:
                if isinstance(t, pyast.Name):
                    out[t.id] = n.value
        elif isinstance(n, (pyast.ImportFrom, pyast.Import)):
            for a in n.names:
                out[a.asname or a.name.split(".")[0]] = n
    return out
