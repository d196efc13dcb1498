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

from typing import TYPE_CHECKING

# Each name is imported from its module on first use (PEP 562), so that one module of
# the runtime (``rpeg check`` reads rpeg.runtime.datacheck) comes without the Dask driver.
_EXPORTS = {
    "RunOptions": ("dask.driver", "RunOptions"), "RunResult": ("dask.driver", "RunResult"),
    "run_pipeline": ("dask.runner", "run"), "plan_for_run": ("plans", "plan_for_run"),
    "Report": ("verify", "Report"), "Violation": ("verify", "Violation"),
    "verify_run": ("verify", "verify_run"),
}

if TYPE_CHECKING:
    from rpeg.runtime.dask.driver import RunOptions, RunResult
    from rpeg.runtime.dask.runner import run as run_pipeline
    from rpeg.runtime.plans import plan_for_run
    from rpeg.runtime.verify import Report, Violation, verify_run

__all__ = ["RunOptions", "RunResult", "run_pipeline", "plan_for_run", "verify_run", "Report",
           "Violation"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    module, attr = _EXPORTS[name]
    value = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
