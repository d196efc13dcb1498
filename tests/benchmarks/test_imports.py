"""Benchmark scripts cannot rot silently: every name a script in benchmarks/ imports from
rpeg, backends or benchmarks -- at the top or inside a function, where most of them import
what they measure -- is still defined there (read from the source, so a script for the
vLLM venv is checked here too, without importing vLLM, torch or the script)."""

from __future__ import annotations

import ast
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT))                   # benchmarks/ is not a package of rpeg

OURS = ("rpeg", "backends", "benchmarks")
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


def module_file(name: str) -> Path | None:
    """The source of module ``name`` of this repository (a package's __init__.py, or the
    folder of a package without one: benchmarks/)."""
    base = ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return base if base.is_dir() else None


def _parse(path: Path) -> ast.Module:
    with warnings.catch_warnings():         # a script's own invalid escapes are not ours
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.parse(path.read_text(encoding="utf-8"))


def defined(path: Path) -> set[str] | None:
    """The names a module binds at its top level (in ifs and trys too), and those its
    ``__all__`` lists where a module ``__getattr__`` imports them on first use; None when
    it answers any name (such a ``__getattr__`` without a literal ``__all__``, ``import *``)."""
    if path.is_dir():
        return set()                        # a folder without __init__: its modules alone
    names: set[str] = set()
    lazy = False                            # a module __getattr__: it answers its __all__
    exported: set[str] | None = None
    body = list(_parse(path).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == "__getattr__":
                lazy = True
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            if (any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets)
                    and isinstance(node.value, (ast.List, ast.Tuple))):
                exported = {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(s for h in getattr(node, "handlers", []) for s in h.body)]
    if lazy:
        return names | exported if exported is not None else None
    return names


def missing_imports(path: Path) -> list[str]:
    """``line: what`` for each import of ours in ``path`` that names nothing."""
    out = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            wanted = [(node.module, a.name) for a in node.names]
        else:
            continue
        for module, name in wanted:
            if module.split(".")[0] not in OURS:
                continue
            source = module_file(module)
            if source is None:
                out.append(f"{node.lineno}: no module {module}")
            elif name is not None and module_file(f"{module}.{name}") is None:
                names = defined(source)
                if names is not None and name not in names:
                    out.append(f"{node.lineno}: {module} has no {name}")
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_every_name_a_benchmark_imports_exists(script):
    assert missing_imports(script) == []


def test_the_check_finds_a_name_that_is_gone(tmp_path):
    script = tmp_path / "gone.py"
    script.write_text("def f():\n"
                      "    from backends.torch_backend.executor import Executor, _export\n"
                      "    from rpeg.no_such_module import x\n"
                      "    from rpeg.plan import search\n")
    assert missing_imports(script) == ["2: backends.torch_backend.executor has no _export",
                                       "3: no module rpeg.no_such_module"]


def test_the_old_weight_path_round_trips_a_model():
    """generation_engines' numpy buckets through Dask (the weight sync it measures against
    the collectives): a model's weights exported in buckets and loaded into another."""
    import torch

    from benchmarks.generation_engines import export_buckets, load_buckets
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    b = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    buckets = export_buckets(a, bucket_bytes=300)       # 512 bytes, then 64 + 256, then 16
    assert [names for names, _, _ in buckets] == [("0.weight",), ("0.bias", "1.weight"),
                                                  ("1.bias",)]
    assert all(flat.dtype == np.float32 for _, _, flat in buckets)
    load_buckets(b, buckets)
    for (k, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(x, y), k
