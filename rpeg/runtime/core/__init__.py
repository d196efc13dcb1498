"""The scheduling core: events in, instructions out, and every decision they rest on.

No Dask, no clock, no I/O. ``scheduler`` (the core's events, instructions and state),
``windows`` (op calls built a window of steps at a time), ``fusion`` (consecutive calls of
one device packed into one task), ``flight`` (tasks in flight, and which is stuck),
``cuts`` (checkpoint cuts: what crosses them).
"""
