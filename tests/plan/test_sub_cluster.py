"""More GPUs never give a slower plan: on a cluster of 8 racks or more the ladder first
searches the spec on its first 1/8 of the racks, and that plan, which runs as it is on the
whole cluster (the rest idle), is one of the starts of the whole cluster's walks."""

from __future__ import annotations

import attrs
import pytest

from rpeg.cost.profiles import cluster_of
from rpeg.plan import SearchOptions, compile_report
from rpeg.plan.compile import SUB_SHARE, _sub_cluster
from rpeg.spec import load

from .conftest import EVERY_ENGINE, ROOT

QUICK = SearchOptions(seed=0, iterations=150, patience=90, stall=60, limits=EVERY_ENGINE)


def test_sub_cluster_is_the_first_eighth_of_the_racks():
    big = cluster_of("a100", gpus_per_node=2, nodes=1, racks=2 * SUB_SHARE)
    sub = _sub_cluster(big)
    assert sub is not None and sub.racks == 2 and sub.num_gpus == big.num_gpus // SUB_SHARE
    assert (sub.gpus_per_node, sub.nodes_per_rack, sub.links) == \
        (big.gpus_per_node, big.nodes_per_rack, big.links)
    assert _sub_cluster(cluster_of("a100", gpus_per_node=8, nodes=2, racks=4)) is None


@pytest.mark.parametrize("spec,gpn,seed", [("tiny_ppo", 2, 0), ("tiny_grpo", 1, 3),
                                           ("grpo_qwen7b", 8, 1)])
def test_more_gpus_is_never_slower_than_the_sub_cluster(spec, gpn, seed):
    pipeline = load(ROOT / f"pipelines/{spec}.rpeg")
    big = cluster_of("a100", gpus_per_node=gpn, nodes=1, racks=SUB_SHARE)
    small = attrs.evolve(big, racks=1)
    opts = attrs.evolve(QUICK, seed=seed)
    on_small = compile_report(pipeline, small, options=opts)
    on_big = compile_report(pipeline, big, options=opts)
    assert on_big.evaluation.step_time_s <= on_small.evaluation.step_time_s + 1e-9
    # the sub-cluster's walks count as the search's proposals
    assert on_big.search.iterations > on_small.search.iterations
    # the same seed gives the same plan
    again = compile_report(pipeline, big, options=opts)
    assert again.plan == on_big.plan
