"""The split baseline's plans: checking the splits for memory in the order of their
least rough step keeps the plans (and their order) of checking every split."""

from __future__ import annotations

from pathlib import Path

import pytest

from rpeg.plan import Evaluator
from rpeg.plan.baselines import _splits
from rpeg.plan.edit import Context
from rpeg.plan.space import Limits
from rpeg.spec import load, load_cluster

ROOT = Path(__file__).resolve().parents[2]
EVERY_SPLIT = 10**9          # keep every split that fits: each one is checked for memory


@pytest.mark.parametrize("spec, cluster", [("tiny_ppo", "local_cpu"),
                                           ("ppo_llama8b", "a100_16"),
                                           ("grpo_qwen7b", "a100_16"),
                                           ("ppo_llama8b", "h100_64")])
def test_the_most_promising_splits_are_those_of_checking_every_split(spec, cluster):
    pipeline = load(ROOT / f"pipelines/{spec}.rpeg")
    gpus = load_cluster(ROOT / f"pipelines/clusters/{cluster}.rpeg")
    ctx, ev = Context.of(pipeline, gpus, Limits.runtime()), Evaluator(pipeline, gpus)
    every = _splits(ctx, ev, keep=EVERY_SPLIT)
    for keep in (1, 3, 10, 48):
        assert _splits(ctx, ev, keep=keep) == every[:keep]
