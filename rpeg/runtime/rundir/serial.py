"""Frozen rpeg values to JSON and back, for the run directory (plan, resolved pipeline).

    >>> from rpeg.spec.model import LengthDist
    >>> text = dumps(LengthDist.fixed(8))
    >>> loads(text) == LengthDist.fixed(8)
    True

attrs classes are written with their type (``"__type__": "rpeg.spec.model:LengthDist"``),
enums with theirs, tuples as lists; reading rebuilds only classes from rpeg's own
modules. A ``Plan`` uses ``Plan.to_json`` / ``Plan.from_json`` when the plan
layer provides them.
"""

from __future__ import annotations

import enum
import importlib
import json

import attrs

from rpeg.errors import RuntimeFailure

_ALLOWED = ("rpeg.",)


def to_data(value):
    if attrs.has(type(value)):
        out = {"__type__": f"{type(value).__module__}:{type(value).__qualname__}"}
        for f in attrs.fields(type(value)):
            out[f.name] = to_data(getattr(value, f.name))
        return out
    if isinstance(value, enum.Enum):
        return {"__enum__": f"{type(value).__module__}:{type(value).__qualname__}",
                "value": value.value}
    if isinstance(value, (tuple, list)):
        return [to_data(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_data(v) for k, v in value.items()}
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()                    # numpy scalars
    return value


def from_data(data):
    if isinstance(data, list):
        return tuple(from_data(v) for v in data)
    if isinstance(data, dict):
        if "__type__" in data:
            cls = _class(data["__type__"])
            fields = {f.name for f in attrs.fields(cls)}
            values = {k: from_data(v) for k, v in data.items() if k in fields}
            # a profile written when its measured terms were (key, value) pairs: the fields
            old = data.get("extra") if "extra" not in fields else None
            for pair in old if isinstance(old, list) else ():
                if isinstance(pair, list) and len(pair) == 2 and pair[0] in fields:
                    values.setdefault(pair[0], from_data(pair[1]))
            return cls(**values)
        if "__enum__" in data:
            return _class(data["__enum__"])(data["value"])
        return {k: from_data(v) for k, v in data.items()}
    return data


def dumps(value) -> str:
    return json.dumps(to_data(value), indent=1, sort_keys=False)


def loads(text: str):
    return from_data(json.loads(text))


def plan_to_json(plan) -> str:
    if hasattr(plan, "to_json"):
        return plan.to_json()
    return dumps(plan)


def plan_from_json(text: str):
    from rpeg.plan.model import Plan
    data = json.loads(text)
    if isinstance(data, dict) and "__type__" not in data and hasattr(Plan, "from_json"):
        return Plan.from_json(text)
    plan = from_data(data)
    if not isinstance(plan, Plan):
        raise RuntimeFailure(f"plan.json must hold a plan, not {type(plan).__name__}")
    return plan


def _class(path: str):
    module, _, name = path.partition(":")
    if not module.startswith(_ALLOWED):
        raise RuntimeFailure(f"a run file may only name rpeg types, not {path!r}")
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj
