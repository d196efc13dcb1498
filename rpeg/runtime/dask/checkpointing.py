"""Checkpoints at cuts: the workers started (or restarted) from the last one, re-planned
when too few are left, and a checkpoint written at each cut.

    >>> attempt = starter.start(1, plan)        # set-up, then restore   # doctest: +SKIP
    >>> checkpointer(10, carried, attempt, futures)   # the cut at step 10  # doctest: +SKIP

At a cut every replica on every worker is saved (weights, optimizer state,
version; one a resume can rebuild is not), with the outputs made before the cut
and read after it, the trace events so far and the data cursor
(``rpeg.runtime.rundir.checkpoints`` writes and commits the files). Starting an attempt
sets every worker up for the plan and restores its replicas from the last
checkpoint, mapped by model when the plan was re-made for fewer devices.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict

import attrs

from rpeg.errors import RpegError, RuntimeFailure, Span
from rpeg.plan.model import Plan
from rpeg.runtime.core import choices as K
from rpeg.runtime.core.windows import CallWindows, SegmentCalls
from rpeg.runtime.dask import worker as W
from rpeg.runtime.dask.devices import Seen, cuda_choice, gpu_table
from rpeg.runtime.dask.driver import (
    DaskCluster,
    RunOptions,
    plan_is_for_gpus,
    rendezvous_at,
)
from rpeg.runtime.dask.losses import Watch, WorkerLost
from rpeg.runtime.data import Cursor
from rpeg.runtime.lowering.context import RunContext, tool_slots
from rpeg.runtime.lowering.instances import graph_for, model_homes
from rpeg.runtime.rundir import checkpoints as ckio
from rpeg.runtime.rundir.directory import RunDir
from rpeg.runtime.rundir.meta import Extension, Replan, RunMeta
from rpeg.runtime.rundir.serial import plan_to_json
from rpeg.runtime.rundir.state import RunState
from rpeg.spec.model import Pipeline


@attrs.frozen(eq=False)
class Attempt:
    """One start of the run's workers: what the segments between losses run with."""

    number: int                                 # 1, then one more after each loss
    plan: Plan                                  # re-made when too few workers are left
    workers: dict[int, str]                     # device -> worker address
    calls: SegmentCalls
    window: int                                 # steps in flight at once


