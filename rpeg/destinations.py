"""Where a command may write: never into a run directory, never over what it reads, never
half a file.

    >>> check_file_destination(Path("runs/x/plan.json"), "-o")              # doctest: +SKIP
    Traceback (most recent call last):
    rpeg.errors.RpegError: error: -o must not name a place inside a run directory ...
    >>> with written(Path("plan.json"), "the plan") as tmp:                  # doctest: +SKIP
    ...     plan.save(tmp)                                                   # renamed on success

A run directory holds what ``rpeg run`` wrote (``run.json`` beside its ``pipeline.json`` or
``plan.json``); only the run writes into it (``rpeg show --plots`` into its ``plots/``). Every
other output (``export -o``, ``compile -o``, ``graph -o``, ``simulate -o``, pictures beside a
plan) is refused before any work when it is a run directory, lies inside one, holds the
run directory the command reads, or is of the wrong kind (a folder where a file is
written, a file where a folder is). What is written goes to a temporary sibling first and is
renamed into place only when complete: a failure removes it and leaves the destination as
it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from rpeg.errors import RpegError, Span

EXPORT_MARK = "rpeg_export.json"          # what an export folder holds (rpeg export)


def is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` holds a run's record (run.json, and its pipeline or plan)."""
    return (os.path.isfile(folder / "run.json")
            and (os.path.lexists(folder / "pipeline.json") or os.path.lexists(folder / "plan.json")))


def run_dir_around(path: Path) -> Path | None:
    """The run directory ``path`` is, or lies inside, as written or with its links
    followed (a link into a run directory leads inside it); None when there is none."""
    written = Path(os.path.abspath(path))
    for here in dict.fromkeys((written, Path(os.path.realpath(path)))):
        for folder in (here, *here.parents):
            if folder.is_dir() and is_run_dir(folder):
                return folder
    return None


def _refuse(option: str, path: Path, problem: str, hint: str) -> RpegError:
    return RpegError(f"{option} must not name {problem}", Span(str(path), 0, 0), hint=hint)


def check_outside_runs(path: Path, option: str, reads: tuple[Path, ...] = ()) -> None:
    """RpegError when writing ``path`` would write into a run directory, or over (or
    around) a run directory the command reads."""
    run = run_dir_around(path)
    if run is not None:
        where = "a run directory" if Path(os.path.abspath(path)) == run else \
            f"a place inside the run directory '{run}'"
        raise _refuse(option, path, f"{where}, and '{path}' is that",
                      "a run directory holds what its run wrote; write elsewhere")
    check_not_around(path, option, reads)


def check_not_around(path: Path, option: str, reads: tuple[Path, ...]) -> None:
    """RpegError when ``path`` is, or holds, a file or folder of ``reads`` (what the
    command reads)."""
    here = Path(os.path.abspath(path))
    for read in reads:
        read = Path(os.path.abspath(read))
        if here == read:
            raise _refuse(option, path, f"'{path}', a file this command reads: writing "
                          "there would replace it", "write elsewhere")
        if here in read.parents:
            raise _refuse(option, path, f"a folder holding '{read}', which this command "
                          f"reads, and '{path}' does", "write elsewhere")


def check_file_destination(path: Path, option: str, reads: tuple[Path, ...] = ()) -> Path:
    """``path`` if a file may be written there: not a folder, in a folder that exists and
    this user may write, outside every run directory."""
    if path.is_dir():
        raise RpegError(f"{option} must name a file to write, not the directory '{path}'",
                             hint=f"e.g. {option} {path / 'NAME'}")
    parent = path.parent
    if not parent.is_dir():
        raise RpegError(f"{option} must name a file in an existing directory, not "
                             f"'{path}' ('{parent}' does not exist)",
                             hint=f"create it first: mkdir -p {parent}")
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists()
                                                    and not os.access(path, os.W_OK)):
        raise RpegError(f"{option} must name a file this user can write, not '{path}' "
                             f"(permission denied)", hint="choose another place")
    check_outside_runs(path, option, reads)
    return path


