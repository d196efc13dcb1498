"""A gang's rules, each one function both sides call: where a gang waits through a join
(``rpeg.cost.control.join_of``: the runtime's lowering makes its join call by it, the
Packer places the join's task by it, the count reads where a gang reads its inputs and
counts its calls by it), which of its calls wait for the gang before
(``control.waiting_before``: the runtime's order of collectives, the count's futures) and
for which calls of the gangs before (``control.gangs_before``), which readers a writer of
the replica they share is ordered after (``rpeg.graph.unroll.write_after_read``: the
placed graph's ordering edges, which the runtime orders its calls by, and the count's
``_write_after_read``) and which of their reads on which device
(``rpeg.plan.lower.read_before``), and which ranks and blocks run together
(``rpeg.plan.oplayout.ranks_together``, ``oplayout.block_together``)."""

from __future__ import annotations

import importlib

import attrs
import pytest

from rpeg.cost import control
from rpeg.cost.profiles import builtin_cluster
from rpeg.plan import dispatchfloor, lower, oplayout, packing, tasks
from rpeg.plan.evaluate import Evaluator
from rpeg.plan.lower import streams
from rpeg.plan.oplayout import OpLayout
from rpeg.resources import shipped
from rpeg.runtime.lowering import calls as opcalls
from rpeg.runtime.lowering import joins, ordering
from rpeg.runtime.lowering.replicas import CallRole
from rpeg.runtime.placement import split_plan
from rpeg.spec import load
from rpeg.spec.model import OpKind

from .conftest import counted_and_fused

unroll = importlib.import_module("rpeg.graph.unroll")    # the package names its function so


def _forget():
    """The memos of layouts and the count's by them, which a patched rule must not find
    filled."""
    for memo in (tasks.laid_out, tasks._reading, tasks._waited, tasks._write_on,
                 tasks._read_on, tasks.gang_calls, lower._op_layout,
                 oplayout._members, dispatchfloor._op_floor, dispatchfloor._gang):
        memo.cache_clear()


def _both(pipeline, plan):
    """(the count's (calls, tasks) of a steady step, the runtime's fusion's; the runtime's
    calls of that step), the memos forgotten."""
    _forget()
    return counted_and_fused(pipeline, plan)


@pytest.fixture(scope="module")
def split():
    pipeline = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    return pipeline, split_plan(pipeline, 2, chunks=2, dp=2, staleness=1)


@pytest.fixture(autouse=True)
def _fresh():
    yield
    _forget()


def test_both_sides_hold_the_one_join_rule():
    assert joins.join_of is packing.join_of is tasks.join_of is control.join_of
    assert ordering.waiting_before is tasks.waiting_before is control.waiting_before
    assert tasks.write_after_read is unroll.write_after_read


def test_one_edit_of_where_gangs_join_changes_both_sides(split, monkeypatch):
    """Joins from two ranks on, edited in the one function: the runtime's train ranks (a
    gang of two) now wait through a join call, and the count counts it and packs the step
    into the tasks the runtime's fusion does."""
    pipeline, plan = split
    usual, same, step = _both(pipeline, plan)
    assert usual == same and not any(c.role is CallRole.JOIN for c in step)
    early = lambda devices: devices[0] if len(devices) >= 2 else None      # noqa: E731
    for side in (joins, packing, tasks):
        monkeypatch.setattr(side, "join_of", early)
    count, runtime, step = _both(pipeline, plan)
    made = [c for c in step if c.role is CallRole.JOIN]
    assert made and count == runtime
    assert count[0] == usual[0] + len(made) and count[1] > usual[1]


