"""What differs between two plans, and what the difference is predicted to cost.

    >>> a = Plan("p", "c", 2, (StagePlacement.of("rollout", (0, 1), dp=2),))
    >>> b = Plan("p", "c", 2, (StagePlacement.of("rollout", (0, 1), tp=2),),
    ...          staleness=(("rollout", 1),))
    >>> print(diff_plans(a, b))
    plans differ
      stage rollout: devices 0-1 dp2 tp1 pp1 mb1 zero0 chunks1 torch -> devices 0-1 dp1 tp2 pp1 mb1 zero0 chunks1 torch
      staleness rollout: 0 -> 1

Built on the same per-stage text as ``str(plan)``; ``rpeg diff`` prints it (or
``to_dict()`` as JSON) for two plans, or for two specs compiled on one cluster.
"""

from __future__ import annotations

import attrs

from rpeg.plan.model import Plan, StagePlacement, device_ranges  # noqa: F401 (doctest)


def describe(p: StagePlacement) -> str:
    """Every field of a placement the cost model prices (carry apart: the structure's),
    those at their default left out after the first few."""
    mb = f"{p.microbatches}" + ("+recompute" if p.recompute else "")
    extra = [f"cp{p.cp}" if p.cp > 1 else "", f"ep{p.ep}" if p.ep > 1 else "",
             "packed" if p.packing else "", "param_offload" if p.param_offload else "",
             f"max_num_seqs {p.max_num_seqs}" if p.max_num_seqs else "",
             f"kv_fraction {p.kv_fraction:g}" if p.kv_fraction else "",
             "cuda_graph" if p.cuda_graph else ""]
    return (f"devices {device_ranges(p.devices)} dp{p.dp} tp{p.tp} pp{p.pp} mb{mb} "
            f"zero{p.zero}{'+offload' if p.offload else ''} chunks{p.chunks} {p.engine.value}"
            + "".join(f" {x}" for x in extra if x))


@attrs.frozen
class PlanDiff:
    a_name: str
    b_name: str
    placements: tuple[tuple[str, str, str], ...]       # (stage, in a, in b); "-" when absent
    structure: tuple[tuple[str, str, str], ...]        # (what, in a, in b)
    step_time_s: tuple[float | None, float | None]
    peak_memory: tuple[float | None, float | None]     # bytes, the largest per device

    @property
    def same(self) -> bool:
        return not self.placements and not self.structure

    @property
    def step_time_delta_s(self) -> float | None:
        a, b = self.step_time_s
        return None if a is None or b is None else b - a

    @property
    def memory_delta(self) -> float | None:
        a, b = self.peak_memory
        return None if a is None or b is None else b - a

    def to_dict(self) -> dict:
        return {
            "same": self.same,
            "placements": [{"stage": s, "a": x, "b": y} for s, x, y in self.placements],
            "structure": [{"what": w, "a": x, "b": y} for w, x, y in self.structure],
            "predicted": {"step_time_s": list(self.step_time_s),
                          "step_time_delta_s": self.step_time_delta_s,
                          "peak_memory": list(self.peak_memory),
                          "peak_memory_delta": self.memory_delta},
        }

    def __str__(self) -> str:
        lines = ["plans are the same" if self.same else "plans differ"]
        for stage, x, y in self.placements:
            lines.append(f"  stage {stage}: {x} -> {y}")
        for what, x, y in self.structure:
            lines.append(f"  {what}: {x} -> {y}")
        a, b = self.step_time_s
        if a is not None and b is not None:
            ratio = "" if not (a > 0 and b > 0) or a == b else \
                f", {a / b:.2f}x faster" if b < a else f", {b / a:.2f}x slower"
            lines.append(f"  predicted step time: {a:.3f} s -> {b:.3f} s "
                         f"({b - a:+.3f} s{ratio})")
        ma, mb = self.peak_memory
        if ma is not None and mb is not None:
            lines.append(f"  predicted peak memory: {ma / 1e9:.1f} GB -> {mb / 1e9:.1f} GB "
                         f"({(mb - ma) / 1e9:+.1f} GB per GPU)")
        return "\n".join(lines)


def diff_plans(a: Plan, b: Plan, a_name: str = "a", b_name: str = "b") -> PlanDiff:
    pa = {p.stage: describe(p) for p in a.placements}
    pb = {p.stage: describe(p) for p in b.placements}
    stages = list(pa) + [s for s in pb if s not in pa]
    placements = tuple((s, pa.get(s, "-"), pb.get(s, "-")) for s in stages
                       if pa.get(s) != pb.get(s))
    structure = []
    for field in ("pipeline", "cluster", "num_devices", "strategy"):
        x, y = getattr(a, field), getattr(b, field)
        if x != y:
            structure.append((field, _text(x), _text(y)))
    sa, sb = dict(a.staleness), dict(b.staleness)
    for stage in sorted(set(sa) | set(sb)):
        if sa.get(stage, 0) != sb.get(stage, 0):
            structure.append((f"staleness {stage}", str(sa.get(stage, 0)),
                              str(sb.get(stage, 0))))
    ca = {p.stage: p.carry for p in a.placements}
    cb = {p.stage: p.carry for p in b.placements}
    for stage in sorted(set(ca) | set(cb)):         # partial rollouts spend the bound too
        if ca.get(stage, 0) != cb.get(stage, 0):
            structure.append((f"carry {stage}", str(ca.get(stage, 0)), str(cb.get(stage, 0))))
    for field, label in (("shared", "share"), ("fusion", "fuse")):
        x, y = getattr(a, field), getattr(b, field)
        if set(x) != set(y):
            structure.append((label, _groups(x), _groups(y)))
    ra, rb = _reserve(a), _reserve(b)             # what a plan leaves free shapes it
    if ra and rb and ra != rb:                    # (an unpriced plan says nothing of it)
        structure.append(("memory reserve", ra, rb))
    return PlanDiff(a_name, b_name, placements, tuple(structure),
                    (_step(a), _step(b)), (_peak(a), _peak(b)))


def _text(v: object) -> str:
    return getattr(v, "value", str(v))


def _groups(groups: tuple[tuple[str, ...], ...]) -> str:
    return "; ".join(", ".join(g) for g in groups) or "none"


def _reserve(p: Plan) -> str | None:
    """The memory a plan keeps free on each device, and its share of the device's (None:
    an unpriced plan)."""
    pr = p.predicted
    if pr is None or not pr.memory_capacity:
        return None
    return f"{pr.memory_reserve / 1e9:.1f} GB of {pr.memory_capacity / 1e9:.0f} GB " \
           f"({100 * pr.memory_reserve / pr.memory_capacity:.0f}%)"


def _step(p: Plan) -> float | None:
    return p.predicted.step_time_s if p.predicted else None


def _peak(p: Plan) -> float | None:
    return float(max(p.predicted.peak_memory)) if p.predicted and p.predicted.peak_memory \
        else None
