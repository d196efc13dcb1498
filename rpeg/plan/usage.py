"""What a priced plan uses of its hardware: per op, its FLOPs, bytes, MFU and MBU; per group
of devices alike, its peak memory by kind.

    >>> from rpeg.spec import load, load_cluster                          # doctest: +SKIP
    >>> ev = Evaluator(load("pipelines/grpo_qwen7b.rpeg"),
    ...                load_cluster("pipelines/clusters/h100_64.rpeg"))    # doctest: +SKIP
    >>> [(u.stage, round(u.mfu, 2)) for u in ev.evaluate(plan).plan.predicted.ops]  # doctest: +SKIP
    [('rollout', 0.03), ('ref_lp', 0.31), ...]

An op's FLOPs and bytes are those the cost model prices it with (:class:`rpeg.cost.Roof`),
on each of its devices as on the busiest (the replica with the longest responses), so its
MFU and MBU (:func:`rpeg.cost.compute.utilisation`) are at most what it achieves. Both are
at most 1 by construction: every GEMM runs at no more than the profile's peak, every byte
moves at no more than its memory bandwidth, and host time only adds.
"""

from __future__ import annotations

from rpeg.cost.checkpoint import CHECKPOINT_OP
from rpeg.cost.compute import Roof, utilisation
from rpeg.graph import Graph
from rpeg.plan.model import MemoryUse, OpUse, Plan

KINDS = ("weights", "grads", "optimizer", "activations", "kv_cache", "buffers")


def op_uses(ev, plan: Plan, graph: Graph, timings: dict, op_times, roofs: dict[str, Roof]
            ) -> tuple[OpUse, ...]:
    """Per op of ``op_times`` (in that order; ops of ``graph``): its devices, FLOPs and bytes
    over them, time, MFU and MBU on ``ev``'s cluster."""
    gpu = ev.cluster.gpu
    out = []
    for name, rounded in op_times:
        timing = timings.get(name)
        devices = len(timing.devices) if timing is not None else 0
        seconds = timing.time_s if timing is not None else rounded
        roof = roofs.get(name, Roof()).scaled(max(devices, 1))
        if name == CHECKPOINT_OP:        # the trained models' bytes, from their trainers
            devices, written = ev.checkpoint_writers(plan, graph)
            roof = Roof(bytes=written)
        stages = graph.op(name).stages if graph.has_op(name) else (name,)
        mfu, mbu = utilisation(roof, seconds, max(devices, 1), gpu, _fp8(ev, plan, stages))
        out.append(OpUse(name, devices, roof.flops, roof.bytes, seconds, mfu, mbu))
    return tuple(out)


def _fp8(ev, plan: Plan, stages: tuple[str, ...]) -> bool:
    """Whether the model of an op (running ``stages``) computes its GEMMs in FP8 (its peak
    is FP8's)."""
    for stage in stages:
        if not plan.has_placement(stage):
            continue
        target = ev.pipeline.stage(stage).target or ""
        if ev.pipeline.has_model(target) and ev.pipeline.model(target).dtype == "fp8" \
                and ev.cluster.gpu.fp8_flops:
            return True
    return False


def memory_uses(ev, plan: Plan, graph, walk) -> tuple[MemoryUse, ...]:
    """The peak of each group of devices that hold the same copies and the same largest
    transient op, by kind (weights, gradients, optimizer state, activations, KV cache,
    buffers): every copy resident there plus that op's transient need (``walk``: the
    evaluator's walk over the plan's ops)."""
    chunks_of = ev.chunks_of(graph, walk)
    groups: dict[tuple, list[int]] = {}
    for d in range(plan.num_devices):
        held = tuple(i for i, h in enumerate(walk.copies) if d in h.devices)
        groups.setdefault((held, walk.top(d)), []).append(d)
    out = []
    for (_, op), devices in groups.items():
        kinds = dict(ev.kinds(plan, graph, devices[0], op, walk.rows.get(op),
                              chunks_of.get(op, ()), walk))
        out.append(MemoryUse(devices=tuple(devices), op=op, **{k: kinds[k] for k in KINDS}))
    return tuple(sorted(out, key=lambda m: m.devices))


__all__ = ["KINDS", "memory_uses", "op_uses"]