@attrs.frozen(eq=False)
class Starter:
    """Workers started (or restarted after a loss) for the plan: found, set up, and
    restored from the last checkpoint (mapped by model onto a re-made plan)."""

    pipeline: Pipeline
    options: RunOptions
    replace_wait_s: float                       # how long to wait for a replacement worker
    steps: int
    cl: DaskCluster
    watch: Watch
    rd: RunDir
    meta: RunMeta
    state: RunState
    pids: dict[str, int]                        # worker address -> its process (filled here)

    def start(self, number: int, plan: Plan) -> Attempt:
        n = plan.num_devices
        watch = self.watch
        workers = self._wait_workers(n, number)
        if workers is None:
            have = watch.gpu_workers()
            decision = K.on_workers(n, len(have), started=number > 1
                                    or self.state.checkpoint is not None)
            if decision is K.Workers.REFUSE:
                raise RuntimeFailure(f"the plan needs {n:,} devices, and the scheduler at "
                                     f"{self.options.scheduler} has {len(have)} worker(s) with "
                                     "resource GPU=1",
                                     hint="start one worker per device with --resources GPU=1, "
                                          "or plan for the workers there are")
            if decision is K.Workers.GIVE_UP:
                raise RuntimeFailure("no worker with resource GPU=1 is left to continue on")
            plan = replan(self.pipeline, plan, len(have), self.meta, self.rd,
                           why=f"only {len(have)} worker(s) left", from_step=self.state.start,
                           state=self.state)
            workers = dict(enumerate(have))
        watch.workers = workers
        calls = SegmentCalls(CallWindows(self.pipeline, plan, self.steps, self.state.base))
        calls.move(self.state.start, min(self.steps, self.state.start + 1), self.state.carry)
        window = K.window_of(plan.staleness)
        cl = self.cl
        if number > 1:
            for a in workers.values():
                try:
                    watch.run_on(a, W.teardown, watch.limits.quick_s)
                except (Exception, WorkerLost):  # noqa: BLE001 — a fresh replacement has nothing to tear down
                    pass
        seen = {d: watch.run_on(a, W.device_report, watch.limits.report_s)
                for d, a in workers.items()}
        cuda = cuda_choice(self.options.use_cuda, {d: len(r["gpus"]) for d, r in seen.items()})
        gpus = gpu_table({d: Seen(r["host"], tuple(r["gpus"])) for d, r in seen.items()}) \
            if cuda else ()
        def meet(address: str) -> str:
            return rendezvous_at(address, watch.run_on(address, W.free_port,
                                                     watch.limits.quick_s))
        ctx = RunContext.create(self.pipeline, plan, calls.calls.sample(),
                                run_dir=str(self.rd.path), dist_addr=meet(workers[0]),
                                use_cuda=cuda)
        timeout = self.options.collective_timeout_s
        ctx = attrs.evolve(ctx, threads=self.options.threads, data=cursor_of(self.state),
                           gpus=gpus, collective_timeout_s=timeout, tool_slots=tool_slots(plan),
                           syncs=tuple(attrs.evolve(s, addr=meet(workers[s.senders[0]]),
                                                    timeout_s=timeout) for s in ctx.syncs))
        check_engine_hosts(ctx, seen, workers)
        self._say_devices(plan, cuda, gpus)
        futs = [cl.client.submit(W.setup, ctx, d, workers=[a], allow_other_workers=False,
                                 key=f"setup-{d}-{cl.token}-{number}", pure=False)
                for d, a in workers.items()]
        try:
            setup = watch.gather(futs, "set-up", list(workers),
                                 limit_s=watch.limits.setup_s)
        except (RpegError, WorkerLost):
            raise
        except Exception as e:
            raise RuntimeFailure(f"worker set-up must succeed, and it failed: "
                                 f"{type(e).__name__}: {e}") from e
        meta = self.meta
        meta.setup_s = max(s["setup_s"] for s in setup)
        meta.workers = dict(workers)
        meta.homes = {m: list(d) for m, d in model_homes(
            self.pipeline, plan, graph_for(self.pipeline, plan)).items()}
        for d, a in workers.items():                       # rpeg verify accepts each
            if a not in meta.worker_history.setdefault(d, []):
                meta.worker_history[d].append(a)
        self.pids.clear()
        self.pids.update({a: watch.run_on(a, os.getpid, watch.limits.quick_s)
                          for a in workers.values()})
        if self.state.checkpoint is not None:
            self._restore(self.state.checkpoint, workers, number)
        self.rd.write_json("run.json", meta.to_json())
        return Attempt(number, plan, workers, calls, window)

    def _say_devices(self, plan: Plan, cuda: bool, gpus) -> None:
        """Record where the ops run; say it once when a plan priced for GPUs runs on CPU."""
        first = self.meta.cuda is None
        self.meta.cuda = cuda
        if cuda:
            self.meta.gpus = {d: f"{g.host}:{g.gpu}" for d, g in enumerate(gpus)}
        elif first and plan_is_for_gpus(plan):
            print(f"rpeg: warning: the plan was priced for the GPU cluster "
                  f"'{plan.cluster}' and runs on CPU workers (no GPU that torch can use, "
                  "or --cpu): its predicted times and memory are that cluster's, not these "
                  "workers'", file=sys.stderr)

    def _wait_workers(self, n: int, number: int) -> dict[int, str] | None:
        end = time.time() + K.workers_wait_s(number, self.replace_wait_s)
        lost = self.meta.lost_workers()
        while True:
            workers = K.take_workers(self.watch.gpu_workers(), lost, n)
            if workers is not None or time.time() > end:
                return workers
            time.sleep(0.25)

    def _restore(self, ck: ckio.Checkpoint, workers: dict[int, str], number: int) -> None:
        # "model@device" -> version, of the replicas whose files the checkpoint holds (a
        # frozen model and a copy equal to its trained replica are rebuilt, not saved)
        saved = {k: v for k, v in dict(ck.state.get("replicas", {})).items()
                 if (ck.path / k).is_dir()}
        restart = ck.step == self.state.base > 0            # an extended run restarts here
        trained = {k for k in saved if ckio.holds_optimizer(ck.path / k)}
        cl = self.cl
        futs = []
        for d, a in workers.items():
            sources = {model: str(ck.path / k) for model, k in K.restore_sources(
                saved, d, trained, restart=restart).items()}
            futs.append(cl.client.submit(ckio.restore_replicas, sources, workers=[a],
                                         allow_other_workers=False, pure=False,
                                         key=f"restore-{d}-{cl.token}-{number}"))
        try:
            self.watch.gather(futs, "restore", list(workers))
        except (RpegError, WorkerLost):
            raise
        except Exception as e:  # noqa: BLE001 — a checkpoint file the backend cannot load
            raise RuntimeFailure(f"checkpoint '{ck.path}' must restore every replica, and it "
                                 f"does not ({type(e).__name__}: {e})"[:500],
                                 Span(str(ck.path), 0, 0),
                                 hint="remove it to resume from the one before") from None


def cursor_of(state: RunState) -> Cursor:
    """Where step ``state.start`` reads its prompts: from the checkpoint, else the start."""
    ck = state.checkpoint
    return Cursor.from_json(ck.state.get("data")) if ck is not None else Cursor()


