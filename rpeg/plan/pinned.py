"""The planner's side of ``place STAGE on gpus A..B { ... }``: pins it can honour, and honours.

    >>> from rpeg.spec.model import Pin
    >>> from rpeg.cost.memory import Parallel
    >>> pin = Pin("actor_step", 0, 3, tp=2, zero=3)
    >>> matches(pin, Parallel(dp=2, tp=2, zero=3), Engine.TORCH)
    True
    >>> matches(pin, Parallel(dp=4, tp=1, zero=3), Engine.TORCH)
    False

The spec's checker refused pins no cluster can lay out (:mod:`rpeg.spec.pins`). Here,
with the cluster and the executor's limits known, :func:`check_pins` refuses a pin the
cluster cannot hold (GPUs it lacks, a tp wider than a node) or the executor does not run
(``Limits``: ZeRO levels, pipeline parallelism, an engine, recomputation, offload), at
the pin's ``FILE:LINE:COL``. The choice table then offers a pinned stage only layouts
that :func:`matches` its pin, on its pinned devices, and :func:`honour` puts back what
a search move may have changed outside the table (chunks, offload, the engine).
"""

from __future__ import annotations

import attrs

from rpeg.cost.memory import Parallel
from rpeg.errors import PlanError
from rpeg.plan.model import StagePlacement
from rpeg.plan.space import Limits
from rpeg.spec.model import Cluster, Engine, OpKind, Pin, Pipeline

_PARALLEL = ("dp", "tp", "pp", "zero", "recompute", "offload", "microbatches", "packed")
ANY_EXECUTOR = "plan for an executor that runs it with `rpeg compile --any-executor`"


def matches(pin: Pin | None, par: Parallel, engine: Engine) -> bool:
    """Whether a layout keeps every key ``pin`` fixes."""
    if pin is None:
        return True
    for key, value in pin.pinned():
        if key in _PARALLEL and getattr(par, key) != value:
            return False
        if key == "engine" and value is not Engine.AUTO and engine is not value:
            return False
    return True


def honour(pin: Pin | None, p: StagePlacement) -> StagePlacement:
    """``p`` with the placement fields ``pin`` fixes outside the layout put back."""
    if pin is None:
        return p
    changes = {}
    if pin.chunks is not None:
        changes["chunks"] = pin.chunks
    if pin.offload is not None:
        changes["offload"] = pin.offload
    return attrs.evolve(p, **changes) if changes else p


def check_pins(pipeline: Pipeline, cluster: Cluster, limits: Limits) -> None:
    """PlanError at a pin the cluster cannot hold or the executor does not run."""
    for pin in pipeline.place:
        if pin.last >= cluster.num_gpus:
            raise PlanError(f"place {pin.stage} must name GPUs in 0..{cluster.num_gpus - 1}, "
                            f"not {pin.first}..{pin.last}", pin.span,
                            hint=f"cluster '{cluster.name}' has {cluster.num_gpus} GPUs")
        if pin.tp is not None and pin.tp > cluster.gpus_per_node:
            raise PlanError(f"place {pin.stage}: tp must stay inside one node of "
                            f"{cluster.gpus_per_node} GPUs, not {pin.tp}", pin.span_of("tp"),
                            hint="tensor parallelism runs over a node's GPU links")
        why = _refusal(pin, pipeline, limits)
        if why is not None:
            key, text = why
            raise PlanError(f"place {pin.stage}: {text}", pin.span_of(key),
                            hint=f"pin what the executor runs, or {ANY_EXECUTOR}")


def _refusal(pin: Pin, pipeline: Pipeline, limits: Limits) -> tuple[str, str] | None:
    for key, cap in (("tp", limits.max_tp), ("pp", limits.max_pp), ("dp", limits.max_dp)):
        value = getattr(pin, key)
        if value is not None and value > cap:
            return key, f"{key} must be at most {cap} for this executor, not {value}" \
                + limits.because(key)
    if pin.zero is not None and pin.zero not in limits.zero:
        levels = ", ".join(str(z) for z in sorted(limits.zero))
        return "zero", f"zero must be one of {levels} for this executor, not {pin.zero}" \
            + limits.because("zero")
    for key, able in (("recompute", "recompute"), ("offload", "offload"),
                      ("packed", "packing")):
        if getattr(pin, key) and not getattr(limits, able):
            return key, f"{key} is not run by this executor" + limits.because(able)
    stage = pipeline.stage(pin.stage)
    if stage.kind is OpKind.GENERATE and pin.engine is not None:
        why = limits.check_engine(pin.engine, pin.tp or 1)
        if why is not None:
            return "engine", why.replace("this backend", "this executor")
    return None


__all__ = ["ANY_EXECUTOR", "check_pins", "honour", "matches"]
