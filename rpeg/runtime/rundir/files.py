"""The files of a run directory, read and written so that a damaged or hostile one is
refused with a message, never waited on, and never a way to touch anything outside it.

    >>> text = read_text(Path("runs/x"), "plan.json", "plan")          # doctest: +SKIP
    >>> rows, damaged = read_metrics(Path("runs/x"))                    # doctest: +SKIP
    >>> with RunLock.take(Path("runs/x")):                              # doctest: +SKIP
    ...     ...                                                         # the run writes here

* Every file is opened without following a symlink (``O_NOFOLLOW``) and without
  blocking (``O_NONBLOCK``), then checked to be a regular file of bounded size: a
  symlink, a pipe, a device or a directory where a record belongs is refused naming
  it. rpeg never writes a symlink into a run directory, so one there was put there
  by someone else; following it could read, write or prune files elsewhere.
* Writes replace a file atomically (a fresh temporary name, then a rename) or append
  to a regular file; neither follows a symlink.
* ``metrics.jsonl`` is read line by line: a damaged line (a write cut by a kill, or
  garbage) is reported with its line number, and the rows around it are kept.
* A run directory is locked (``run.lock``, ``flock``) while a run writes it; a
  second run is refused with the pid of the one that holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
import uuid
from collections.abc import Iterator
from pathlib import Path

from rpeg.errors import RuntimeFailure, Span

MAX_RECORD_BYTES = 1 << 30          # a trace of a long run is large; beyond this it is not one
MAX_JSON_DEPTH = 64                 # rpeg's records nest a few levels
LOCK = "run.lock"
# what a run directory holds, and of which kind: a record rpeg wrote, or a folder
FILES = ("spec.rpeg", "pipeline.json", "plan.json", "run.json", "trace.json", "events.jsonl",
         "metrics.jsonl", "eval.jsonl", "samples.jsonl", "record.json", "cluster.json", LOCK)
FOLDERS = ("checkpoints", "plots")


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def _refuse(path: Path, what: str, problem: str, hint: str | None = None) -> RuntimeFailure:
    return RuntimeFailure(f"{what} '{path}' must be {problem}", Span(str(path), 0, 0),
                          hint=hint)


def read_bytes(path: Path, what: str, limit: int = MAX_RECORD_BYTES) -> bytes:
    """The bytes of a regular file at ``path`` (no symlink followed, a pipe never waited
    on, at most ``limit`` bytes); RuntimeFailure naming it otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, what, "a regular file, not a symlink",
                          "rpeg writes no symlinks into a run directory; replace it with the "
                          "file itself") from None
        if e.errno == errno.ENOENT:
            raise _refuse(path, what, "there, and it is missing") from None
        raise _refuse(path, what, f"readable, not {e.strerror.lower()}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(path, what, f"a regular file, not {_kind(st.st_mode)}")
        if st.st_size > limit:
            raise _refuse(path, what, f"at most {limit:,} bytes, not {st.st_size:,}")
        return f.read(limit + 1)[:limit]


def read_text(path: Path, what: str, limit: int = MAX_RECORD_BYTES) -> str:
    try:
        return read_bytes(path, what, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise _refuse(path, what, "UTF-8 text, not binary") from None


def parse_json(text: str, path: Path, what: str):
    """JSON of a run record; RuntimeFailure naming the file when it is not JSON, nests
    absurdly deep, or holds numbers Python refuses to convert."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RuntimeFailure(f"{what} '{path}' must be JSON, and it is not ({e.msg} at line "
                             f"{e.lineno} column {e.colno})", Span(str(path), e.lineno, e.colno)
                             ) from None
    except (ValueError, RecursionError) as e:
        problem = "nested too deep" if isinstance(e, RecursionError) else str(e)
        raise RuntimeFailure(f"{what} '{path}' must be JSON as rpeg writes it, not "
                             f"{problem[:200]}", Span(str(path), 0, 0)) from None


def read_json(path: Path, what: str, limit: int = MAX_RECORD_BYTES):
    return parse_json(read_text(path, what, limit), path, what)


def read_parsed(path: Path, name: str, parse):
    """A record of a run directory, read as :func:`read_text` does and parsed by
    ``parse``; whatever is wrong with it is a RuntimeFailure naming the file."""
    from rpeg.errors import RpegError
    text = read_text(path, name)
    try:
        return parse(text)
    except RpegError as e:
        if e.span is not None and e.span.path and not e.span.path.startswith("<"):
            raise
        raise RuntimeFailure(f"'{path}' is unusable: {e.message}", Span(str(path), 0, 0),
                             hint=e.hint) from None
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        what = "nested too deep" if isinstance(e, RecursionError) else f"{type(e).__name__}: {e}"
        raise RuntimeFailure(f"'{path}' must be the {name} rpeg run wrote, and it is not "
                             f"({what})"[:400], Span(str(path), 0, 0)) from None


def read_metrics(run_dir: Path, *, required: bool = False, name: str = "metrics.jsonl"
                 ) -> tuple[list[dict], list[tuple[int, str]]]:
    """The rows of ``metrics.jsonl`` (or another per-step JSON-lines file, ``name``:
    ``eval.jsonl``, ``samples.jsonl``) and its damaged lines as ``(line number, why)``: a
    line that is not a JSON object with an integer ``step`` (cut by a kill mid-write,
    or garbage). A missing file is no rows (a RuntimeFailure when ``required``)."""
    path = Path(run_dir) / name
    if not required and not os.path.lexists(path):
        return [], []
    text = read_bytes(path, f"{name} file").decode("utf-8", errors="replace")
    rows: list[dict] = []
    damaged: list[tuple[int, str]] = []
    for n, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            damaged.append((n, "not JSON" + (" (cut short)" if n == text.count("\n") + 1
                                             else "")))
            continue
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            damaged.append((n, "not a row with a step number"))
            continue
        rows.append(row)
    return rows, damaged


def check_entries(run_dir: Path) -> None:
    """Refuse a run directory where a record is a symlink, a pipe or a device, or a folder
    rpeg writes into is not a plain folder (a symlink to one elsewhere)."""
    run_dir = Path(run_dir)
    for name in FILES + FOLDERS:
        p = run_dir / name
        try:
            mode = os.lstat(p).st_mode
        except FileNotFoundError:
            continue
        want_dir = name in FOLDERS
        ok = stat.S_ISDIR(mode) if want_dir else stat.S_ISREG(mode)
        if not ok:
            raise _refuse(p, "run directory entry",
                          f"a {'folder' if want_dir else 'regular file'}, not {_kind(mode)}",
                          "rpeg writes only plain files and folders into a run directory; "
                          "remove it, or use another directory")


# --- writing ---------------------------------------------------------------------------------

def write_atomic(path: Path, data: str | bytes) -> Path:
    """Replace ``path`` with ``data``: a fresh temporary name beside it (never an existing
    file or symlink), flushed, then renamed over it (a symlink there is replaced, not
    followed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


@contextlib.contextmanager
def open_append(path: Path, what: str) -> Iterator:
    """``path`` opened to append text (created if missing), never through a symlink and
    never a pipe or device."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                     | os.O_NONBLOCK, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, what, "a regular file, not a symlink") from None
        raise _refuse(path, what, f"writable, not {e.strerror.lower()}") from None
    f = os.fdopen(fd, "a", encoding="utf-8")
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _refuse(path, what, f"a regular file, not {_kind(mode)}")
        yield f
    finally:
        f.close()


def open_update(path: Path, what: str):
    """``path`` opened to read and truncate (``r+b``), never through a symlink."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise _refuse(path, what, "a regular file, not a symlink") from None
        raise _refuse(path, what, f"readable, not {e.strerror.lower()}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _refuse(path, what, f"a regular file, not {_kind(mode)}")
    return os.fdopen(fd, "r+b")


def _locked(run_dir: Path, pid: bytes) -> RuntimeFailure:
    holder = pid.decode("ascii", "replace").strip() or "unknown"
    return RuntimeFailure(f"run directory '{run_dir}' must not be written by two runs at "
                          f"once, and rpeg run (pid {holder}) is writing it",
                          Span(str(Path(run_dir) / LOCK), 0, 0),
                          hint="wait for it to end, or choose another directory (--run-dir)")


def check_unlocked(run_dir: Path) -> None:
    """RuntimeFailure when a run holds ``run_dir``'s lock; writes nothing (a directory
    without a lock file is unlocked)."""
    try:
        fd = os.open(Path(run_dir) / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return                      # refused, with its kind, when the lock is taken
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _locked(run_dir, os.pread(fd, 32, 0)) from None
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def held(run_dir: Path) -> bool:
    """Whether a process holds ``run_dir``'s lock (a run writing it now): the kernel drops
    a killed process's lock, so a record that says "running" without it was left by a run
    that did not close it (killed, or its machine lost)."""
    try:
        check_unlocked(run_dir)
    except RuntimeFailure:
        return True
    return False


class RunLock:
    """An exclusive lock on a run directory while a run writes it (``flock`` on
    ``run.lock``, which holds the pid of the process that took it). The kernel drops it
    when the process ends, however it ends."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    @contextlib.contextmanager
    def take(cls, run_dir: Path) -> Iterator[RunLock]:
        path = Path(run_dir) / LOCK
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            raise _refuse(path, "run lock", "a regular file rpeg can create, not "
                          + ("a symlink" if e.errno == errno.ELOOP else e.strerror.lower())
                          ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _refuse(path, "run lock", f"a regular file, not "
                              f"{_kind(os.fstat(fd).st_mode)}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise _locked(run_dir, os.pread(fd, 32, 0)) from None
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            yield cls(path, fd)
        finally:
            os.close(fd)                     # releases the lock
