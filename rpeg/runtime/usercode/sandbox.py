"""Tool calls outside the policy's process: a server process that forks a confined child
per call (``rpeg.runtime.usercode.sandbox_server``), and this client the generation engines call.

    >>> box = Sandbox.start([calc], path=[spec_dir], slots=2)          # doctest: +SKIP
    >>> [o.text for o in box.call_many([("calc", "6*7"), ("calc", "1/0")])]  # doctest: +SKIP
    ['42', '']
    >>> box.call_many([("calc", "1/0")])[0].error                      # doctest: +SKIP
    'ZeroDivisionError: division by zero (tools.py:2)'
    >>> box.close()                                                    # doctest: +SKIP

A tool's failure of any kind -- an exception, a timeout, its memory or output limit, a
crash, a value that is not text -- comes back as an :class:`Outcome` with ``ok`` False and
the reason, which the engine shows the policy as an error observation; nothing a tool does
stops the run. If the server itself dies, the calls in flight fail the same way and the
next call starts a new server. An environment (``open_many``, ``step_many``) is a child
that lives for one sample; its failure ends that sample's conversation.

The server imports each tool's module once at start, so a module that cannot be imported,
or a name that is not a function (a class with ``step``, for an environment), stops the
run before anything is generated (:class:`rpeg.errors.RuntimeFailure` at the tool's line).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs

from rpeg.errors import RuntimeFailure
from rpeg.runtime.usercode.sandbox_server import HEADER, landlock_abi

SERVER = Path(__file__).with_name("sandbox_server.py")
START_TIMEOUT_S = 120.0


@attrs.frozen
class Outcome:
    """What one call (or environment step) gave: its text, or why it failed."""

    ok: bool
    text: str = ""
    error: str = ""
    seconds: float = 0.0
    done: bool = False          # an environment: the conversation ends here
    handle: int = -1            # an environment opened: its handle for step_many

    @property
    def timed_out(self) -> bool:
        return not self.ok and self.error.startswith("timed out")


@attrs.define
class Counts:
    """What a sandbox did, for a generate op's statistics (the run's metrics)."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0

    def add(self, o: Outcome) -> None:
        self.calls += 1
        self.errors += 0 if o.ok else 1
        self.timeouts += 1 if o.timed_out else 0
        self.seconds += o.seconds

    def stats(self) -> dict:
        return {"tool_calls": self.calls, "tool_errors": self.errors,
                "tool_timeouts": self.timeouts, "tool_s": round(self.seconds, 6)}


def _config(tool) -> dict:
    return {"name": tool.name, "module": tool.module, "function": tool.function,
            "source": getattr(tool, "source", ""), "folder": getattr(tool, "folder", ""),
            "environment": tool.environment, "timeout": tool.timeout, "memory": tool.memory,
            "max_output": tool.max_output, "cores": tool.cores}


