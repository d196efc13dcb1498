"""The layers import only leftward: spec -> graph -> cost -> plan -> runtime -> backends.

Every import statement in rpeg/ and backends/ is read with ``ast`` (those inside functions too: a lazy
import is still a dependency). A layer may import its own package and those to its left,
never one to its right, and the compile path (spec, graph, cost, plan) never imports a
backend: of ``backends`` it reads only the registry (the package ``backends`` itself, which
imports no backend until asked) for each backend's declared ``capabilities``, data modules
that import nothing but the compile path's values.

The backends lie right of every layer, so they may import any of rpeg's layers, by public
names only: no private name of rpeg (``_x``) is imported or read off a module of rpeg
(``worker._STATE``), and no backend imports the command line (``rpeg.cli``, ``rpeg.__main__``).
Inside rpeg's layers and inside backends/ no module imports itself through others.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RPEG = Path(__file__).resolve().parents[1] / "rpeg"
BACKENDS = RPEG.parent / "backends"
LAYERS = ("spec", "graph", "cost", "plan", "runtime")
COMPILE_PATH = LAYERS[:4]
# The runtime reaches backends only through their registry (``backends.load``).
REGISTRY = "backends"


def imports(source: str, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in ``source`` (a module of ``package``), relative
    imports resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base))
            # ``from backends import torch_backend`` imports a backend, not the registry
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names
                    if base == REGISTRY and _is_module(f"{base}.{a.name}")]
    return sorted(out)


def _is_module(name: str) -> bool:
    path = RPEG.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def rightward(layer: str, module: str) -> bool:
    """Whether ``module`` lies to the right of ``layer`` (the registry of backends lies to
    the right of the runtime only)."""
    parts = module.split(".")
    if parts[0] == "backends":
        return module != REGISTRY or layer == "runtime"
    if parts[0] != "rpeg" or len(parts) < 2 or parts[1] not in LAYERS:
        return False
    return LAYERS.index(parts[1]) > LAYERS.index(layer)


def rightward_imports(layer: str) -> list[tuple[str, int, str]]:
    out = []
    for path in sorted((RPEG / layer).rglob("*.py")):
        name = path.relative_to(RPEG.parent)
        package = ".".join(name.with_suffix("").parts[:-1])
        out += [(name.as_posix(), line, module)
                for line, module in imports(path.read_text(encoding="utf-8"), package)
                if rightward(layer, module)]
    return out


@pytest.mark.parametrize("layer", COMPILE_PATH)
def test_the_compile_path_imports_only_leftward_and_no_backend(layer):
    assert rightward_imports(layer) == []


def test_the_compile_path_reads_the_backends_registry_only_for_capabilities():
    """Where the compile path imports the registry, and what the registry's
    ``capabilities`` entries are: modules importing only the compile path's values."""
    users = set()
    for layer in COMPILE_PATH:
        for path in sorted((RPEG / layer).rglob("*.py")):
            package = ".".join(path.relative_to(RPEG.parent).with_suffix("").parts[:-1])
            if any(m == REGISTRY for _, m in imports(path.read_text(encoding="utf-8"),
                                                    package)):
                users.add(path.relative_to(RPEG).as_posix())
    assert users == {"plan/capabilities.py"}
    import backends
    for name in backends.NAMES:
        module = backends._REGISTRY[name]["capabilities"].split(":")[0]
        path = RPEG.parent.joinpath(*module.split(".")).with_suffix(".py")
        found = {m for _, m in imports(path.read_text(encoding="utf-8"), module)}
        assert {m for m in found if m != "__future__" and not any(
            m.startswith(f"rpeg.{layer}") for layer in COMPILE_PATH)} == set(), (name, found)


def test_the_runtime_reaches_backends_only_through_their_registry():
    found = {(path, module) for path, _, module in rightward_imports("runtime")}
    assert found and {module for _, module in found} == {REGISTRY}, sorted(found)


def test_the_command_line_reaches_backends_only_through_their_registry():
    found = []
    for path in sorted((RPEG / "cli").rglob("*.py")):
        package = ".".join(path.relative_to(RPEG.parent).with_suffix("").parts[:-1])
        found += [(path.name, line, m) for line, m in imports(path.read_text(encoding="utf-8"),
                                                              package)
                  if m.split(".")[0] == REGISTRY and m != REGISTRY]
    assert found == []


def test_a_rightward_import_is_seen_even_inside_a_function():
    source = "def f():\n    from backends import vllm_backend\nfrom ..plan import space\n"
    (_, registry), (_, lazy), (_, relative) = imports(source, "rpeg.cost")
    assert (registry, lazy, relative) == ("backends", "backends.vllm_backend", "rpeg.plan")
    assert rightward("cost", lazy) and rightward("cost", relative)
    assert rightward("plan", "backends.torch_backend.capabilities")
    assert not rightward("plan", "backends") and rightward("runtime", "backends.api")
    assert not rightward("plan", "rpeg.cost.memory") and not rightward("spec", "rpeg.errors")


