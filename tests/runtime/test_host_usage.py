"""The Dask tasks a step takes are counted by the step each task runs for: tasks go out ahead
of their step, in a window, so a count by when they were submitted undercounts a short run
(to none where the window holds every step measured), and the control plane's fit, which
reads it from ``rpeg calibrate``'s short runs, prices too little."""

from __future__ import annotations

import doctest

from rpeg.runtime.rundir import directory as rundir
from rpeg.runtime.rundir.directory import host_usage

EVENTS = [{"device": 0, "end": t, "cpu_s": 0.1, "proc_cpu_s": 0.15 * t} for t in range(1, 9)]


def test_tasks_are_counted_for_their_steps_not_when_submitted():
    # every task of steps 0..7 submitted before step 2 ended: the marks see no new task
    marks = [(s, float(s), 0.1 * s, 7 * 8) for s in range(2, 8)]
    steps = {s: 7 for s in range(8)}
    assert host_usage(EVENTS, marks, warmup=0)["tasks_per_step"] == 0.0
    assert host_usage(EVENTS, marks, warmup=0, task_steps=steps)["tasks_per_step"] == 7.0
    # a step whose chunks took more tasks counts them
    steps[5] = 15
    assert host_usage(EVENTS, marks, warmup=0, task_steps=steps)["tasks_per_step"] == 8.6


def test_the_worked_examples_run():
    assert doctest.testmod(rundir, optionflags=doctest.ELLIPSIS).failed == 0
