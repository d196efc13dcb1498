"""The sandbox's server: a process that forks one confined child per tool call.

Started by :class:`rpeg.runtime.usercode.sandbox.Sandbox` as ``python -I sandbox_server.py`` with a
cleared environment, no inherited file descriptors and its own working directory; it
imports nothing of rpeg (only the standard library, the tools' modules, and beside it, by
its path, ``sandbox_confine.py``: what a child does to itself), so it can run
whatever the worker's interpreter can. It reads its configuration, imports each tool's
module once (a module that fails to import is reported and the parent refuses to start),
then serves requests, each a length-prefixed JSON message on stdin, answered on stdout:

    {"op": "call", "id": 7, "tool": "calc", "arg": "6*7"}
    {"op": "open", "id": 8, "tool": "maze", "prompt": "...", "row": {...}}   -> a handle
    {"op": "step", "id": 9, "handle": 3, "action": "north"}
    {"op": "close", "id": 10, "handle": 3}
    {"op": "quit"}

A call runs in a forked child that, before running the tool, leaves the server's session
and process group, closes every inherited descriptor (stdin reads /dev/null, stdout and
stderr write a capped file in its scratch directory), clears its environment, moves into a
fresh scratch directory, and limits itself: address space (the declared memory beyond
what the server had mapped), CPU seconds, file size (the output cap), open files, core
dumps, processes. Where the kernel has Landlock it may then write only under its scratch
directory and open no TCP connection; run as root it drops to ``nobody``. A Python audit
hook refuses writes outside the scratch directory and starting processes, with a clear
message, where those do not already fail. The server enforces the wall-clock timeout and
the output cap from outside (SIGKILL to the child's process group) and, as a child
subreaper, kills anything a call left running. An environment is a child of the same kind
that lives for one sample and answers ``step`` requests over a pipe of its own.

Every failure -- an exception, a timeout, a signal, memory, too much output, a return value
that is not text -- is an answer with ``ok`` false and the reason; the server keeps serving.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import os
import selectors
import shutil
import signal
import struct
import sys
import time
import traceback

HEADER = struct.Struct(">I")
MAX_MESSAGE = 1 << 30
ERROR_CHARS = 600


def _sibling(name: str):
    """A module beside this file, loaded by its path: the server runs as a script under
    ``python -I``, with no entry for this folder on its path (and a tool's module must not
    find rpeg's own beside it by name)."""
    key = f"_rpeg_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            key, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


_confine = _sibling("sandbox_confine")                 # what a child does to itself
_PR_SET_CHILD_SUBREAPER, NOBODY = _confine.PR_SET_CHILD_SUBREAPER, _confine.NOBODY
_libc, landlock_abi = _confine.libc, _confine.landlock_abi
_confine_with = _confine.confine_with


# --- framing -------------------------------------------------------------------------------

def read_message(fd: int) -> dict | None:
    """One message from ``fd`` (blocking); None at end of file."""
    head = _read_exactly(fd, HEADER.size)
    if head is None:
        return None
    (size,) = HEADER.unpack(head)
    if size > MAX_MESSAGE:
        raise ValueError(f"message of {size} bytes")
    body = _read_exactly(fd, size)
    if body is None:
        return None
    return json.loads(body.decode("utf-8"))


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        chunk = os.read(fd, n - got)
        if not chunk:
            return None
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def write_message(fd: int, message: dict) -> None:
    body = json.dumps(message).encode("utf-8")
    data = HEADER.pack(len(body)) + body
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _answer(ok: bool, text: str = "", error: str = "", **extra) -> bytes:
    return json.dumps({"ok": ok, "text": text, "error": error, **extra}).encode("utf-8")


def _failure(e: BaseException) -> str:
    """An exception as one line: its type and message, and where in the user's code."""
    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                  if os.path.basename(f.filename) != os.path.basename(__file__)), "")
    text = f"{type(e).__name__}: {e}"
    return (text[:ERROR_CHARS] + (f" ({where})" if where else ""))


def _text(value) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a tool (or an environment) must return text, not {type(value).__name__}")
    return value


def _over(text: str, cap: int) -> bool:
    """Whether a tool's text is more than ``cap`` bytes (``max_output``), counted as UTF-8,
    not as its JSON escape (which counts an é as 6 bytes and lets ASCII past the cap)."""
    return 4 * len(text) > cap and len(text.encode("utf-8", "surrogatepass")) > cap


