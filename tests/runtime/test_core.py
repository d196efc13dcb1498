"""The scheduling core, driven by hand: no Dask, no clock."""

from __future__ import annotations

from rpeg.runtime.core.scheduler import (
    Abort,
    Core,
    Finish,
    OpDone,
    OpFailed,
    Release,
    Started,
    StepDone,
    Submit,
)
from rpeg.runtime.lowering.instances import build_calls
from rpeg.runtime.placement import split_plan


def _submitted(out):
    return [i.call.id for i in out if isinstance(i, Submit)]


def _drain(core, out, stop_at=None):
    """Complete every submitted op in order, as a cluster would; collect instructions."""
    queue = _submitted(out)
    log = list(out)
    while queue:
        op = queue.pop(0)
        if op == stop_at:
            break
        new = core.handle(OpDone(op))
        log += new
        queue += _submitted(new)
    return log


def test_synchronous_runs_one_step_at_a_time(ppo, plan_by_hand):
    calls = build_calls(ppo, plan_by_hand(ppo, {}, devices=1), steps=3)
    core = Core.create(calls, steps=3, window=1)
    first = core.handle(Started())
    assert {core.calls[i].step for i in _submitted(first)} == {0}
    log = _drain(core, first)
    steps = [i.step for i in log if isinstance(i, StepDone)]
    assert steps == [0, 1, 2] and isinstance(log[-1], Finish)
    # every op submitted exactly once, and only after everything it depends on
    order = _submitted(log)
    assert sorted(order) == sorted(c.id for c in calls)
    pos = {op: n for n, op in enumerate(order)}
    assert all(pos[d] < pos[c.id] for c in calls for d in c.all_deps)


def test_staleness_one_submits_the_next_generation_before_training_ends(ppo):
    plan = split_plan(ppo, 2, staleness=1)
    calls = build_calls(ppo, plan, steps=4)
    core = Core.create(calls, steps=4, window=2)
    first = _submitted(core.handle(Started()))
    assert "rollout/s1/c0" in first and "actor_step/s0" in first
    assert "rollout/s2/c0" not in first          # step 2 waits for step 0 to finish


def test_results_are_released_when_every_consumer_is_done(ppo, plan_by_hand):
    calls = build_calls(ppo, plan_by_hand(ppo, {}, devices=1), steps=1)
    core = Core.create(calls, steps=1, window=1)
    log = _drain(core, core.handle(Started()))
    released = {i.op_id for i in log if isinstance(i, Release)}
    assert released == {c.id for c in calls}


def test_a_failed_op_aborts(ppo, plan_by_hand):
    calls = build_calls(ppo, plan_by_hand(ppo, {}, devices=1), steps=2)
    core = Core.create(calls, steps=2, window=1)
    core.handle(Started())
    out = core.handle(OpFailed("rollout/s0/c0", "boom"))
    assert out == [Abort("rollout/s0/c0", "boom")]


# --- a segment's decisions: tasks, losses, stuck devices, Ctrl-C, all without Dask ----------
from rpeg.runtime.core import choices as K  # noqa: E402
from rpeg.runtime.core import scheduler as C  # noqa: E402
from rpeg.runtime.core.cuts import Cuts  # noqa: E402
from rpeg.runtime.core.flight import Task  # noqa: E402


def _segment(ppo, plan_by_hand, steps=3, window=1):
    calls = build_calls(ppo, plan_by_hand(ppo, {}, devices=1), steps=steps)
    table = {c.id: c for c in calls}
    cuts = Cuts(table)
    core = C.Core.create(cuts.core_view(set(table), steps), steps, window, cuts=cuts,
                         devices=[0])
    return core, core.handle(C.Started(now=0.0))


def _pack(core, out, now, limit=5.0):
    """Each submitted op as a task of its own, as the adapter reports them."""
    keys = []
    for ins in out:
        if isinstance(ins, C.Submit):
            core.handle(C.TaskSubmitted(ins.call.id, Task((ins.call.id,), ins.call.device,
                                                          ins.call.step, limit, ()), now))
            keys.append(ins.call.id)
    return keys


