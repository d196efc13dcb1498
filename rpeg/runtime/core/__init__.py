"""The scheduling core: events in, instructions out, and every decision they rest on.

No Dask, no clock, no I/O. ``scheduler`` (the core's events, instructions and state, and
the run's decisions between segments: where a segment ends, its window, the eval cadence,
the limits past which a worker is stuck, what to do after a loss), ``windows`` (op calls
built a window of steps at a time, and those around a segment), ``fusion`` (consecutive
calls of one device packed into one task), ``flight`` (tasks in flight, which is stuck,
and whom a stuck collective blames), ``cuts`` (checkpoint cuts: what a segment runs, what
crosses them), ``choices`` (the run's choices outside a segment: the workers a start
takes, the replica each model restores from, where a resume restarts, where the eval
runs, which replicas a cut saves and which checkpoints it keeps).
"""
