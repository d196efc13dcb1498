"""The run directory: its files, records and checkpoints, read back and checked.

``directory`` (the run directory, its trace and metrics), ``files`` (each file read and
written safely), ``record`` (record.json), ``checkpoints`` (step checkpoints written and
found), ``state`` (a run's state at a cut, read back for a rollback or resume), ``check``
(the records checked before the trace), ``serial`` (frozen values to JSON and back),
``outputs`` (samples, evaluations), ``tensorboard`` and ``trackers``.
"""
