"""What a forked child of the sandbox's server does to itself before it runs user code
(:mod:`rpeg.runtime.usercode.sandbox_server`, whose module doc says why): its descriptors,
environment and directory; resource limits; Landlock, where the kernel has it; no root; an
audit hook refusing writes outside its scratch directory and new processes.

Like the server, it imports nothing of rpeg: the server loads it by its path.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys

NOBODY = 65534

_LANDLOCK_CREATE, _LANDLOCK_ADD, _LANDLOCK_RESTRICT = 444, 445, 446   # x86-64 and arm64 alike
_PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 38, 36


def libc():
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        r = libc().syscall(_LANDLOCK_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    except (OSError, AttributeError):
        return 0
    return max(int(r), 0)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _landlock(scratch: str, abi: int) -> bool:
    """Writes only beneath ``scratch``, no TCP, no signals out of the sandbox (as far as the
    kernel's ABI goes); True when in force."""
    if abi < 1:
        return False
    write = (1 << 1) | (1 << 4) | (1 << 5) | sum(1 << b for b in range(6, 13))
    if abi >= 2:
        write |= 1 << 13                     # refer: links and renames
    if abi >= 3:
        write |= 1 << 14                     # truncate
    attr = _RulesetAttr(write, ((1 << 0) | (1 << 1)) if abi >= 4 else 0,
                        ((1 << 0) | (1 << 1)) if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else (16 if abi >= 4 else 8)
    lib = libc()
    fd = lib.syscall(_LANDLOCK_CREATE, ctypes.byref(attr), ctypes.c_size_t(size),
                      ctypes.c_uint32(0))
    if fd < 0:
        return False
    try:
        where = os.open(scratch, os.O_PATH | os.O_CLOEXEC)
        rule = _PathBeneath(write, where)
        if lib.syscall(_LANDLOCK_ADD, fd, 1, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            return False
        os.close(where)
        lib.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        return lib.syscall(_LANDLOCK_RESTRICT, fd, ctypes.c_uint32(0)) == 0
    finally:
        os.close(fd)


def _vm_size() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


_WRITE_MODES = ("w", "a", "x", "+")
_PROCESS_EVENTS = ("os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.system",
                   "subprocess.Popen", "os.spawn", "pty.spawn")
_PATH_EVENTS = {"os.remove": 0, "os.rmdir": 0, "os.mkdir": 0, "os.rename": (0, 1),
                "os.link": (0, 1), "os.symlink": 1, "os.truncate": 0, "os.chmod": 0,
                "os.chown": 0, "os.utime": 0, "shutil.rmtree": 0, "shutil.copyfile": 1,
                "shutil.move": (0, 1), "os.mkfifo": 0, "os.mknod": 0}


def _inside(path, scratch: str) -> bool:
    if isinstance(path, int):
        return True                     # an open descriptor: it was opened here
    try:
        p = os.fsdecode(path)
    except TypeError:
        return True
    real = os.path.realpath(os.path.join(scratch, p))
    return real == scratch or real.startswith(scratch + os.sep) or real == os.devnull


def _guard(scratch: str):
    """An audit hook: writing outside ``scratch`` and starting processes are refused."""
    def hook(event, args):
        if event in _PROCESS_EVENTS:
            raise PermissionError(f"a sandboxed call may not start processes ({event})")
        if event == "open":
            path, mode, flags = args[0], args[1], args[2]
            writes = (isinstance(mode, str) and any(c in mode for c in _WRITE_MODES)) or (
                isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT
                                                    | os.O_TRUNC | os.O_APPEND))
            if writes and path is not None and not _inside(path, scratch):
                raise PermissionError(f"a sandboxed call may write only in its scratch "
                                      f"directory, not {os.fsdecode(path)!r}")
            return
        where = _PATH_EVENTS.get(event)
        if where is not None:
            for i in (where if isinstance(where, tuple) else (where,)):
                if i < len(args) and not _inside(args[i], scratch):
                    raise PermissionError(f"a sandboxed call may change files only in its "
                                          f"scratch directory ({event} {args[i]!r})")
    sys.addaudithook(hook)


def max_fd() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if 0 < soft < 1 << 20 else 4096



def confine_with(scratch: str, limits: dict, abi: int, answer_fd: int, request_fd: int) -> None:
    """What a forked child does to itself before running user code (see the module doc): it
    keeps its answer pipe on descriptor 3 and an environment's request pipe on 4, and no
    other descriptor it inherited."""
    import fcntl
    os.setsid()
    answer = fcntl.fcntl(answer_fd, fcntl.F_DUPFD, 100)
    request = fcntl.fcntl(request_fd, fcntl.F_DUPFD, 100) if request_fd >= 0 else -1
    os.dup2(answer, 3)
    if request >= 0:
        os.dup2(request, 4)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    out = os.open(os.path.join(scratch, ".output"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.closerange(5 if request >= 0 else 4, max_fd())
    os.environ.clear()
    os.chdir(scratch)
    memory = int(limits["memory"])
    cpu = max(int(float(limits["timeout"]) * limits.get("cpu_factor", 1)) + 1, 1)
    for what, value in ((resource.RLIMIT_AS, _vm_size() + memory),
                        (resource.RLIMIT_CPU, cpu),
                        (resource.RLIMIT_FSIZE, int(limits["max_output"])),
                        (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0),
                        (resource.RLIMIT_NPROC, 8)):
        try:
            resource.setrlimit(what, (value, value))
        except (ValueError, OSError):
            pass
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    _landlock(scratch, abi)
    if os.geteuid() == 0:
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    _guard(scratch)
