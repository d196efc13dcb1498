"""Every op call the runtime's lowering makes, as text: the golden form its passes keep.

    nice -n 15 python benchmarks/lowering_calls.py > /tmp/calls.txt
    nice -n 15 python benchmarks/lowering_calls.py --digest

For tiny_ppo, tiny_grpo and tiny_tools on the local 2-device cluster under plans of every
shape the lowering's tests use (split, colocated, chunked, stale, carried, fused, shared
actor-critic, tensor parallel, a ZeRO-3 reader gathering in place), from step 0 and from a
resumed step, and ppo_llama8b on 8 GPUs with vLLM engines (beside their trainer, a copy of
their own, on devices of their own), one line per call: id, device, kind, role, model,
versions, gang, sources, fills, tp group, deps and after. Two lowerings that print the same
text run the same calls in the same order.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import attrs

from rpeg.errors import PlanError
from rpeg.plan.model import Plan, StagePlacement, Strategy
from rpeg.runtime.calibrate.simulated import scaled
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan
from rpeg.spec import load
from rpeg.spec.model import Engine, OpKind

PIPELINES = Path(__file__).resolve().parents[1] / "pipelines"
STEPS = 5
RESUMED = 2                     # the first step of a resumed run


def _carry(plan: Plan, n: int) -> Plan:
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, carry=n) if p.stage == "rollout" else p for p in plan.placements))


def _tp(pipeline, staleness: int = 1) -> Plan:
    """Actor, critic and reference split over devices 0-1 (tp 2); the rest on device 0."""
    places = []
    for s in pipeline.stages:
        if s.target in ("actor", "critic", "ref") and s.kind is not OpKind.COMPUTE:
            places.append(StagePlacement(s.name, (0, 1), dp=1, tp=2,
                                         chunks=2 if s.kind is OpKind.GENERATE else 1))
        else:
            places.append(StagePlacement(s.name, (0,)))
    return Plan(pipeline.name, "golden", 2, tuple(places),
                model_homes=(("actor", (0, 1)), ("critic", (0, 1))),
                staleness=tuple((st, min(k, staleness)) for st, k in pipeline.staleness),
                strategy=Strategy.MANUAL)


def colocated(pipeline, n: int, *, zero: int = 0, reader_zero: int = 0,
              engine: Engine = Engine.TORCH, gen_tp: int = 1, gen_on: int = 0) -> Plan:
    """Every model stage on devices 0..n-1 (trained at ``zero``, trained models' passes at
    ``reader_zero``); generation on ``engine`` at ``gen_tp`` on the first ``gen_on``."""
    places = []
    every = tuple(range(n))
    for s in pipeline.stages:
        if s.kind is OpKind.GENERATE:
            gen = every[:gen_on or n]
            places.append(StagePlacement(s.name, gen, dp=len(gen) // gen_tp, tp=gen_tp,
                                         chunks=len(gen) // gen_tp, engine=engine))
        elif s.kind is OpKind.TRAIN:
            places.append(StagePlacement(s.name, every, dp=n, zero=zero))
        elif s.kind is OpKind.FORWARD:
            frozen = pipeline.model(s.target).frozen
            places.append(StagePlacement(s.name, every, dp=n,
                                         zero=0 if frozen else reader_zero))
        else:
            places.append(StagePlacement(s.name, (0,)))
    homes = tuple((m.name, every) for m in pipeline.models if not m.frozen)
    return Plan(pipeline.name, "golden", n, tuple(places), model_homes=homes,
                staleness=tuple((st, 0) for st, _ in pipeline.staleness),
                strategy=Strategy.MANUAL)


def disaggregated(pipeline, n: int, *, zero: int = 2, gen_tp: int = 1) -> Plan:
    """Generation (vLLM) on the first half of the devices, everything else on the second."""
    half = n // 2
    gen, rest = tuple(range(half)), tuple(range(half, n))
    places = []
    for s in pipeline.stages:
        if s.kind is OpKind.GENERATE:
            places.append(StagePlacement(s.name, gen, dp=half // gen_tp, tp=gen_tp,
                                         chunks=half // gen_tp, engine=Engine.VLLM))
        elif s.kind in (OpKind.TRAIN, OpKind.FORWARD):
            places.append(StagePlacement(s.name, rest, dp=len(rest),
                                         zero=zero if s.kind is OpKind.TRAIN else 0))
        else:
            places.append(StagePlacement(s.name, (half,)))
    homes = tuple((m.name, rest) for m in pipeline.models if not m.frozen)
    return Plan(pipeline.name, "golden", n, tuple(places), model_homes=homes,
                staleness=tuple((st, min(k, 1)) for st, k in pipeline.staleness),
                strategy=Strategy.MANUAL)


def _vllm(plan: Plan, tp: int = 1) -> Plan:
    return attrs.evolve(plan, placements=tuple(
        attrs.evolve(p, engine=Engine.VLLM, tp=tp, dp=len(p.devices) // tp)
        if p.stage == "rollout" else p for p in plan.placements))


TINY = {
    "sync, split": lambda p: split_plan(p, 2, staleness=0),
    "stale, split": lambda p: split_plan(p, 2, staleness=1),
    "stale, one device": lambda p: split_plan(p, 1),
    "carried, split": lambda p: _carry(split_plan(p, 2, staleness=0), 1),
    "chunked x4, dp 2": lambda p: split_plan(p, 2, dp=2, chunks=4, staleness=0),
    "dp 2, stale": lambda p: split_plan(p, 2, dp=2, staleness=1),
    "fused": lambda p: attrs.evolve(split_plan(p, 1, staleness=0),
                                    fusion=(("ref_lp", "scores"),)),
    "shared actor-critic": lambda p: split_plan(p, 2, share=True, staleness=1)
    if p.shares else split_plan(p, 2),
    "tensor parallel": _tp,
    "colocated, zero-3 readers in place": lambda p: colocated(p, 2, zero=3, reader_zero=3,
                                                              gen_on=1),
}
GPU8 = {
    "vllm beside its trainer": lambda p: _vllm(scaled(split_plan(p, 1, staleness=0), 8)),
    "vllm copy at tp 2, x16": lambda p: _vllm(scaled(split_plan(p, 2), 8), 2),
    "vllm beside zero-2": lambda p: colocated(p, 8, zero=2, engine=Engine.VLLM),
    "vllm tp 2 beside zero-2": lambda p: colocated(p, 8, zero=2, engine=Engine.VLLM,
                                                   gen_tp=2),
    "zero-3 readers in place": lambda p: colocated(p, 8, zero=3, reader_zero=3, gen_on=1),
    "disaggregated vllm": lambda p: disaggregated(p, 8),
    "disaggregated vllm tp 2, zero-3": lambda p: disaggregated(p, 8, zero=3, gen_tp=2),
}


def line(c) -> str:
    return (f"{c.id} d{c.device} {c.kind.value} role={c.role} model={c.model} "
            f"v={c.version} w={c.writes} b={c.bound} l={c.limit} carry={c.carry} "
            f"chunk={c.chunk}/{c.chunks} rank={c.rank}/{c.world} tp={list(c.tp_group)} "
            f"gang={list(c.gang)} sources={list(c.sources)} fills={list(c.fills)} "
            f"inputs={list(c.inputs)} deps={list(c.deps)} after={list(c.after)}")


def cases():
    """(title, pipeline, plan) of every lowering the dump covers."""
    for name in ("tiny_ppo", "tiny_grpo", "tiny_tools"):
        pipeline = load(PIPELINES / f"{name}.rpeg")
        for shape, make in TINY.items():
            yield f"{name} / {shape}", pipeline, lambda m=make, p=pipeline: m(p)
    ppo8b = load(PIPELINES / "ppo_llama8b.rpeg")
    for shape, make in GPU8.items():
        yield f"ppo_llama8b / {shape}", ppo8b, lambda m=make: m(ppo8b)


def dump() -> str:
    out = []
    for title, pipeline, make in cases():
        for first in (0, RESUMED):
            out.append(f"== {title} / from step {first}")
            try:
                calls = build_calls(pipeline, make(), STEPS, first=first)
            except PlanError as e:           # a shape a pipeline cannot take: its refusal
                out.append(f"refused: {e}")
                continue
            out.extend(line(c) for c in calls)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    text = dump()
    if "--digest" in sys.argv:
        print(hashlib.sha256(text.encode()).hexdigest(), text.count("\n"), "lines")
    else:
        sys.stdout.write(text)