def test_tasks_that_end_finish_their_ops_and_the_segment(ppo, plan_by_hand):
    core, out = _segment(ppo, plan_by_hand)
    queue, t, log = _pack(core, out, 0.0), 0.0, []
    while queue:
        t += 1.0
        new = core.handle(C.TaskEnded(queue.pop(0), t))
        log += new
        queue += _pack(core, new, t)
    assert isinstance(log[-1], C.Finish) and core.submitted == 0
    assert all(st is C.OpState.DONE for st in core.status.values())


def test_a_worker_lost_under_a_task_is_a_loss_and_a_cancelled_task_is_given_up(ppo, plan_by_hand):
    core, out = _segment(ppo, plan_by_hand)
    first = _pack(core, out, 0.0)[0]
    lost = core.handle(C.TaskEnded(first, 1.0, C.Outcome.LOST, error=ConnectionError("gone")))
    assert lost == [C.Lost(0, first, 0, "worker lost (ConnectionError)")]
    core, out = _segment(ppo, plan_by_hand)
    first = _pack(core, out, 0.0)[0]
    [gave_up] = core.handle(C.TaskEnded(first, 1.0, C.Outcome.CANCELLED))
    assert isinstance(gave_up, C.GaveUp) and gave_up.task.ids == (first,)


def test_an_op_that_raises_aborts_and_is_failed(ppo, plan_by_hand):
    core, out = _segment(ppo, plan_by_hand)
    first = _pack(core, out, 0.0)[0]
    err = ValueError("bad reward")
    [abort] = core.handle(C.TaskEnded(first, 1.0, C.Outcome.FAILED, error=err))
    assert abort == C.Abort(first, "ValueError: bad reward") and abort.cause is err
    assert core.status[first] is C.OpState.FAILED and core.finished


def test_a_device_without_progress_past_its_limit_is_stuck(ppo, plan_by_hand):
    core, out = _segment(ppo, plan_by_hand)
    first = _pack(core, out, 0.0, limit=5.0)[0]
    assert not [i for i in core.handle(C.Tick(4.0)) if isinstance(i, C.Stuck)]
    stuck = [i for i in core.handle(C.Tick(6.0)) if isinstance(i, C.Stuck)]
    assert [(s.task.ids, s.idle_s) for s in stuck] == [((first,), 6.0)]


def test_a_stuck_task_of_several_ops_names_the_one_its_worker_is_on(ppo, plan_by_hand):
    """A task packs several calls; those its worker finished report done as they end, so
    the op blamed for no progress is the first not done (a hung reward after the forward
    that ran before it in the task), not the task's first."""
    core, out = _segment(ppo, plan_by_hand)
    ids = tuple(i.call.id for i in out if isinstance(i, C.Submit))
    assert len(ids) >= 1
    task = Task(ids, 0, 0, 5.0, ())
    assert core.running(task) == ids[0]
    more = [i.call.id for i in core.handle(C.OpDone(ids[0])) if isinstance(i, C.Submit)]
    longer = Task(ids + tuple(more), 0, 0, 5.0, ())         # the first done, the rest not
    assert core.running(longer) == (ids + tuple(more))[1]


def test_every_instruction_records_the_event_that_caused_it(ppo, plan_by_hand):
    """Each instruction's stimulus is the id of the event it answers: the adapter's own name
    for what it saw, else the core's (the event's kind and its place among the segment's
    events), so a rollback names the task end or tick that found the loss."""
    core, out = _segment(ppo, plan_by_hand)
    assert out and {i.stimulus for i in out} == {"started-1"}
    queue = _pack(core, out, 0.0, limit=5.0)                  # events 2 .. len(queue) + 1
    stuck = [i for i in core.handle(C.Tick(6.0)) if isinstance(i, C.Stuck)]
    assert [s.stimulus for s in stuck] == [f"tick-{len(queue) + 2}"]
    t, log = 6.0, []
    while queue:
        key, t = queue.pop(0), t + 1.0
        new = core.handle(C.TaskEnded(key, t, id=f"task-ended-{key}"))
        assert all(i.stimulus == f"task-ended-{key}" for i in new), new
        log += new
        queue += _pack(core, new, t)
    assert isinstance(log[-1], C.Finish) and any(isinstance(i, C.Submit) for i in log)
    core, out = _segment(ppo, plan_by_hand)
    first = _pack(core, out, 0.0)[0]
    lost = core.handle(C.TaskEnded(first, 1.0, C.Outcome.LOST, error=EOFError(), id="k"))
    assert [(type(i), i.stimulus) for i in lost] == [(C.Lost, "k")]
    # the stimulus says where an instruction came from, not what it says
    assert lost == [C.Lost(0, first, 0, "worker lost (EOFError)", stimulus="other")]


