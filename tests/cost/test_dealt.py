"""A generate stage is priced for the batch as the runtime deals it out to its data-parallel
ranks: responses r, r + dp, ... to rank r, or, under dynamic sampling, whole groups (a
prompt with all its samples), so the busiest rank holds ceil(prompts / dp) groups."""

from __future__ import annotations

import math
from pathlib import Path

import attrs
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rpeg.cost.generation import dealt_batch
from rpeg.cost.memory import Parallel
from rpeg.cost.stages import estimate_stage, stage_memory
from rpeg.graph.work import Work, work_of
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Engine, LengthDist, OpKind, Workload

sampling = pytest.importorskip("backends.torch_backend.sampling")

ROOT = Path(__file__).resolve().parents[2]


@given(st.integers(1, 64), st.integers(1, 8), st.integers(1, 80), st.booleans())
def test_the_priced_busiest_rank_is_the_runtimes(prompts, samples, dp, refills):
    """``ceil(dealt / dp)``, the responses the cost model gives each rank, is the most the
    runtime's dealing (``backends.torch_backend``'s generate) gives any rank."""
    w = Workload(steps=1, prompts=prompts, samples=samples, prompt_len=8,
                 gen_len=LengthDist.fixed(8))
    work = Work("rollout", OpKind.GENERATE, w, refill_rounds=2 if refills else 0)
    batch = prompts * samples
    if refills:
        busiest = max(len(sampling.whole_groups(r, dp, w)) for r in range(dp))
    else:
        busiest = max(len(np.arange(r, batch, dp)) for r in range(dp))
    assert math.ceil(dealt_batch(work, batch, dp) / dp) == busiest
    assert dealt_batch(work, batch, dp) >= batch


def test_a_rank_past_the_prompts_does_not_speed_dynamic_sampling_up():
    """DAPO's rollout (128 prompts x 16) on 64 and on 68 GPUs: at 68, 60 ranks still hold two
    whole groups, so the step takes no less than at 64, and holds as much (a rank's
    responses; the expected longest of more responses in the refill rounds may add a
    little). Priced as an even split, 68 ranks were faster."""
    pipeline = load(ROOT / "pipelines" / "dapo_qwen7b.rpeg")
    cluster = load_cluster(ROOT / "pipelines" / "clusters" / "gh200_256.rpeg")
    work = work_of(pipeline, "rollout")
    assert work.refill_rounds and pipeline.workload.prompts == 128

    def priced(dp):
        par = Parallel(dp=dp)
        t = estimate_stage(work, par, range(dp), cluster, engine=Engine.VLLM).time_s
        m = stage_memory(work, par, cluster, engine=Engine.VLLM)
        return t, m

    (t64, m64), (t68, m68) = priced(64), priced(68)
    assert t64 <= t68 < t64 * 1.01 and m68 == m64
    even = attrs.evolve(work, refill_rounds=0)           # without it, more ranks: faster
    assert estimate_stage(even, Parallel(dp=68), range(68), cluster,
                          engine=Engine.VLLM).time_s < t68
