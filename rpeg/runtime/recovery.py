"""Runs that survive: step checkpoints, worker loss and stuck ops, resume, Ctrl-C.

    >>> result = run_resilient(pipeline, plan, RunOptions(steps=60), spec_path=spec,
    ...                        resilience=Resilience(checkpoint_every=10))   # doctest: +SKIP
    >>> result = resume_run("runs/tiny_ppo-20261130-011500")                 # doctest: +SKIP

The run is cut into segments at step boundaries. A *cut* at step B is the set
of op calls every step before B needs — all ops of steps < B plus, with
staleness k, the generation of step B that must read version B - 1 before
training overwrites it in place (the write-after-read edges). A segment runs
the ops between two cuts on the scheduling core; at its cut every replica on
every worker is checkpointed (weights, optimizer state, version), with the
outputs made before the cut and read after it, so the state at a cut is
complete: re-running from it gives the same numbers as running through it
(all randomness is seeded by (seed, step)); under partial rollouts (a generate
stage's ``carry``) the responses an engine started early for later steps are
checkpointed with its replica and continued after the cut.

The ops the core releases are submitted as fused tasks (``rpeg.runtime.fusion``:
consecutive ready ops of one device in one Dask task, each op still traced on
its own); an output carried over a cut is one its task returns.

Faults, each handled by rolling back to the last cut:

* a worker process dies (SIGKILL, OOM): seen as its address leaving the
  scheduler, or as a task the scheduler cancels because something it needs went with
  the worker (an output scattered there at the cut, or one only it held) — whichever
  comes first; the nanny's replacement (or a spare worker) takes its device. A task
  that ends cancelled never ran: it is a loss, never dropped (dropped, the core waited
  for its ops with nothing in flight);
* an op is stuck: no task on a device finished for ``max(floor, factor x the
  plan's predicted time of the task's ops)`` since its inputs were ready
  (``rpeg.runtime.flight``); reported with op, step and worker, the worker is
  killed, and it is handled as a loss;
* too few workers remain: the plan is re-made for the devices left (split
  placement, same staleness), said in run.json and on stderr, and state is
  mapped by model onto the new layout.

Rolling back truncates metrics.jsonl and the trace to the cut, so no step
is lost or counted twice. Ctrl-C stops submitting past the next reachable cut,
lets the ops already started finish, checkpoints there and raises
:class:`Interrupted`; ``rpeg run --resume RUN_DIR`` continues from it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

import attrs

from rpeg.errors import RpegError, RuntimeFailure, Span
from rpeg.plan.model import Plan
from rpeg.runtime import checkpoint_io as ckio
from rpeg.runtime import core as C
from rpeg.runtime import fusion as F
from rpeg.runtime import outputs as O
from rpeg.runtime import worker as W
from rpeg.runtime.context import RunContext
from rpeg.runtime.cuts import Cuts
from rpeg.runtime.data import Cursor, eval_rows, workload_rows
from rpeg.runtime.driver import (
    RunOptions,
    RunResult,
    _Cluster,
    _Progress,
    _rendezvous,
    check_local_devices,
    uses_vllm,
)
from rpeg.runtime.flight import Flight, Task
from rpeg.runtime.instances import base_of, graph_for, model_homes
from rpeg.runtime.record import write_record
from rpeg.runtime.rundir import RunDir, host_usage, step_metrics
from rpeg.runtime.runfiles import RunLock
from rpeg.runtime.runstate import RunState, state_at
from rpeg.runtime.serial import dumps, plan_to_json
from rpeg.runtime.stopflag import StopFlag, Terminated
from rpeg.runtime.windows import CallWindows
from rpeg.spec.model import Pipeline


@attrs.frozen
class Resilience:
    checkpoint_every: int = 10         # steps between cuts (the last step always ends one)
    keep: int = 2                      # complete checkpoints kept
    timeout_factor: float = 10.0       # an op is stuck after factor x its predicted time ...
    timeout_floor_s: float = 120.0     # ... and never before this
    max_recoveries: int = 3
    replace_wait_s: float = 60.0       # how long to wait for a replacement worker
    poll_s: float = 0.1


SETUP_LIMIT_S = 600.0
ENDED = ("finished", "error", "cancelled")     # a future's end states ("lost" is not one)


class Interrupted(RpegError):
    """Ctrl-C: the run stopped at a checkpoint and can be resumed."""


class _Lost(Exception):
    def __init__(self, device: int, worker: str, op: str, step: int, reason: str) -> None:
        super().__init__(f"{reason}: device {device} ({worker}), op {op}, step {step}")
        self.device, self.worker, self.op, self.step, self.reason = device, worker, op, step, reason


# --- the run -------------------------------------------------------------------------------

def run_resilient(pipeline: Pipeline, plan: Plan, options: RunOptions,
                  spec_path: str | None = None, resilience: Resilience = Resilience(),
                  on_step=None, *, _resume: tuple[RunDir, RunState, dict] | None = None
                  ) -> RunResult:
    """Run ``plan`` with step checkpoints, surviving worker loss and stuck ops. The run
    directory is locked while the run writes it; one that already holds a run is refused
    (``rpeg run --resume`` continues it: ``rpeg.runtime.resume``)."""
    steps = options.steps or pipeline.workload.steps
    if options.scheduler is None:
        check_local_devices(plan.num_devices)             # before any worker process starts
    spec_dir = str(Path(spec_path).resolve().parent) if spec_path else str(Path.cwd())
    if _resume is not None:
        spec_dir = str(_resume[2].get("spec_dir", spec_dir))    # where the data and rewards are
        _check_data(pipeline, spec_dir)
        return _run(pipeline, plan, options, spec_path, resilience, on_step, *_resume,
                    resumed=True)
    _check_data(pipeline, spec_dir)
    rd = RunDir.create(options.root, pipeline.name, options.run_dir)
    with RunLock.take(rd.path):
        if rd.holds_run():
            raise _holds_run(rd)
        if spec_path:
            import shutil
            shutil.copyfile(spec_path, rd.path / "spec.rpeg")
        rd.write_text("pipeline.json", dumps(pipeline))
        rd.write_text("plan.json", plan_to_json(plan))
        meta = {"pipeline": pipeline.name, "steps": steps, "status": "running",
                "scheduler": options.scheduler or "local", "started": time.time(),
                "spec_dir": spec_dir, "recoveries": [], "replans": [], "resumes": [],
                "overrides": list(options.overrides)}
        rd.write_text("metrics.jsonl", "")
        state = RunState(0, [], [], defaultdict(list), {})
        return _run(pipeline, plan, options, spec_path, resilience, on_step, rd, state, meta)


def _check_data(pipeline: Pipeline, spec_dir: str) -> None:
    """A dataset problem (the workload's or the eval block's) stops the run here."""
    workload_rows(pipeline, spec_dir)
    if pipeline.evaluation is not None:
        eval_rows(pipeline, spec_dir)


def _holds_run(rd: RunDir) -> RuntimeFailure:
    """The refusal to start a run in a directory that holds one (its records would mix)."""
    try:
        meta = rd.read_json("run.json")
    except RpegError:
        meta = None
    what = ""
    if isinstance(meta, dict):
        what = (f" ({meta.get('pipeline', '?')}, {meta.get('status', '?')}, "
                f"{meta.get('steps', '?')} steps)")
    return RuntimeFailure(f"run directory '{rd.path}' must be empty or new for a new run, and "
                          f"it holds a run{what}; a second run would mix its records with "
                          "that one's", Span(str(rd.path), 0, 0),
                          hint=f"continue that run with: rpeg run --resume {rd.path} (add "
                               "--steps N to extend it), or choose another --run-dir")


def _run(pipeline, plan, options, spec_path, resilience, on_step, rd: RunDir,
         state: RunState, meta: dict, *, resumed: bool = False) -> RunResult:
    steps = int(meta["steps"])
    meta["checkpoint_every"] = resilience.checkpoint_every
    from rpeg.runtime.trackers import Trackers, chosen
    picked = chosen(pipeline, options.trackers)
    meta["trackers"] = [t.value for t in picked]      # TensorBoard reads it (tensorboard.py)
    rd.write_json("run.json", meta)
    stop = StopFlag()
    t_start = time.time()
    trackers = Trackers.open(pipeline, rd.path, picked,
                             config={"pipeline": pipeline.name, "steps": steps,
                                     "overrides": " ".join(meta.get("overrides", []))},
                             resume=resumed)
    runner = _Runner(pipeline, plan, options, resilience, rd, meta, state, steps,
                     str(meta["spec_dir"]), on_step, stop)
    runner.trackers = trackers
    try:
        stop.install_terminate(str(rd.path))        # SIGTERM closes the record, as Ctrl-C does
        # worker processes start with Ctrl-C ignored: a terminal sends it to the whole
        # process group, and they must live to finish the ops before the checkpoint
        with stop.ignored(), _Cluster(plan.num_devices, options.scheduler,
                                              uses_vllm(plan)) as cl:
            stop.install()
            runner.cl = cl
            try:
                runner.go()
            except BaseException:
                runner.salvage()                    # the ops that finished, for the trace
                raise
        meta["status"] = "ok"
        current = set(runner.workers.values())          # a restarted worker counts afresh
        host = host_usage([e for e in state.events if e.get("worker") in current],
                          runner.host_marks)
        if host is not None:
            meta["host"] = host
    except Interrupted:
        meta["status"] = "interrupted"
        raise
    except Terminated:
        meta["status"] = "terminated"
        raise
    except BaseException:
        meta["status"] = "failed"
        raise
    finally:
        stop.uninstall()
        trackers.close()
        try:
            if meta["status"] == "ok":
                state.write_trace(rd, runner.workers, meta.get("started", t_start), force=True)
            else:                            # and every op that finished after the last step
                rd.write_trace(state.events + state.unfinished(), runner.workers,
                               meta.get("started", t_start))
        except (OSError, RpegError) as e:
            print(f"rpeg: warning: trace.json not written: {e}", file=sys.stderr)
        meta["wall_s"] = meta.get("wall_s", 0.0) + time.time() - t_start
        rd.write_json("run.json", meta)
        write_record(rd.path, spec_path)
    return RunResult(rd.path, tuple(state.metrics), meta["wall_s"], steps)


def resume_run(run_dir: str | Path, options: RunOptions | None = None,
               resilience: Resilience = Resilience(), devices: int | None = None,
               on_step=None, steps: int | None = None) -> RunResult:
    """Continue a run directory from its last complete checkpoint (``rpeg.runtime.resume``)."""
    from rpeg.runtime.resume import resume
    return resume(run_dir, options, resilience, devices=devices, on_step=on_step, steps=steps)


class _Runner:
    def __init__(self, pipeline, plan, options, res, rd, meta, state, steps, spec_dir,
                 on_step, stop) -> None:
        self.pipeline, self.plan, self.options, self.res = pipeline, plan, options, res
        self.rd, self.meta, self.state, self.steps = rd, meta, state, steps
        self.spec_dir, self.on_step, self.stop = spec_dir, on_step, stop
        self.cl = None
        self._seg_futures: dict[str, object] = {}
        self.attempt = 0
        self.t0 = time.time()
        self.workers: dict[int, str] = {}
        self.pids: dict[str, int] = {}
        self.host_marks: list[tuple[int, float, float, int]] = []    # see host_usage
        self.bar = _Progress(steps, options.progress)
        self.trackers = None
        self.bar_done = state.start
        if self.bar.p is not None and state.start:
            self.bar.p.update(self.bar.task, advance=state.start)

    # one attempt per (re)start of the workers
    def go(self) -> None:
        try:
            while True:
                self.attempt += 1
                try:
                    self._start_workers()
                    self._segments()
                    return
                except _Lost as lost:
                    lost.__traceback__ = None      # frees the abandoned attempt's futures
                    self._recover(lost)
        finally:
            self.bar.close()

    def _start_workers(self) -> None:
        n = self.plan.num_devices
        workers = self._wait_workers(n)
        if workers is None:
            have = self._gpu_workers()
            if self.attempt == 1 and self.state.checkpoint is None:
                raise RuntimeFailure(f"the plan needs {n:,} devices, and the scheduler at "
                                     f"{self.options.scheduler} has {len(have)} worker(s) with "
                                     "resource GPU=1",
                                     hint="start one worker per device with --resources GPU=1, "
                                          "or plan for the workers there are")
            if not have:
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
        ctx = RunContext.create(self.pipeline, self.plan, self.calls_of.sample(),
                                spec_dir=self.spec_dir,
                                run_dir=str(self.rd.path), dist_addr=_rendezvous(workers[0]),
                                use_cuda=self.options.use_cuda)
        ctx = attrs.evolve(ctx, threads=self.options.threads, data=self._cursor(), syncs=tuple(
            attrs.evolve(s, addr=_rendezvous(workers[s.senders[0]])) for s in ctx.syncs))
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
                model, dev = key.rsplit("@", 1)
                if int(dev) == d:
                    sources[model] = str(ck.path / key)
            for key in saved:                                  # re-planned: map by model
                model, _ = key.rsplit("@", 1)
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

    def _evaluate(self, step: int) -> None:
        """The eval block at the cut at ``step`` (every ``every`` steps, the first and the
        last), on the trained actor's first home device; once per step, across resumes."""
        from rpeg.runtime.instances import base_of
        e = self.pipeline.evaluation
        if e is None or (step % e.every and step != self.steps) or O.evaluated(self.rd.path,
                                                                                step):
            return
        gen = next(s for s in self.pipeline.stages if s.kind.value == "generate")
        homes = {m: d for m, d in self.meta.get("homes", {}).items()
                 if gen.target in base_of(m).split("+")}
        if not homes:
            raise RuntimeFailure(f"eval needs a trained replica of '{gen.target}', and the "
                                 "plan trains none", e.span)
        model, devices = next(iter(homes.items()))
        device = devices[0]
        fut = self.cl.client.submit(_evaluate_on_worker, model, step,
                                    workers=[self.workers[device]], allow_other_workers=False,
                                    pure=False, key=f"eval-{step}-{self.cl.token}-{self.attempt}")
        row = self._gather([fut], f"eval at step {step}", [device])[0]
        kept = row.pop("kept", [])
        O.append_rows(self.rd.path, O.SAMPLES, [{"step": step, "eval": True, **r} for r in kept])
        O.append_rows(self.rd.path, O.EVALS, [row])
        self.trackers.log_eval(row)
        print(f"rpeg: {O.eval_line(row)}", file=sys.stderr, flush=True)

    def _segments(self) -> None:
        if self.state.start == 0:
            self._evaluate(0)                       # the untrained model, to compare with
        every = self.pipeline.evaluation.every if self.pipeline.evaluation else self.steps
        while self.state.start < self.steps:
            start = self.state.start
            end = min(self.steps, (start // self.res.checkpoint_every + 1)
                      * self.res.checkpoint_every, (start // every + 1) * every)
            self._window(start, end)
            before = self.cuts.closure(start) if start else set()
            inside = self.cuts.closure(end)
            end, inside = self._run_segment(start, end, inside - before, inside)
            self._checkpoint(end, inside)
            self._seg_futures = {}
            self._evaluate(end)
            if self.stop.requested:
                raise Interrupted(f"interrupted: stopped after step {end - 1} and wrote a "
                                  f"checkpoint; the run directory is {self.rd.path}",
                                  hint=f"continue with: rpeg run --resume {self.rd.path}")

    def _window(self, start: int, end: int) -> None:
        """The calls around the segment start..end: its table, cuts and consumers (built a
        window at a time, so a long run starts as fast as a short one)."""
        table = self.calls_of.around(start, end)
        if table is not getattr(self, "table", None):
            self.table = table
            self.cuts = Cuts(table)
            self.consumers = F.consumers_of(table.values())
        unknown = sorted(op for op in self.state.carry if op not in table)
        if unknown:
            raise RuntimeFailure(f"the checkpoint at step {start} carries outputs of op "
                                 f"'{unknown[0]}', which is not an op of this run's "
                                 f"{self.steps} steps", hint="was run.json edited? resume "
                                 "with the steps the run was made with (--steps N)")

    def _run_segment(self, start: int, end: int, seg: set[str], inside: set[str]):
        from distributed import as_completed

        cl, table = self.cl, self.table
        keep = self.cuts.carried(end)
        before = set(inside) - seg
        futures: dict[str, object] = {}              # op id -> the future of its task
        self._seg_futures = futures
        for op_id, value in self.state.carry.items():          # outputs from before the cut
            futures[op_id] = self._scatter({op_id: value}, table[op_id].device, start)
        core = C.Core.create(self.cuts.core_view(seg, end), end, self.window)
        core.steps_done = start
        fl = Flight()
        last_done = dict.fromkeys(self.workers, time.time())
        held: set[str] = set()
        limit_cut: set[str] | None = None
        last_step = time.time()
        last_alive = 0.0
        completions = as_completed()
        idle_s = 0.0005
        # an op with no future is done: it ran before the cut (or in this batch's groups)
        finished = lambda d: d not in futures or futures[d].status == "finished"  # noqa: E731
        task_of = lambda d: futures[d].key if d in futures else None             # noqa: E731
        instructions = core.handle(C.Started())
        while True:
            # submissions first: the per-step bookkeeping (a round trip to every worker)
            # must not delay work that is ready
            batch = []
            for ins in instructions:
                if isinstance(ins, C.Submit):
                    if limit_cut is not None and ins.call.id not in limit_cut:
                        held.add(ins.call.id)
                    else:
                        batch.append(table[ins.call.id])
            now = time.time()
            for g in F.fuse(batch, self.consumers, finished, self.options.fuse, task_of):
                f = F.submit(cl.client, g, futures, self.workers[g.device],
                             key=f"{g.ids[0]}+{len(g.ids) - 1}-{cl.token}-{self.attempt}")
                for op_id in g.ids:
                    futures[op_id] = f
                fl.add(f.key, Task(g.ids, g.device, g.calls[0].step, self._limit(g.calls),
                                   tuple(d for d in g.external if d in seg)), now)
                completions.add(f)
                self.meta["tasks"] = self.meta.get("tasks", 0) + 1
            for ins in instructions:
                if isinstance(ins, C.Release):
                    if ins.op_id not in keep:
                        futures.pop(ins.op_id, None)
                elif isinstance(ins, C.StepDone):
                    last_step = self._step_done(ins.step, last_step)
                elif isinstance(ins, C.Abort):
                    call = table[ins.op_id]
                    raise RuntimeFailure(
                        f"op '{ins.op_id}' (stage {call.op}, step {call.step}) failed on "
                        f"device {call.device}: {ins.error}",
                        hint="the trace and metrics up to the failure are in the run directory")
                elif isinstance(ins, C.Finish):
                    return end, inside
            if limit_cut is not None and limit_cut <= fl.done | before:
                return self._cut_short(end, limit_cut)
            if self.stop.requested and limit_cut is None:
                limit_cut, end = self._reachable_cut(fl.submitted(), start, end)
                inside = limit_cut
                keep = self.cuts.carried(end)
                if limit_cut <= fl.done | before:
                    return self._cut_short(end, limit_cut)
            if not len(fl):
                if held:
                    continue
                self._check_alive()               # a loss not seen yet is a loss, not a stall
                raise RuntimeFailure("the run stalled: nothing is running and nothing is left "
                                     "to submit (a bug in rpeg's scheduling)")
            # completions in batches without blocking, so the loss and stuck checks below run
            # however long an op takes; the pause grows while nothing finishes (at most 10 ms)
            got = completions.next_batch(block=False)
            if got:
                idle_s = 0.0005
            else:
                time.sleep(idle_s)
                idle_s = min(idle_s * 2, 0.01)
            now = time.time()
            instructions = []
            for f in got:
                ok = f.status == "finished"
                task = fl.finish(f.key, now, ok)
                if f.status == "error":
                    err = f.exception()
                    op_id = getattr(err, "rpeg_op", task.ids[0])
                    call = table[op_id]
                    if _is_loss(err):
                        raise _Lost(call.device, self.workers[call.device], op_id, call.step,
                                    f"worker lost ({type(err).__name__})")
                    if isinstance(err, RpegError):
                        raise err
                    instructions += core.handle(C.OpFailed(op_id, f"{type(err).__name__}: "
                                                                  f"{err}"))
                    continue
                if not ok:
                    # cancelled: the scheduler gave the task up because what it needs was lost
                    # with a worker (an output scattered there at the cut, or one only it
                    # held). Its ops never ran; forgetting it would leave the core waiting
                    # for them with nothing in flight (the run "stalled"): it is a loss.
                    raise self._gave_up(task, f.status, fl)
                last_done[task.device] = now
                for op_id in task.ids:
                    instructions += core.handle(C.OpDone(op_id))
            if now - last_alive > 0.5:
                last_alive = now
                self._check_alive(fl)
            if (hit := fl.stuck(last_done, now)) is not None:
                task, idle = hit
                raise self._lost_or_stuck(task.device, self.workers[task.device], task.ids[0],
                                          task.step, f"op stuck: no progress for {idle:.1f} s "
                                          f"(limit {task.limit_s:.1f} s from the plan's "
                                          f"prediction for {len(task.ids)} op(s))")

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

    def _step_done(self, step: int, last: float) -> float:
        now = time.time()
        for e in self._drain():
            self.state.pending[int(e["step"])].append(e)
        evs = self.state.pending.pop(step, [])
        O.append_rows(self.rd.path, O.SAMPLES, O.take_samples(step, evs))
        self.state.events += evs
        row = step_metrics(step, evs, now - last)
        cpu = os.times()
        cpu = cpu.user + cpu.system
        if self.host_marks:               # the client's CPU since the last step (checkpoints too)
            row["client_cpu_s"] = round(cpu - self.host_marks[-1][2], 5)
        self.host_marks.append((step, now, cpu, self.meta.get("tasks", 0)))
        self.rd.append_metrics(row)
        self.trackers.log(row)
        self.state.metrics.append(row)
        self.bar.update(row)
        if self.on_step is not None:
            self.on_step(row)
        return now

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

    def _limit(self, calls) -> float:
        """How long a task of ``calls`` may go without progress: ``timeout_factor`` x the
        plan's predicted time of its ops together, and never less than the floor (once per
        task: a frozen worker is found as fast whatever the task holds)."""
        predicted = dict(self.plan.predicted.op_times) if self.plan.predicted else {}
        t = sum(max((predicted.get(s, 0.0) for s in c.stages), default=0.0) for c in calls)
        return max(self.res.timeout_floor_s, self.res.timeout_factor * t)

    def _reachable_cut(self, started: set[str], start: int, end: int):
        """The first cut after ``start`` that holds every op already submitted."""
        for b in range(start + 1, end + 1):
            inside = self.cuts.closure(b)
            if started <= inside:
                return inside, b
        return self.cuts.closure(end), end

    def _cut_short(self, end: int, inside: set[str]):
        print(f"rpeg: interrupted: steps before {end} are done; writing a checkpoint",
              file=sys.stderr)
        return end, inside

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

    def _recover(self, lost: _Lost) -> None:
        print(f"rpeg: {lost}; rolling back to step {self.state.start}", file=sys.stderr)
        record = {"attempt": self.attempt, "device": lost.device, "worker": lost.worker,
                  "op": lost.op, "step": lost.step, "reason": lost.reason,
                  "rolled_back_to": self.state.start, "at": time.time()}
        self.meta.setdefault("recoveries", []).append(record)
        if len(self.meta["recoveries"]) > self.res.max_recoveries:
            raise RuntimeFailure(f"the run lost workers {len(self.meta['recoveries'])} times "
                                 f"(last: {lost}); giving up",
                                 hint=f"resume later with: rpeg run --resume {self.rd.path}")
        if "stuck" in lost.reason:
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


def _evaluate_on_worker(model: str, step: int) -> dict:
    return W._STATE["executor"].evaluate(model, step)


def _gpu_worker_addresses(dask_scheduler=None) -> list[str]:
    return [a for a, ws in dask_scheduler.workers.items()
            if ws.resources.get("GPU", 0) >= 1 and ws.status.name == "running"]


def _is_loss(err) -> bool:
    name = type(err).__name__
    return name in ("KilledWorker", "CommClosedError", "FutureCancelledError",
                    "CancelledError") or isinstance(err, (ConnectionError, EOFError))


def _best_source(saved: dict[str, int], model: str, ck) -> str:
    """For a model on a device it was not on before: its newest replica (a trained one
    first; of the same copy, or else of the backbone it copies)."""
    cands = [k for k in saved if k.rsplit("@", 1)[0] == model]
    newest = max((saved[k] for k in saved if base_of(k.rsplit("@", 1)[0]) == base_of(model)),
                 default=None)
    if not cands or (newest is not None and max(saved[k] for k in cands) < newest):
        cands = [k for k in saved if base_of(k.rsplit("@", 1)[0]) == base_of(model)]
    with_opt = [k for k in cands if (ck.path / k / "optimizer.safetensors").exists()]
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
