"""Checkpoints at cuts: the workers started (or restarted) from the last one, re-planned
when too few are left, and a checkpoint written at each cut.

    >>> runner._start_workers()                 # set-up, then restore   # doctest: +SKIP
    >>> runner._checkpoint(10, runner.cuts.closure(10))                  # doctest: +SKIP

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

import attrs

from rpeg.errors import RpegError, RuntimeFailure, Span
from rpeg.graph.ids import ReplicaAt, ReplicaKey
from rpeg.plan.model import Plan
from rpeg.runtime.core import scheduler as C
from rpeg.runtime.core.windows import CallWindows
from rpeg.runtime.dask import worker as W
from rpeg.runtime.dask.devices import Seen, cuda_choice, gpu_table
from rpeg.runtime.dask.driver import _rendezvous, plan_is_for_gpus
from rpeg.runtime.dask.losses import _Lost
from rpeg.runtime.data import Cursor
from rpeg.runtime.lowering.context import RunContext, tool_slots
from rpeg.runtime.lowering.instances import graph_for, model_homes
from rpeg.runtime.rundir import checkpoints as ckio
from rpeg.runtime.rundir.directory import RunDir
from rpeg.runtime.rundir.serial import plan_to_json
from rpeg.spec.model import Pipeline

SETUP_LIMIT_S = 600.0


class Checkpointing:
    """The runner's worker start, restore and checkpoints (a part of ``recovery._Runner``)."""

    def _start_workers(self) -> None:
        n = self.plan.num_devices
        workers = self._wait_workers(n)
        if workers is None:
            have = self._gpu_workers()
            decision = C.on_workers(n, len(have), started=self.attempt > 1
                                    or self.state.checkpoint is not None)
            if decision is C.Workers.REFUSE:
                raise RuntimeFailure(f"the plan needs {n:,} devices, and the scheduler at "
                                     f"{self.options.scheduler} has {len(have)} worker(s) with "
                                     "resource GPU=1",
                                     hint="start one worker per device with --resources GPU=1, "
                                          "or plan for the workers there are")
            if decision is C.Workers.GIVE_UP:
                raise RuntimeFailure("no worker with resource GPU=1 is left to continue on")
            self.plan = _replan(self.pipeline, self.plan, len(have), self.meta, self.rd,
                                why=f"only {len(have)} worker(s) left",
                                from_step=self.state.start)
            workers = dict(enumerate(have))
        self.workers = workers
        self.host_marks = []
        self.calls_of = CallWindows(self.pipeline, self.plan, self.steps, self.state.base)
        self._window(self.state.start, min(self.steps, self.state.start + 1))
        # k + 1 steps may run at once; one more is submitted ahead, so the scheduler holds
        # its ops and starts them the moment their inputs exist (no client round trip)
        self.window = max((k for _, k in self.plan.staleness), default=0) + 2
        cl = self.cl
        if self.attempt > 1:
            for a in workers.values():
                try:
                    self._run_on(a, W.teardown, 30.0)
                except (Exception, _Lost):  # noqa: BLE001 — a fresh replacement has nothing to tear down
                    pass
        seen = {d: self._run_on(a, W.device_report, 120.0) for d, a in workers.items()}
        cuda = cuda_choice(self.options.use_cuda, {d: len(r["gpus"]) for d, r in seen.items()})
        gpus = gpu_table({d: Seen(r["host"], tuple(r["gpus"])) for d, r in seen.items()}) \
            if cuda else ()
        ctx = RunContext.create(self.pipeline, self.plan, self.calls_of.sample(),
                                run_dir=str(self.rd.path), dist_addr=_rendezvous(workers[0]),
                                use_cuda=cuda)
        timeout = self.options.collective_timeout_s
        ctx = attrs.evolve(ctx, threads=self.options.threads, data=self._cursor(), gpus=gpus,
                           collective_timeout_s=timeout, tool_slots=tool_slots(self.plan),
                           syncs=tuple(attrs.evolve(s, addr=_rendezvous(workers[s.senders[0]]),
                                                    timeout_s=timeout) for s in ctx.syncs))
        _check_engine_hosts(ctx, seen, workers)
        self._say_devices(cuda, gpus)
        futs = [cl.client.submit(W.setup, ctx, d, workers=[a], allow_other_workers=False,
                                 key=f"setup-{d}-{cl.token}-{self.attempt}", pure=False)
                for d, a in workers.items()]
        try:
            # set-up imports torch and builds models: minutes on a busy machine, not seconds
            setup = self._gather(futs, "set-up", list(workers),
                                 limit_s=max(SETUP_LIMIT_S, 2 * self.res.timeout_floor_s))
        except (RpegError, _Lost):
            raise
        except Exception as e:
            raise RuntimeFailure(f"worker set-up must succeed, and it failed: "
                                 f"{type(e).__name__}: {e}") from e
        self.meta["setup_s"] = max(s["setup_s"] for s in setup)
        self.meta["workers"] = {str(d): a for d, a in workers.items()}
        self.meta["homes"] = {m: list(d) for m, d in model_homes(
            self.pipeline, self.plan, graph_for(self.pipeline, self.plan)).items()}
        history = self.meta.setdefault("worker_history", {})    # rpeg verify accepts each
        for d, a in workers.items():
            if a not in history.setdefault(str(d), []):
                history[str(d)].append(a)
        self.pids = {a: self._run_on(a, os.getpid, 60.0) for a in workers.values()}
        if self.state.checkpoint is not None:
            self._restore(self.state.checkpoint)
        self.rd.write_json("run.json", self.meta)

    def _say_devices(self, cuda: bool, gpus) -> None:
        """Record where the ops run; say it once when a plan priced for GPUs runs on CPU."""
        first = "cuda" not in self.meta
        self.meta["cuda"] = cuda
        if cuda:
            self.meta["gpus"] = {str(d): f"{g.host}:{g.gpu}" for d, g in enumerate(gpus)}
        elif first and plan_is_for_gpus(self.plan):
            print(f"rpeg: warning: the plan was priced for the GPU cluster "
                  f"'{self.plan.cluster}' and runs on CPU workers (no GPU that torch can use, "
                  "or --cpu): its predicted times and memory are that cluster's, not these "
                  "workers'", file=sys.stderr)

    def _wait_workers(self, n: int) -> dict[int, str] | None:
        end = time.time() + (self.res.replace_wait_s if self.attempt > 1 else 30.0)
        lost = {r["worker"] for r in self.meta.get("recoveries", [])}
        while True:
            have = [a for a in self._gpu_workers() if a not in lost]
            if len(have) >= n:
                return dict(enumerate(have[:n]))
            if time.time() > end:
                return None
            time.sleep(0.25)

    def _restore(self, ck: ckio.Checkpoint) -> None:
        # "model@device" -> version, of the replicas whose files the checkpoint holds (a
        # frozen model and a copy equal to its trained replica are rebuilt, not saved)
        saved = {k: v for k, v in dict(ck.state.get("replicas", {})).items()
                 if (ck.path / k).is_dir()}
        restart = ck.step == self.state.base > 0            # an extended run restarts here
        futs = []
        for d, a in self.workers.items():
            sources = {}
            for key in saved:
                if ReplicaAt(key).device == d:
                    sources[ReplicaAt(key).key] = str(ck.path / key)
            for key in saved:                                  # re-planned: map by model
                model = ReplicaAt(key).key
                if restart:                # every replica at the newest version, as at step 0
                    sources[model] = str(ck.path / _best_source(saved, model, ck))
                sources.setdefault(model, str(ck.path / _best_source(saved, model, ck)))
            futs.append(self.cl.client.submit(ckio.restore_replicas, sources, workers=[a],
                                              allow_other_workers=False, pure=False,
                                              key=f"restore-{d}-{self.cl.token}-{self.attempt}"))
        try:
            self._gather(futs, "restore", list(self.workers))
        except (RpegError, _Lost):
            raise
        except Exception as e:  # noqa: BLE001 — a checkpoint file the backend cannot load
            raise RuntimeFailure(f"checkpoint '{ck.path}' must restore every replica, and it "
                                 f"does not ({type(e).__name__}: {e})"[:500],
                                 Span(str(ck.path), 0, 0),
                                 hint="remove it to resume from the one before") from None

    def _cursor(self) -> Cursor:
        """Where step ``state.start`` reads its prompts: from the checkpoint, else the start."""
        ck = self.state.checkpoint
        cursor = Cursor.from_json(ck.state.get("data")) if ck is not None else Cursor()
        return cursor

    def _checkpoint(self, cut: int, inside: set[str]) -> None:
        cl, rd = self.cl, self.rd
        keep = self.cuts.carried(cut)
        for e in self._drain():
            self.state.pending[int(e["step"])].append(e)
        carry = {}
        if keep:
            # a task returns {op id: outputs} for the ops it keeps; each task gathered once
            tasks = {}
            for op_id in sorted(keep):
                tasks.setdefault(self._seg_futures[op_id].key, (self._seg_futures[op_id],
                                                                self.table[op_id].device))
            got = dict(zip(tasks, self._gather([f for f, _ in tasks.values()], "carry",
                                               [d for _, d in tasks.values()]), strict=True))
            carry = {op_id: got[self._seg_futures[op_id].key][op_id] for op_id in sorted(keep)}
        tmp = ckio.begin(rd.path, cut)
        held = {}                      # only what a resume cannot rebuild is written
        for v in self._gather([cl.client.submit(
                ckio.replica_versions, workers=[a], allow_other_workers=False, pure=False,
                key=f"versions-{cut}-{d}-{cl.token}-{self.attempt}")
                for d, a in self.workers.items()], "versions", list(self.workers)):
            held.update(v)
        skip = tuple(sorted(ckio.rebuildable(held)))
        saves = [cl.client.submit(ckio.save_replicas, str(tmp), cut, skip, workers=[a],
                                  allow_other_workers=False, pure=False,
                                  key=f"ckpt-{cut}-{d}-{cl.token}-{self.attempt}")
                 for d, a in self.workers.items()]
        versions: dict[str, int] = {}
        for v in self._gather(saves, f"checkpoint at step {cut}", list(self.workers)):
            versions.update(v)
        ckio.save_tree(tmp, "carry", carry)
        size = rd.append_events(self.state.events[self.state.appended:])
        self.state.appended = len(self.state.events)
        self.state.write_trace(rd, self.workers, self.meta.get("started", self.t0))
        pending = [e for evs in self.state.pending.values() for e in evs]
        self.state.checkpoint = ckio.commit(rd.path, tmp, cut, {
            "replicas": versions, "events_bytes": size, "events_count": len(self.state.events),
            "pending": pending,
            "metrics_rows": len(self.state.metrics), "num_devices": self.plan.num_devices,
            "carry": sorted(carry), "run_steps": self.steps, "base": self.state.base,
            "data": self._cursor().moved_to(cut, self.pipeline.workload.prompts).to_json()})
        ckio.prune(rd.path, keep=self.res.keep)
        self.state.start = cut
        self.state.carry = carry


