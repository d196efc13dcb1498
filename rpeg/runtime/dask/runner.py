"""Runs that survive: step checkpoints, worker loss and stuck ops, resume, Ctrl-C.

    >>> result = run_resilient(pipeline, plan, RunOptions(steps=60), spec_path=spec,
    ...                        resilience=Resilience(checkpoint_every=10))   # doctest: +SKIP
    >>> result = resume_run("runs/tiny_ppo-20261130-011500")  # dask.resume  # doctest: +SKIP

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

The ops the core releases are submitted as fused tasks (``rpeg.runtime.core.fusion``:
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
  (``rpeg.runtime.core.flight``); reported with op, step and worker, the worker is
  killed, and it is handled as a loss;
* too few workers remain: the plan is re-made for the devices left (split
  placement, same staleness), said in run.json and on stderr, and state is
  mapped by model onto the new layout.

Rolling back truncates metrics.jsonl and the trace to the cut, so no step
is lost or counted twice. Ctrl-C stops submitting past the next reachable cut,
lets the ops already started finish, checkpoints there and raises
:class:`Interrupted`; ``rpeg run --resume RUN_DIR`` continues from it.

This module is the public face and the run's frame (its directory, status and
attempts); the runner composes its parts, each given what it needs:
``rpeg.runtime.dask.losses`` (``Watch``: the calls to the workers, loss and stuck
detection; ``Rollback``), ``rpeg.runtime.dask.checkpointing`` (``Starter``: worker start
and restore; ``Checkpointer``: the checkpoint at each cut) and
``rpeg.runtime.dask.segments`` (``SegmentLoop``, with ``Recorder`` for each step and
``Evals``); run.json is ``rpeg.runtime.rundir.meta.RunMeta``.
"""

from __future__ import annotations

import os
import sys
import time
from collections import defaultdict
from pathlib import Path

from rpeg.destinations import check_not_around
from rpeg.errors import RpegError, RuntimeFailure, Span
from rpeg.plan.model import Plan
from rpeg.runtime.core import choices as K
from rpeg.runtime.dask.checkpointing import Checkpointer, Starter
from rpeg.runtime.dask.driver import (
    DaskCluster,
    Resilience,
    RunOptions,
    RunResult,
    StepProgress,
    check_local_devices,
    plan_is_for_gpus,
    uses_vllm,
)
from rpeg.runtime.dask.losses import Rollback, Watch, WorkerLost
from rpeg.runtime.dask.segments import Evals, Interrupted, Recorder, SegmentLoop, Tally
from rpeg.runtime.dask.stopflag import StopFlag, Terminated
from rpeg.runtime.inputs import check_inputs, fingerprints, recorded_paths
from rpeg.runtime.rundir import files as rf
from rpeg.runtime.rundir.directory import RunDir, host_usage
from rpeg.runtime.rundir.files import RunLock
from rpeg.runtime.rundir.meta import RunMeta, Status
from rpeg.runtime.rundir.record import write_record
from rpeg.runtime.rundir.serial import dumps, plan_to_json
from rpeg.runtime.rundir.state import RunState
from rpeg.runtime.rundir.trackers import Trackers, check_installed, chosen
from rpeg.spec.model import Pipeline

__all__ = ["Resilience", "Interrupted", "kept", "run", "run_resilient"]


# --- the run -------------------------------------------------------------------------------

def run(pipeline: Pipeline, plan: Plan, options: RunOptions, spec_path: str | None = None,
        on_step=None) -> RunResult:
    """Execute ``plan`` for ``pipeline`` with one checkpoint, at the end; write and return the
    run directory. The run is the resilient runner's with a single segment and no recovery:
    a lost worker fails the run."""
    return run_resilient(pipeline, plan, options, spec_path,
                         Resilience(checkpoint_every=0, max_recoveries=0), on_step)