def test_the_cluster_is_asked_for_lost_workers_twice_a_second(ppo, plan_by_hand):
    core, out = _segment(ppo, plan_by_hand)
    _pack(core, out, 0.0)
    asks = [t for t in (0.1, 0.3, 0.6, 0.8, 1.2) if C.CheckAlive() in core.handle(C.Tick(t))]
    assert asks == [0.6, 1.2]


def test_nothing_in_flight_with_work_left_is_a_stall(ppo, plan_by_hand):
    core, _ = _segment(ppo, plan_by_hand)
    core.submitted = 0                          # as if the adapter had lost track of them
    assert C.Stalled() in core.handle(C.Tick(1.0))


def test_ctrl_c_stops_at_the_first_cut_holding_every_submitted_op(ppo, plan_by_hand):
    core, out = _segment(ppo, plan_by_hand, steps=3, window=2)
    queue = _pack(core, out, 0.0)
    [stopping] = core.handle(C.StopRequested())
    assert isinstance(stopping, C.Stopping) and stopping.end >= 1
    assert {i for i, st in core.status.items() if st is C.OpState.SUBMITTED} <= stopping.inside
    log, t = [], 0.0
    while queue:
        t += 1.0
        new = core.handle(C.TaskEnded(queue.pop(0), t))
        log += new
        queue += _pack(core, new, t)
    assert [i for i in log if isinstance(i, C.CutShort)] == [C.CutShort(
        stopping.end, stopping.inside, frozenset(core.cuts.carried(stopping.end)))]
    # nothing past the cut was submitted: it is held for the resumed run
    assert all(core.status[i] is not C.OpState.DONE for i in core.status
               if i not in stopping.inside)


def test_every_state_change_is_in_the_transition_table():
    moves = {(a.value, what, b.value) for (a, what), b in C.TRANSITIONS.items()}
    assert moves == {("pending", "submit", "submitted"), ("pending", "hold", "held"),
                     ("submitted", "done", "done"), ("submitted", "fail", "failed")}


def test_a_segment_ends_at_the_next_checkpoint_or_eval_step_or_the_run_end():
    assert [K.next_cut(s, 25, 10, None) for s in (0, 9, 10, 20)] == [10, 10, 20, 25]
    assert [K.next_cut(s, 25, 10, 4) for s in (0, 4, 8, 10, 24)] == [4, 8, 10, 12, 25]
    # checkpoint_every 0: no checkpoint between, only the evals and the end
    assert [K.next_cut(s, 25, 0, None) for s in (0, 24)] == [25, 25]
    assert [K.next_cut(s, 25, 0, 10) for s in (0, 10, 20)] == [10, 20, 25]


def test_workers_found_at_a_restart_run_refuse_replan_or_give_up():
    decide = K.on_workers
    assert decide(2, 2, started=False) is K.Workers.RUN
    assert decide(2, 3, started=True) is K.Workers.RUN
    assert decide(2, 1, started=False) is K.Workers.REFUSE       # a run never started
    assert decide(2, 0, started=False) is K.Workers.REFUSE
    assert decide(2, 1, started=True) is K.Workers.REPLAN        # after a loss: the rest
    assert decide(2, 0, started=True) is K.Workers.GIVE_UP


def test_a_loss_past_the_limit_gives_up_and_a_stuck_worker_is_killed_first():
    assert K.on_loss(1, 3, stuck=False) == (False, False)
    assert K.on_loss(3, 3, stuck=True) == (False, True)
    assert K.on_loss(4, 3, stuck=False) == (True, False)