def test_both_sides_ask_which_calls_wait_for_the_gang_before(split, monkeypatch):
    """The runtime asks once a gang, the count once a gang size; each side's answer is the
    rule's, and the futures the count orders a gang by follow it."""
    asked: list[tuple[str, int, bool]] = []

    def spy(side):
        def waiting(ranks, join):
            asked.append((side, len(ranks), join is None))
            return control.waiting_before(ranks, join)
        return waiting

    pipeline, plan = split
    monkeypatch.setattr(ordering, "waiting_before", spy("runtime"))
    monkeypatch.setattr(tasks, "waiting_before", spy("count"))
    _both(pipeline, plan)
    sides = {side for side, _, _ in asked}
    assert sides == {"runtime", "count"}
    assert {(n, alone) for side, n, alone in asked if side == "count"} <= \
        {(n, alone) for side, n, alone in asked if side == "runtime"}
    _forget()
    monkeypatch.setattr(tasks, "waiting_before", lambda ranks, join: ranks)   # every rank
    assert tasks.gang_calls(control.JOIN_MIN) == (control.JOIN_MIN + 1, control.JOIN_MIN ** 2)


def test_one_write_after_read_rule_for_the_placed_graph_and_the_count(monkeypatch):
    """Where every op shares one device, readers share their writer's replica: the placed
    graph has write-after-read ordering edges (the runtime orders its calls by them) and
    the count readers to wait for. With no reader ordered before its writer's next write
    (the rule edited in its one function), neither has any."""
    pipeline = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    plan = split_plan(pipeline, 1, chunks=1, staleness=0)
    ev = Evaluator(pipeline, builtin_cluster("gh200_8"))
    graph = ev.graph(plan)
    placed = tasks.layouts_of(pipeline, plan, graph, ev.timings(plan, graph)[0])[2]
    shared = tasks.shared_of(placed, plan)
    streamed = streams(placed, tasks._placing(plan))

    def war_edges():
        return [d for d in streamed.edges(4).deps if d.kind is unroll.DepKind.ORDER
                and d.data not in (unroll.STREAM, unroll.CARRY)]

    assert war_edges() and tasks._write_after_read(graph, shared)
    monkeypatch.setattr(unroll, "write_after_read", lambda *a: {})
    monkeypatch.setattr(tasks, "write_after_read", lambda *a: {})
    assert not war_edges() and not tasks._write_after_read(graph, shared)


@pytest.mark.parametrize("lay", [
    OpLayout((0, 1, 2, 3), tp=2, chunked=True), OpLayout((0, 1, 2, 3), tp=2, chunked=True,
                                                         per_block=True),
    OpLayout((4, 5, 6), everywhere=True, collective=True), OpLayout((2, 3), tp=2),
    OpLayout((), chunked=True), OpLayout((7, 8, 9), chunked=True, parts=3)])
def test_the_count_lays_an_instance_out_where_the_runtime_does(lay):
    """The devices of each chunk's instance in the count are :meth:`OpLayout.devices_of`,
    which the runtime's calls are laid out by (:meth:`OpLayout.calls`)."""
    at = tasks.laid_out(lay)
    for c in range(2 * len(at)):
        assert at[c % len(at)][0] == (lay.devices_of(c) or (-1,))
    for call in lay.calls(4):
        assert call.device in lay.devices_of(call.chunk)


def test_one_edit_of_which_ranks_run_together_changes_both_sides(split, monkeypatch):
    """Whether an op's data-parallel ranks run collectives together is one function
    (``rpeg.plan.oplayout.ranks_together``): the runtime's calls say they are a gang's ranks
    by it, a layout its instances gangs by it. Edited so that no ranks run together, the
    train ranks are a gang on neither side, and the count still packs the step as the
    runtime's fusion does."""
    assert opcalls.ranks_together is ordering.ranks_together is oplayout.ranks_together
    pipeline, plan = split
    usual, _, step = _both(pipeline, plan)
    assert any(c.collective and c.kind is OpKind.TRAIN for c in step)
    for side in (opcalls, ordering, oplayout):
        monkeypatch.setattr(side, "ranks_together", lambda kind, world: False)
    count, runtime, step = _both(pipeline, plan)
    assert not any(c.collective for c in step if c.kind is OpKind.TRAIN)
    ev = Evaluator(pipeline, builtin_cluster("gh200_8"))
    graph = ev.graph(plan)
    layouts = tasks.layouts_of(pipeline, plan, graph, ev.timings(plan, graph)[0])[0]
    assert not any(layouts[o.name].collective for o in graph.ops if o.kind is OpKind.TRAIN)
    assert count == runtime == usual


