"""The execution plan: one immutable value for searched, baseline and hand-written plans.

    >>> plan = Plan.from_json(Path("plan.json").read_text())    # doctest: +SKIP
    >>> plan.placement("rollout").devices, plan.staleness_of("rollout")  # doctest: +SKIP
    ((0, 1, 2, 3), 1)

A plan says, per stage, which devices run it and how (DP x TP x PP, micro-batches,
engine, chunks); per model, where its weights live between stages; the
structural choices (staleness, sharing, fusion); and what the cost model
predicted for it. It round-trips through JSON with a schema version.
"""

from __future__ import annotations

import enum

import attrs

from rpeg.spec.model import Engine

SCHEMA_VERSION = 1


class Strategy(enum.Enum):
    SEARCH = "search"
    COLOCATED = "colocated"
    SPLIT = "split"
    REALLOC = "realloc"
    MANUAL = "manual"


@attrs.frozen
class StagePlacement:
    stage: str
    devices: tuple[int, ...]          # global device indices, contiguous blocks
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    chunks: int = 1                   # generation streams finished responses in this many chunks
    engine: Engine = Engine.TORCH
    recompute: bool = False


@attrs.frozen
class Predicted:
    step_time_s: float
    peak_memory: tuple[float, ...] = ()    # bytes, per device index
    busy: tuple[float, ...] = ()           # fraction of the step each device computes
    tokens_per_s: float = 0.0
    op_times: tuple[tuple[str, float], ...] = ()   # stage -> predicted seconds per step


@attrs.frozen
class Plan:
    pipeline: str
    cluster: str
    num_devices: int
    placements: tuple[StagePlacement, ...]
    model_homes: tuple[tuple[str, tuple[int, ...]], ...] = ()   # model -> devices holding its weights
    staleness: tuple[tuple[str, int], ...] = ()                 # stage -> chosen bound (<= spec's)
    shared: tuple[tuple[str, ...], ...] = ()                    # models merged into one backbone
    fusion: tuple[tuple[str, ...], ...] = ()                    # stages fused into one op
    predicted: Predicted | None = None
    strategy: Strategy = Strategy.MANUAL
    seed: int = 0
    spec_hash: str = ""
    rpeg_version: str = ""
    schema_version: int = SCHEMA_VERSION

    def placement(self, stage: str) -> StagePlacement:
        return next(p for p in self.placements if p.stage == stage)

    def staleness_of(self, stage: str) -> int:
        return dict(self.staleness).get(stage, 0)

    def home(self, model: str) -> tuple[int, ...]:
        return dict(self.model_homes).get(model, ())
