"""Graphviz pictures: version edges drawn apart from data edges, one box per step, dot accepts it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from rpeg.errors import GraphError
from rpeg.graph import Graph, build
from rpeg.graph.render import SYNC_COLOUR, to_dot, write
from rpeg.spec import load

ROOT = Path(__file__).resolve().parents[2]
HAVE_DOT = shutil.which("dot") is not None


@pytest.fixture(scope="module")
def ppo() -> Graph:
    return build(load(ROOT / "pipelines" / "ppo_llama8b.rpeg"))


def _edges(dot: str) -> list[str]:
    return [line.strip() for line in dot.splitlines() if " -> " in line]


def test_step_graph_draws_version_edges_dashed_with_lag(ppo):
    dot = to_dot(ppo)
    edges = _edges(dot)
    version = [e for e in edges if "dashed" in e]
    data = [e for e in edges if "dashed" not in e and SYNC_COLOUR not in e]
    assert any(e.startswith('"sync_actor" -> "rollout"') and 'label="actor, lag 1"' in e
               for e in version)
    assert any(e.startswith('"critic_step" -> "values"') and "lag 0" in e for e in version)
    assert all("dashed" not in e for e in data) and len(data) == 11
    sync = [e for e in edges if SYNC_COLOUR in e]
    assert sync == [e for e in sync if e.startswith('"actor_step" -> "sync_actor"')] and sync
    assert 'shape="cds"' in dot                          # the weight-sync op has its own shape


def test_three_unrolled_steps_one_box_each(ppo):
    dot = to_dot(ppo, steps=3)
    assert re.findall(r'subgraph "(cluster_step\d)"', dot) == [
        "cluster_step0", "cluster_step1", "cluster_step2"]
    edges = _edges(dot)
    # rollout at step 2 reads the actor version synced at step 0 (lag 1); step 1 reads none yet
    assert any(e.startswith('"sync_actor@0" -> "rollout@2"') and "lag 1" in e for e in edges)
    assert not any(e.endswith('"rollout@1"') or '-> "rollout@1" ' in e for e in edges)
    assert any(e.startswith('"critic_step@1" -> "values@2"') for e in edges)
    assert dot == to_dot(ppo, steps=3)                    # deterministic


def test_shared_backbone_is_visible():
    g = build(load(ROOT / "pipelines" / "ppo_shared.rpeg"), share=True)
    dot = to_dot(g, steps=2)
    assert "shared: actor, critic" in dot
    assert "peripheries" in dot
    assert "shared backbone actor+critic: actor, critic" in dot


def test_chunks_draw_one_node_per_chunk(ppo):
    dot = to_dot(ppo, steps=1, chunks={"rollout": 3})
    for c in ("rollout@0", "rollout@0#1", "rollout@0#2"):
        assert f'"{c}" [' in dot
    assert "rollout [3/3]" in dot


@pytest.mark.skipif(not HAVE_DOT, reason="Graphviz 'dot' is not installed")
@pytest.mark.parametrize("suffix", ["svg", "png"])
def test_dot_draws_three_steps_of_ppo(ppo, tmp_path, suffix):
    out = write(to_dot(ppo, steps=3), tmp_path / f"ppo.{suffix}")
    data = out.read_bytes()
    assert len(data) > 10_000
    if suffix == "svg":
        text = data.decode()
        assert "step 2" in text and "stroke-dasharray" in text    # dashed version edges


def test_write_dot_and_bad_suffix(ppo, tmp_path):
    out = write(to_dot(ppo), tmp_path / "g.dot")
    assert out.read_text().startswith('digraph "ppo_llama8b"')
    with pytest.raises(GraphError, match="must end in"):
        write(to_dot(ppo), tmp_path / "g.txt")
    with pytest.raises(GraphError, match="at least 1"):
        to_dot(ppo, steps=0)