def test_a_collective_that_fails_waits_for_a_lost_peer_before_it_aborts(ppo):
    """A gloo collective fails at once when its peer is killed, often before the cluster
    reports the peer gone: the loss must win, so the core asks for lost workers first and
    aborts only when none shows up within the grace."""
    calls = build_calls(ppo, split_plan(ppo, 2, staleness=1), steps=3)
    table = {c.id: c for c in calls}
    cuts = Cuts(table)
    core = C.Core.create(cuts.core_view(set(table), 3), 3, 2, cuts=cuts, devices=[0, 1])
    queue, t, sync = _pack(core, core.handle(C.Started(now=0.0)), 0.0), 0.0, None
    while queue and sync is None:
        t += 1.0
        op = queue.pop(0)
        if table[op].collective:
            sync = op
            break
        queue += _pack(core, core.handle(C.TaskEnded(op, t)), t)
    assert sync is not None
    err = RuntimeError("Connection closed by peer")
    assert core.handle(C.TaskEnded(sync, t, C.Outcome.FAILED, error=err)) == [C.CheckAlive()]
    assert not [i for i in core.handle(C.Tick(t + 5.0)) if isinstance(i, C.Abort)]
    [abort] = [i for i in core.handle(C.Tick(t + core.peer_grace_s)) if isinstance(i, C.Abort)]
    assert abort.op_id == sync and abort.cause is err and core.finished


# --- the run's decisions the Dask adapter only carries out ----------------------------------
def _staleness_segment(ppo, steps=4, end=2):
    """The first segment (to ``end``) of a staleness-1 run on two devices, as the adapter
    builds it."""
    calls = build_calls(ppo, split_plan(ppo, 2, staleness=1), steps=steps)
    table = {c.id: c for c in calls}
    cuts = Cuts(table)
    seg = cuts.closure(end)
    core = C.Core.create(cuts.core_view(seg, end), end, K.window_of(((None, 1),)), cuts=cuts,
                         devices=[0, 1])
    return core, cuts, seg


def test_a_segment_keeps_the_outputs_read_past_its_cut_and_releases_the_rest(ppo):
    core, cuts, seg = _staleness_segment(ppo)
    queue, t, log = _pack(core, core.handle(C.Started(now=0.0)), 0.0), 0.0, []
    while queue:
        t += 1.0
        new = core.handle(C.TaskEnded(queue.pop(0), t))
        log += new
        queue += _pack(core, new, t)
    carried = frozenset(cuts.carried(2))
    assert carried and any("/s2/" in op for op in carried)    # generation pulled in by the cut
    [finish] = [i for i in log if isinstance(i, C.Finish)]
    assert finish.carried == carried
    released = [i.op_id for i in log if isinstance(i, C.Release)]
    assert len(released) == len(set(released)) and set(released) == seg - carried


def test_fusion_reads_what_the_core_heard_not_the_cluster(ppo):
    core, _, seg = _staleness_segment(ppo)
    first = _pack(core, core.handle(C.Started(now=0.0)), 0.0)
    op = first[0]
    assert core.task_of(op) == op and not core.is_done(op)
    assert core.is_done("actor_step/s40") and core.task_of("actor_step/s40") is None
    core.handle(C.TaskEnded(op, 1.0))
    assert core.is_done(op) and core.task_of(op) == op


def test_the_window_holds_staleness_plus_one_steps_and_one_ahead():
    assert K.window_of(()) == 2                                       # synchronous
    assert K.window_of((("rollout", 1), ("critic", 0))) == 3
    assert K.window_of((("rollout", 3),)) == 5


def test_evals_run_every_so_many_steps_from_the_first_and_at_the_last():
    assert [s for s in range(13) if K.eval_due(s, 12, 5)] == [0, 5, 10, 12]
    assert [s for s in range(7) if K.eval_due(s, 6, 3)] == [0, 3, 6]
    assert not any(K.eval_due(s, 12, None) for s in range(13))


def test_a_task_may_take_factor_times_its_predicted_time_and_never_less_than_the_floor():
    lim = K.Limits(factor=10.0, floor_s=120.0)
    times = {"rollout": 20.0, "ref_lp": 1.0, "actor_step": 5.0}
    # a fused call counts its slowest stage; the calls of a task add up
    assert lim.task([("rollout", "ref_lp"), ("actor_step",)], times) == 250.0
    assert lim.task([("ref_lp",)], times) == 120.0                    # the floor
    assert lim.task([("unknown",)], {}) == 120.0
    assert (lim.gather_s, lim.setup_s, lim.drain_s) == (240.0, 600.0, 10.0)
    short = K.Limits(factor=1.0, floor_s=2.0)
    assert (short.gather_s, short.setup_s, short.drain_s) == (4.0, 600.0, 2.0)
    assert K.Limits(1.0, 400.0).setup_s == 800.0
    # a call answered at once, a worker's first look at its GPUs, whether it answers at all
    assert (lim.quick_s, lim.report_s, lim.answer_s, short.answer_s) == (30.0, 120.0, 5.0, 2.0)


