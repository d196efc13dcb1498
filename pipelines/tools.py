"""Tools the shipped pipelines name with ``tool NAME = python("tools:FUNCTION")``.

A tool takes the text of a call's argument and returns the observation's text. Each call
runs in rpeg's sandbox (a process of its own, with the declared limits); an exception, a
timeout or an oversized answer becomes an error observation for the policy.
"""

from __future__ import annotations

import ast
import hashlib
import json

_SALT = b"rpeg-lookup-table"          # the table is a hash the policy cannot reproduce
LETTERS = "abcdefghijklmnopqrstuvwxyz"


VALUES = "abcdefgh"


def lookup(key: str) -> str:
    """The value of a three-letter key in a table only this tool holds: a letter a to h."""
    key = key.strip()
    if len(key) != 3 or not all(c in LETTERS for c in key):
        raise KeyError(f"no key {key!r}: keys are three lowercase letters")
    digest = hashlib.sha256(_SALT + key.encode()).digest()
    return VALUES[digest[0] % len(VALUES)]


def calculator(expression: str) -> str:
    """The value of an arithmetic expression of numbers, + - * / and parentheses; given as
    text, or as the chat formats' arguments object ``{"expression": "12*7"}``."""
    try:
        args = json.loads(expression)
        if isinstance(args, dict):
            expression = str(next(iter(args.values()), ""))
    except ValueError:
        pass
    tree = ast.parse(expression.strip(), mode="eval")
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(round(value, 6) if isinstance(value, float) else value)


_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def _value(node):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _value(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    raise ValueError("not an arithmetic expression: only numbers, + - * / and parentheses")


def run_python(code: str) -> str:
    """Run a snippet of Python and return what it printed (code execution for a policy that
    writes programs). A call's arguments may come as JSON ({"code": "..."}, the chat
    formats' arguments object). Runs inside rpeg's sandbox: its limits bound it."""
    import contextlib
    import io
    import json
    try:
        args = json.loads(code)
        if isinstance(args, dict) and isinstance(args.get("code"), str):
            code = args["code"]
    except ValueError:
        pass
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<tool call>", "exec"), {"__name__": "__tool__"})
    return out.getvalue()
