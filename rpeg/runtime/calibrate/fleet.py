"""Many lightweight Dask workers on this machine, to measure what the control plane costs
per task and per worker: a scheduler in a process of its own, N workers (one thread
each, resource ``GPU=1``, as ``rpeg run`` starts them) together in a second process, and
this process as the client, each process's CPU time read apart.

    >>> with Fleet(64) as fleet:                                         # doctest: +SKIP
    ...     before = fleet.cpu()
    ...     fleet.client.submit(noop, workers=[fleet.workers[3]]).result()
    ...     spent = fleet.cpu() - before
    >>> spent.scheduler_s, spent.client_s                                 # doctest: +SKIP
    (0.0021, 0.0034)

The workers run rpeg's own task function (``rpeg.runtime.dask.worker.run_group``) over an
executor that runs no op (:class:`NullExecutor`): every output a call reads is ``None``.
So a task costs what rpeg's dispatch costs — the client's submission and the results it
hears of, the scheduler's transitions, the workers' event loops — and nothing else. The
workers share one process and one event loop (``python -m rpeg.runtime.calibrate.fleet workers``),
so hundreds fit on a small machine; they talk to the scheduler over TCP as remote ones do.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs


@attrs.frozen
class Cpu:
    """CPU seconds (user + system) of the client, the scheduler and the workers' process."""

    client_s: float
    scheduler_s: float
    workers_s: float
    wall_s: float

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(self.client_s - other.client_s, self.scheduler_s - other.scheduler_s,
                   self.workers_s - other.workers_s, self.wall_s - other.wall_s)


def noop(*args) -> None:
    """A task that does nothing with what it is given."""


class NullOutputs(dict):
    """What a call of :class:`NullExecutor` returns: ``None`` for every output name."""

    def __missing__(self, key):
        return None


class NullExecutor:
    """Runs no op: the dispatch of a call without its work."""

    def run(self, call, inputs):
        return NullOutputs(), {}

    def shutdown(self) -> None:
        pass


class Fleet:
    """A scheduler and ``n`` workers in two child processes, and a client here."""

    def __init__(self, n: int, *, start_timeout_s: float = 300.0) -> None:
        self.n = n
        self.start_timeout_s = start_timeout_s
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> Fleet:
        import psutil
        from distributed import Client

        self._tmp = tempfile.TemporaryDirectory(prefix="rpeg-fleet-")
        addr_file = Path(self._tmp.name) / "scheduler"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (str(Path(__file__).resolve().parents[2]),
                        os.environ.get("PYTHONPATH", "")) if p))
        try:
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "rpeg.runtime.calibrate.fleet", "scheduler", str(addr_file)],
                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.address = _wait_for(addr_file, self.procs[0], self.start_timeout_s)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "rpeg.runtime.calibrate.fleet", "workers", self.address,
                 str(self.n)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.client = Client(self.address, timeout=self.start_timeout_s)
            self.client.wait_for_workers(self.n, timeout=self.start_timeout_s)
        except BaseException:
            self.__exit__()
            raise
        self.workers = sorted(self.client.scheduler_info(n_workers=-1)["workers"])
        self._ps = [psutil.Process(p.pid) for p in self.procs]
        self._me = psutil.Process()
        return self

    def cpu(self) -> Cpu:
        def of(p) -> float:
            t = p.cpu_times()
            return t.user + t.system
        return Cpu(of(self._me), of(self._ps[0]), of(self._ps[1]), time.perf_counter())

    def memory(self) -> dict[str, int]:
        """Resident bytes of the scheduler's and the workers' processes."""
        return {"scheduler": self._ps[0].memory_info().rss,
                "workers": self._ps[1].memory_info().rss}

    def __exit__(self, *exc) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close(timeout=10)
        for p in reversed(self.procs):
            p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._tmp.cleanup()


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> str:
    end = time.time() + timeout_s
    while time.time() < end:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"the scheduler exited with status {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError("the scheduler did not start")


async def _scheduler(path: str) -> None:
    from distributed import Scheduler
    async with Scheduler(host="127.0.0.1", port=0, dashboard=False) as s:
        tmp = Path(path + ".tmp")
        tmp.write_text(s.address)
        tmp.rename(path)
        await s.finished()


async def _workers(address: str, n: int) -> None:
    from distributed import Worker

    from rpeg.runtime.dask import worker as W
    W.install(NullExecutor(), 0, "fleet")
    workers = [Worker(address, nthreads=1, resources={"GPU": 1}, host="127.0.0.1",
                      name=f"device-{i}", dashboard=False, memory_limit=0, nanny=None)
               for i in range(n)]
    await asyncio.gather(*workers)
    await asyncio.Event().wait()


USAGE = ("usage: python -m rpeg.runtime.calibrate.fleet scheduler FILE | workers ADDRESS N\n"
         "  scheduler FILE      a scheduler on 127.0.0.1; its address is written to FILE\n"
         "  workers ADDRESS N   N workers of the scheduler at ADDRESS, in this process\n"
         "(Fleet starts both as its children.)")


def main(argv: list[str]) -> int:
    """The children :class:`Fleet` starts; a wrong command line is a usage error (exit 2)."""
    problem = _misuse(argv)
    if problem:
        print(f"{USAGE}\nerror: {problem}", file=sys.stderr)
        return 2
    if argv[0] == "scheduler":
        asyncio.run(_scheduler(argv[1]))
    else:
        asyncio.run(_workers(argv[1], int(argv[2])))
    return 0


def _misuse(argv: list[str]) -> str | None:
    """What is wrong with the command line ``argv``, or None."""
    if not argv:
        return "give a command: scheduler or workers"
    what, args = argv[0], argv[1:]
    wanted = {"scheduler": ("FILE",), "workers": ("ADDRESS", "N")}.get(what)
    if wanted is None:
        return f"the command must be scheduler or workers, not {what!r}"
    if len(args) != len(wanted):
        return f"{what} takes {' '.join(wanted)}, not {len(args)} argument(s)"
    if what == "workers" and not (args[1].isdigit() and int(args[1]) >= 1):
        return f"N must be a count of workers from 1, not {args[1]!r}"
    return None


if __name__ == "__main__":
    import logging
    logging.disable(logging.WARNING)
    sys.exit(main(sys.argv[1:]))