class Sandbox:
    """A sandbox server for the tools of a pipeline (see the module doc)."""

    def __init__(self, tools, path: list[str], slots: int) -> None:
        self.tools = {t.name: t for t in tools}
        self.path = list(path)
        self.slots = max(int(slots), 1)
        self.proc: subprocess.Popen | None = None
        self.root: str | None = None
        self.next_id = 0
        self.counts = Counts()
        self.landlock = landlock_abi()

    @classmethod
    def start(cls, tools, path: list[str] | None = None, slots: int = 1) -> Sandbox:
        box = cls(tools, path if path is not None else list(sys.path), slots)
        box._launch()
        return box

    # --- the server ----------------------------------------------------------------------
    def _launch(self) -> None:
        self.root = tempfile.mkdtemp(prefix="rpeg-sandbox-")
        os.chmod(self.root, 0o711)       # calls' directories inside are their own
        log = open(os.path.join(self.root, "server.log"), "wb")     # noqa: SIM115
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", str(SERVER)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, env={}, cwd=self.root, close_fds=True,
                start_new_session=True)
        finally:
            log.close()
        self._write({"tools": [_config(t) for t in self.tools.values()],
                     "path": [os.path.abspath(p) for p in self.path if p], "root": self.root,
                     "slots": self.slots})
        ready = self._read(START_TIMEOUT_S)
        if ready is None or not ready.get("ready"):
            why = self._log_tail()
            self.close()
            raise RuntimeFailure("the tool sandbox must start, and it did not"
                                 + (f": {why}" if why else ""))
        failed = ready.get("failed") or {}
        if failed:
            name, why = next(iter(failed.items()))
            span = self.tools[name].span
            self.close()
            raise RuntimeFailure(f"{'environment' if self.tools[name].environment else 'tool'} "
                                 f"'{name}' ({self.tools[name].ref}) must load in the "
                                 f"sandbox, and it failed: {why}", span)

    def _write(self, message: dict) -> None:
        body = json.dumps(message, default=str).encode("utf-8")
        self.proc.stdin.write(HEADER.pack(len(body)) + body)
        self.proc.stdin.flush()

    def _read(self, timeout: float | None = None) -> dict | None:
        out = self.proc.stdout
        if timeout is not None:
            ready, _, _ = select.select([out], [], [], timeout)
            if not ready:
                return None
        head = out.read(HEADER.size)
        if len(head) < HEADER.size:
            return None
        (size,) = HEADER.unpack(head)
        body = out.read(size)
        if len(body) < size:
            return None
        return json.loads(body.decode("utf-8"))

    def _log_tail(self) -> str:
        try:
            text = Path(self.root, "server.log").read_text(errors="replace").strip()
        except OSError:
            return ""
        return text.splitlines()[-1][:300] if text else ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # --- requests ------------------------------------------------------------------------
    def _ask(self, requests: list[dict]) -> list[Outcome]:
        """Send ``requests`` (each gets an id), wait for every answer, in request order."""
        if not requests:
            return []
        if not self.alive():
            self._restart()
        ids = []
        try:
            for r in requests:
                self.next_id += 1
                ids.append(self.next_id)
                self._write({**r, "id": self.next_id})
        except (BrokenPipeError, OSError):
            return self._lost(requests)
        answers: dict[int, dict] = {}
        while len(answers) < len(ids):
            msg = self._read()
            if msg is None:                        # the server died: what is left failed
                break
            answers[msg["id"]] = msg
        out = []
        for i in ids:
            a = answers.get(i)
            if a is None:
                out.append(Outcome(False, error="the sandbox stopped", done=True))
                continue
            out.append(Outcome(bool(a.get("ok")), str(a.get("text", "")),
                               str(a.get("error", "")), float(a.get("seconds", 0.0)),
                               bool(a.get("done", False)), int(a.get("handle", -1))))
        if len(answers) < len(ids):
            self._restart()
        return out

    def _lost(self, requests) -> list[Outcome]:
        self._restart()
        return [Outcome(False, error="the sandbox stopped", done=True) for _ in requests]

    def _restart(self) -> None:
        self._stop()
        self._launch()

    def call_many(self, calls: list[tuple[str, str]]) -> list[Outcome]:
        """Run ``(tool, argument text)`` calls, as many at once as the slots allow."""
        out = self._ask([{"op": "call", "tool": t, "arg": a} for t, a in calls])
        for o in out:
            self.counts.add(o)
        return out

    def open_many(self, opens: list[tuple[str, str, dict]]) -> list[Outcome]:
        """Start ``(environment, prompt, dataset row)`` environments: each outcome's
        ``handle`` (its reset's text, if any, as ``text``)."""
        return self._ask([{"op": "open", "tool": e, "prompt": p, "row": r}
                          for e, p, r in opens])

    def step_many(self, steps: list[tuple[int, str]]) -> list[Outcome]:
        """One step of each ``(handle, action text)`` environment."""
        out = self._ask([{"op": "step", "handle": h, "action": a} for h, a in steps])
        for o in out:
            self.counts.add(o)
        return out

    def close_many(self, handles) -> None:
        if handles and self.alive():
            self._ask([{"op": "close", "handle": h} for h in handles])

    # --- shutdown ------------------------------------------------------------------------
    def _stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                if proc.poll() is None:
                    body = json.dumps({"op": "quit"}).encode("utf-8")
                    proc.stdin.write(HEADER.pack(len(body)) + body)
                    proc.stdin.flush()
                    proc.wait(timeout=10)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for f in (proc.stdin, proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None

    def close(self) -> None:
        self._stop()

    def __del__(self) -> None:          # a forgotten sandbox leaves no server behind
        try:
            self._stop()
        except Exception:                # noqa: BLE001  (interpreter shutdown)
            pass


def measure(box: Sandbox, tool: str, args: list[str], calls: int) -> tuple[list[float], int]:
    """Seconds of ``calls`` calls of ``tool`` (one at a time, over ``args`` in turn), as the
    policy waits for them, and how many failed: for ``rpeg calibrate --tools``."""
    out, failed = [], 0
    for n in range(calls):
        t0 = time.perf_counter()
        (o,) = box.call_many([(tool, args[n % len(args)] if args else "")])
        out.append(time.perf_counter() - t0)
        failed += 0 if o.ok else 1
    return out, failed


def measure_environment(box: Sandbox, name: str, args: list[str], calls: int
                        ) -> tuple[list[float], int]:
    """Seconds of ``calls`` steps of environment ``name`` (each started afresh, reset on an
    empty prompt), and how many failed."""
    out, failed = [], 0
    for n in range(calls):
        (opened,) = box.open_many([(name, "", {})])
        if not opened.ok:
            failed += 1
            continue
        t0 = time.perf_counter()
        (o,) = box.step_many([(opened.handle, args[n % len(args)] if args else "")])
        out.append(time.perf_counter() - t0)
        failed += 0 if o.ok else 1
        box.close_many([opened.handle])
    return out, failed


def probe_tool():
    """A tool that answers at once (``rpeg.runtime.usercode.sandbox_probe``): what a sandboxed call
    costs by itself."""
    from rpeg.spec.tools import Tool
    here = Path(__file__).resolve()
    return Tool("probe", "sandbox_probe", "echo", timeout=10.0,
                source=str(here.with_name("sandbox_probe.py")), folder=str(here.parent))


__all__ = ["Counts", "Outcome", "Sandbox", "measure", "measure_environment", "probe_tool"]
