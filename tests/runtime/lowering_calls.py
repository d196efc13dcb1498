"""Every op call the runtime's lowering makes, as text: the golden form its passes keep.

    nice -n 15 python tests/runtime/lowering_calls.py > /tmp/calls.txt
    nice -n 15 python tests/runtime/lowering_calls.py --digest

For tiny_ppo, tiny_grpo and tiny_tools on the local 2-device cluster under plans of every
shape the lowering's tests use (``test_instance_graph``'s and ``test_copies_priced``'s:
split, colocated, chunked, stale, carried, fused, shared actor-critic, tensor parallel, a
ZeRO-3 reader gathering in place), from step 0 and from a resumed step, and ppo_llama8b on 8 GPUs with vLLM engines (beside their trainer, a copy of
their own, on devices of their own), one line per call: id, device, kind, role, model,
versions, gang, sources, fills, tp group, deps and after. Two lowerings that print the same
text run the same calls in the same order.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import attrs

from rpeg.errors import PlanError
from rpeg.runtime.calibrate.simulated import scaled
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan
from rpeg.spec import load
from rpeg.spec.model import Engine

HERE = Path(__file__).resolve().parent
PIPELINES = HERE.parents[1] / "pipelines"
STEPS = 5
RESUMED = 2                     # the first step of a resumed run


def _load(name: str):
    """A test module beside this one, by its file (the plan shapes its tests use)."""
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_graph, _copies = _load("test_instance_graph"), _load("test_copies_priced")
_carry, _tp, _vllm = _graph._carry, _graph._tp, _graph._vllm
colocated, disaggregated = _copies.colocated, _copies.disaggregated


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
    "tensor parallel": lambda p: _tp(p, staleness=1),
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
