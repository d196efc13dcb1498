"""The segment loop: the ops between two cuts run on the scheduling core, as fused Dask
tasks, with each step's metrics written as it ends and the eval block at each cut.

    >>> runner._segments()          # every segment up to the last step   # doctest: +SKIP

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

from rpeg.errors import RpegError, RuntimeFailure
from rpeg.runtime.core import fusion as F
from rpeg.runtime.core import scheduler as C
from rpeg.runtime.core.cuts import Cuts
from rpeg.runtime.core.flight import Task
from rpeg.runtime.dask import worker as W
from rpeg.runtime.dask.losses import _is_loss, _Lost
from rpeg.runtime.rundir import outputs as O
from rpeg.runtime.rundir.directory import step_metrics


class Interrupted(RpegError):
    """Ctrl-C: the run stopped at a checkpoint and can be resumed."""


class SegmentLoop:
    """The runner's segments, steps and evals (a part of ``recovery._Runner``)."""

    def _evaluate(self, step: int) -> None:
        """The eval block at the cut at ``step`` (every ``every`` steps, the first and the
        last), on the trained actor's first home device; once per step, across resumes."""
        from rpeg.runtime.lowering.instances import base_of
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
        every = self.pipeline.evaluation.every if self.pipeline.evaluation else None
        while self.state.start < self.steps:
            start = self.state.start
            end = C.next_cut(start, self.steps, self.res.checkpoint_every, every)
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
        """Run the segment's ops on the scheduling core, which makes every decision; this
        loop only carries its instructions out on Dask and reports what happened."""
        from distributed import as_completed

        cl, table = self.cl, self.table
        keep = self.cuts.carried(end)
        futures: dict[str, object] = {}              # op id -> the future of its task
        self._seg_futures = futures
        for op_id, value in self.state.carry.items():          # outputs from before the cut
            futures[op_id] = self._scatter({op_id: value}, table[op_id].device, start)
        core = C.Core.create(self.cuts.core_view(seg, end), end, self.window, start=start,
                             cuts=self.cuts, before=set(inside) - seg, devices=self.workers)
        last_step = time.time()
        completions = as_completed()
        idle_s = 0.0005
        # an op with no future is done: it ran before the cut (or in this batch's groups)
        finished = lambda d: d not in futures or futures[d].status == "finished"  # noqa: E731
        task_of = lambda d: futures[d].key if d in futures else None             # noqa: E731
        instructions = core.handle(C.Started(time.time()))
        while True:
            # submissions first: the per-step bookkeeping (a round trip to every worker)
            # must not delay work that is ready
            batch = [table[i.call.id] for i in instructions if isinstance(i, C.Submit)]
            now = time.time()
            for g in F.fuse(batch, self.consumers, finished, self.options.fuse, task_of,
                            self.plan.fusion):
                f = F.submit(cl.client, g, futures, self.workers[g.device],
                             key=f"{g.ids[0]}+{len(g.ids) - 1}-{cl.token}-{self.attempt}")
                for op_id in g.ids:
                    futures[op_id] = f
                core.handle(C.TaskSubmitted(f.key, Task(
                    g.ids, g.device, g.calls[0].step, self._limit(g.calls),
                    tuple(d for d in g.external if d in seg)), now))
                completions.add(f)
                self.meta["tasks"] = self.meta.get("tasks", 0) + 1
                self.task_steps[g.calls[0].step] = self.task_steps.get(g.calls[0].step, 0) + 1
            for ins in instructions:
                if isinstance(ins, C.Release):
                    if ins.op_id not in keep:
                        futures.pop(ins.op_id, None)
                elif isinstance(ins, C.StepDone):
                    last_step = self._step_done(ins.step, last_step)
                elif isinstance(ins, C.Stopping):
                    end, inside, keep = ins.end, set(ins.inside), self.cuts.carried(ins.end)
                elif isinstance(ins, C.CutShort):
                    return self._cut_short(ins.end, set(ins.inside))
                elif isinstance(ins, C.Finish):
                    return end, inside
                elif not isinstance(ins, C.Submit):
                    self._carry_out(ins, core)
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

    def _carry_out(self, ins, core) -> None:
        """The core's instructions that end the segment with an error (each raises) or ask
        the cluster something."""
        if isinstance(ins, C.Abort):
            if isinstance(ins.cause, RpegError):
                raise ins.cause
            call = self.table[ins.op_id]
            raise RuntimeFailure(
                f"op '{ins.op_id}' (stage {call.op}, step {call.step}) failed on "
                f"device {call.device}: {ins.error}",
                hint="the trace and metrics up to the failure are in the run directory")
        if isinstance(ins, C.CheckAlive):
            self._check_alive(core.flight)
        elif isinstance(ins, C.Stalled):
            raise RuntimeFailure("the run stalled: nothing is running and nothing is left "
                                 "to submit (a bug in rpeg's scheduling)")
        elif isinstance(ins, C.Lost):
            raise _Lost(ins.device, self.workers[ins.device], ins.op_id, ins.step, ins.reason,
                        stimulus=ins.stimulus)
        elif isinstance(ins, C.GaveUp):
            raise self._gave_up(ins.task, ins.status, core.flight).caused_by(ins.stimulus)
        elif isinstance(ins, C.Stuck):
            task = ins.task
            raise self._lost_or_stuck(task.device, self.workers[task.device], task.ids[0],
                                      task.step, f"op stuck: no progress for {ins.idle_s:.1f} "
                                      f"s (limit {task.limit_s:.1f} s from the plan's "
                                      f"prediction for {len(task.ids)} op(s))"
                                      ).caused_by(ins.stimulus)
        else:
            raise TypeError(f"unknown instruction {ins!r}")

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

    def _limit(self, calls) -> float:
        """How long a task of ``calls`` may go without progress: ``timeout_factor`` x the
        plan's predicted time of its ops together, and never less than the floor (once per
        task: a frozen worker is found as fast whatever the task holds)."""
        predicted = dict(self.plan.predicted.op_times) if self.plan.predicted else {}
        t = sum(max((predicted.get(s, 0.0) for s in c.stages), default=0.0) for c in calls)
        return max(self.res.timeout_floor_s, self.res.timeout_factor * t)

    def _cut_short(self, end: int, inside: set[str]):
        print(f"rpeg: interrupted: steps before {end} are done; writing a checkpoint",
              file=sys.stderr)
        return end, inside


def _evaluate_on_worker(model: str, step: int) -> dict:
    return W._STATE["executor"].evaluate(model, step)


def _ended(future, now: float) -> C.TaskEnded:
    """What the core hears of a finished Dask future."""
    stimulus = f"task-ended-{future.key}"          # named by the Dask task it reports
    if future.status == "finished":
        return C.TaskEnded(future.key, now, id=stimulus)
    if future.status == "error":
        err = future.exception()
        outcome = C.Outcome.LOST if _is_loss(err) else C.Outcome.FAILED
        return C.TaskEnded(future.key, now, outcome, getattr(err, "rpeg_op", ""), err,
                           id=stimulus)
    # cancelled: the scheduler gave the task up because what it needs was lost with a worker
    # (an output scattered there at the cut, or one only it held)
    return C.TaskEnded(future.key, now, C.Outcome.CANCELLED, id=stimulus)
