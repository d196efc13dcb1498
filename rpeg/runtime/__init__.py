"""The runtime: a plan executed on Dask, traced, and verified. Imports no torch.

    >>> pipeline, plan, spec = plan_for_run("pipelines/tiny_ppo.rpeg")          # doctest: +SKIP
    >>> result = run_pipeline(pipeline, plan, RunOptions(steps=10), spec_path=spec)  # doctest: +SKIP
    >>> verify_run(result.path).ok                                               # doctest: +SKIP
    True

Modules: ``instances`` (the plan unrolled into op calls), ``core`` (the
scheduling core: events in, instructions out), ``recovery`` (the Dask adapter every
run goes through; its parts: ``segments``, the loop between checkpoint cuts,
``checkpointing``, worker start, restore and checkpoints, and ``losses``, loss and stuck
detection and the rollback; ``resume`` continues a run),
``fusion`` and ``flight`` (ops packed into Dask tasks, and those tasks tracked),
``driver`` (options, the cluster, the progress bar), ``worker`` (what runs in a worker), ``rundir`` and ``verify`` (the record of a
run and its check), ``placement`` (the split plan used when none is given),
``inline`` (the same calls in one process, the reference for overhead).
"""

from __future__ import annotations

from rpeg.runtime.driver import RunOptions, RunResult
from rpeg.runtime.plans import plan_for_run
from rpeg.runtime.recovery import run as run_pipeline
from rpeg.runtime.verify import Report, Violation, verify_run

__all__ = ["RunOptions", "RunResult", "run_pipeline", "plan_for_run", "verify_run", "Report",
           "Violation"]
