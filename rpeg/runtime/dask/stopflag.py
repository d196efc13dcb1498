"""Ctrl-C during a run: once, stop at the next checkpoint cut; twice, stop at once.
SIGTERM: stop at once (the run's record is closed on the way out).

A signal handler's exception is raised wherever the main thread happens to be, and one
raised inside a finaliser (a Dask future's ``__del__``) is printed and dropped: so each
handler also records what it asked for, and the run's loop raises it again at its next
check (:meth:`StopFlag.check`) if it was lost."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

from rpeg.errors import RuntimeFailure


class Terminated(RuntimeFailure):
    """SIGTERM: the run stopped at once; its record says so, and it can be resumed from
    its last checkpoint."""


class StopFlag:
    """Ctrl-C once: stop at the next cut and checkpoint. Twice: stop now."""

    def __init__(self) -> None:
        self.requested = False
        self.now: BaseException | None = None    # stop at once: what the handler raised
        self.previous = None
        self.previous_term = None
        self.run_dir = ""

    def install_terminate(self, run_dir: str = "") -> None:
        """SIGTERM stops the run at once, as a second Ctrl-C does, so that the run's
        record is closed (status, trace) on the way out instead of the process vanishing."""
        if threading.current_thread() is threading.main_thread():
            self.run_dir = run_dir
            previous = signal.signal(signal.SIGTERM, self._terminate)
            if self.previous_term is None:
                self.previous_term = previous

    def _terminate(self, signum, frame) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)     # a second SIGTERM ends it outright
        where = f" {self.run_dir}" if self.run_dir else " RUN_DIR"
        hint = f"continue from its last checkpoint with: rpeg run --resume{where}"
        if self.run_dir and not any(Path(self.run_dir).glob("checkpoints/step-*/COMPLETE")):
            hint = ("no checkpoint was complete yet, so nothing of it can be resumed: run it "
                    "again (its directory keeps what it did)")
        self.now = Terminated("terminated (SIGTERM): the run stopped; its record is closed",
                              hint=hint)
        raise self.now

    def check(self) -> None:
        """Raise the stop-at-once a handler asked for, again: the handler's own raise may
        have landed in a finaliser, which drops it."""
        if self.now is not None:
            raise self.now

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, self._handle)
            if self.previous is None:
                self.previous = previous

    def ignored(self):
        """While entered (starting the cluster), Ctrl-C is ignored, and so by the workers."""
        @contextlib.contextmanager
        def block():
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            self.previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
            try:
                yield
            finally:
                signal.signal(signal.SIGINT, self.previous)
        return block()

    def _handle(self, signum, frame) -> None:
        if self.requested:
            self.now = KeyboardInterrupt()
            raise self.now
        self.requested = True
        print("\nrpeg: Ctrl-C: finishing the ops already started, then writing a checkpoint "
              "(Ctrl-C again to stop at once)", file=sys.stderr)

    def uninstall(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
        if self.previous_term is not None:
            signal.signal(signal.SIGTERM, self.previous_term)
            self.previous_term = None