def test_one_edit_of_which_gangs_a_gang_waits_for_changes_both_sides(split, monkeypatch):
    """What a gang's waiting calls wait for is one function (``control.gangs_before``): the
    runtime chains each device's gangs by it, the count counts the futures ordering a gang
    by it. Edited so that a gang waits only for the gang before on its first member's
    device, the runtime's gangs wait for fewer calls, the count counts fewer futures, and
    the count still packs the step as the runtime's fusion does."""
    assert ordering.gangs_before is tasks.gangs_before is control.gangs_before
    pipeline, plan = split
    usual, _, step = _both(pipeline, plan)
    waits = sum(len(c.after) for c in step)
    futures = tasks.gang_calls(2)[1]
    first = lambda devices, last_on: control.gangs_before(list(devices)[:1], last_on)  # noqa: E731
    for side in (ordering, tasks):
        monkeypatch.setattr(side, "gangs_before", first)
    count, runtime, step = _both(pipeline, plan)
    assert sum(len(c.after) for c in step) < waits
    assert tasks.gang_calls(2)[1] < futures
    assert count == runtime == usual


def test_one_edit_of_which_reads_a_write_waits_for_changes_both_sides(monkeypatch):
    """Which reads a write waits for, write after read, is one function
    (``lower.read_before``: of the copy it writes, on its device, so a weight sync's only
    where it fills a copy): the runtime orders each device's writer by it, the count finds
    the readers a weight sync waits for by it. Where the actor trains on one device and a
    weight sync loads the rollout's copy on the other, edited so that no write waits for a
    read of the version before, the sync's calls wait for no rollout call and the count
    orders it after no rollout instance, and the count still packs the step as the
    runtime's fusion does."""
    assert ordering.read_before is tasks.read_before is lower.read_before
    assert ordering.read_of is tasks.read_of is lower.read_of
    pipeline = load(shipped("pipelines", "ppo_llama8b.rpeg"))
    plan = split_plan(pipeline, 2, chunks=2, staleness=1)
    waiting: list[int] = []

    def spy(head, waits):
        waiting.append(len(waits))
        return packing.is_read_elsewhere(head, waits)

    def both():
        waiting.clear()
        count, runtime, step = _both(pipeline, plan)
        read = [r for c in step if c.op.startswith("sync_") for r in c.after
                if r.startswith("rollout/")]
        return count, runtime, sum(waiting), read

    monkeypatch.setattr(tasks, "is_read_elsewhere", spy)
    usual, same, waits, read = both()
    assert usual == same and read
    for side in (ordering, tasks):
        monkeypatch.setattr(side, "read_before", lambda copy, device, writes: None)
    count, runtime, fewer, read = both()
    assert fewer < waits and not read
    assert count == runtime == usual


def test_one_edit_of_whether_a_block_runs_together_changes_both_sides(split, monkeypatch):
    """Whether an instance's calls on a tensor-parallel block run collectives together is
    one function (``rpeg.plan.oplayout.block_together``): the runtime's calls carry their
    block by it (``OpCall.tp_group``, by which they are a gang), a layout says its
    instances are gangs by it. Edited so that no block runs together, training at tp 2
    is a gang on neither side, and the count still packs the step as the runtime's fusion
    does."""
    pipeline, plan = split
    plan = attrs.evolve(plan, placements=tuple(
        p.changed(tp=2, dp=len(p.devices) // 2) if p.stage == "actor_step" else p
        for p in plan.placements))
    usual, same, step = _both(pipeline, plan)
    assert usual == same and any(c.tp_group for c in step if c.kind is OpKind.TRAIN)
    monkeypatch.setattr(oplayout, "block_together", lambda tp, per_block: False)
    count, runtime, step = _both(pipeline, plan)
    assert not any(c.tp_group or c.collective for c in step if c.op == "actor_step")
    ev = Evaluator(pipeline, builtin_cluster("gh200_8"))
    graph = ev.graph(plan)
    layouts = tasks.layouts_of(pipeline, plan, graph, ev.timings(plan, graph)[0])[0]
    assert not layouts["actor_step"].collective
    assert count == runtime