def _best_source(saved: dict[str, int], model: str, ck) -> str:
    """For a model on a device it was not on before: its newest replica (a trained one
    first; of the same copy, or else of the backbone it copies)."""
    backbone = ReplicaKey(model).backbone
    cands = [k for k in saved if ReplicaAt(k).key == model]
    newest = max((saved[k] for k in saved if ReplicaAt(k).key.backbone == backbone),
                 default=None)
    if not cands or (newest is not None and max(saved[k] for k in cands) < newest):
        cands = [k for k in saved if ReplicaAt(k).key.backbone == backbone]
    with_opt = [k for k in cands if ckio.holds_optimizer(ck.path / k)]
    return max(with_opt or cands, key=lambda k: saved[k])


def _replan(pipeline: Pipeline, plan: Plan, devices: int, meta: dict, rd: RunDir,
            why: str, from_step: int) -> Plan:
    """Re-plan for ``devices``; the new plan governs steps from ``from_step`` (the cut the
    run rolled back or resumed to), which ``rpeg verify`` reads from the replan record."""
    from rpeg.runtime.placement import split_plan
    k = max((b for _, b in plan.staleness), default=0)
    new = split_plan(pipeline, devices, staleness=k, share=bool(plan.shared))
    meta.setdefault("replans", []).append({"why": why, "from_devices": plan.num_devices,
                                           "to_devices": devices, "from_step": from_step,
                                           "at": time.time()})
    n = len(meta["replans"])
    rd.write_text(f"plan.{n - 1}.json", plan_to_json(plan))
    rd.write_text("plan.json", plan_to_json(new))
    print(f"rpeg: re-planned for {devices} device(s) ({why}); the old plan is in "
          f"plan.{n - 1}.json", file=sys.stderr)
    return new


def _check_engine_hosts(ctx: RunContext, seen: dict, workers: dict) -> None:
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
