"""The segment loop: the ops between two cuts run on the scheduling core, as fused Dask
tasks, with each step's metrics written as it ends and the eval block at each cut.

    >>> SegmentLoop(...).run()      # every segment up to the last step   # doctest: +SKIP

A segment runs from the run's last cut to the next checkpoint (or eval) step; the
core (``rpeg.runtime.core.scheduler``) says what to submit, ``rpeg.runtime.core.fusion`` packs it
into tasks and ``rpeg.runtime.core.flight`` tracks them, so a lost worker or a stuck op
is raised as a loss (``rpeg.runtime.dask.losses``) for the runner to roll back. Ctrl-C
cuts the segment short at the first cut that holds every op already submitted, and
the run stops there with :class:`Interrupted` once its checkpoint is written.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import attrs

from rpeg.errors import RpegError, RuntimeFailure
from rpeg.runtime.core import choices as K
from rpeg.runtime.core import fusion as F
from rpeg.runtime.core import scheduler as C
from rpeg.runtime.core.flight import Task
from rpeg.runtime.dask import worker as W
from rpeg.runtime.dask.checkpointing import Attempt, Checkpointer
from rpeg.runtime.dask.driver import DaskCluster, Resilience, RunOptions, StepProgress
from rpeg.runtime.dask.losses import Watch, WorkerLost
from rpeg.runtime.dask.stopflag import StopFlag
from rpeg.runtime.rundir import outputs as O
from rpeg.runtime.rundir.directory import RunDir, step_metrics
from rpeg.runtime.rundir.meta import RunMeta
from rpeg.runtime.rundir.state import RunState
from rpeg.runtime.rundir.trackers import Trackers
from rpeg.spec.model import Pipeline


class Interrupted(RpegError):
    """Ctrl-C: the run stopped at a checkpoint and can be resumed."""


@attrs.define
class Tally:
    """What the run counts for its host usage (``rpeg.runtime.rundir.directory.host_usage``):
    a mark at each step of the attempt (step, time, the client's CPU, tasks so far), and
    the Dask tasks submitted, by the step they run."""

    marks: list[tuple[int, float, float, int]] = attrs.field(factory=list)
    task_steps: dict[int, int] = attrs.field(factory=dict)


@attrs.frozen(eq=False)
class Recorder:
    """A finished step written down: its samples, its metrics row (to metrics.jsonl, the
    trackers, the progress bar and ``on_step``) and its trace events."""

    watch: Watch
    rd: RunDir
    meta: RunMeta
    state: RunState
    tally: Tally
    trackers: Trackers
    bar: StepProgress
    on_step: Callable[[dict], None] | None

    def __call__(self, step: int, last: float) -> float:
        """Step ``step`` is done (the step before it ended at ``last``): when it ended."""
        now = time.time()
        state = self.state
        for e in self.watch.drain():
            state.pending[int(e["step"])].append(e)
        evs = state.pending.pop(step, [])
        O.append_rows(self.rd.path, O.SAMPLES, O.take_samples(step, evs))
        state.events += evs
        row = step_metrics(step, evs, now - last)
        cpu = os.times()
        cpu = cpu.user + cpu.system
        marks = self.tally.marks
        if marks:                         # the client's CPU since the last step (checkpoints too)
            row["client_cpu_s"] = round(cpu - marks[-1][2], 5)
        marks.append((step, now, cpu, self.meta.tasks))
        self.rd.append_metrics(row)
        self.trackers.log(row)
        state.metrics.append(row)
        self.bar.update(row)
        if self.on_step is not None:
            self.on_step(row)
        return now


@attrs.frozen(eq=False)
class Evals:
    """The eval block at a cut (every ``every`` steps, the first and the last), on the
    trained actor's first home device; once per step, across resumes."""

    pipeline: Pipeline
    steps: int
    cl: DaskCluster
    watch: Watch
    rd: RunDir
    meta: RunMeta
    trackers: Trackers

    def __call__(self, step: int, attempt: int) -> None:
        from rpeg.runtime.lowering.instances import base_of
        e = self.pipeline.evaluation
        if not K.eval_due(step, self.steps, e.every if e else None) \
                or O.evaluated(self.rd.path, step):       # once per step, across resumes
            return
        gen = next(s for s in self.pipeline.stages if s.kind.value == "generate")
        home = K.eval_home(self.meta.homes or {}, lambda m: gen.target in base_of(m).members)
        if home is None:
            raise RuntimeFailure(f"eval needs a trained replica of '{gen.target}', and the "
                                 "plan trains none", e.span)
        model, device = home
        cl = self.cl
        fut = cl.client.submit(_evaluate_on_worker, model, step,
                               workers=[self.watch.workers[device]], allow_other_workers=False,
                               pure=False, key=f"eval-{step}-{cl.token}-{attempt}")
        row = self.watch.gather([fut], f"eval at step {step}", [device])[0]
        kept = row.pop("kept", [])
        O.append_rows(self.rd.path, O.SAMPLES, [{"step": step, "eval": True, **r} for r in kept])
        O.append_rows(self.rd.path, O.EVALS, [row])
        self.trackers.log_eval(row)
        print(f"rpeg: {O.eval_line(row)}", file=sys.stderr, flush=True)


@attrs.frozen(eq=False)
class SegmentLoop:
    """One attempt's segments, from the run's last cut to its last step (or a loss)."""

    options: RunOptions
    res: Resilience
    steps: int
    eval_every: int | None                     # the spec's eval cadence, if it has one
    attempt: Attempt
    cl: DaskCluster
    watch: Watch
    checkpoint: Checkpointer
    record: Recorder
    evaluate: Evals
    rd: RunDir
    meta: RunMeta
    state: RunState
    tally: Tally
    stop: StopFlag

    def run(self) -> None:
        state, calls = self.state, self.attempt.calls
        if state.start == 0:
            self.evaluate(0, self.attempt.number)        # the untrained model, to compare with
        while state.start < self.steps:
            start = state.start
            end = K.next_cut(start, self.steps, self.res.checkpoint_every, self.eval_every)
            calls.move(start, end, state.carry)
            end, carried, futures = self._run_segment(start, end,
                                                      *calls.cuts.segment(start, end))
            self.checkpoint(end, carried, self.attempt, futures)
            del futures
            self.evaluate(end, self.attempt.number)
            self.stop.check()
            if self.stop.requested:
                raise Interrupted(f"interrupted: stopped after step {end - 1} and wrote a "
                                  f"checkpoint; the run directory is {self.rd.path}",
                                  hint=f"continue with: rpeg run --resume {self.rd.path}")

    def _run_segment(self, start: int, end: int, seg: set[str], inside: set[str]):
        """Run the segment's ops on the scheduling core, which makes every decision; this
        loop only carries its instructions out on Dask and reports what happened. Returns
        the step the segment ended at, the ops whose outputs cross its cut, and the
        futures of their tasks."""
        from distributed import as_completed

        cl, calls, workers = self.cl, self.attempt.calls, self.attempt.workers
        table, cuts = calls.table, calls.cuts
        plan, number = self.attempt.plan, self.attempt.number
        fusion = calls.calls.fusion                 # the placed value's (Placed.fusion)
        op_times = dict(plan.predicted.op_times) if plan.predicted else {}
        limits = self.watch.limits
        futures: dict[str, object] = {}              # op id -> the future of its task
        for op_id, value in self.state.carry.items():          # outputs from before the cut
            futures[op_id] = self.watch.scatter({op_id: value}, table[op_id].device, start)
        core = C.Core.create(cuts.core_view(seg, end), end, self.attempt.window, start=start,
                             cuts=cuts, before=set(inside) - seg, devices=workers)
        last_step = time.time()
        completions = as_completed()
        idle_s = 0.0005
        instructions = core.handle(C.Started(time.time()))
        while True:
            # submissions first: the per-step bookkeeping (a round trip to every worker)
            # must not delay work that is ready
            batch = [table[i.call.id] for i in instructions if isinstance(i, C.Submit)]
            now = time.time()
            # packed by what the core has heard (never by a future's status, which races it)
            for g in F.fuse(batch, calls.consumers, core.is_done, self.options.fuse,
                            core.task_of, fusion):
                f = submit_group(cl.client, g, futures, workers[g.device],
                                 key=f"{g.ids[0]}+{len(g.ids) - 1}-{cl.token}-{number}")
                for op_id in g.ids:
                    futures[op_id] = f
                core.handle(C.TaskSubmitted(f.key, Task(
                    g.ids, g.device, g.calls[0].step,
                    limits.task([c.stages for c in g.calls], op_times),
                    tuple(d for d in g.external if d in seg), _reads_from(g, table)), now))
                completions.add(f)
                self.meta.tasks += 1
                steps = self.tally.task_steps
                steps[g.calls[0].step] = steps.get(g.calls[0].step, 0) + 1
            follow: list = []                       # the core's answers to what was asked
            for ins in instructions:
                if isinstance(ins, C.Release):
                    futures.pop(ins.op_id, None)
                elif isinstance(ins, C.StepDone):
                    last_step = self.record(ins.step, last_step)
                elif isinstance(ins, C.CutShort):
                    print(f"rpeg: interrupted: steps before {ins.end} are done; writing a "
                          "checkpoint", file=sys.stderr)
                    return ins.end, ins.carried, futures
                elif isinstance(ins, C.Finish):
                    return end, ins.carried, futures
                elif isinstance(ins, C.Stopping):
                    end = ins.end                   # the core holds what is past its cut
                elif not isinstance(ins, C.Submit):
                    follow += self._carry_out(ins, core, table)
            if follow:
                instructions = follow
                continue
            self.stop.check()
            if self.stop.requested and not core.stopping:
                instructions = core.handle(C.StopRequested())
                continue
            # completions in batches without blocking, so the loss and stuck checks run
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
                instructions += core.handle(_ended(f, now))
            instructions += core.handle(C.Tick(now))

    def _carry_out(self, ins, core, table) -> list:
        """The core's instructions that end the segment with an error (each raises) or ask
        the cluster something (the core's answer to what it heard is returned)."""
        watch, workers = self.watch, self.attempt.workers
        if isinstance(ins, C.Abort):
            if isinstance(ins.cause, RpegError):
                raise ins.cause
            call = table[ins.op_id]
            raise RuntimeFailure(
                f"op '{ins.op_id}' (stage {call.op}, step {call.step}) failed on "
                f"device {call.device}: {ins.error}",
                hint="the trace and metrics up to the failure are in the run directory")
        if isinstance(ins, C.CheckAlive):
            watch.check_alive(core.flight)
        elif isinstance(ins, C.Ask):
            silent = watch.silent(ins.devices)
            return core.handle(C.Answers(time.time(), frozenset(silent),
                                         id=f"{ins.stimulus}/answers"))
        elif isinstance(ins, C.Stalled):
            raise RuntimeFailure("the run stalled: nothing is running and nothing is left "
                                 "to submit (a bug in rpeg's scheduling)")
        elif isinstance(ins, C.Lost):
            raise WorkerLost(ins.device, workers[ins.device], ins.op_id, ins.step, ins.reason,
                        stimulus=ins.stimulus)
        elif isinstance(ins, C.GaveUp):
            raise watch.gave_up(ins.task, ins.status, core.flight).caused_by(ins.stimulus)
        elif isinstance(ins, C.Stuck):
            task = ins.task
            waiting = "".join(f"; device {d} waits for it in a collective"
                              for d in ins.blocked) \
                + "".join(f"; device {d} waits to read an output it holds" for d in ins.reading)
            raise watch.lost_or_stuck(task.device, workers[task.device],
                                      core.running(task), task.step,
                                      f"op stuck: no progress for {ins.idle_s:.1f} "
                                      f"s (limit {task.limit_s:.1f} s from the plan's "
                                      f"prediction for {len(task.ids)} op(s)){waiting}"
                                      ).caused_by(ins.stimulus)
        else:
            raise TypeError(f"unknown instruction {ins!r}")
        return []


def submit_group(client, g: F.Group, futures: dict, worker: str, key: str):
    """Submit ``g`` as one Dask task pinned to ``worker``, prioritised by its step.

    Its arguments are the futures (``futures``: op id -> the future of its task) of the
    other tasks whose results the calls read, each passed once, and of the tasks they only
    wait for (ordering edges); an ordering dependency with no future finished before (an op
    before a checkpoint cut) and is not waited for."""
    args: list = []
    index: dict[str, int] = {}
    own = set(g.ids)

    def arg(f) -> int:
        if f.key not in index:
            index[f.key] = len(args)
            args.append(f)
        return index[f.key]

    where = []
    for call in g.calls:
        where.append(tuple((-1, d) if d in own else (arg(futures[d]), d) for d in call.deps))
        for a in call.after:
            if a not in own and a in futures:
                arg(futures[a])
    # of two tasks ready on one worker the older step's runs first (Dask runs higher priority
    # first, and equal priorities in submission order): a step's cheap tail (a reward, say)
    # must not wait behind the next step's generation while another device waits for it
    return client.submit(W.run_group, g.calls, g.keep, tuple(where), *args, key=key,
                         workers=[worker], allow_other_workers=False, pure=False,
                         priority=-g.calls[0].step)


def _reads_from(g: F.Group, table) -> tuple[tuple[int, str], ...]:
    """(device, op) of each other device whose output a call of ``g`` reads, one op each:
    the task waits for that worker to hand it over."""
    own = set(g.ids)
    got: dict[int, str] = {}
    for call in g.calls:
        for d in call.deps:
            if d not in own and d in table and table[d].device != g.device:
                got.setdefault(table[d].device, d)
    return tuple(sorted(got.items()))


def _evaluate_on_worker(model: str, step: int) -> dict:
    return W.current_executor().evaluate(model, step)


def _ended(future, now: float) -> C.TaskEnded:
    """What the core hears of a finished Dask future."""
    stimulus = f"task-ended-{future.key}"          # named by the Dask task it reports
    err = future.exception() if future.status == "error" else None
    return C.TaskEnded(future.key, now, C.outcome_of(future.status, err),
                       getattr(err, "rpeg_op", ""), err, id=stimulus)
