"""Loss detection and rollback: the Dask calls of a resilient run, watched for workers
that leave or stop answering, and the rollback to the last cut when one does.

    >>> setup = runner._gather(futs, "set-up", list(runner.workers))   # doctest: +SKIP
    _Lost: worker lost (left the cluster): device 1 (tcp://127.0.0.1:40123), op set-up, step 0

Every wait on a worker has a time limit and a check that the worker is still in the
cluster: a worker that left (killed, OOM) raises :class:`_Lost` as a loss, one still
there that does not answer is *stuck* (frozen, hung in a collective) and is killed
when the run recovers. ``_recover`` records the loss in run.json, drops the attempt's
futures and rolls metrics, trace and carried outputs back to the last checkpoint; the
runner (``rpeg.runtime.dask.runner``) then restarts the workers from it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from rpeg.errors import RuntimeFailure
from rpeg.runtime.core import scheduler as C
from rpeg.runtime.core.flight import Flight, Task
from rpeg.runtime.dask import worker as W
from rpeg.runtime.rundir import outputs as O
from rpeg.runtime.rundir.state import state_at

ENDED = ("finished", "error", "cancelled")     # a future's end states ("lost" is not one)


class _Lost(Exception):
    def __init__(self, device: int, worker: str, op: str, step: int, reason: str, *,
                 stimulus: str = "") -> None:
        super().__init__(f"{reason}: device {device} ({worker}), op {op}, step {step}")
        self.device, self.worker, self.op, self.step, self.reason = device, worker, op, step, reason
        self.stimulus = stimulus        # the core's event that found it ("" = seen outside it)

    def caused_by(self, stimulus: str) -> _Lost:
        self.stimulus = self.stimulus or stimulus
        return self


class WorkerWatch:
    """The runner's calls to its workers and the scheduler, each turning a loss into
    :class:`_Lost`, and the rollback after one (a part of ``recovery._Runner``)."""

    def _gather(self, futs: list, what: str, devices: list[int] | None = None,
                limit_s: float | None = None) -> list:
        """Results of ``futs``, watching the workers meanwhile: a worker that dies (or was
        already gone) raises _Lost instead of waiting forever on a task pinned to it."""
        from distributed import wait

        start = time.time()
        limit_s = limit_s or 2 * self.res.timeout_floor_s
        pending = list(futs)
        while pending:
            self._check_alive()
            try:
                wait(pending, timeout=0.5)
            except TimeoutError:
                pass
            # "lost": its result went with a worker and waits to be made again (pinned there,
            # never): still pending, until the loss check above sees the worker gone
            pending = [f for f in pending if f.status not in ENDED]
            if pending and time.time() - start > limit_s:
                d = devices[futs.index(pending[0])] if devices else -1
                raise self._lost_or_stuck(d, self.workers.get(d, "?"), what, self.state.start,
                                          f"op stuck: {what} took over {limit_s:.0f} s")
        for f in futs:
            if f.status == "cancelled" or (f.status == "error" and _is_loss(f.exception())):
                self._check_alive()
                raise _Lost(-1, "?", what, self.state.start, "worker lost during " + what)
        return self.cl.client.gather(futs)

    def salvage(self) -> None:
        """The events of ops that finished since the last step, from every worker that
        answers within seconds: a run that stops early leaves them in its trace."""
        import asyncio
        try:
            client, addrs = self.cl.client, list(self.workers.values())
            got = client.sync(lambda: asyncio.wait_for(
                client._run(W.drain, workers=addrs, on_error="return"), 5.0))
            for a in addrs:
                if isinstance(got.get(a), list):
                    for e in got[a]:
                        self.state.pending[int(e["step"])].append(e)
        except BaseException:  # noqa: BLE001 — best effort while the run is already ending
            pass

    def _drain(self, addrs: list[str] | None = None) -> list[dict]:
        """Trace events recorded on every device's worker (or on ``addrs``) since the last
        drain: one round trip to all of them at once; when one does not answer or fails,
        each is asked on its own, and a worker that does not answer (frozen, hung in a
        collective) is reported as stuck."""
        import asyncio

        client, every = self.cl.client, addrs is None
        addrs = list(self.workers.values()) if addrs is None else addrs
        try:
            got = client.sync(lambda: asyncio.wait_for(
                client._run(W.drain, workers=addrs, on_error="return"),
                min(10.0, self.res.timeout_floor_s)))
            if all(isinstance(got.get(a), list) for a in addrs):
                return [e for a in addrs for e in got[a]]
        except Exception:  # noqa: BLE001 — asked one by one below, which tells which failed
            pass
        if every:
            self._check_alive()           # a worker that left is a loss now, not after timeouts
        out: list[dict] = []
        for a in addrs:
            try:
                out += self._run_on(a, W.drain, self.res.timeout_floor_s)
            except _Lost:
                raise
            except Exception:  # noqa: BLE001 — a worker died mid-drain: the loss check sees it
                continue
        return out

    def _run_on(self, address: str, fn, timeout: float):
        """``client.run`` on one worker, with a time limit (a frozen worker never answers)."""
        import asyncio

        client = self.cl.client
        device = next((d for d, a in self.workers.items() if a == address), -1)
        try:
            got = client.sync(lambda: asyncio.wait_for(
                client._run(fn, workers=[address], on_error="raise"), timeout))
        except (TimeoutError, asyncio.TimeoutError):
            raise self._lost_or_stuck(device, address, fn.__name__, self.state.start,
                                      f"op stuck: worker did not answer within {timeout:.0f} s"
                                      ) from None
        except Exception as e:
            if _is_loss(e):
                raise _Lost(device, address, fn.__name__, self.state.start,
                            f"worker lost ({type(e).__name__})") from None
            raise
        return got[address]

    def _scatter(self, value, device: int, step: int):
        """Put an output carried over a cut on ``device``'s worker, with the same time limit
        as any op: a worker that died or froze since the cut is a loss, not a hang."""
        import asyncio

        client, address = self.cl.client, self.workers[device]
        try:
            # a list of one: scatter would split a dict and use its keys as task keys
            return client.sync(lambda: asyncio.wait_for(client._scatter(
                [value], workers=[address], hash=False), self.res.timeout_floor_s))[0]
        except (TimeoutError, asyncio.TimeoutError):
            raise self._lost_or_stuck(device, address, "carry", step,
                                      "op stuck: worker did not take the carried outputs within "
                                      f"{self.res.timeout_floor_s:.0f} s") from None
        except Exception as e:
            if _is_loss(e) or "timed out" in str(e).lower():
                raise self._lost_or_stuck(device, address, "carry", step,
                                          f"worker lost ({type(e).__name__})") from None
            raise

    def _lost_or_stuck(self, device: int, address: str, op: str, step: int,
                       reason: str) -> _Lost:
        """A worker that did not answer: lost if it has left the cluster (killed, OOM), else
        stuck (frozen, hung in a collective) with ``reason``."""
        try:
            gone = address not in set(self._gpu_workers())
        except Exception:  # noqa: BLE001 — the scheduler itself is unreachable: report as given
            gone = False
        if gone:
            return _Lost(device, address, op, step, "worker lost (left the cluster)")
        return _Lost(device, address, op, step, reason)

    def _gave_up(self, task: Task, status: str, fl: Flight) -> _Lost:
        """The loss behind a task the scheduler gave up: the worker that left (with the op it
        was running), or, if every worker is still there, the task itself (with no worker to
        shun: the replacement pool keeps them all)."""
        try:
            self._check_alive(fl)
        except _Lost as lost:
            return lost
        return _Lost(task.device, "?", task.ids[0], task.step,
                     f"task {status} by the scheduler (an input of it was lost, or another "
                     "client cancelled it)")

    def _check_alive(self, fl: Flight | None = None) -> None:
        alive = set(self._gpu_workers(all_=True))
        for d, a in self.workers.items():
            if a not in alive:
                op, step = fl.running_on(d) if fl is not None else ("(none)", -1)
                raise _Lost(d, a, op, step, "worker lost (left the cluster)")

    def _recover(self, lost: _Lost) -> None:
        print(f"rpeg: {lost}; rolling back to step {self.state.start}", file=sys.stderr)
        record = {"attempt": self.attempt, "device": lost.device, "worker": lost.worker,
                  "op": lost.op, "step": lost.step, "reason": lost.reason,
                  "stimulus": lost.stimulus, "rolled_back_to": self.state.start,
                  "at": time.time()}
        self.meta.setdefault("recoveries", []).append(record)
        give_up, kill = C.on_loss(len(self.meta["recoveries"]), self.res.max_recoveries,
                                  stuck="stuck" in lost.reason)
        if give_up:
            raise RuntimeFailure(f"the run lost workers {len(self.meta['recoveries'])} times "
                                 f"(last: {lost}); giving up",
                                 hint=f"resume later with: rpeg run --resume {self.rd.path}")
        if kill:
            self._kill(lost.worker)
        # dropping the futures releases what has not run (each attempt has keys of its own);
        # an explicit cancel of a graph whose workers died trips assertions in the scheduler
        self._seg_futures = {}
        self._wait_idle(30.0)
        try:                     # the workers still there: a dead one would only time out
            alive = set(self._gpu_workers())
            abandoned = len(self._drain([a for a in self.workers.values() if a in alive]))
        except _Lost:
            abandoned = -1
        record["abandoned_ops"] = abandoned
        # roll back to the last cut: metrics, trace and carried outputs as they were there
        ck = self.state.checkpoint
        fresh = state_at(self.rd, ck)
        O.cut_back(self.rd.path, fresh.start)
        self.state.start, self.state.metrics = fresh.start, fresh.metrics
        self.state.events, self.state.pending, self.state.carry = (fresh.events, fresh.pending,
                                                                   fresh.carry)
        self.state.appended, self.state.traced = fresh.appended, 0
        self.rd.write_json("run.json", self.meta)

    def _kill(self, worker: str) -> None:
        pid = self.pids.get(worker)
        if self.options.scheduler is None and pid:
            try:
                os.kill(pid, signal.SIGKILL)
                return
            except ProcessLookupError:
                return
        try:
            self.cl.client.restart_workers([worker], timeout=30, raise_for_error=False)
        except Exception:  # noqa: BLE001 — it may be gone already
            pass

    def _wait_idle(self, timeout: float) -> None:
        end = time.time() + timeout
        while time.time() < end:
            try:
                busy = any(self.cl.client.processing().values())
            except Exception:  # noqa: BLE001
                busy = False
            if not busy:
                return
            time.sleep(0.2)

    def _gpu_workers(self, all_: bool = False) -> list[str]:
        info = self.cl.client.run_on_scheduler(_gpu_worker_addresses)
        return sorted(info)


def _gpu_worker_addresses(dask_scheduler=None) -> list[str]:
    return [a for a, ws in dask_scheduler.workers.items()
            if ws.resources.get("GPU", 0) >= 1 and ws.status.name == "running"]


def _is_loss(err) -> bool:
    name = type(err).__name__
    return name in ("KilledWorker", "CommClosedError", "FutureCancelledError",
                    "CancelledError") or isinstance(err, (ConnectionError, EOFError))
