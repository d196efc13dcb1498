"""The event-driven simulator on placed graphs small enough to check by hand."""

from __future__ import annotations

import pytest

from rpeg.graph import DataEdge, Graph, Op, VersionEdge
from rpeg.plan.lower import Placed
from rpeg.plan.simulate import Contention, OpTiming, simulate
from rpeg.spec.model import OpKind


def _graph(ops, data=(), versions=()):
    return Graph("toy", tuple(ops), tuple(data), tuple(versions),
                 tuple({o.reads_model for o in ops if o.reads_model}),
                 tuple({o.writes_model for o in ops if o.writes_model}))


def _placed(graph, chunks: int = 1, shared=()) -> Placed:
    """``graph`` placed: its generate ops streaming ``chunks`` chunks a step on one lane,
    the (writer, reader) pairs of ``shared`` reading one replica."""
    return Placed(graph, 1, chunks=chunks, in_place=frozenset(shared), lanes=tuple(
        (o.name, 1) for o in graph.ops if o.kind is OpKind.GENERATE))


def _gen_train(lag: int, shared: bool = False) -> Placed:
    """gen reads the weights train writes ``lag`` steps stale; ``shared``: one replica."""
    gen = Op("gen", OpKind.GENERATE, ("prompts",), ("x",), reads_model="m")
    train = Op("train", OpKind.TRAIN, ("x",), (), reads_model="m", writes_model="m")
    return _placed(_graph([gen, train], [DataEdge("gen", "train", "x")],
                          [VersionEdge("m", "train", "gen", lag)]),
                   shared=[("train", "gen")] if shared else ())


def _events(tl):
    return [(str(e.instance), e.start, e.end) for e in tl.events]


def test_chain_on_one_device_runs_back_to_back():
    a = Op("a", OpKind.FORWARD, outputs=("x",))
    b = Op("b", OpKind.FORWARD, inputs=("x",))
    tl = simulate(_placed(_graph([a, b], [DataEdge("a", "b", "x")])),
                  {"a": OpTiming((0,), 2.0), "b": OpTiming((0,), 1.0)}, steps=3)
    assert _events(tl) == [("a@0", 0.0, 2.0), ("b@0", 2.0, 3.0), ("a@1", 3.0, 5.0),
                           ("b@1", 5.0, 6.0), ("a@2", 6.0, 8.0), ("b@2", 8.0, 9.0)]
    assert tl.step_ends == (3.0, 6.0, 9.0)
    assert tl.step_time_s == 3.0


def test_synchronous_generation_waits_for_last_update():
    tl = simulate(_gen_train(0), {"gen": OpTiming((0,), 2.0), "train": OpTiming((1,), 3.0)},
                  steps=4)
    assert _events(tl)[:4] == [("gen@0", 0.0, 2.0), ("train@0", 2.0, 5.0),
                               ("gen@1", 5.0, 7.0), ("train@1", 7.0, 10.0)]
    assert tl.step_time_s == 5.0


def test_one_step_stale_generation_overlaps_training_on_other_devices():
    tl = simulate(_gen_train(1), {"gen": OpTiming((0,), 2.0), "train": OpTiming((1,), 3.0)},
                  steps=6)
    # ties in start time keep priority order: the earlier step first
    assert _events(tl)[:6] == [("gen@0", 0.0, 2.0), ("train@0", 2.0, 5.0), ("gen@1", 2.0, 4.0),
                               ("train@1", 5.0, 8.0), ("gen@2", 5.0, 7.0), ("train@2", 8.0, 11.0)]
    assert tl.step_time_s == 3.0                 # the slower of the two, not their sum
    busy = tl.busy()
    assert busy[1] == pytest.approx(1.0) and busy[0] == pytest.approx(2.0 / 3.0)


def test_stale_generation_on_shared_devices_gains_nothing():
    tl = simulate(_gen_train(1, shared=True),
                  {"gen": OpTiming((0,), 2.0), "train": OpTiming((0,), 3.0)}, steps=6)
    assert tl.step_time_s == 5.0
    starts = [e.start for e in tl.events]
    ends = [e.end for e in tl.events]
    assert all(s >= e for s, e in zip(starts[1:], ends, strict=False))   # never overlapping