def check_folder_destination(path: Path, option: str, reads: tuple[Path, ...] = (),
                             mark: str = EXPORT_MARK) -> Path:
    """``path`` if a folder may be written (or replaced) there: not a file, outside every
    run directory and around none it reads, and new, empty or an earlier output of the
    same kind (holding ``mark``) -- anything else there would be lost."""
    if os.path.lexists(path) and not path.is_dir():
        raise RpegError(f"{option} must name a folder to write, not the file '{path}'",
                             Span(str(path), 0, 0), hint=f"e.g. {option} {path}.d")
    check_outside_runs(path, option, reads)
    if path.is_dir() and any(path.iterdir()) and not (path / mark).is_file():
        raise RpegError(f"{option} must name a new or empty folder, or an earlier "
                             f"export, not '{path}', which holds other files", Span(str(path), 0, 0),
                             hint="rpeg replaces only what it wrote; choose a new folder")
    added = _added(path, mark)
    if added:
        raise RpegError(f"{option} must name a new or empty folder, or an earlier export as "
                        f"rpeg wrote it, not '{path}', which holds files of yours too "
                        f"({', '.join(added[:3])}{', ...' if len(added) > 3 else ''})",
                        Span(str(path), 0, 0),
                        hint="replacing the export would lose them: move them out, or "
                             "choose a new folder")
    parent = path.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise RpegError(f"{option} must name a folder in an existing directory this user "
                             f"can write, not '{path}'", hint=f"create it first: mkdir -p {parent}")
    return path


def _added(path: Path, mark: str) -> list[str]:
    """The files in the earlier output ``path`` that its mark does not list as written
    (none where it lists nothing: an output of an older rpeg)."""
    try:
        listed = json.loads((path / mark).read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(listed, list):
        return []
    written = set(listed) | {mark}
    return sorted(str(f.relative_to(path)) for f in path.rglob("*")
                  if (f.is_file() or f.is_symlink()) and str(f.relative_to(path)) not in written)


def temporary_sibling(path: Path) -> Path:
    """A fresh name beside ``path``, ending as ``path`` does (a picture's suffix says its
    format)."""
    return path.with_name(f".{path.stem}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}")


@contextlib.contextmanager
def written(path: Path, what: str) -> Iterator[Path]:
    """Write ``path`` through a temporary sibling: yields its name; renamed into place when
    the block ends, removed (and ``path`` left as it was) when it fails. An OSError is a
    RpegError naming ``path``."""
    tmp = temporary_sibling(path)
    try:
        yield tmp
        if not os.path.lexists(tmp):
            return                               # the block chose to write nothing
        os.replace(tmp, path)
    except OSError as e:
        raise RpegError(f"{what} '{path}' must be written, and writing it failed: "
                             f"{e.strerror or e}") from None
    finally:
        with contextlib.suppress(OSError):
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                shutil.rmtree(tmp)
            elif os.path.lexists(tmp):
                os.unlink(tmp)


@contextlib.contextmanager
def written_folder(path: Path, what: str) -> Iterator[Path]:
    """A folder written through a temporary sibling: yields it (created, empty); when the
    block ends it replaces ``path`` (an earlier one is moved aside first, then removed);
    when the block fails it is removed and ``path`` is left as it was."""
    tmp = temporary_sibling(path)
    tmp.mkdir(parents=True)
    old = None
    try:
        yield tmp
        if path.exists():
            old = temporary_sibling(path)
            os.replace(path, old)
        os.replace(tmp, path)
    except OSError as e:
        if old is not None and not path.exists():
            os.replace(old, path)                # put the earlier one back
            old = None
        raise RpegError(f"{what} '{path}' must be written, and writing it failed: "
                             f"{e.strerror or e}") from None
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
