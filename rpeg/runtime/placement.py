"""A plan for running now, when no compiled plan is given: split the models over the devices.

    >>> plan = split_plan(load("pipelines/tiny_ppo.rpeg"), devices=2)     # doctest: +SKIP
    >>> plan.placement("rollout").devices, plan.home("actor")             # doctest: +SKIP
    ((0,), (1,))

``rpeg run FILE.rpeg`` uses the planner (``rpeg.plan``) when it can price the
local cluster; otherwise this OpenRLHF-style split: generation alone on device
0 and the generator's model trained on the last device (so with staleness k,
generation of step s + k overlaps training of step s), other trained models
on device 0 with the forward passes that read them, frozen models and
per-sample scoring beside the trainer. One device: everything colocated.
"""

from __future__ import annotations

from rpeg.graph.ids import Backbone
from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.spec.model import Engine, OpKind, Pipeline


def split_plan(pipeline: Pipeline, devices: int, *, staleness: int | None = None,
               chunks: int = 2, share: bool = False, dp: int = 1,
               cluster: str = "local") -> Plan:
    """A hand-built split placement; ``staleness`` caps every bound (None: the spec's);
    ``share`` merges the spec's share groups; ``dp`` > 1 trains every model on devices 0..dp-1."""
    last = devices - 1
    gen_models = {s.target for s in pipeline.stages if s.kind is OpKind.GENERATE}
    shared = tuple(tuple(g) for g in pipeline.shares) if share else ()
    merged = {m: Backbone.of(g) for g in shared for m in g}
    homes: dict[str, tuple[int, ...]] = {}
    for m in pipeline.models:
        if m.frozen:
            continue
        key = merged.get(m.name, m.name)
        in_gen = any(x in gen_models for x in Backbone(key).members)
        homes[key] = tuple(range(dp)) if dp > 1 else ((last,) if in_gen else (0,))
    placements = []
    for s in pipeline.stages:
        key = merged.get(s.target, s.target)
        if s.kind is OpKind.GENERATE:
            devs, n_chunks = (0,), chunks
        elif s.kind is OpKind.TRAIN:
            devs, n_chunks = homes[key], 1
        elif s.kind is OpKind.FORWARD and key in homes:
            devs, n_chunks = homes[key][:1], 1
        else:
            devs, n_chunks = (last,), 1
        engine = Engine.VLLM if s.param("engine", Engine.AUTO) is Engine.VLLM else Engine.TORCH
        placements.append(StagePlacement.of(s.name, devs, dp=len(devs) if s.kind is OpKind.TRAIN
                                         else 1, chunks=n_chunks, engine=engine))
    bounds = tuple((st, bound if staleness is None else min(bound, staleness))
                   for st, bound in pipeline.staleness)
    return Plan(pipeline=pipeline.name, cluster=cluster, num_devices=devices,
                placements=tuple(placements), model_homes=tuple(sorted(homes.items())),
                staleness=bounds, shared=shared, strategy=Strategy.SPLIT,
                seed=pipeline.workload.seed)
