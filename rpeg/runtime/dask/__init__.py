"""The Dask adapter: the cluster, the workers, and the loop that carries out the core's
instructions.

``runner`` (every run goes through it), ``segments`` (the loop between checkpoint cuts),
``checkpointing`` (workers started or restarted from the last checkpoint, one written at
each cut), ``losses`` (lost and stuck workers, the rollback), ``resume`` (a run directory
continued), ``driver`` (options, the cluster, the progress bar), ``worker`` (what runs in
a worker), ``devices`` (which GPU each worker owns), ``security`` (who may talk to a run),
``stopflag`` (Ctrl-C and SIGTERM).
"""
