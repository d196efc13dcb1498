"""Where a command writes: an output path checked before any work, and written without a
traceback.

    >>> writable(Path("plan.json"), "-o")                   # doctest: +SKIP
    PosixPath('plan.json')
    >>> writable(Path("."), "-o")                           # doctest: +SKIP
    Traceback (most recent call last):
    rpeg.errors.RpegError: error: -o must name a file to write, not the directory '.'

An output that cannot be written (a directory, a folder that does not exist or is not
writable, a place inside a run directory) is the user's input, so it is an error with
exit status 1, said before a search or a measurement spends minutes; a write goes through
a temporary sibling renamed into place when complete (:func:`writing`), and one that fails
anyway (a full disk) is reported the same way and leaves nothing behind. A suffix the
command cannot write (``-o graph.txt``) is a usage error (exit 2): :func:`suffix`.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rpeg.destinations import check_file_destination, written


def writable(path: Path | None, option: str, reads: tuple[Path, ...] = ()) -> Path | None:
    """``path`` if a file can be written there (``rpeg.destinations``: not a directory, in
    one that exists and this user can write, outside every run directory and around none of
    ``reads``); RpegError (exit 1) saying why not."""
    if path is None:
        return None
    return check_file_destination(path, option, reads)


def writing(path: Path, what: str):
    """Write ``path`` through a temporary sibling (``with writing(p, "the plan") as tmp``):
    renamed into place when complete, removed on failure; an OSError is an RpegError naming
    ``path`` (exit 1)."""
    return written(path, what)


def suffix(path: Path | None, option: str, allowed: tuple[str, ...]) -> Path | None:
    """``path`` if it ends in one of ``allowed``; a usage error (exit 2) if not (a directory
    is left to :func:`writable`, which says it is one)."""
    if path is not None and not path.is_dir() and path.suffix.lower() not in allowed:
        raise typer.BadParameter(f"must end in {', '.join(allowed)}, not "
                                 f"'{path.suffix or path.name}'", param_hint=option)
    return path