def _module_imports(folder: Path, top: str = "rpeg") -> dict[str, set[str]]:
    """Module of ``folder`` -> the modules of package ``top`` it imports (lazily too);
    ``from rpeg.x import y`` names the module ``rpeg.x.y`` when that is a module."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        name = ".".join(path.relative_to(RPEG.parent).with_suffix("").parts)
        package = name.rsplit(".", 1)[0]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                (_, base), = imports(ast.unparse(node), package)[:1] or [(0, "")]
                found.add(base)
                found.update(f"{base}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                found.update(a.name for a in node.names)
        out[name] = {m for m in found if m.startswith(f"{top}.")}
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every import cycle among the graph's modules (one per set of modules)."""
    found, seen = [], set()

    def walk(node, path):
        for nxt in sorted(graph.get(node, ())):
            if nxt == path[0]:
                key = frozenset(path)
                if key not in seen:
                    seen.add(key)
                    found.append(path + [nxt])
            elif nxt in graph and nxt not in path and nxt > path[0]:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return found


@pytest.mark.parametrize("layer", LAYERS)
def test_no_module_imports_itself_through_others(layer):
    """No import cycle inside a layer, lazy imports included (the runtime's driver and
    recovery, and recovery and resume, imported each other)."""
    assert _cycles(_module_imports(RPEG / layer)) == []


def test_no_backend_module_imports_itself_through_others():
    """No import cycle inside backends/, lazy imports included (the carried rollouts and
    the torch engine, the executor and the eval, LoRA and the model builder, the
    measurements and the layouts' measurements, the optimizer and the sharding did)."""
    assert _cycles(_module_imports(BACKENDS, "backends")) == []


# What the scheduling core must not reach, even through others: Dask, the runtime's adapters
# (the Dask one, the run directory's files, user code, calibration) and the backends.
ADAPTERS = ("dask", "distributed", "torch", "vllm", "backends", "rpeg.runtime.dask",
            "rpeg.runtime.rundir", "rpeg.runtime.usercode", "rpeg.runtime.calibrate")


def test_the_scheduling_core_imports_no_dask_and_no_adapter_even_through_others():
    """Every decision of a run (what to submit, when a segment ends, what is stuck or lost,
    what a cut keeps) is made in ``rpeg.runtime.core`` and tested without Dask: its modules,
    imported in a fresh interpreter, load none of ``ADAPTERS`` (lazy imports are read too)."""
    import subprocess
    import sys
    core = sorted(f"rpeg.runtime.core.{p.stem}" for p in (RPEG / "runtime" / "core").glob("*.py")
                  if p.stem != "__init__")
    lazy = [(path.name, line, m) for path in sorted((RPEG / "runtime" / "core").glob("*.py"))
            for line, m in imports(path.read_text(encoding="utf-8"), "rpeg.runtime.core")
            if m.split(".")[0] in ADAPTERS[:4] or m.startswith(ADAPTERS[4:])]
    assert lazy == []
    code = (f"import sys\nfor m in {core!r}: __import__(m)\n"
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {ADAPTERS[:4]!r}"
            f" or m.startswith({ADAPTERS[4:]!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=RPEG.parent).stdout.strip()
    assert len(core) >= 6 and out == "[]", out


def private_uses(source: str, package: str) -> list[tuple[int, str]]:
    """(line, what) of each private name of rpeg ``source`` imports or reads off a module
    of rpeg, and each import of rpeg's command line."""
    tree = ast.parse(source)
    out, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            (_, base), = imports(ast.unparse(node), package)[:1] or [(0, "")]
            if base.split(".")[0] != "rpeg":
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [f"{base}.{a.name}" for a in node.names]
            for alias, full in zip(node.names, names, strict=True):
                parts = full.split(".")
                if parts[1:2] in (["cli"], ["__main__"]) or any(
                        x.startswith("_") and not x.startswith("__") for x in parts):
                    out.append((node.lineno, full))
                modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in modules and node.attr.startswith("_") \
                and not node.attr.startswith("__"):
            out.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return sorted(out)


def test_the_backends_use_rpeg_by_public_names_only():
    found = []
    for path in sorted(BACKENDS.rglob("*.py")):
        name = path.relative_to(RPEG.parent)
        package = ".".join(name.with_suffix("").parts[:-1])
        found += [(name.as_posix(), line, what) for line, what in
                  private_uses(path.read_text(encoding="utf-8"), package)]
    assert found == []


def test_the_runtime_modules_use_one_another_by_public_names_only():
    """No module of ``rpeg/runtime`` imports a private name of another module or reads one
    off it (``worker._STATE``): what one job's module needs of another's is public."""
    found = []
    for path in sorted((RPEG / "runtime").rglob("*.py")):
        name = path.relative_to(RPEG.parent)
        package = ".".join(name.with_suffix("").parts[:-1])
        found += [(name.as_posix(), line, what) for line, what in
                  private_uses(path.read_text(encoding="utf-8"), package)]
    assert found == []


def test_a_private_use_of_rpeg_is_seen():
    source = ("from rpeg.runtime import worker as W\nfrom rpeg.cost import _x\n"
              "import rpeg.cli.run\nfrom backends import _y\n"
              "def f():\n    return W._STATE, W.setup\n")
    assert private_uses(source, "backends.torch_backend") == [
        (2, "rpeg.cost._x"), (3, "rpeg.cli.run"), (6, "W._STATE")]


def test_an_import_cycle_is_seen():
    graph = {"rpeg.a": {"rpeg.b"}, "rpeg.b": {"rpeg.c"}, "rpeg.c": {"rpeg.a"}, "rpeg.d": set()}
    assert _cycles(graph) == [["rpeg.a", "rpeg.b", "rpeg.c", "rpeg.a"]]
