"""Plans: the value, its simulation, the search for a good one, baselines and diffs.

    >>> from rpeg.plan import compile_plan, SearchOptions, Strategy     # doctest: +SKIP
    >>> plan = compile_plan(pipeline, cluster, Strategy.SEARCH,
    ...                     SearchOptions(seed=0, iterations=1500))       # doctest: +SKIP
    >>> print(plan)                                                       # doctest: +SKIP
"""

from typing import TYPE_CHECKING

# Each name is imported from its module on first use (PEP 562), so that importing one
# module of this package (``rpeg check`` reads rpeg.plan.pinned) does not import the
# planner, the simulator and the cost model with it.
_EXPORTS = {
    "Capabilities": "capabilities", "runtime_capabilities": "capabilities",
    "CompileReport": "compile", "check_executable": "compile", "compile_plan": "compile",
    "compile_report": "compile", "recompile": "compile",
    "PlanDiff": "diff", "diff_plans": "diff",
    "Evaluation": "evaluate", "Evaluator": "evaluate",
    "SCHEMA_VERSION": "model", "Plan": "model", "Predicted": "model",
    "StagePlacement": "model", "Strategy": "model",
    "Method": "options", "SearchOptions": "options", "SearchRecord": "options",
    "OpTiming": "simulate", "Timeline": "simulate",
    "Limits": "space",
}

if TYPE_CHECKING:
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
    from rpeg.plan.simulate import OpTiming, Timeline
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
    "Evaluator", "Evaluation", "OpTiming", "Timeline",
    # comparing
    "diff_plans", "PlanDiff",
]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

