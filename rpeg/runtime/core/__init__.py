"""The scheduling core: events in, instructions out, and every decision they rest on.

No Dask, no clock, no I/O. ``scheduler`` (the core's events, instructions and state:
what to submit, what a task's end means, what is stuck, a Ctrl-C's cut), ``windows`` (op calls
built a window of steps at a time, and those around a segment), ``fusion`` (consecutive
calls of one device packed into one task), ``flight`` (tasks in flight, which is stuck,
and whom a stuck collective blames), ``cuts`` (checkpoint cuts: what a segment runs, what
crosses them), ``choices`` (the run's choices between segments: where a segment ends,
its window, the eval cadence, the limits past which a worker is stuck, what to do with
the workers at a start and after a loss, the replica each model restores from, where a
resume restarts, where the eval runs, which replicas a cut saves and which checkpoints
it keeps).
"""
