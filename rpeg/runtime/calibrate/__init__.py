"""What the runtime costs on this machine, measured: the profile the cost model reads.

``machine`` (this machine's profile, calibrated once per CPU), ``dispatch`` (what one Dask
task costs), ``fleet`` (many lightweight workers: the control plane per task and worker),
``simulated`` (the client's work on a simulated clock), ``inline`` (the same calls in one
process, the reference for overhead).
"""