@attrs.frozen(eq=False)
class Checkpointer:
    """The checkpoint at a cut: every replica on every worker (but those a resume can
    rebuild), the outputs carried over the cut, the trace so far and the data cursor."""

    pipeline: Pipeline
    steps: int
    keep: int                                   # complete checkpoints kept
    t0: float                                   # the run's start, if run.json has none
    cl: DaskCluster
    watch: Watch
    rd: RunDir
    meta: RunMeta
    state: RunState

    def __call__(self, cut: int, keep: frozenset[str], attempt: Attempt,
                 futures: dict[str, object]) -> None:
        """Checkpoint at ``cut`` with the outputs of ``keep`` (the ops whose outputs are
        read past it, as the core says); ``futures``: op id -> the future of its task."""
        cl, rd, state, watch = self.cl, self.rd, self.state, self.watch
        for e in watch.drain():
            state.pending[int(e["step"])].append(e)
        carry = {}
        if keep:
            # a task returns {op id: outputs} for the ops it keeps; each task gathered once
            table = attempt.calls.table
            tasks = {}
            for op_id in sorted(keep):
                tasks.setdefault(futures[op_id].key, (futures[op_id], table[op_id].device))
            got = dict(zip(tasks, watch.gather([f for f, _ in tasks.values()], "carry",
                                               [d for _, d in tasks.values()]), strict=True))
            carry = {op_id: got[futures[op_id].key][op_id] for op_id in sorted(keep)}
        tmp = ckio.begin(rd.path, cut)
        held = {}                      # only what a resume cannot rebuild is written
        workers, number = attempt.workers, attempt.number
        for v in watch.gather([cl.client.submit(
                ckio.replica_versions, workers=[a], allow_other_workers=False, pure=False,
                key=f"versions-{cut}-{d}-{cl.token}-{number}")
                for d, a in workers.items()], "versions", list(workers)):
            held.update(v)
        skip = tuple(sorted(K.rebuildable(held)))
        saves = [cl.client.submit(ckio.save_replicas, str(tmp), cut, skip, workers=[a],
                                  allow_other_workers=False, pure=False,
                                  key=f"ckpt-{cut}-{d}-{cl.token}-{number}")
                 for d, a in workers.items()]
        versions: dict[str, int] = {}
        hashed: dict[str, tuple[int, str]] = {}         # as each writer hashed its files
        for v, files in watch.gather(saves, f"checkpoint at step {cut}", list(workers)):
            versions.update(v)
            hashed.update(files)
        ckio.save_tree(tmp, "carry", carry)
        size = rd.append_events(state.events[state.appended:])
        state.appended = len(state.events)
        state.write_trace(rd, workers, self.meta.started_or(self.t0))
        pending = [e for evs in state.pending.values() for e in evs]
        state.checkpoint = ckio.commit(rd.path, tmp, cut, {
            "replicas": versions, "events_bytes": size, "events_count": len(state.events),
            "pending": pending,
            "metrics_rows": len(state.metrics), "num_devices": attempt.plan.num_devices,
            "carry": sorted(carry), "run_steps": self.steps, "base": state.base,
            "data": cursor_of(state).moved_to(cut, self.pipeline.workload.prompts).to_json()},
            hashed=hashed)
        ckio.prune(rd.path, keep=self.keep)           # all but the newest: choices.pruned
        state.start = cut
        state.carry = carry


def replan(pipeline: Pipeline, plan: Plan, devices: int, meta: RunMeta, rd: RunDir,
            why: str, from_step: int, state: RunState) -> Plan:
    """Re-plan for ``devices``; the new plan governs steps from ``from_step`` (the cut the
    run rolled back or resumed to), which ``rpeg verify`` reads from the replan record.
    What the old plan carried over the cut (outputs of later steps, made by its ops and
    chunks) is no input of the new plan's: the run restarts at the cut with every replica
    at the checkpoint's version, as an extended run does (run.json's ``extensions``)."""
    from rpeg.runtime.placement import split_plan
    k = max((b for _, b in plan.staleness), default=0)
    new = split_plan(pipeline, devices, staleness=k, share=bool(plan.shared))
    if state.carry or state.pending:
        state.base, state.carry, state.pending = from_step, {}, defaultdict(list)
        meta.extensions.append(Extension(from_step, meta.steps, meta.steps, time.time()))
    meta.replans.append(Replan(why, plan.num_devices, devices, from_step, time.time()))
    n = len(meta.replans)
    rd.write_text(f"plan.{n - 1}.json", plan_to_json(plan))
    rd.write_text("plan.json", plan_to_json(new))
    print(f"rpeg: re-planned for {devices} device(s) ({why}); the old plan is in "
          f"plan.{n - 1}.json", file=sys.stderr)
    return new


def check_engine_hosts(ctx: RunContext, seen: dict, workers: dict) -> None:
    """A vLLM engine starts child processes, which a daemonic worker cannot have: refuse,
    naming the fix, before any engine tries (the embedded cluster's workers are not)."""
    from rpeg.spec.model import Engine
    hosts = {d for p in ctx.plan.placements if p.engine is Engine.VLLM for d in p.devices}
    daemonic = sorted(d for d in hosts if d in seen and seen[d]["daemon"])
    if daemonic:
        raise RuntimeFailure(f"the vLLM engines of devices {daemonic} start child processes, "
                             f"and their workers ({', '.join(workers[d] for d in daemonic)}) "
                             "are daemon processes, which cannot have children",
                             hint="start those workers with DASK_DISTRIBUTED__WORKER__DAEMON="
                                  "False dask worker ... (tutorial 05)")
