"""Ctrl-C during a run: once, stop at the next checkpoint cut; twice, stop at once."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class StopFlag:
    """Ctrl-C once: stop at the next cut and checkpoint. Twice: stop now."""

    def __init__(self) -> None:
        self.requested = False
        self.previous = None

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
                self.uninstall()
        return block()

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nrpeg: Ctrl-C: finishing the ops already started, then writing a checkpoint "
              "(Ctrl-C again to stop at once)", file=sys.stderr)

    def uninstall(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