def _run_call(fn, arg: str, out: int, cap: int) -> None:
    """In the child: the tool on ``arg``; its answer on ``out``."""
    try:
        text = _text(fn(arg))
        data = _answer(False, error=f"the tool returned more than {cap} bytes") \
            if _over(text, cap) else _answer(True, text)
    except BaseException as e:              # everything the tool does is the tool's failure
        data = _answer(False, error=_failure(e))
    _write_all(out, _frame(data))
    os._exit(0)


def _call_reset(env, prompt: str, row: dict):
    reset = getattr(env, "reset", None)
    if reset is None:
        return None
    try:
        n = len([p for p in inspect.signature(reset).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    except (TypeError, ValueError):
        n = 2
    return reset(*(prompt, row)[:n])


def _step_value(value) -> tuple[str, bool]:
    if isinstance(value, tuple) and len(value) == 2:
        obs, done = value
        if not isinstance(done, (bool, int)) and type(done).__name__ != "bool_":
            # "false" is true to bool(): a done that is no truth value is the step's mistake
            raise TypeError(f"an environment's step must return (text, done) with done a "
                            f"bool, not {type(done).__name__}")
        return _text(obs), bool(done)
    return _text(value), False


def _run_env(cls, prompt: str, row: dict, requests: int, out: int, cap: int) -> None:
    """In the child: an environment for one sample; reset, then one step per request."""
    try:
        env = cls()
        first = _call_reset(env, prompt, row)
        data = _answer(True, _text(first) if first is not None else "")
    except BaseException as e:
        _write_all(out, _frame(_answer(False, error=_failure(e))))
        os._exit(0)
    _write_all(out, _frame(data))
    while True:
        msg = _read_frame(requests)
        if msg is None:
            os._exit(0)
        try:
            obs, done = _step_value(env.step(msg.decode("utf-8")))
            data = _answer(False, error=f"the environment returned more than {cap} bytes",
                           done=True) if _over(obs, cap) else _answer(True, obs, done=done)
        except BaseException as e:
            data = _answer(False, error=_failure(e), done=True)
        _write_all(out, _frame(data))


def _frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


def _read_frame(fd: int) -> bytes | None:
    head = _read_exactly(fd, HEADER.size)
    if head is None:
        return None
    return _read_exactly(fd, HEADER.unpack(head)[0])


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError:
        pass


# --- the server --------------------------------------------------------------------------

class Job:
    """One call (or one environment) running in a child."""

    def __init__(self, req: dict, pid: int, fd: int, scratch: str, deadline: float, cap: int,
                 slots: int, requests: int = -1) -> None:
        self.req, self.pid, self.fd, self.scratch = req, pid, fd, scratch
        self.deadline, self.cap, self.slots, self.requests = deadline, cap, slots, requests
        self.buf = bytearray()
        self.start = time.monotonic()
        self.status: tuple[str, int] | None = None     # ("exit" | "signal", n) once exited
        self.waiting_id: int | None = None      # an environment: the request it answers


class Server:
    def __init__(self, config: dict) -> None:
        self.config = config
        self.root = os.path.realpath(config["root"])
        self.slots = max(int(config.get("slots", 1)), 1)
        self.abi = landlock_abi()
        self.tools = {t["name"]: t for t in config["tools"]}
        self.code: dict[str, object] = {}
        self.queue: list[dict] = []
        self.jobs: dict[int, Job] = {}          # pid -> job
        self.envs: dict[int, Job] = {}          # handle -> its environment's job
        self.busy = 0
        self.count = 0
        self.sel = selectors.DefaultSelector()

    def load(self) -> dict:
        """Import every tool's module; what failed, by tool."""
        for p in reversed(self.config.get("path", [])):
            if p not in sys.path:
                sys.path.insert(0, p)
        failed = {}
        for name, t in self.tools.items():
            try:
                obj = getattr(_module(t), t["function"])
                if t.get("environment"):
                    if not inspect.isclass(obj) or not callable(getattr(obj, "step", None)):
                        raise TypeError(f"{t['function']} must be a class with step(action)")
                elif not callable(obj) or inspect.isclass(obj):
                    raise TypeError(f"{t['function']} must be a function of the argument text")
                self.code[name] = obj
            except BaseException as e:
                failed[name] = _failure(e)
        return failed

    def serve(self) -> None:
        libc = _libc()
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        os.set_blocking(0, True)
        self.sel.register(0, selectors.EVENT_READ, "parent")
        wake_r, wake_w = os.pipe()           # SIGCHLD wakes the loop: a child exited
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel.register(wake_r, selectors.EVENT_READ, "child")
        while True:
            self._start_queued()
            timeout = self._next_deadline()
            for key, _ in self.sel.select(timeout):
                if key.data == "child":
                    _drain_fd(wake_r)
                elif key.data == "parent":
                    msg = read_message(0)
                    if msg is None or msg.get("op") == "quit":
                        self._shutdown()
                        return
                    self._request(msg)
                else:
                    self._readable(key.data)
            self._reap()
            self._expire()

    # requests
    def _request(self, msg: dict) -> None:
        op = msg.get("op")
        if op in ("call", "open"):
            if msg.get("tool") not in self.code:
                self._reply(msg, False, error=f"no tool {msg.get('tool')!r} is loaded")
                return
            self.queue.append(msg)
        elif op == "step":
            job = self.envs.get(int(msg.get("handle", -1)))
            if job is None or job.status is not None:
                self._reply(msg, False, error="the environment has ended", done=True)
                return
            self.queue.append(msg)
        elif op == "close":
            job = self.envs.pop(int(msg.get("handle", -1)), None)
            if job is not None:
                self._finish(job)
            self._reply(msg, True)
        else:
            self._reply(msg, False, error=f"unknown request {op!r}")

    def _start_queued(self) -> None:
        """Start queued work while slots are free: a call or an environment's start forks a
        child; a step goes to its environment. Each holds its tool's cores until answered
        (an environment waiting between steps holds none)."""
        while self.queue:
            msg = self.queue[0]
            env = self.envs.get(int(msg.get("handle", -1))) if msg["op"] == "step" else None
            if msg["op"] == "step" and env is None:
                self.queue.pop(0)
                self._reply(msg, False, error="the environment has ended", done=True)
                continue
            t = self.tools[env.req["tool"] if env is not None else msg["tool"]]
            need = min(max(int(t.get("cores", 1)), 1), self.slots)
            if self.busy and self.busy + need > self.slots:
                return
            self.queue.pop(0)
            self.busy += need
            if env is None:
                self._fork(msg, t, need)
                continue
            env.slots, env.waiting_id = need, msg["id"]
            env.deadline = env.start = time.monotonic()
            env.deadline += float(t["timeout"])
            _write_all(env.requests, _frame(str(msg.get("action", "")).encode("utf-8")))

    def _answered(self, job: Job) -> None:
        """An environment answered: its cores are free until its next step."""
        self.busy -= job.slots
        job.slots = 0

    def _fork(self, msg: dict, t: dict, need: int) -> None:
        self.count += 1
        scratch = os.path.join(self.root, f"call-{self.count}")
        os.mkdir(scratch, 0o700)
        if os.geteuid() == 0:
            os.chown(scratch, NOBODY, NOBODY)
        r, w = os.pipe()
        req_r = req_w = -1
        env = msg["op"] == "open"
        if env:
            req_r, req_w = os.pipe()
        limits = dict(t, cpu_factor=64 if env else 1)
        pid = os.fork()
        if pid == 0:                                         # the child
            try:
                _confine_with(scratch, limits, self.abi, w, req_r)
                if env:
                    _run_env(self.code[msg["tool"]], str(msg.get("prompt", "")),
                             msg.get("row") or {}, 4, 3, int(t["max_output"]))
                _run_call(self.code[msg["tool"]], str(msg.get("arg", "")), 3,
                          int(t["max_output"]))
            except BaseException as e:
                try:
                    data = _answer(False, error=f"the sandbox could not start: {_failure(e)}")
                    _write_all(3, _frame(data))
                finally:
                    os._exit(1)
            os._exit(1)
        os.close(w)
        if env:
            os.close(req_r)
        os.set_blocking(r, False)
        deadline = time.monotonic() + float(t["timeout"])
        job = Job(msg, pid, r, scratch, deadline, int(t["max_output"]), need, req_w)
        self.jobs[pid] = job
        if env:
            job.waiting_id = msg["id"]
            self.envs[msg["id"]] = job
        self.sel.register(r, selectors.EVENT_READ, job)

    # children
    def _readable(self, job: Job) -> None:
        try:
            data = os.read(job.fd, 1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:                 # closed: the child exited, or soon will (see _reap)
            self.sel.unregister(job.fd)
            return
        job.buf += data
        if len(job.buf) > job.cap + 4096 + HEADER.size:
            self._kill(job, f"more than {job.cap} bytes of output")
            return
        if job.req["op"] == "open":
            self._env_frames(job)

    def _env_frames(self, job: Job) -> None:
        while len(job.buf) >= HEADER.size:
            (size,) = HEADER.unpack(job.buf[:HEADER.size])
            if len(job.buf) < HEADER.size + size:
                return
            body = bytes(job.buf[HEADER.size:HEADER.size + size])
            del job.buf[:HEADER.size + size]
            answer = _decode(body)
            if job.waiting_id is not None:
                extra = {"handle": job.req["id"]} if job.waiting_id == job.req["id"] else {}
                self._send(job.waiting_id, answer, time.monotonic() - job.start, **extra)
                job.waiting_id = None
                self._answered(job)
            if not answer.get("ok", False) and job.req["id"] in self.envs:
                self.envs.pop(job.req["id"])
                self._finish(job)
                return

    def _settle(self, job: Job) -> None:
        """A call's child exited: answer from what it wrote, clean up."""
        body = _frames(job.buf)
        answer = _decode(body[0]) if body else {"ok": False, "text": "",
                                                "error": _died(job.status, job)}
        self._send(job.req["id"], answer, time.monotonic() - job.start)
        self._finish(job)

    def _exited(self, job: Job, block: bool = False) -> bool:
        """Whether the child exited, leaving it a zombie (not reaped: its process group id
        stays reserved until :meth:`_finish` has killed the group)."""
        if job.status is None:
            flags = os.WEXITED | os.WNOWAIT | (0 if block else os.WNOHANG)
            try:
                info = os.waitid(os.P_PID, job.pid, flags)
            except ChildProcessError:
                info = None
                job.status = ("gone", 0)
            if info is not None:
                killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
                job.status = ("signal" if killed else "exit", info.si_status)
        return job.status is not None

    def _reap(self) -> None:
        """Children that exited (their answer pipe may be held open by what they started)."""
        for job in list(self.jobs.values()):
            if not self._exited(job):
                continue
            _drain(job)
            if job.req["op"] == "call":
                self._settle(job)
                continue
            self._env_frames(job)
            if job.pid not in self.jobs:
                continue
            if job.waiting_id is not None:
                self._send(job.waiting_id, {"ok": False, "text": "", "done": True,
                                            "error": _died(job.status, job)},
                           time.monotonic() - job.start)
                job.waiting_id = None
            self.envs.pop(job.req["id"], None)
            self._finish(job)

    def _expire(self) -> None:
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if job.waiting_id is None and job.req["op"] == "open":
                continue                           # an idle environment, between steps
            if now >= job.deadline:
                t = self.tools[job.req["tool"]]
                self._kill(job, f"timed out after {float(t['timeout']):g} s")

    def _kill(self, job: Job, why: str) -> None:
        _kill_group(job.pid)
        self._exited(job, block=True)
        reply_id = job.req["id"] if job.req["op"] == "call" else job.waiting_id
        if reply_id is not None:
            self._send(reply_id, {"ok": False, "text": "", "error": why, "done": True},
                       time.monotonic() - job.start)
        job.waiting_id = None
        self.envs.pop(job.req["id"], None)
        self._finish(job)

    def _finish(self, job: Job) -> None:
        """The child's process group killed (while the child, a zombie at most, keeps its id
        reserved), the child reaped, its orphans killed, its scratch directory removed."""
        if job.pid not in self.jobs:
            return
        _kill_group(job.pid)
        try:
            os.waitpid(job.pid, 0)
        except ChildProcessError:
            pass
        if job.fd in self.sel.get_map():
            self.sel.unregister(job.fd)
        for fd in (job.fd, job.requests):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        del self.jobs[job.pid]
        self.busy -= job.slots
        _reap_orphans(set(self.jobs))
        shutil.rmtree(job.scratch, ignore_errors=True)

    def _next_deadline(self) -> float | None:
        live = [j.deadline for j in self.jobs.values()
                if j.req["op"] == "call" or j.waiting_id is not None]
        return max(min(live) - time.monotonic(), 0.0) if live else None

    def _reply(self, msg: dict, ok: bool, **extra) -> None:
        self._send(msg.get("id"), {"ok": ok, "text": "", "error": "", **extra}, 0.0)

    def _send(self, id_, answer: dict, seconds: float, **extra) -> None:
        write_message(_ANSWERS, {**answer, "id": id_, "seconds": round(seconds, 6), **extra})

    def _shutdown(self) -> None:
        for job in list(self.jobs.values()):
            self._finish(job)


def _module(t: dict):
    """A tool's module: the file the spec found (its folder first on the path, for the
    modules beside it), else by name."""
    folder, source = t.get("folder") or "", t.get("source") or ""
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    if not source:
        return importlib.import_module(t["module"])
    name = t["module"]
    have = sys.modules.get(name)
    if have is not None and os.path.realpath(getattr(have, "__file__", "") or "") == \
            os.path.realpath(source):
        return have
    spec = importlib.util.spec_from_file_location(name if have is None else
                                                  f"_tool_{t['name']}_{name}", source)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _frames(buf: bytearray) -> list[bytes]:
    """The whole frames at the start of ``buf``."""
    out, at = [], 0
    while len(buf) - at >= HEADER.size:
        (size,) = HEADER.unpack(buf[at:at + HEADER.size])
        if len(buf) - at - HEADER.size < size:
            break
        out.append(bytes(buf[at + HEADER.size:at + HEADER.size + size]))
        at += HEADER.size + size
    return out


def _decode(body: bytes) -> dict:
    try:
        answer = json.loads(body.decode("utf-8"))
        if isinstance(answer, dict) and "ok" in answer:
            return answer
    except (UnicodeDecodeError, ValueError):
        pass
    return {"ok": False, "text": "", "error": "the tool's process wrote an answer that is not "
                                              "the sandbox's"}


def _drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _drain(job: Job) -> None:
    while True:
        try:
            data = os.read(job.fd, 1 << 16)
        except (BlockingIOError, OSError):
            return
        if not data:
            return
        job.buf += data
        if len(job.buf) > job.cap + 4096 + HEADER.size:
            job.buf = bytearray()
            return


def _died(status: tuple[str, int] | None, job: Job) -> str:
    if status is None or status[0] == "gone":
        return "the call ended without an answer"
    kind, value = status
    if kind == "signal":
        why = {signal.SIGXCPU: "its CPU time limit", signal.SIGXFSZ:
               f"its output limit ({job.cap} bytes)", signal.SIGKILL: "SIGKILL",
               signal.SIGSEGV: "a segmentation fault"}.get(value, _signal_name(value))
        return f"the call was killed: {why}"
    return f"the call exited with status {value} without an answer (out of memory, or it " \
           "exited)"


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _kill_group(pid: int) -> None:
    for target in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            target()
        except (ProcessLookupError, PermissionError):
            pass


def _children() -> list[int]:
    """This process's children (its orphans' too: it is their subreaper)."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children") as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        pass
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
            if int(stat[stat.rindex(b")") + 2:].split()[1]) == me:
                out.append(int(name))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _reap_orphans(keep: set[int]) -> None:
    """Kill and reap what calls left running: as a subreaper, their orphans are ours."""
    for pid in _children():
        if pid in keep:
            continue
        _kill_group(pid)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


_ANSWERS = 1          # the descriptor answers go out on (main moves them off stdout)


def main() -> None:
    global _ANSWERS
    import fcntl
    # the answers keep a descriptor of their own, and stdout becomes stderr: a tool module
    # that prints as it is imported (or later, in this process) cannot write into them
    _ANSWERS = fcntl.fcntl(1, fcntl.F_DUPFD, 100)
    os.dup2(2, 1)
    config = read_message(0)
    server = Server(config)
    failed = server.load()
    write_message(_ANSWERS, {"ready": True, "failed": failed, "landlock": server.abi,
                             "root": os.geteuid() == 0})
    server.serve()


if __name__ == "__main__":
    main()
