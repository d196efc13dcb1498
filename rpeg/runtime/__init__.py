"""The runtime: a plan executed on Dask, traced, and verified. Imports no torch.

    >>> pipeline, plan, spec = plan_for_run("pipelines/tiny_ppo.rpeg")          # doctest: +SKIP
    >>> result = run_pipeline(pipeline, plan, RunOptions(steps=10), spec_path=spec)  # doctest: +SKIP
    >>> verify_run(result.path).ok                                               # doctest: +SKIP
    True

Subpackages, one job each: ``lowering`` (the plan unrolled into op calls), ``core``
(the scheduling core: events in, instructions out, every decision), ``dask`` (the adapter
every run goes through: the cluster, the workers, the loop between checkpoint cuts, loss
and stuck detection, resume), ``rundir`` (the run directory's files, records and
checkpoints), ``usercode`` (user functions, rewards, the tool sandbox), ``calibrate``
(what the runtime costs on this machine). Beside them: ``plans`` and ``placement`` (which
plan a run executes), ``data``, ``datacheck`` and ``inputs`` (what a run reads), ``verify``
(a run's trace checked against its plan).
"""

from __future__ import annotations

from rpeg.runtime.dask.driver import RunOptions, RunResult
from rpeg.runtime.dask.runner import run as run_pipeline
from rpeg.runtime.plans import plan_for_run
from rpeg.runtime.verify import Report, Violation, verify_run

__all__ = ["RunOptions", "RunResult", "run_pipeline", "plan_for_run", "verify_run", "Report",
           "Violation"]