def test_the_worked_examples_of_the_run_decisions_hold():
    import doctest
    result = doctest.testmod(C)
    assert result.attempted and result.failed == 0


def test_a_task_that_raised_is_lost_when_its_worker_went_and_failed_otherwise():
    """Dask's errors by name (the core imports no Dask): a killed worker, a closed comm, a
    cancelled future are losses; whatever an op raises is a failure."""
    killed = type("KilledWorker", (Exception,), {})
    closed = type("CommClosedError", (OSError,), {})
    assert C.outcome_of("error", killed()) is C.Outcome.LOST
    assert C.outcome_of("error", closed()) is C.Outcome.LOST
    assert C.outcome_of("error", BrokenPipeError()) is C.Outcome.LOST
    assert C.outcome_of("error", RuntimeError("Connection closed by peer")) is C.Outcome.FAILED
    assert C.outcome_of("cancelled") is C.Outcome.CANCELLED
    assert C.outcome_of("finished") is C.Outcome.DONE


# --- whom a stuck collective blames -----------------------------------------------------------
def _at_the_sync(ppo):
    """A staleness-1 segment on two devices run until its first weight sync (a collective of
    both devices: the trainer's export, the generator's load) is all that is ready: neither
    rank finishes it, as when one of them froze."""
    core, _, _ = _staleness_segment(ppo)
    table = core.calls
    queue, t, held = _pack(core, core.handle(C.Started(now=0.0)), 0.0), 0.0, []
    while queue:
        op = queue.pop(0)
        if table[op].collective:
            held.append(op)
            continue
        t += 1.0
        queue += _pack(core, core.handle(C.TaskEnded(op, t)), t)
    first = [op for op in held if table[op].step == min(table[h].step for h in held)]
    assert sorted(table[op].device for op in first) == [0, 1], held
    return core, t, {table[op].device: op for op in first}


def test_a_stuck_collective_blames_the_rank_that_does_not_answer_not_the_one_waiting(ppo):
    """Both ranks of the sync are overdue; device 0's is found first, but device 1 is the
    one that does not answer (frozen): the core asks before it blames, and blames device 1,
    naming device 0 as blocked with it."""
    core, t, sync = _at_the_sync(ppo)
    [ask] = [i for i in core.handle(C.Tick(t + 6.0)) if not isinstance(i, C.CheckAlive)]
    assert ask == C.Ask((0, 1)) and ask.stimulus.startswith("tick-")
    # asked once: the ticks until the answer do not ask again
    assert not [i for i in core.handle(C.Tick(t + 7.0)) if isinstance(i, (C.Ask, C.Stuck))]
    [stuck] = core.handle(C.Answers(t + 7.0, frozenset({1}), id="tick-9/answers"))
    assert stuck.task.ids == (sync[1],) and stuck.blocked == (0,)
    assert stuck.stimulus == "tick-9/answers" and stuck.idle_s > stuck.task.limit_s


def test_a_stuck_collective_whose_ranks_all_answer_blames_the_rank_found(ppo):
    core, t, sync = _at_the_sync(ppo)
    [ask] = [i for i in core.handle(C.Tick(t + 6.0)) if isinstance(i, C.Ask)]
    [stuck] = core.handle(C.Answers(t + 6.0, frozenset()))
    assert stuck.task.ids == (sync[0],) and stuck.blocked == ()
    core, t, sync = _at_the_sync(ppo)
    core.handle(C.Tick(t + 6.0))
    [stuck] = core.handle(C.Answers(t + 6.0, frozenset({0, 1})))    # both frozen: the first
    assert stuck.task.ids == (sync[0],)
    assert core.handle(C.Answers(t + 6.0, frozenset({1}))) == []     # nothing was asked


