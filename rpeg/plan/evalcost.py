"""The eval block priced like any op: generation on the held-out prompts, then the reward.

    >>> seconds = eval_time(pipeline, plan, cluster)       # doctest: +SKIP
    >>> plan.predicted.op_times                             # doctest: +SKIP
    (..., ('eval', 4.1))

The runtime evaluates at a checkpoint cut, every ``every`` steps, with the trained
actor's replica on its first home device (the train stage's first device): its generate
stage's engine on one device, for ``prompts x samples`` responses at the eval's
temperature and length cap, then the reward on them. The step time the planner
optimises carries ``eval / every`` of it, and ``op_times`` the whole op.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from rpeg.cost.stages import estimate_stage
from rpeg.graph.layout import Layout
from rpeg.graph.work import work_of
from rpeg.spec.model import Cluster, Engine, OpKind, Pipeline

EVAL_OP = "eval"


def eval_prompts(pipeline: Pipeline) -> int:
    """How many held-out prompts an evaluation answers, as the run takes them
    (``rpeg.runtime.data.eval_rows``): the first ``prompts`` of its dataset's rows (counted
    without reading it whole), all of them where it has fewer or ``prompts`` is unset; the
    workload's per step where the rows cannot be counted."""
    e = pipeline.evaluation
    n = count_rows(Path(e.dataset.path), e.split)
    if e.prompts:
        return min(e.prompts, n) if n else e.prompts
    return n or pipeline.workload.prompts


def count_rows(path: Path, split: str | None = None) -> int:
    """Rows of a JSON-lines file, a Parquet file (its footer) or a saved dataset (its
    metadata); 0 when that cannot be told."""
    try:
        if path.is_dir():
            info = path / (split or "") / "dataset_info.json" if split else \
                path / "dataset_info.json"
            splits = json.loads(info.read_text(encoding="utf-8")).get("splits") or {}
            entry = splits.get(split) if split else next(iter(splits.values()), None)
            return int(entry["num_examples"]) if entry else 0
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq
            return int(pq.ParquetFile(path).metadata.num_rows)
        with open(path, "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return 0


def eval_time(pipeline: Pipeline, train_devices: tuple[int, ...], cluster: Cluster) -> float:
    """Seconds of one evaluation (0 without an eval block)."""
    e = pipeline.evaluation
    if e is None:
        return 0.0
    gen = next((s for s in pipeline.stages if s.kind is OpKind.GENERATE), None)
    if gen is None or not train_devices:
        return 0.0
    w = pipeline.workload
    max_len = e.max_len or int(gen.param("max_len", w.gen_len.max_len))
    gen_len = attrs.evolve(w.gen_len, max_len=min(max_len, w.gen_len.max_len)) \
        if max_len < w.gen_len.max_len else w.gen_len
    prompts = eval_prompts(pipeline)
    held_out = attrs.evolve(pipeline, workload=attrs.evolve(
        w, prompts=prompts, samples=e.samples, gen_len=gen_len))
    device = (train_devices[0],)
    t = estimate_stage(work_of(held_out, gen.name), Layout(), device, cluster,
                       engine=Engine.TORCH).time_s
    score = next((s for s in pipeline.stages if s.kind is OpKind.SCORE
                  and s.target == e.reward), None)
    if score is not None:
        t += estimate_stage(work_of(held_out, score.name), Layout(), device, cluster).time_s
    return t


def trainer_devices(pipeline: Pipeline, plan) -> tuple[int, ...]:
    """The devices of the train stage of the model the eval generates with."""
    gen = next((s for s in pipeline.stages if s.kind is OpKind.GENERATE), None)
    train = next((s for s in pipeline.stages if s.kind is OpKind.TRAIN and gen is not None
                  and s.target == gen.target), None)
    return plan.placement(train.name).devices if train is not None else ()
