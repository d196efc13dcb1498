"""Each backend implements the contracts of ``backends.api``: the torch backend's op runner
is an ``Executor``, vLLM's engine copy an ``EngineCopy``, both engines ``GenerationEngine``s.

The check reads the classes, without building them (no model, no vLLM): every member of
the protocol is there, a method with the protocol's parameters in its order (more only
with defaults), a data member set on the class or in ``__init__``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest

from backends import api, load
from backends.torch_backend.generation import TorchEngine
from backends.vllm_backend.disaggregated import EngineReplica
from backends.vllm_backend.engine import VllmEngine


def _protocol_members(proto) -> tuple[dict[str, object], set[str]]:
    """The methods and the data members a protocol declares."""
    methods = {k: v for k, v in vars(proto).items()
               if inspect.isfunction(v) and not k.startswith("_")}
    return methods, set(vars(proto).get("__annotations__", {}))


def _set_in_init(cls) -> set[str]:
    """Attributes ``__init__`` of ``cls`` assigns on ``self``."""
    init = vars(cls).get("__init__")
    if init is None:
        return set()
    tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in ast.walk(t) if isinstance(t, ast.Attribute)
            and isinstance(t.value, ast.Name) and t.value.id == "self"}


def mismatches(cls, proto) -> list[str]:
    """How ``cls`` falls short of ``proto`` (empty: it implements it)."""
    methods, data = _protocol_members(proto)
    out = []
    for name, want in methods.items():
        have = getattr(cls, name, None)
        if not inspect.isfunction(have) or have is want:
            out.append(f"{name}: missing")
            continue
        want_params = list(inspect.signature(want).parameters.values())
        have_params = list(inspect.signature(have).parameters.values())
        names = [p.name for p in have_params[:len(want_params)]]
        if names != [p.name for p in want_params]:
            out.append(f"{name}{inspect.signature(have)}: must take "
                       f"{inspect.signature(want)}")
        elif any(p.default is inspect.Parameter.empty and p.kind not in
                 (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                 for p in have_params[len(want_params):]):
            out.append(f"{name}{inspect.signature(have)}: its extra parameters need defaults")
    for name in sorted(data - set(dir(cls)) - _set_in_init(cls)):
        out.append(f"{name}: never set")
    return out


@pytest.mark.parametrize(("cls", "proto"), [
    (load("torch", "executor"), api.Executor),
    (EngineReplica, api.EngineCopy),
    (TorchEngine, api.GenerationEngine),
    (VllmEngine, api.GenerationEngine),
], ids=["torch-executor", "vllm-engine-copy", "torch-engine", "vllm-engine"])
def test_each_backend_implements_its_contract(cls, proto):
    assert mismatches(cls, proto) == []


def test_a_replica_of_the_torch_backend_is_no_engine_copy():
    """The executor tells its torch replicas from engine copies by the protocol."""
    from backends.torch_backend.executor import Replica
    assert mismatches(Replica, api.EngineCopy) != []


def test_a_class_that_falls_short_is_named_with_what_it_lacks():
    class Short:
        def __init__(self):
            self.other = {}

        def run(self, call):                           # inputs missing
            return {}, {}

        def evaluate(self, model, step, extra):        # extra without a default
            return {}

        def carries(self, model, step=0):              # an extra with a default is fine
            return False

        def checkpoint(self, model, path, meta):
            return path

        def shutdown(self):
            pass
    assert mismatches(Short, api.Executor) == [
        "run(self, call): must take (self, call, inputs: 'dict[str, list]') -> 'tuple[dict, dict]'",
        "evaluate(self, model, step, extra): its extra parameters need defaults",
        "restore: missing", "replicas: never set"]
