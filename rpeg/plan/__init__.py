"""Plans: the value, its simulation, the search for a good one, baselines and diffs.

    >>> from rpeg.plan import compile_plan, SearchOptions, Strategy     # doctest: +SKIP
    >>> plan = compile_plan(pipeline, cluster, Strategy.SEARCH,
    ...                     SearchOptions(seed=0, iterations=1500))       # doctest: +SKIP
    >>> print(plan)                                                       # doctest: +SKIP
"""

from rpeg.plan.capabilities import Capabilities, runtime_capabilities
from rpeg.plan.compile import (
    CompileReport,
    check_executable,
    compile_plan,
    compile_report,
    recompile,
)
from rpeg.plan.diff import PlanDiff, diff_plans
from rpeg.plan.evaluate import Evaluation, Evaluator
from rpeg.plan.model import SCHEMA_VERSION, Plan, Predicted, StagePlacement, Strategy
from rpeg.plan.options import Method, SearchOptions, SearchRecord
from rpeg.plan.simulate import OpTiming, Timeline, simulate
from rpeg.plan.space import Limits

__all__ = [
    # the value
    "Plan", "StagePlacement", "Predicted", "Strategy", "SCHEMA_VERSION",
    # planning
    "compile_plan", "compile_report", "recompile", "CompileReport", "SearchOptions", "Method",
    "SearchRecord", "Limits",
    "check_executable",
    # what an executor runs
    "Capabilities", "runtime_capabilities",
    # pricing and simulation
    "Evaluator", "Evaluation", "simulate", "OpTiming", "Timeline",
    # comparing
    "diff_plans", "PlanDiff",
]