def test_chunked_generation_streams_to_a_per_sample_consumer():
    gen = Op("gen", OpKind.GENERATE, ("prompts",), ("x",))
    fwd = Op("fwd", OpKind.FORWARD, ("x",), ("y",))
    g = _graph([gen, fwd], [DataEdge("gen", "fwd", "x")])
    timings = {"gen": OpTiming((0,), 3.0, chunk_ends=(1.0, 3.0), chunk_sizes=(4, 4)),
               "fwd": OpTiming((1,), 2.0)}
    tl = simulate(_placed(g, chunks=2), timings, steps=2)
    assert _events(tl)[:4] == [("gen@0", 0.0, 1.0), ("gen@0#1", 1.0, 3.0), ("fwd@0", 1.0, 2.0),
                               ("fwd@0#1", 3.0, 4.0)]
    whole = simulate(_placed(g), {"gen": OpTiming((0,), 3.0), "fwd": OpTiming((1,), 2.0)}, steps=2)
    assert _events(whole)[:2] == [("gen@0", 0.0, 3.0), ("fwd@0", 3.0, 5.0)]


def test_chunk_sizes_split_consumer_time():
    gen = Op("gen", OpKind.GENERATE, ("prompts",), ("x",))
    fwd = Op("fwd", OpKind.FORWARD, ("x",), ("y",))
    g = _graph([gen, fwd], [DataEdge("gen", "fwd", "x")])
    tl = simulate(_placed(g, chunks=2),
                  {"gen": OpTiming((0,), 4.0, chunk_ends=(2.0, 4.0), chunk_sizes=(3, 1)),
                      "fwd": OpTiming((1,), 4.0)}, steps=2)
    assert ("fwd@0", 2.0, 5.0) in _events(tl)           # 3 of 4 responses: 3 s of 4
    assert ("fwd@0#1", 5.0, 6.0) in _events(tl)


def test_host_ops_need_no_device():
    a = Op("a", OpKind.FORWARD, outputs=("x",))
    h = Op("h", OpKind.COMPUTE, inputs=("x",), outputs=("z",))
    b = Op("b", OpKind.FORWARD, inputs=("x",))
    g = _graph([a, h, b], [DataEdge("a", "h", "x"), DataEdge("a", "b", "x")])
    tl = simulate(_placed(g), {"a": OpTiming((0,), 1.0), "h": OpTiming((), 5.0),
                      "b": OpTiming((0,), 1.0)}, steps=2)
    assert ("h@0", 1.0, 6.0) in _events(tl) and ("b@0", 1.0, 2.0) in _events(tl)


def test_an_op_on_two_groups_waits_for_both():
    a = Op("a", OpKind.FORWARD, outputs=("x",))
    b = Op("b", OpKind.FORWARD, outputs=("y",))
    s = Op("s", OpKind.SYNC_WEIGHTS)
    g = _graph([a, b, s])
    tl = simulate(_placed(g), {"a": OpTiming((0,), 1.0), "b": OpTiming((1,), 2.0),
                      "s": OpTiming((0, 1), 0.5)}, steps=2)
    assert ("s@0", 2.0, 2.5) in _events(tl)
    assert tl.bubbles()[0][0] == (0,) and tl.bubbles()[1][0] == (1,)


def test_streamed_chunks_take_their_own_times():
    """A consumer priced per chunk (short responses cheap, the long tail dear) runs each
    chunk for its own time, not a share of the whole."""
    gen = Op("gen", OpKind.GENERATE, ("prompts",), ("x",))
    fwd = Op("fwd", OpKind.FORWARD, ("x",), ("y",))
    g = _graph([gen, fwd], [DataEdge("gen", "fwd", "x")])
    tl = simulate(_placed(g, chunks=3), {"gen": OpTiming((0,), 4.0, chunk_ends=(1.0, 2.0, 4.0),
                                      chunk_sizes=(2, 2, 2)),
                      "fwd": OpTiming((1,), 3.5, chunk_times=(0.5, 1.0, 2.0))}, steps=2)
    assert _events(tl)[:6] == [("gen@0", 0.0, 1.0), ("gen@0#1", 1.0, 2.0),
                               ("fwd@0", 1.0, 1.5), ("gen@0#2", 2.0, 4.0),
                               ("fwd@0#1", 2.0, 3.0), ("fwd@0#2", 4.0, 6.0)]