def run_resilient(pipeline: Pipeline, plan: Plan, options: RunOptions,
                  spec_path: str | None = None, resilience: Resilience = Resilience(),
                  on_step=None, *, _resume: tuple[RunDir, RunState, RunMeta] | None = None
                  ) -> RunResult:
    """Run ``plan`` with step checkpoints, surviving worker loss and stuck ops. The run
    directory is locked while the run writes it; one that already holds a run is refused
    (``rpeg run --resume`` continues it: ``rpeg.runtime.dask.resume``).

    A start is atomic: nothing is written to the run directory until the inputs (the
    datasets, the reward's module, the trackers, the directory itself) are checked and the
    cluster is reached; a start that fails after that and before its first step leaves the
    directory marked ``failed-before-start``, and the same command runs into it again."""
    steps = options.steps or pipeline.workload.steps
    if options.scheduler is None:
        check_local_devices(plan.num_devices)             # before any worker process starts
    check_installed(chosen(pipeline, options.trackers))
    stop = StopFlag()
    if _resume is not None:                         # its inputs checked by the resume
        with stop.ignored(), _cluster(plan, options) as cl:
            return _run(pipeline, plan, options, spec_path, resilience, on_step, *_resume,
                        cl=cl, stop=stop, resumed=True)
    check_inputs(pipeline)
    where = RunDir.target(options.root, pipeline.name, options.run_dir)
    check_not_around(where, "--run-dir", tuple(Path(p) for _, p, _ in recorded_paths(pipeline))
                     + ((Path(spec_path),) if spec_path else ()))
    if where.is_dir():
        rf.check_unlocked(where)                    # a run writing it: said with its pid
        if RunDir(where).holds_run():
            raise _holds_run(RunDir(where))
        others = sorted(p.name for p in where.iterdir()
                        if p.name not in rf.FILES + rf.FOLDERS)
        if others and not RunDir(where).failed_start():     # the user's own files
            raise RuntimeFailure(f"run directory '{where}' must be empty or new for a new run, "
                                 f"and it holds {', '.join(others[:5])}"
                                 + (f" and {len(others) - 5} more" if len(others) > 5 else "")
                                 + ", which no run wrote", Span(str(where), 0, 0),
                                 hint="choose a new or empty --run-dir: a run's files would "
                                      "mix with them")
    # worker processes start with Ctrl-C ignored: a terminal sends it to the whole process
    # group, and they must live to finish the ops before the checkpoint
    with stop.ignored(), _cluster(plan, options) as cl:
        rd = RunDir.create(options.root, pipeline.name, where)
        with RunLock.take(rd.path):
            if rd.holds_run():
                raise _holds_run(rd)
            rd.clear_failed_start()
            if spec_path:
                rf.write_atomic(rd.path / "spec.rpeg", Path(spec_path).read_bytes())
            rd.write_text("pipeline.json", dumps(pipeline))
            rd.write_text("plan.json", plan_to_json(plan))
            meta = RunMeta.new(pipeline.name, steps=steps,
                               scheduler=options.scheduler or "local", started=time.time(),
                               spec=str(Path(spec_path).absolute()) if spec_path else None,
                               overrides=options.overrides)
            meta.files = fingerprints(pipeline)     # what a resume checks it reads again
            rd.write_text("metrics.jsonl", "")
            state = RunState(0, [], [], defaultdict(list), {})
            return _run(pipeline, plan, options, spec_path, resilience, on_step, rd, state,
                        meta, cl=cl, stop=stop)


def _cluster(plan: Plan, options: RunOptions) -> DaskCluster:
    return DaskCluster(plan.num_devices, options.scheduler, uses_vllm(plan), options.use_cuda,
                    _host_bytes(plan))


def _holds_run(rd: RunDir) -> RuntimeFailure:
    """The refusal to start a run in a directory that holds one (its records would mix)."""
    try:
        meta = rd.read_json("run.json")
    except RpegError:
        meta = None
    if not isinstance(meta, dict):
        files = [f for f in rf.FILES if f != rf.LOCK and os.path.lexists(rd.path / f)]
        return RuntimeFailure(f"run directory '{rd.path}' must be empty or new for a new run, "
                              f"and it holds {', '.join(files)}, which a run writes; the run "
                              f"would replace {'it' if len(files) == 1 else 'them'}",
                              Span(str(rd.path), 0, 0),
                              hint="choose a new or empty --run-dir")
    what = (f" ({meta.get('pipeline', '?')}, {meta.get('status', '?')}, "
            f"{meta.get('steps', '?')} steps)")
    return RuntimeFailure(f"run directory '{rd.path}' must be empty or new for a new run, and "
                          f"it holds a run{what}; a second run would mix its records with "
                          "that one's", Span(str(rd.path), 0, 0),
                          hint=f"continue that run with: rpeg run --resume {rd.path} (add "
                               "--steps N to extend it), or choose another --run-dir")


