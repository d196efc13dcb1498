"""Where a command writes: an output path checked before any work, and written without a
traceback.

    >>> writable(Path("plan.json"), "-o")                   # doctest: +SKIP
    PosixPath('plan.json')
    >>> writable(Path("."), "-o")                           # doctest: +SKIP
    Traceback (most recent call last):
    rpeg.errors.RpegError: error: -o must name a file to write, not the directory '.'

An output that cannot be written (a directory, a folder that does not exist or is not
writable) is the user's input, so it is an error with exit status 1, said before a
search or a measurement spends minutes; a write that fails anyway (a full disk) is
reported the same way by :func:`writing`. A suffix the command cannot write (``-o
graph.txt``) is a usage error (exit 2): :func:`suffix`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import typer

from rpeg.errors import RpegError


def writable(path: Path | None, option: str) -> Path | None:
    """``path`` if a file can be written there; RpegError (exit 1) saying why not."""
    if path is None:
        return None
    if path.is_dir():
        raise RpegError(f"{option} must name a file to write, not the directory '{path}'",
                        hint=f"e.g. {option} {path / 'NAME'}")
    parent = path.parent
    if not parent.is_dir():
        raise RpegError(f"{option} must name a file in an existing directory, not '{path}' "
                        f"('{parent}' does not exist)", hint=f"create it first: mkdir -p {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists()
                                                    and not os.access(path, os.W_OK)):
        raise RpegError(f"{option} must name a file this user can write, not '{path}' "
                        f"(permission denied)", hint="choose another place")
    return path


@contextlib.contextmanager
def writing(path: Path, what: str) -> Iterator[None]:
    """Turn an OSError while writing ``path`` into an RpegError naming it (exit 1)."""
    try:
        yield
    except OSError as e:
        raise RpegError(f"{what} '{path}' must be written, and writing it failed: "
                        f"{e.strerror or e}") from None


def suffix(path: Path | None, option: str, allowed: tuple[str, ...]) -> Path | None:
    """``path`` if it ends in one of ``allowed``; a usage error (exit 2) if not."""
    if path is not None and path.suffix.lower() not in allowed:
        raise typer.BadParameter(f"must end in {', '.join(allowed)}, not "
                                 f"'{path.suffix or path.name}'", param_hint=option)
    return path