def test_steady_state_window_spans_whole_periods():
    """Steps finishing in pairs (a period of 2, as a staleness-2 schedule can): the step
    time is the pair's span over two, not skewed by a window that ends mid-period."""
    from rpeg.graph import Instance
    from rpeg.plan.simulate import Event, _timeline
    ends = [2 * (s // 2) + 1 + 0.1 * (s % 2) for s in range(12)]   # 1, 1.1, 3, 3.1, ...
    events = [Event(Instance("a", s), (0,), e - 0.5, e) for s, e in enumerate(ends)]
    tl = _timeline(events, 12, 1, drain=3)
    assert tl.step_time_s == pytest.approx(1.0)
    assert tl.window == (ends[3], ends[9])
    sync = _timeline(list(events), 12, 1, drain=1)          # no staleness: after 2 steps
    assert sync.window == (ends[2], ends[11])


def test_the_window_leaves_out_the_fill_of_a_stale_pipeline():
    """With staleness 1 the first two generations wait for no update and run back to
    back; the step time is measured after them."""
    from rpeg.plan.simulate import steps_for
    timings = {"gen": OpTiming((0,), 2.0), "train": OpTiming((0,), 3.0)}
    tl = simulate(_gen_train(1, shared=True), timings, steps=steps_for(1))
    assert tl.steps == 10 and tl.window == (tl.step_ends[4], tl.step_ends[8])
    assert tl.step_time_s == 5.0


def test_step_time_is_never_below_the_busiest_devices_work():
    """A window still in the fill (steps ending 1 s apart) cannot beat the busiest
    device's work of one step (generation 2 s + weight load 1 s on device 0)."""
    from rpeg.graph import Instance
    from rpeg.plan.simulate import Event, _timeline
    events = [Event(Instance("a", s), (0,), s + 0.5, s + 1.0) for s in range(15)]
    assert _timeline(list(events), 15, 1, drain=3).step_time_s == pytest.approx(1.0)
    assert _timeline(list(events), 15, 1, drain=3, floor=3.0).step_time_s == 3.0
    gen = Op("gen", OpKind.GENERATE, ("prompts",), ("x",), reads_model="m")
    train = Op("train", OpKind.TRAIN, ("x",), (), reads_model="m", writes_model="m")
    sync = Op("sync", OpKind.SYNC_WEIGHTS, (), (), reads_model="m")
    g = _graph([gen, train, sync], [DataEdge("gen", "train", "x")],
               [VersionEdge("m", "train", "sync", 0), VersionEdge("m", "sync", "gen", 2)])
    tl = simulate(_placed(g, shared=[("sync", "gen")]),
                  {"gen": OpTiming((0,), 2.0), "train": OpTiming((1,), 2.9),
                      "sync": OpTiming((0,), 1.0)}, steps=15)
    assert tl.step_time_s == pytest.approx(3.0)


def test_an_output_crossing_to_other_devices_arrives_a_dispatch_later():
    """gen on device 0 feeds train on device 1: each crossing (gen -> train, and the new
    weights train -> gen) costs 0.5 s; a chain on one device pays nothing."""
    tl = simulate(_gen_train(0), {"gen": OpTiming((0,), 2.0), "train": OpTiming((1,), 1.0)},
                  steps=2, crossing_s=0.5)
    assert _events(tl) == [("gen@0", 0.0, 2.0), ("train@0", 2.5, 3.5),
                           ("gen@1", 4.0, 6.0), ("train@1", 6.5, 7.5)]
    same = simulate(_gen_train(0, shared=True),
                    {"gen": OpTiming((0,), 2.0), "train": OpTiming((0,), 1.0)},
                    steps=2, crossing_s=0.5)
    assert same.step_ends == (3.0, 6.0)


def test_ops_that_wait_on_one_another_are_a_plan_error_the_search_steps_over():
    """ppo_async with actor and critic trained as one model and the critic's values one
    update stale: the values of step k read the weights the shared train op overwrites in
    place before step k's rollout, which waits on that train op. A plan error (a message,
    not a traceback, from compile), and a move the search skips."""
    import attrs

    from rpeg.errors import PlanError
    from rpeg.plan.compile import compile_report
    from rpeg.plan.evaluate import Evaluator
    from rpeg.plan.model import Strategy
    from rpeg.plan.options import SearchOptions
    from rpeg.plan.space import Limits
    from rpeg.spec import load, load_cluster
    from tests.conftest import ROOT

    pipeline = load(ROOT / "pipelines" / "ppo_async.rpeg")
    cluster = load_cluster(ROOT / "pipelines" / "clusters" / "a100_16.rpeg")
    plan = compile_report(pipeline, cluster, Strategy.COLOCATED,
                          SearchOptions(seed=0, iterations=5, limits=Limits())).plan
    ev = Evaluator(pipeline, cluster)
    # the values read the critic in place: laid out as its trainer
    critic = plan.placement("critic_step")
    plan = attrs.evolve(plan, placements=tuple(
        p.changed(dp=critic.dp, tp=critic.tp, pp=critic.pp, microbatches=critic.pp)
        if p.stage == "values" else p for p in plan.placements))
    shared = attrs.evolve(plan, shared=pipeline.shares, predicted=None)
    assert ev.evaluate(shared).feasible                     # shared, synchronous: runs
    with pytest.raises(PlanError, match="must be schedulable step after step") as e:
        ev.evaluate(attrs.evolve(shared, staleness=(("values", 1),)))
    assert "values" in e.value.message or "actor_step+critic_step" in e.value.message


def _two_devices(a_s: float, b_s: float) -> tuple[Placed, dict]:
    """a on device 0 and b on device 1, independent: they overlap from the start."""
    a = Op("a", OpKind.FORWARD, outputs=("x",))
    b = Op("b", OpKind.FORWARD, outputs=("y",))
    return _placed(_graph([a, b])), {"a": OpTiming((0,), a_s), "b": OpTiming((1,), b_s)}


def test_ops_overlapping_on_one_hosts_cores_compute_slower_while_they_overlap():
    """Each op is 1.5x slower while the other device computes: b's 1 s of work takes 1.5 s
    beside a; a then did 1 s of its 2 s and finishes the rest alone."""
    placed, timings = _two_devices(2.0, 1.0)
    tl = simulate(placed, timings, steps=1, shared=Contention(1.5, 2))
    assert _events(tl) == [("a@0", 0.0, pytest.approx(2.5)), ("b@0", 0.0, pytest.approx(1.5))]


def test_devices_of_different_hosts_do_not_contend():
    placed, timings = _two_devices(2.0, 1.0)
    tl = simulate(placed, timings, steps=1, shared=Contention(1.5, 1))
    assert _events(tl) == [("a@0", 0.0, 2.0), ("b@0", 0.0, 1.0)]


def test_without_contention_the_timeline_is_the_plain_one():
    placed, timings = _two_devices(2.0, 1.0)
    plain = simulate(placed, timings, steps=3)
    assert _events(simulate(placed, timings, steps=3, shared=Contention(1.0, 2))) \
        == _events(plain)


def test_an_op_on_every_device_keeps_its_priced_time():
    """A gang on both devices is priced with the slowdown already (rpeg.cost.stages)."""
    a = Op("a", OpKind.FORWARD, outputs=("x",))
    b = Op("b", OpKind.FORWARD, inputs=("x",))
    placed = _placed(_graph([a, b], [DataEdge("a", "b", "x")]))
    timings = {"a": OpTiming((0, 1), 1.3), "b": OpTiming((1,), 1.0)}
    tl = simulate(placed, timings, steps=1, shared=Contention(1.3, 2))
    assert _events(tl) == [("a@0", 0.0, pytest.approx(1.3)), ("b@0", pytest.approx(1.3),
                                                              pytest.approx(2.3))]


def test_the_slowdown_grows_with_the_hosts_busy_devices():
    c = Contention(1.6, 4)
    assert [c.factor(k) for k in (0, 1, 2, 3, 4, 5)] == pytest.approx(
        [1.0, 1.0, 1.2, 1.4, 1.6, 1.6])
