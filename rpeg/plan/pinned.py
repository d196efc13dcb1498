"""The planner's side of ``place STAGE on gpus A..B { ... }``: pins it can honour, and honours.

    >>> from rpeg.spec.model import Pin
    >>> from rpeg.graph.layout import Layout
    >>> pin = Pin("actor_step", 0, 3, tp=2, zero=3)
    >>> matches(pin, Layout(dp=2, tp=2, zero=3), Engine.TORCH)
    True
    >>> matches(pin, Layout(dp=4, tp=1, zero=3), Engine.TORCH)
    False

The spec's checker refused pins no cluster can lay out (:mod:`rpeg.spec.pins`). Here,
with the cluster and the executor's limits known, :func:`check_pins` refuses a pin the
cluster cannot hold (GPUs it lacks; for rpeg's runtime, a tp wider than a node — another
system's tensor parallelism across nodes is priced over the inter-node link) or the
executor does not run
(``Limits``: ZeRO levels, pipeline parallelism, an engine, recomputation, offload), at
the pin's ``FILE:LINE:COL``. The choice table then offers a pinned stage only layouts
that :func:`matches` its pin, on its pinned devices, and :func:`honour` puts back what
a search move may have changed outside the table (chunks, offload, the engine).
"""

from __future__ import annotations

from rpeg.errors import PlanError
from rpeg.graph.layout import DECODING_FIELDS, Layout, changed
from rpeg.plan.model import StagePlacement
from rpeg.plan.space import Limits
from rpeg.spec.model import Cluster, Engine, OpKind, Pin, Pipeline, Zero

_PARALLEL = ("dp", "tp", "pp", "zero", "recompute", "offload", "microbatches", "cp", "ep",
             "packing", "param_offload", "max_num_seqs", "kv_fraction", "cuda_graph")
FOREIGN = frozenset({Engine.HF, Engine.HYBRID, Engine.DEEPSPEED, Engine.MEGATRON})
ANY_EXECUTOR = "plan for an executor that runs it with `rpeg compile --any-executor`"


def matches(pin: Pin | None, par: Layout, engine: Engine) -> bool:
    """Whether a layout keeps every key ``pin`` fixes."""
    if pin is None:
        return True
    for key, value in pin.pinned():
        if key in _PARALLEL and getattr(par.decoding if key in DECODING_FIELDS else par,
                                        key) != value:
            return False
        if key == "engine" and value is not Engine.AUTO and engine is not value:
            return False
    return True


def overlay(pin: Pin | None, par: Layout) -> Layout:
    """``par`` with the pin's batching, packing and offload keys (which the layouts the
    planner enumerates leave at their defaults) put in."""
    if pin is None:
        return par
    keys = ("packing", "param_offload", "max_num_seqs", "kv_fraction", "cuda_graph", "ep")
    changes = {k: getattr(pin, k) for k in keys if getattr(pin, k) is not None}
    return changed(par, **changes) if changes else par


def honour(pin: Pin | None, p: StagePlacement) -> StagePlacement:
    """``p`` with the placement fields ``pin`` fixes outside the layout put back."""
    if pin is None:
        return p
    changes = {}
    if pin.chunks is not None:
        changes["chunks"] = pin.chunks
    if pin.offload is not None:
        changes["offload"] = pin.offload
    return p.changed(**changes) if changes else p


def check_pins(pipeline: Pipeline, cluster: Cluster, limits: Limits) -> None:
    """PlanError at a pin the cluster cannot hold or the executor does not run."""
    for pin in pipeline.place:
        if pin.last >= cluster.num_gpus:
            raise PlanError(f"place {pin.stage} must name GPUs in 0..{cluster.num_gpus - 1}, "
                            f"not {pin.first}..{pin.last}", pin.span,
                            hint=f"cluster '{cluster.name}' has {cluster.num_gpus} GPUs")
        if pin.tp is not None and pin.tp > cluster.gpus_per_node and not limits.foreign:
            raise PlanError(f"place {pin.stage}: tp must stay inside one node of "
                            f"{cluster.gpus_per_node} GPUs, not {pin.tp}", pin.span_of("tp"),
                            hint="tensor parallelism runs over a node's GPU links")
        why = _refusal(pin, pipeline, limits)
        if why is not None:
            key, text = why
            raise PlanError(f"place {pin.stage}: {text}", pin.span_of(key),
                            hint=f"pin what the executor runs, or {ANY_EXECUTOR}")
        _check_eval_pin(pin, pipeline, limits)


def check_eval_pins(pipeline: Pipeline, limits: Limits) -> None:
    """PlanError at a pin the eval block cannot run beside (whatever the cluster): what
    ``rpeg check`` asks of rpeg's runtime before any plan."""
    for pin in pipeline.place:
        _check_eval_pin(pin, pipeline, limits)


