"""The torch backend's implementations of the registry's functions, found by name.

    >>> impl = implementation("group_norm")
    >>> impl.__module__
    'backends.torch_backend.advantages'

Each module of this backend marks what it implements with ``@implements(NAME)``;
``rpeg.spec.functions`` holds the one list of names, and a test checks the two
agree both ways (every entry has an implementation here, every implementation an
entry). The executor calls an estimator, a loss, a reward kind or an optimizer only
through :func:`implementation`, never by comparing names.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

_IMPLEMENTATIONS: dict[str, Callable] = {}
_MODULES = ("advantages", "losses", "rewards", "optim", "executor")


def implements(name: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as this backend's implementation of ``name``."""
    def register(fn: Callable) -> Callable:
        if name in _IMPLEMENTATIONS and _IMPLEMENTATIONS[name] is not fn:
            raise ValueError(f"{name!r} is implemented twice")
        _IMPLEMENTATIONS[name] = fn
        return fn
    return register


def implementations() -> dict[str, Callable]:
    """Every implementation, by registry name (importing the modules that hold them)."""
    for module in _MODULES:
        importlib.import_module(f"backends.torch_backend.{module}")
    return dict(_IMPLEMENTATIONS)


def implementation(name: str) -> Callable:
    found = _IMPLEMENTATIONS.get(name) or implementations().get(name)
    if found is None:
        from rpeg.errors import BackendError
        raise BackendError(f"the torch backend must implement '{name}', and it does not")
    return found
