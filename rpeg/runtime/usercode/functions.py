"""The user's ``python("module:function")`` code, imported as the spec found it.

    >>> fn = python_function("rewards", "toy_reward", source="/exp/base/rewards.py",
    ...                      folder="/exp/base", what="reward 'toy'")       # doctest: +SKIP

Loading a spec finds the module without running it (``rpeg.spec.paths.find_python``):
next to the file that names it, else on the Python path, and records the module's file
(``source``) and that folder. Here, in the worker, the module is imported from the same
folder (put first on the Python path, so its own imports of modules beside it work) and
must be that same file: a module of the same name imported earlier from elsewhere (another
spec's ``rewards.py``) or found first on the path is not used -- the recorded file is then
loaded under a name of its own. What the spec was checked against is what runs, whatever
the current directory.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

from rpeg.errors import RuntimeFailure, Span

_LOADED: dict[tuple[str, str], object] = {}      # (source or module, module) -> module


def python_function(module: str, function: str, *, source: str = "", folder: str = "",
                    what: str = "python code", span: Span | None = None):
    """``module:function`` as the spec found it (``source``, from ``folder``), or a
    RuntimeFailure at ``span`` saying why it cannot be had."""
    key = (source or module, module)
    if key not in _LOADED:
        _LOADED[key] = _import(module, source, folder, what, span)
    fn = getattr(_LOADED[key], function, None)
    if fn is None or not callable(fn):
        raise RuntimeFailure(f"{what} must name a function, and {module}:{function} is not "
                             f"one (the module {_where(source, module)} has no such "
                             "callable)", span)
    return fn


def _import(module: str, source: str, folder: str, what: str, span: Span | None):
    if source and not os.path.isfile(source):
        raise RuntimeFailure(f"{what} names {module}, read from '{source}' when the spec was "
                             "loaded, and that file is not there now (moved or removed)", span,
                             hint=f"put the module back at {source}")
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    try:
        found = sys.modules.get(module) or importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 — the user's module: any exception is theirs to see
        if not source:
            raise RuntimeFailure(f"{what} must name a module that imports, and '{module}' "
                                 f"does not ({type(e).__name__}: {e})", span) from None
        found = None
    if not source or _same(getattr(found, "__file__", None), source):
        return found
    return _load_file(module, source, what, span)


def _load_file(module: str, source: str, what: str, span: Span | None):
    """The module at ``source`` under a name of its own (another module holds ``module``)."""
    name = f"_rpeg_user_{hashlib.sha256(source.encode()).hexdigest()[:12]}_{module}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, source)
    if spec is None or spec.loader is None:
        raise RuntimeFailure(f"{what}: '{source}' must be a Python module, and it is not",
                             span)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 — the user's module: any exception is theirs to see
        del sys.modules[name]
        raise RuntimeFailure(f"{what} must name a module that imports, and '{source}' does "
                             f"not ({type(e).__name__}: {e})", span) from None
    return mod


def _same(a: str | None, b: str) -> bool:
    if not a:
        return False
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.abspath(a) == os.path.abspath(b)


def _where(source: str, module: str) -> str:
    return f"'{source}'" if source else f"'{module}'"
