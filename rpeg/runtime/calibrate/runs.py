"""What a generate op costs in a real run, against what the calibration's own op costs.

    >>> rows = [{"cpu_s": 0.034, "lengths": {"20": 24, "3": 8}, "prompts": 32}]
    >>> residual_per_step(rows, lambda r: 0.028)                      # doctest: +ELLIPSIS
    0.0003

The calibration times each model op over and over in a worker's task thread
(``backends.torch_backend.measure``): the same op, on a model whose weights and code stay in
the caches. A run's generate op pays more for the same shapes: in ``rpeg run``'s split plan
of tiny_ppo (the rollout on a worker of its own, waiting for the trainer between steps) its
thread CPU was 1.15-1.25x the price at the lengths it generated (load 4-7, 2026-12-06), and
the same engine's call on the run's prompts, timed back to back in one process, 1.04x. What
the run adds is a near constant per decode step (~0.25-0.3 ms on a 2-core EPYC, whatever
the tokens: 206 to 613 a step gave the same residual), the engine's per-step Python and
torch dispatch after the worker waited and other work ran on its core. It is not the
worker's settings (one torch thread, OpenMP/MKL at 1, glibc's allocator defaults: the
calibration's workers have the same), nor Dask: the same ops run in one process in the
run's order (``rpeg.runtime.calibrate.inline``) cost 1.15x too, while the engine's call
alone, back to back, cost 1.02-1.05x; a 60 ms wait before each call added 5-9%, the prompts'
tokenizing ~2%. A rollout on a worker of its own and one sharing it with the training
paid alike (1.22x and 1.18x in one calibration's runs).

Three calibrations at load 5-10 measured 0.27, 0.29 and 0.38 ms per decode step; with it,
the rollouts of tiny_ppo's runs cost 0.95-1.02x their price (1.13-1.21x without), and
tiny_grpo's (64 responses a step, not in the fit) 0.98-1.00x (1.10-1.16x).

:func:`rpeg.runtime.calibrate.dispatch.measure_control` already makes real runs of the
shipped tiny PPO pipeline; it keeps each step's rollout CPU and response lengths
(:func:`generate_rows`). :func:`residual_per_step` is the median of (measured − priced) per
decode step over them, and :func:`with_run_decode` adds it to the profile's
``decode_overhead`` (a fixed host cost per decode step), so the cost model prices a generate
op at what the runs pay on this machine, measured under the same load as the rest of the
calibration.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import attrs

# Steps of a run before its rollouts are compared (start-up: the first steps compile and
# allocate), as ``rpeg show`` and ``benchmarks/runtime.py`` skip them.
WARMUP = 5

__all__ = ["WARMUP", "generate_rows", "residual_per_step", "price_row", "with_run_decode"]


def generate_rows(run_dir, stage: str = "rollout") -> list[dict]:
    """Per step after ``WARMUP``: the thread CPU of ``stage``'s generate calls (summed over
    a step's chunks and devices), the responses' lengths (a histogram) and how many there
    were, from a run directory's trace."""
    from pathlib import Path

    from rpeg.runtime.rundir.directory import RunDir, events_from_trace
    per: dict[int, dict] = {}
    for e in events_from_trace(RunDir(Path(run_dir)).read_json("trace.json")):
        if e["op"] != stage or e["kind"] != "generate" or e["step"] < WARMUP:
            continue
        hist = e.get("stats", {}).get("lengths")
        if hist is None or "cpu_s" not in e:
            continue
        row = per.setdefault(e["step"], {"cpu_s": 0.0, "lengths": {}, "prompts": 0})
        row["cpu_s"] += e["cpu_s"]
        for k, n in hist.items():
            row["lengths"][str(k)] = row["lengths"].get(str(k), 0) + int(n)
        row["prompts"] += int(e.get("stats", {}).get("responses", 0))
    return [dict(per[s], step=s) for s in sorted(per)]


def _lengths(row: dict) -> list[int]:
    return sorted(int(k) for k, n in row["lengths"].items() for _ in range(int(n)))


def residual_per_step(rows: list[dict], price: Callable[[dict], float]) -> float | None:
    """The median over ``rows`` of (measured CPU − ``price(row)``) per decode step (the
    row's longest response: the op decodes until it ends); None without rows."""
    got = [(r["cpu_s"] - price(r)) / max(_lengths(r)) for r in rows if r.get("lengths")]
    return round(statistics.median(got), 7) if got else None


def price_row(row: dict, profile, link, dims, prompt_len: int, max_len: int) -> float:
    """The cost model's seconds for one measured rollout: ``dims``' generate op of the
    row's responses on one device, at the lengths they had (no dispatch)."""
    from rpeg.cost.calibrate import cpu_cluster, predict_op
    lengths = _lengths(row)
    return predict_op("generate", dims, len(lengths), prompt_len, max_len,
                      cpu_cluster(profile, link), lengths=lengths)[0]


def with_run_decode(profile, link, control: dict):
    """``profile`` with the generate ops' residual in the runs of ``control``
    (``measure_control``'s result: rows under ``generate``, with the model's preset and the
    workload's prompt and response caps) added to ``decode_overhead``; the residual, or
    None when the runs kept no rows (then the profile is returned as it is). A negative
    residual (the runs cost less than the price) leaves ``decode_overhead`` as fitted."""
    from rpeg.spec.presets import PRESETS
    g = control.get("generate") or {}
    rows = [r for run in g.get("runs", []) for r in run.get("rows", [])]
    if not rows or g.get("model") not in PRESETS:
        return profile, None
    dims = PRESETS[g["model"]]
    r = residual_per_step(rows, lambda row: price_row(row, profile, link, dims,
                                                      g["prompt_len"], g["max_len"]))
    if r is None or r <= 0:
        return profile, r
    return attrs.evolve(profile, decode_overhead=profile.decode_overhead + r), r
