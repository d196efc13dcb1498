"""Experiments a user can compare: run records read back, summaries, pictures, run diffs.

    >>> from rpeg.experiments import Run, summary, diff_runs          # doctest: +SKIP
    >>> print(summary(Run.open("runs/tiny_ppo-20261130-011500")))     # doctest: +SKIP
    >>> print(diff_runs("runs/a", "runs/b").text())                    # doctest: +SKIP

The record itself is written by the runtime (:mod:`rpeg.runtime.rundir.record`);
``rpeg show`` and ``rpeg diff`` on run directories are built from this package.
"""

from rpeg.experiments.compare import RunDiff, diff_runs
from rpeg.experiments.explain import cost_lines
from rpeg.experiments.runs import Run, plan_plots, summary, verification, write_plots

__all__ = ["Run", "summary", "verification", "write_plots", "plan_plots",
           "RunDiff", "diff_runs", "cost_lines"]
