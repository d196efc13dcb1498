"""How many chunks a generate op's block streams a step: one function both sides call
(``rpeg.plan.oplayout.block_rounds``: chunk ``c`` on block ``c mod blocks``). The runtime's
generate call splits its block's share of the responses into that many pieces and ends its
stream after the last (``backends.torch_backend.executor``), the op's layout makes that
many calls on the block (``OpLayout.calls``), and the cost model prices the first block's
as the rounds of the step (``oplayout.rounds_of``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from backends.torch_backend import executor  # noqa: E402
from rpeg.cost.profiles import builtin_cluster  # noqa: E402
from rpeg.graph import Op  # noqa: E402
from rpeg.plan import oplayout  # noqa: E402
from rpeg.plan.evaluate import Evaluator  # noqa: E402
from rpeg.plan.model import StagePlacement  # noqa: E402
from rpeg.runtime.placement import split_plan  # noqa: E402
from rpeg.spec import load  # noqa: E402
from rpeg.spec.model import OpKind  # noqa: E402
from tests.backends.one_process import run_step  # noqa: E402

PIPELINES = Path(__file__).resolve().parents[2] / "pipelines"


def test_both_sides_hold_the_one_rule():
    assert executor.block_rounds is oplayout.block_rounds


@given(st.integers(1, 12), st.integers(1, 4), st.integers(1, 40))
def test_a_blocks_calls_are_its_rounds(blocks, tp, chunks):
    """The calls the layout makes on each block of a streamed generate op (tensor-parallel
    ranks of a block counted once) are the rounds the rule gives it; the first block's
    are the op's rounds."""
    gen = Op("rollout", OpKind.GENERATE, reads_model="actor", stages=("rollout",))
    place = StagePlacement.of("rollout", tuple(range(blocks * tp)), tp=tp, chunks=chunks)
    lay = oplayout.op_layout(gen, place, streamed=True)
    made = Counter(c.chunk % blocks for c in lay.calls(chunks) if c.device % tp == 0)
    assert all(made[b] == oplayout.block_rounds(chunks, blocks, b) for b in made)
    assert oplayout.rounds_of(place, chunks) == max(made.values())


def test_both_sides_ask_the_rule_alike(monkeypatch):
    """A step of tiny GRPO streaming its rollout in 2 chunks on one device: the runtime's
    generate calls ask the rule for their block's pieces with the chunks and blocks the
    cost model asks it for the op's rounds with."""
    asked: list[tuple[str, int, int]] = []
    rule = oplayout.block_rounds

    def spy(side):
        def rounds(chunks, blocks, block=0):
            asked.append((side, chunks, blocks))
            return rule(chunks, blocks, block)
        return rounds

    pipeline = load(PIPELINES / "tiny_grpo.rpeg")
    plan = split_plan(pipeline, 1, chunks=2, staleness=0)
    monkeypatch.setattr(executor, "block_rounds", spy("runtime"))
    run_step(pipeline, plan)
    monkeypatch.setattr(oplayout, "block_rounds", spy("cost"))
    ev = Evaluator(pipeline, builtin_cluster("local_cpu"))
    graph = ev.graph(plan)
    ev.timings(plan, graph, ev.walk(plan, graph))
    by_side = {side: {(c, b) for s, c, b in asked if s == side} for side in ("runtime", "cost")}
    assert by_side["runtime"] == by_side["cost"] == {(2, 1)}
