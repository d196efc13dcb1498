"""Loss detection and rollback: the Dask calls of a resilient run, watched for workers
that leave or stop answering, and the rollback to the last cut when one does.

    >>> setup = watch.gather(futs, "set-up", list(watch.workers))      # doctest: +SKIP
    WorkerLost: worker lost (left the cluster): device 1 (tcp://127.0.0.1:40123), op set-up, step 0

Every wait on a worker has a time limit and a check that the worker is still in the
cluster: a worker that left (killed, OOM) raises :class:`WorkerLost` as a loss, one still
there that does not answer is *stuck* (frozen, hung in a collective) and is killed
when the run recovers. :class:`Watch` makes those calls; :class:`Rollback` records the
loss in run.json and rolls metrics, trace and carried outputs back to the last
checkpoint; the runner (``rpeg.runtime.dask.runner``) then restarts the workers from it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import attrs

from rpeg.errors import RuntimeFailure
from rpeg.runtime.core import choices as K
from rpeg.runtime.core import scheduler as C
from rpeg.runtime.core.flight import Flight, Task, first_silent
from rpeg.runtime.dask import worker as W
from rpeg.runtime.rundir import outputs as O
from rpeg.runtime.rundir.directory import RunDir
from rpeg.runtime.rundir.meta import Recovery, RunMeta
from rpeg.runtime.rundir.state import RunState, state_at


class WorkerLost(Exception):
    def __init__(self, device: int, worker: str, op: str, step: int, reason: str, *,
                 stimulus: str = "", stuck: bool = False) -> None:
        super().__init__(f"{reason}: device {device} ({worker}), op {op}, step {step}")
        self.device, self.worker, self.op, self.step, self.reason = device, worker, op, step, reason
        self.stimulus = stimulus        # the core's event that found it ("" = seen outside it)
        self.stuck = stuck              # still in the cluster, not answering: killed first

    def caused_by(self, stimulus: str) -> WorkerLost:
        self.stimulus = self.stimulus or stimulus
        return self


@attrs.define
class Watch:
    """The run's calls to its workers and the scheduler, each turning a loss into
    :class:`WorkerLost`. ``workers`` (device -> worker address) is the attempt's; ``state``
    says the step the run is at, for the reports."""

    client: object                              # the run's distributed.Client
    limits: K.Limits                            # how long a worker may take to answer
    state: RunState
    workers: dict[int, str] = attrs.field(factory=dict)

    def gather(self, futs: list, what: str, devices: list[int] | None = None,
               limit_s: float | None = None) -> list:
        """Results of ``futs``, watching the workers meanwhile: a worker that dies (or was
        already gone) raises WorkerLost instead of waiting forever on a task pinned to it."""
        from distributed import wait

        start = time.time()
        limit_s = limit_s or self.limits.gather_s
        pending = list(futs)
        at = K.waiting([f.status for f in pending], 0.0, limit_s)
        while at is not K.Wait.ENDED:             # where it stands is the core's to say
            self.check_alive()
            try:
                wait(pending, timeout=0.5)
            except TimeoutError:
                pass
            pending = [f for f in pending if f.status not in K.ENDED]
            at = K.waiting([f.status for f in pending], time.time() - start, limit_s)
            if at is K.Wait.STUCK:
                late = list(dict.fromkeys(devices[futs.index(f)] for f in pending)) \
                    if devices else []
                d = first_silent(late, self.silent(late) if len(late) > 1 else set())
                raise self.lost_or_stuck(d, self.workers.get(d, "?"), what, self.state.start,
                                         f"op stuck: {what} took over {limit_s:.0f} s")
        if K.lost_in((f.status, f.exception() if f.status == "error" else None) for f in futs):
            self.check_alive()
            raise WorkerLost(-1, "?", what, self.state.start, "worker lost during " + what)
        return self.client.gather(futs)

    def salvage(self) -> None:
        """The events of ops that finished since the last step, from every worker that
        answers within seconds: a run that stops early leaves them in its trace."""
        import asyncio
        try:
            client, addrs = self.client, list(self.workers.values())
            got = client.sync(lambda: asyncio.wait_for(
                client._run(W.drain, workers=addrs, on_error="return"), 5.0))
            for a in addrs:
                if isinstance(got.get(a), list):
                    for e in got[a]:
                        self.state.pending[int(e["step"])].append(e)
        except BaseException:  # noqa: BLE001 — best effort while the run is already ending
            pass

    def drain(self, addrs: list[str] | None = None) -> list[dict]:
        """Trace events recorded on every device's worker (or on ``addrs``) since the last
        drain: one round trip to all of them at once; when one does not answer or fails,
        each is asked on its own, and a worker that does not answer (frozen, hung in a
        collective) is reported as stuck."""
        import asyncio

        client, every = self.client, addrs is None
        addrs = list(self.workers.values()) if addrs is None else addrs
        try:
            got = client.sync(lambda: asyncio.wait_for(
                client._run(W.drain, workers=addrs, on_error="return"),
                self.limits.drain_s))
            if all(isinstance(got.get(a), list) for a in addrs):
                return [e for a in addrs for e in got[a]]
        except Exception:  # noqa: BLE001 — asked one by one below, which tells which failed
            pass
        if every:
            self.check_alive()            # a worker that left is a loss now, not after timeouts
        out: list[dict] = []
        for a in addrs:
            try:
                out += self.run_on(a, W.drain, self.limits.floor_s)
            except WorkerLost:
                raise
            except Exception:  # noqa: BLE001 — a worker died mid-drain: the loss check sees it
                continue
        return out

    def run_on(self, address: str, fn, timeout: float):
        """``client.run`` on one worker, with a time limit (a frozen worker never answers)."""
        import asyncio

        client = self.client
        device = next((d for d, a in self.workers.items() if a == address), -1)
        try:
            got = client.sync(lambda: asyncio.wait_for(
                client._run(fn, workers=[address], on_error="raise"), timeout))
        except (TimeoutError, asyncio.TimeoutError):
            raise self.lost_or_stuck(device, address, fn.__name__, self.state.start,
                                     f"op stuck: worker did not answer within {timeout:.0f} s"
                                     ) from None
        except Exception as e:
            if C.is_loss(e):
                raise WorkerLost(device, address, fn.__name__, self.state.start,
                            f"worker lost ({type(e).__name__})") from None
            raise
        return got[address]

    def silent(self, devices) -> set[int]:
        """Of ``devices``, those whose workers do not answer within ``limits.answer_s`` (all
        asked at once): frozen, or gone."""
        import asyncio

        client = self.client
        addrs = {d: self.workers[d] for d in devices if d in self.workers}

        async def ask():
            return await asyncio.gather(*(asyncio.wait_for(
                client._run(os.getpid, workers=[a], on_error="raise"), self.limits.answer_s)
                for a in addrs.values()), return_exceptions=True)

        try:
            got = client.sync(ask)
        except Exception:  # noqa: BLE001 — the scheduler itself does not answer: blame none
            return set()
        return {d for d, g in zip(addrs, got, strict=True) if isinstance(g, BaseException)}

    def scatter(self, value, device: int, step: int):
        """Put an output carried over a cut on ``device``'s worker, with the same time limit
        as any op: a worker that died or froze since the cut is a loss, not a hang."""
        import asyncio

        client, address = self.client, self.workers[device]
        try:
            # a list of one: scatter would split a dict and use its keys as task keys
            return client.sync(lambda: asyncio.wait_for(client._scatter(
                [value], workers=[address], hash=False), self.limits.floor_s))[0]
        except (TimeoutError, asyncio.TimeoutError):
            raise self.lost_or_stuck(device, address, "carry", step,
                                     "op stuck: worker did not take the carried outputs within "
                                     f"{self.limits.floor_s:.0f} s") from None
        except Exception as e:
            if K.carry_lost(e):
                raise self.lost_or_stuck(device, address, "carry", step,
                                         f"worker lost ({type(e).__name__})", stuck=False
                                         ) from None
            raise

    def lost_or_stuck(self, device: int, address: str, op: str, step: int,
                      reason: str, *, stuck: bool = True) -> WorkerLost:
        """A worker that did not answer: lost if it has left the cluster (killed, OOM), else
        ``stuck`` (frozen, hung in a collective: killed before the rollback) with ``reason``."""
        try:
            gone = address not in set(self.gpu_workers())
        except Exception:  # noqa: BLE001 — the scheduler itself is unreachable: report as given
            gone = False
        if gone:
            return WorkerLost(device, address, op, step, "worker lost (left the cluster)")
        return WorkerLost(device, address, op, step, reason, stuck=stuck)

    def gave_up(self, task: Task, status: str, fl: Flight) -> WorkerLost:
        """The loss behind a task the scheduler gave up: the worker that left (with the op it
        was running), or, if every worker is still there, the task itself (with no worker to
        shun: the replacement pool keeps them all)."""
        try:
            self.check_alive(fl)
        except WorkerLost as lost:
            return lost
        return WorkerLost(task.device, "?", task.ids[0], task.step,
                     f"task {status} by the scheduler (an input of it was lost, or another "
                     "client cancelled it)")

    def check_alive(self, fl: Flight | None = None) -> None:
        alive = set(self.gpu_workers())
        for d, a in self.workers.items():
            if a not in alive:
                op, step = fl.running_on(d) if fl is not None else ("(none)", -1)
                raise WorkerLost(d, a, op, step, "worker lost (left the cluster)")

    def kill(self, worker: str, pid: int | None, local: bool) -> None:
        """End a stuck worker: by its pid on a cluster of our own (``local``), else by
        asking the scheduler to restart it."""
        if local and pid:
            try:
                os.kill(pid, signal.SIGKILL)
                return
            except ProcessLookupError:
                return
        try:
            self.client.restart_workers([worker], timeout=self.limits.quick_s,
                                        raise_for_error=False)
        except Exception:  # noqa: BLE001 — it may be gone already
            pass

    def wait_idle(self, timeout: float) -> None:
        end = time.time() + timeout
        while time.time() < end:
            try:
                busy = any(self.client.processing().values())
            except Exception:  # noqa: BLE001
                busy = False
            if not busy:
                return
            time.sleep(0.2)

    def gpu_workers(self) -> list[str]:
        info = self.client.run_on_scheduler(_gpu_worker_addresses)
        return sorted(info)


@attrs.frozen
class Rollback:
    """The rollback after a loss: recorded in run.json, the stuck worker killed, the
    attempt's work dropped, and the run's state, metrics and trace back at the last cut."""

    watch: Watch
    meta: RunMeta
    rd: RunDir
    state: RunState
    max_recoveries: int
    local: bool                                 # the cluster is ours (a stuck worker's pid)

    def __call__(self, lost: WorkerLost, attempt: int, pids: dict[str, int]) -> None:
        print(f"rpeg: {lost}; rolling back to step {self.state.start}", file=sys.stderr)
        record = Recovery(attempt, lost.device, lost.worker, lost.op, lost.step, lost.reason,
                          lost.stimulus, self.state.start, time.time())
        self.meta.recoveries.append(record)
        give_up, kill = K.on_loss(len(self.meta.recoveries), self.max_recoveries,
                                  stuck=lost.stuck)
        if give_up:
            raise RuntimeFailure(f"the run lost workers {len(self.meta.recoveries)} times "
                                 f"(last: {lost}); giving up",
                                 hint=f"resume later with: rpeg run --resume {self.rd.path}")
        watch = self.watch
        if kill:
            watch.kill(lost.worker, pids.get(lost.worker), self.local)
        # the attempt's futures went with it (each attempt has keys of its own); an explicit
        # cancel of a graph whose workers died trips assertions in the scheduler
        watch.wait_idle(watch.limits.quick_s)
        try:                     # the workers still there: a dead one would only time out
            alive = set(watch.gpu_workers())
            abandoned = len(watch.drain([a for a in watch.workers.values() if a in alive]))
        except WorkerLost:
            abandoned = -1
        self.meta.recoveries[-1] = attrs.evolve(record, abandoned_ops=abandoned)
        # roll back to the last cut: metrics, trace and carried outputs as they were there
        state = self.state
        fresh = state_at(self.rd, state.checkpoint)
        O.cut_back(self.rd.path, fresh.start)
        state.start, state.metrics = fresh.start, fresh.metrics
        state.events, state.pending, state.carry = fresh.events, fresh.pending, fresh.carry
        state.appended, state.traced = fresh.appended, 0
        self.rd.write_json("run.json", self.meta.to_json())


def _gpu_worker_addresses(dask_scheduler=None) -> list[str]:
    return [a for a, ws in dask_scheduler.workers.items()
            if ws.resources.get("GPU", 0) >= 1 and ws.status.name == "running"]