def _run(pipeline, plan, options, spec_path, resilience, on_step, rd: RunDir,
         state: RunState, meta: RunMeta, *, cl: DaskCluster, stop: StopFlag,
         resumed: bool = False) -> RunResult:
    steps = meta.steps
    meta.checkpoint_every = resilience.checkpoint_every
    picked = chosen(pipeline, options.trackers)
    meta.trackers = [t.value for t in picked]        # TensorBoard reads it (tensorboard.py)
    rd.write_json("run.json", meta.to_json())
    t_start = time.time()
    runner = _Runner(pipeline, plan, options, resilience, steps, on_step, rd, meta, state,
                     cl, stop)
    trackers = None
    try:
        trackers = Trackers.open(pipeline, rd.path, picked,
                                 config={"pipeline": pipeline.name, "steps": steps,
                                         "overrides": " ".join(meta.overrides)},
                                 resume=resumed)
        stop.install_terminate(str(rd.path))        # SIGTERM closes the record, as Ctrl-C does
        stop.install()
        try:
            runner.go(trackers)
        except BaseException:
            runner.watch.salvage()                  # the ops that finished, for the trace
            raise
        meta.status, meta.error = Status.OK, None        # a resumed failure: done now
        current = set(runner.watch.workers.values())    # a restarted worker counts afresh
        host = host_usage([e for e in state.events if e.get("worker") in current],
                          runner.tally.marks, task_steps=runner.tally.task_steps)
        if host is not None:
            meta.host = host
    except Interrupted:
        meta.status = Status.INTERRUPTED
        raise
    except Terminated:
        meta.status = Status.TERMINATED
        raise
    except BaseException as e:
        meta.status = Status.FAILED
        meta.error = failure_text(e)
        raise
    finally:
        if meta.status is not Status.OK and not resumed and not state.metrics \
                and not state.events and not state.unfinished() and not rd.checkpoints():
            meta.status = Status.NOT_STARTED       # no op ran: the start can be retried
        stop.uninstall()
        if trackers is not None:
            trackers.close()
        workers = runner.watch.workers
        try:
            if meta.status is Status.OK:
                state.write_trace(rd, workers, meta.started_or(t_start), force=True)
            else:                            # and every op that finished after the last step
                rd.write_trace(state.events + state.unfinished(), workers,
                               meta.started_or(t_start))
        except (OSError, RpegError) as e:
            print(f"rpeg: warning: trace.json not written: {e}", file=sys.stderr)
        meta.wall_s = (meta.wall_s or 0.0) + time.time() - t_start
        rd.write_json("run.json", meta.to_json())
        write_record(rd.path, spec_path)
    return RunResult(rd.path, tuple(state.metrics), meta.wall_s, steps)


def failure_text(e: BaseException) -> str:
    """What run.json records of why a run stopped: the error as rpeg said it (where, what),
    or the exception's type and message; one line, at most 2,000 characters."""
    text = e.located if isinstance(e, RpegError) else f"{type(e).__name__}: {e}"
    return " ".join(text.split())[:2000]


def _host_bytes(plan: Plan) -> float:
    """Host memory one device worker needs: a CPU device's predicted peak (its memory is
    the host's); on GPUs the model lives on the device."""
    peaks = plan.predicted.peak_memory if plan.predicted is not None else ()
    if not peaks or plan_is_for_gpus(plan):
        return 0.0
    return float(max(peaks))


class _Runner:
    """One run's attempts, composed of its parts: the watch on its workers (``losses``),
    their start and the checkpoint at each cut (``checkpointing``), the segment loop
    with its step records and evals (``segments``), and the rollback after a loss."""

    def __init__(self, pipeline: Pipeline, plan: Plan, options: RunOptions, res: Resilience,
                 steps: int, on_step, rd: RunDir, meta: RunMeta, state: RunState,
                 cl: DaskCluster, stop: StopFlag) -> None:
        self.pipeline, self.plan, self.options, self.res = pipeline, plan, options, res
        self.steps, self.on_step = steps, on_step
        self.rd, self.meta, self.state, self.cl, self.stop = rd, meta, state, cl, stop
        self.tally = Tally()
        self.pids: dict[str, int] = {}
        self.watch = Watch(cl.client, K.Limits(res.timeout_factor, res.timeout_floor_s), state)
        self.starter = Starter(pipeline, options, res.replace_wait_s, steps, cl, self.watch,
                               rd, meta, state, self.pids)
        self.checkpointer = Checkpointer(pipeline, steps, kept(pipeline), time.time(), cl,
                                         self.watch, rd, meta, state)
        self.rollback = Rollback(self.watch, meta, rd, state, res.max_recoveries,
                                 local=options.scheduler is None)

    def go(self, trackers: Trackers) -> None:
        """Attempts until one reaches the last step: each (re)starts the workers and runs
        the segments; a loss rolls back to the last cut and starts the next."""
        bar = StepProgress(self.steps, self.options.progress)
        if bar.p is not None and self.state.start:
            bar.p.update(bar.task, advance=self.state.start)
        record = Recorder(self.watch, self.rd, self.meta, self.state, self.tally, trackers,
                          bar, self.on_step)
        evals = Evals(self.pipeline, self.steps, self.cl, self.watch, self.rd, self.meta,
                      trackers)
        number = 0
        try:
            while True:
                number += 1
                try:
                    self._attempt(number, record, evals)
                    return
                except WorkerLost as lost:
                    lost.__traceback__ = None      # frees the abandoned attempt's futures
                    self.rollback(lost, number, self.pids)
        finally:
            bar.close()

    def _attempt(self, number: int, record: Recorder, evals: Evals) -> None:
        self.tally.marks.clear()
        attempt = self.starter.start(number, self.plan)
        self.plan = attempt.plan
        every = self.pipeline.evaluation.every if self.pipeline.evaluation else None
        SegmentLoop(self.options, self.res, self.steps, every, attempt, self.cl, self.watch,
                    self.checkpointer, record, evals, self.rd, self.meta, self.state,
                    self.tally, self.stop).run()


def kept(pipeline: Pipeline) -> int:
    """The complete checkpoints a run keeps (the workload's ``keep_checkpoints``; 0: every
    one), which the checkpointer prunes to."""
    return pipeline.workload.keep_checkpoints or 1 << 62
