"""A known execution priced as it ran: every model stage on the devices and layout its pin says.

    >>> from rpeg.spec import load, load_cluster                                # doctest: +SKIP
    >>> p = load("benchmarks/published/orb/openrlhf_ray_vllm_7b.rpeg")           # doctest: +SKIP
    >>> plan = pinned_plan(p, load_cluster("benchmarks/published/clusters/a800_8.rpeg"))  # doctest: +SKIP
    >>> Evaluator(p, cluster).evaluate(plan).step_time_s                        # doctest: +SKIP
    884.1

``rpeg compile --strategy pinned`` prices the plan a spec's ``place`` statements describe,
with no search: a configuration another system ran, written down with the placement it
used, is priced by the same model that plans (``rpeg compile --strategy search`` on the
same spec then says what a searched plan would gain). Every model stage must be pinned;
a degree the pin leaves out is what its devices leave over (``dp`` fills the rest), a
flag it leaves out is off, micro-batches default to the pipeline depth. Host stages (python
rewards, advantages) sit with the model stage feeding them. The plan is synchronous up to
the spec's staleness bounds (each stage at its bound), with no fusion and no sharing.
"""

from __future__ import annotations

from rpeg.errors import PlanError
from rpeg.plan.edit import feeder
from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.plan.pinned import check_pins
from rpeg.plan.space import Limits, generate_engines
from rpeg.plan.structure import is_host_op
from rpeg.spec.model import Cluster, Engine, OpKind, Pin, Pipeline, Zero


def pinned_plan(pipeline: Pipeline, cluster: Cluster, limits: Limits | None = None) -> Plan:
    """The plan the spec's pins describe; PlanError naming a stage that is not pinned, or a
    pin the cluster or the executor (``limits``, default: any executor) cannot hold."""
    limits = Limits() if limits is None else limits
    check_pins(pipeline, cluster, limits)
    by: dict[str, StagePlacement] = {}
    for s in pipeline.stages:
        if is_host_op(pipeline, s.name):
            continue
        pin = pipeline.pin(s.name)
        if pin is None:
            raise PlanError(f"stage '{s.name}' must be placed to price the spec as pinned, not "
                            f"left to the planner", s.span,
                            hint=f"add `place {s.name} on gpus A..B {{ dp = ...; tp = ... }}`, "
                                 f"or plan it with --strategy search")
        by[s.name] = _placement(pipeline, pin, limits)
    for s in pipeline.stages:
        if not is_host_op(pipeline, s.name):
            continue
        pin = pipeline.pin(s.name)
        src = feeder(pipeline, s.name, by)
        devices = pin.devices if pin is not None else (src.devices if src else (0,))
        by[s.name] = StagePlacement.of(s.name, devices, dp=len(devices))
    placements = tuple(by[s.name] for s in pipeline.stages)
    return Plan(pipeline.name, cluster.name, cluster.num_gpus, placements,
                staleness=tuple(pipeline.staleness), strategy=Strategy.PINNED)


def _placement(pipeline: Pipeline, pin: Pin, limits: Limits) -> StagePlacement:
    stage = pipeline.stage(pin.stage)
    tp, pp, cp = pin.tp or 1, pin.pp or 1, pin.cp or 1
    dp = pin.dp or max(pin.size // (tp * pp * cp), 1)
    if dp * tp * pp * cp != pin.size:
        raise PlanError(f"place {pin.stage}: dp x tp x pp x cp must be the {pin.size} GPUs of "
                        f"{pin.first}..{pin.last}, not {dp} x {tp} x {pp} x {cp}", pin.span,
                        hint="give the degrees that multiply to the device count")
    engine = pin.engine or Engine.TORCH
    if stage.kind is OpKind.GENERATE and engine is Engine.AUTO or pin.engine is None \
            and stage.kind is OpKind.GENERATE:
        engine = generate_engines(pipeline, pin.stage, limits)[0]
    return StagePlacement.of(pin.stage, pin.devices, dp=dp, tp=tp, pp=pp,
                          microbatches=pin.microbatches or pp, chunks=pin.chunks or 1,
                          engine=engine, recompute=bool(pin.recompute), zero=pin.zero or Zero.NONE,
                          offload=bool(pin.offload), cp=cp, ep=pin.ep or 1,
                          packing=bool(pin.packing), param_offload=bool(pin.param_offload),
                          max_num_seqs=pin.max_num_seqs or 0,
                          kv_fraction=pin.kv_fraction or 0.0, cuda_graph=bool(pin.cuda_graph))


__all__ = ["pinned_plan"]
