"""Every path a spec names, resolved once, against the folder of the file that wrote it.

    >>> ref = FileRef.written("data/toy.jsonl", Span("/exp/base/tiny.rpeg", 11, 18))
    >>> ref.path, str(ref)
    ('/exp/base/data/toy.jsonl', 'data/toy.jsonl')
    >>> FileRef.written("/srv/data/a.jsonl", Span("/exp/base/tiny.rpeg", 11, 18)).path
    '/srv/data/a.jsonl'
    >>> written_folder(Span("command line", 1, 20)) == Path.cwd()
    True

A dataset, an eval dataset, a ``python("module:function")`` module, an ``hf(...)`` folder,
a ``weights`` folder, a histogram file, a cluster's profile file and an ``extend`` target
are each relative to the folder of the file whose text names them -- a base file's paths
to the base file's folder, whichever file extends it and wherever the command runs -- and
an override typed on the command line to the current directory, like any path typed in a
shell. A leading ``~`` is the user's home. The rule runs once, when the spec is loaded:
the value carries the absolute path (a :class:`FileRef`, a reward's ``source`` and
``folder``, a model's ``weights``), the run records it in ``pipeline.json``, and the
checker, the compiler and the runtime read that path and never resolve the text again.

Symbolic links are kept as written (the folder of a linked spec is the folder the link
is in), as the shell and ``extend`` see them.
"""

from __future__ import annotations

import ast as pyast
import importlib.machinery
import os
import stat
import sys
from pathlib import Path

import attrs

from rpeg.errors import NOWHERE, Span, SpecError, did_you_mean

MAX_MODULE_BYTES = 16 << 20        # a python("module:function") module's source, read to check it


def written_folder(span: Span) -> Path:
    """The folder a path written at ``span`` is relative to: its file's folder (the current
    directory for text typed on the command line, which names no file)."""
    return Path(os.path.abspath(span.path)).parent


def resolve_written(text: str, span: Span) -> Path:
    """``text``, a path written at ``span``, as an absolute path (``~`` expanded, ``..``
    folded)."""
    return Path(os.path.normpath(written_folder(span) / Path(text).expanduser()))


@attrs.frozen
class FileRef:
    """A file or folder a spec names: the text as written, its absolute path, and where it
    was written. Equal when the paths are (one file named two ways is one file)."""

    text: str = attrs.field(eq=False)
    path: str
    span: Span = attrs.field(default=NOWHERE, eq=False)

    @classmethod
    def written(cls, text: str, span: Span) -> FileRef:
        return cls(text, str(resolve_written(text, span)), span)

    def __str__(self) -> str:
        return self.text

    def __fspath__(self) -> str:
        return self.path

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def described(self) -> str:
        """``'data/toy.jsonl' (/exp/data/toy.jsonl)``: as written and where it is."""
        return f"'{self.text}'" if self.text == self.path else f"'{self.text}' ({self.path})"


# --- python("module:function") ------------------------------------------------------------------

@attrs.frozen
class PythonSource:
    """Where a ``python("module:function")`` reference was found when the spec was loaded:
    ``source``, the module's file, and ``folder``, the folder of the file naming it (the
    module is imported from there first, then from the Python path)."""

    source: str
    folder: str


def find_python(module: str, function: str, span: Span, what: str = "reward"
                ) -> PythonSource:
    """Find ``module`` (next to the file that names it first, then on ``sys.path``) and
    ``function`` in it, by reading its source: loading a spec runs none of the user's code.
    SpecError at ``span`` when either is missing."""
    folder = written_folder(span)
    stem = module.replace(".", "/")
    candidates = [folder / (stem + ".py"), folder / stem / "__init__.py"]
    source = next((p for p in candidates if p.is_file()), None)
    if source is None:
        found = _find_module(module)
        if found is None or not found.origin or not found.origin.endswith(".py"):
            raise SpecError(f"{what} module '{module}' not found", span,
                            hint=f"put {stem}.py next to the file that names it ({folder}) "
                                 "or on the Python path")
        source = Path(found.origin)
    try:
        st = source.stat()
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MODULE_BYTES:
            raise SpecError(f"{what} module '{module}' ({_shown(source)}) must be a regular file of "
                            f"at most {MAX_MODULE_BYTES:,} bytes", span)
        tree = pyast.parse(source.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError, OSError, ValueError, RecursionError) as e:
        raise SpecError(f"{what} module '{module}' ({_shown(source)}) cannot be read: {e}",
                        span) from None
    names = {n.name for n in tree.body if isinstance(n, (pyast.FunctionDef,
                                                         pyast.AsyncFunctionDef))}
    names |= {t.id for n in tree.body if isinstance(n, pyast.Assign) for t in n.targets
              if isinstance(t, pyast.Name)}
    names |= {a.asname or a.name for n in tree.body if isinstance(n, pyast.ImportFrom)
              for a in n.names}
    if what != "reward":         # a tool may name a class (an environment's, or by mistake)
        names |= {n.name for n in tree.body if isinstance(n, pyast.ClassDef)}
    if function not in names:
        kind = "class" if what == "environment" else "function"
        raise SpecError(f"module '{module}' ({_shown(source)}) has no {kind} '{function}'",
                        span, hint=did_you_mean(function, sorted(names)))
    return PythonSource(os.path.abspath(source), str(folder))


def _shown(path: Path) -> str:
    """A path as a message shows it: relative to the working folder when it lies inside it
    (what the user typed), else whole."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _find_module(module: str):
    """The spec of ``a.b.c`` found along sys.path without importing anything: importlib's
    find_spec would import (run) the parent packages ``a`` and ``a.b``."""
    if module in sys.builtin_module_names:
        return None
    found = None
    path = None
    for part in module.split("."):
        try:
            found = importlib.machinery.PathFinder.find_spec(part, path)
        except (ImportError, ValueError):
            return None
        if found is None:
            return None
        path = found.submodule_search_locations
    return found
