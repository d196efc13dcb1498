"""Choices a sub-cluster takes from its whole: the same as it prices itself."""

from __future__ import annotations

from pathlib import Path

import attrs

from rpeg.plan.choices import priced_alike
from rpeg.plan.edit import Context, options
from rpeg.plan.space import Limits
from rpeg.spec import load, load_cluster
from rpeg.spec.model import Level

ROOT = Path(__file__).resolve().parents[2]


def test_a_sub_cluster_shares_the_choices_its_whole_priced_and_prices_them_alike():
    pipeline = load(ROOT / "pipelines/ppo_llama8b.rpeg")
    whole = load_cluster(ROOT / "pipelines/clusters/gh200_256.rpeg")
    sub = attrs.evolve(whole, racks=1)
    big = Context.of(pipeline, whole, Limits.runtime())
    for size in (12, 24, 48):                      # off the table: priced on first use
        options(big, "actor_step", size)
    shared = Context.of(pipeline, sub, Limits.runtime(), like=big)
    alone = Context.of(pipeline, sub, Limits.runtime())
    assert shared.table == alone.table
    for size in (12, 24, 48, 20):
        assert options(shared, "actor_step", size) == options(alone, "actor_step", size)
    assert shared._extra is big._extra and alone._extra is not big._extra


def test_clusters_price_alike_only_apart_from_their_racks_and_with_every_level_linked():
    whole = load_cluster(ROOT / "pipelines/clusters/gh200_256.rpeg")
    assert priced_alike(whole, attrs.evolve(whole, racks=1))
    assert not priced_alike(whole, attrs.evolve(whole, gpus_per_node=2, racks=1))
    unlinked = attrs.evolve(whole, links=tuple(k for k in whole.links
                                               if k.level is not Level.RACK))
    assert not priced_alike(unlinked, attrs.evolve(unlinked, racks=1))