def test_a_stuck_task_outside_any_collective_is_blamed_without_asking(ppo, plan_by_hand):
    core, out = _segment(ppo, plan_by_hand)
    _pack(core, out, 0.0, limit=5.0)
    got = core.handle(C.Tick(6.0))
    assert any(isinstance(i, C.Stuck) for i in got) and not any(isinstance(i, C.Ask)
                                                               for i in got)


def test_a_stuck_reader_blames_the_frozen_device_that_holds_its_input(ppo):
    """A task on one device reads an output another device's op made, and that worker froze
    after the op finished: the reader is overdue (it waits in the fetch), not frozen. The
    core asks both before it blames, and blames the holder, naming the reader."""
    core, _, _ = _staleness_segment(ppo)
    table = core.calls

    def reads_from(op):
        return tuple(sorted({table[d].device: d for d in table[op].deps
                             if d in table and table[d].device != table[op].device}.items()))

    def pack(out, now):
        keys = []
        for ins in out:
            if isinstance(ins, C.Submit):
                op = ins.call.id
                core.handle(C.TaskSubmitted(op, Task((op,), ins.call.device, ins.call.step, 5.0,
                                                     (), reads_from(op)), now))
                keys.append(op)
        return keys

    queue, t, readers = pack(core.handle(C.Started(now=0.0)), 0.0), 0.0, []
    while queue:                            # every task that reads across devices is held
        op = queue.pop(0)
        if reads_from(op) and not table[op].collective:
            readers.append(op)
            continue
        t += 1.0
        queue += pack(core.handle(C.TaskEnded(op, t)), t)
    assert readers
    [ask] = [i for i in core.handle(C.Tick(t + 6.0)) if isinstance(i, C.Ask)]
    hit, _ = core.flight.stuck(core.last_done, t + 6.0)          # the overdue reader
    assert hit.ids[0] in readers
    reader, holder = hit.device, hit.reads_from[0][0]
    assert set(ask.devices) >= {reader, holder}
    [stuck] = core.handle(C.Answers(t + 6.0, frozenset({holder})))
    assert stuck.task.device == holder and stuck.reading == (reader,) and stuck.blocked == ()
    core, _, _ = _staleness_segment(ppo)         # and when the holder answers: the reader
    assert core.handle(C.Answers(t, frozenset({holder}))) == []       # nothing was asked


from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from rpeg.runtime.core.flight import Flight, blame  # noqa: E402


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 10), st.floats(1, 8),
                          st.booleans(), st.booleans()), min_size=1, max_size=8),
       st.frozensets(st.integers(0, 3)), st.floats(0, 20))
def test_blame_prefers_a_silent_device_then_an_overdue_peer_busy_elsewhere(tasks, silent,
                                                                            last):
    """Over any tasks in flight (device, ready at, limit, holds its device's call of the
    collective, waits for an op not done), any devices silent: the blamed is the rank in
    hand when it is silent, else a silent peer, else an overdue peer busy outside the
    collective, else the rank in hand."""
    fl = Flight()
    gang_ops: dict[int, str] = {}
    for n, (device, ready, limit, member, waits) in enumerate(tasks):
        op = f"op{n}"
        if member and device not in gang_ops:
            gang_ops[device] = op
        fl.add(f"k{n}", Task((op,), device, 0, limit, ("never",) if waits else ()), now=ready)
    now, last_done = 30.0, dict.fromkeys(range(4), last)
    hit = fl.stuck(last_done, now)
    if hit is None or hit[0].device not in gang_ops:
        return
    gang = {d: op for d, op in gang_ops.items() if d != hit[0].device}
    task, idle = blame(fl, hit, gang, silent, last_done, now)
    key = next(k for k, t in fl.tasks.items() if t == task)
    if hit[0].device in silent:
        assert (task, idle) == hit
    elif silent & set(gang):
        assert task.device in silent & set(gang)
        if key not in fl.ready_at:                # nothing ready there: the collective's call
            assert gang[task.device] in task.ids and idle == now - last
    elif task != hit[0]:
        assert task.device in gang and gang[task.device] not in task.ids
        assert idle > task.limit_s
    if key in fl.ready_at:
        assert idle == now - max(fl.ready_at[key], last_done[task.device])