def _check_eval_pin(pin: Pin, pipeline: Pipeline, limits: Limits) -> None:
    """A pinned layout of the evaluated model's train stage the eval block cannot run
    beside (ZeRO-3, tensor parallelism: the eval needs one whole trained replica)."""
    stage = pipeline.stage(pin.stage)
    why = limits.check_eval(pipeline, stage, Layout(tp=pin.tp or 1, zero=pin.zero or Zero.NONE))
    if why is None:
        return
    key = "zero" if (pin.zero or Zero.NONE) not in limits.eval_zero else "tp"
    levels = ", ".join(str(z) for z in sorted(limits.eval_zero))
    raise PlanError(f"place {pin.stage}: {why}", pin.span_of(key),
                    notes=[("the eval block", pipeline.evaluation.span)],
                    hint=f"pin zero = {max(limits.eval_zero)} (levels {levels} keep the weights "
                         "whole between steps) and tp = 1, or leave the layout to the "
                         "planner, or drop the eval block"
                    if key == "zero" else "pin tp = 1, or drop the eval block")


def gathers_pinned(pin: Pin, pipeline: Pipeline) -> bool:
    """Whether the pins place forward stage ``pin.stage`` where every plan honouring them
    reads its trainer's ZeRO-3 shards in place (``rpeg.plan.oplayout.gathers_in_place``):
    on the GPUs its model's train stage is pinned to at ZeRO-3, both at tp 1, and every
    generate stage pinned to one block streaming one chunk (a step streams one)."""
    stage = pipeline.stage(pin.stage)
    if stage.kind is not OpKind.FORWARD or (pin.tp or 1) != 1 or pin.size < 2:
        return False
    pins = {p.stage: p for p in pipeline.place}
    train = next((pins.get(s.name) for s in pipeline.stages
                  if s.kind is OpKind.TRAIN and s.target == stage.target), None)
    if train is None or train.devices != pin.devices or (train.tp or 1) != 1 \
            or train.zero is None or not train.zero.shards_params:
        return False
    gens = [pins.get(s.name) for s in pipeline.stages if s.kind is OpKind.GENERATE]
    return all(g is not None and g.chunks == 1 and g.size == (g.tp or 1) for g in gens)


def _refusal(pin: Pin, pipeline: Pipeline, limits: Limits) -> tuple[str, str] | None:
    for key, cap in (("tp", limits.max_tp), ("pp", limits.max_pp), ("dp", limits.max_dp),
                     ("cp", limits.max_cp), ("ep", limits.max_ep)):
        value = getattr(pin, key)
        if value is not None and value > cap:
            return key, f"{key} must be at most {cap} for this executor, not {value}" \
                + limits.because(key)
    if pin.zero is not None and pin.zero not in limits.zero:
        levels = ", ".join(str(z) for z in sorted(limits.zero))
        return "zero", f"zero must be one of {levels} for this executor, not {pin.zero}" \
            + limits.because("zero")
    for key in ("recompute", "offload", "packing", "param_offload"):
        if getattr(pin, key) and not getattr(limits, key):
            return key, f"{key} is not run by this executor" + limits.because(key)
    for key in ("max_num_seqs", "kv_fraction", "cuda_graph"):
        if getattr(pin, key) and not limits.batching:
            return key, (f"{key} is not run by this executor: its engines batch as they "
                         f"decide") + limits.because("batching")
    if pin.engine is not None:
        why = limits.check_batching(pin.engine, pin.max_num_seqs or 0, pin.kv_fraction or 0.0,
                                    bool(pin.cuda_graph))
        if why is not None:
            key = next(k for k in ("max_num_seqs", "kv_fraction", "cuda_graph")
                       if getattr(pin, k) and f"{k} is not run" in why)
            return key, why.replace("this backend", "this executor")
    if pin.engine in FOREIGN and not limits.foreign:
        return "engine", (f"engine {pin.engine.value} is another system's, which this "
                          f"executor does not run")
    stage = pipeline.stage(pin.stage)
    if stage.kind is not OpKind.GENERATE and pin.sharded and not limits.inference_zero \
            and stage.kind is not OpKind.TRAIN and not gathers_pinned(pin, pipeline):
        return "zero", ("inference on ZeRO-3-sharded weights is not run by this executor, "
                        "but by a forward stage on its trainer's ZeRO-3 GPUs (tp 1) in a step "
                        "streaming one chunk (its generate stages pinned to one block, "
                        "chunks = 1): there it reads the trainer's shards in place")
    if stage.kind is OpKind.GENERATE and pin.sharded and not limits.inference_zero:
        return "zero", "generation on ZeRO-3-sharded weights is not run by this executor"
    model = pipeline.model(stage.target) if pipeline.has_model(stage.target or "") else None
    if model is not None and model.lora is not None:
        trained = stage.kind is OpKind.TRAIN
        why = limits.check_lora(model, Layout(tp=pin.tp or 1,
                                                zero=(pin.zero or Zero.NONE) if trained
                                                else Zero.NONE))
        if why is not None:
            return ("tp" if (pin.tp or 1) > limits.lora_max_tp else "zero"), why
    if stage.kind is OpKind.GENERATE and pin.engine is not None \
            and not (pin.engine in FOREIGN and limits.foreign):
        why = limits.check_engine(pin.engine, pin.tp or 1)
        if why is not None:
            return "engine", why.replace("this backend", "this executor")
    return None


__all__ = ["ANY_EXECUTOR", "FOREIGN", "check_eval_pins", "check_pins", "gathers_pinned",
           "honour", "matches",
           "overlay"]
