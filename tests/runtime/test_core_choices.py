"""The run's choices outside a segment, without Dask: the workers a start takes, the replica
each model restores from, where a resume restarts, where the eval runs, what a cut keeps."""

from __future__ import annotations

import doctest

from hypothesis import given
from hypothesis import strategies as st

from rpeg.runtime.core import choices as K
from rpeg.runtime.core.flight import first_silent


@given(st.lists(st.integers(0, 50), unique=True), st.integers(0, 8))
def test_a_cut_keeps_the_newest_checkpoints_and_removes_the_rest(steps, keep):
    gone = K.pruned(steps, keep)
    kept = sorted(set(steps) - set(gone))
    assert set(gone) <= set(steps) and len(gone) == len(set(gone))
    assert kept == (sorted(steps)[-keep:] if keep else [])
    assert all(g < k for g in gone for k in kept)


@given(st.lists(st.sampled_from([f"tcp://w{i}" for i in range(8)]), unique=True),
       st.sets(st.sampled_from([f"tcp://w{i}" for i in range(8)])), st.integers(1, 6))
def test_a_start_takes_n_workers_never_one_lost_before(alive, lost, n):
    got = K.take_workers(alive, lost, n)
    usable = [a for a in alive if a not in lost]
    if len(usable) < n:
        assert got is None
    else:
        assert sorted(got) == list(range(n)) and list(got.values()) == usable[:n]
        assert not set(got.values()) & lost


def test_a_restart_waits_for_a_replacement_and_a_first_start_for_the_cluster():
    assert K.workers_wait_s(1, 60.0) == K.FIRST_WORKERS_S
    assert K.workers_wait_s(2, 60.0) == 60.0 and K.workers_wait_s(3, 5.0) == 5.0


def test_a_model_restores_from_its_newest_replica_a_trained_one_first():
    saved = {"actor@0": 4, "actor@1": 4, "actor~vllm@0": 3, "critic@1": 4}
    # the same copy where one is saved, with optimizer state first
    assert K.best_source(saved, "actor", trained={"actor@1"}) == "actor@1"
    assert K.best_source(saved, "actor", trained=set()) in ("actor@0", "actor@1")
    # an engine's copy older than its backbone: the backbone's newest
    assert K.best_source(saved, "actor~vllm", trained={"actor@1"}) == "actor@1"
    assert K.best_source({"actor~vllm@0": 5, "actor@1": 4}, "actor~vllm", set()) \
        == "actor~vllm@0"
    # a device keeps its own replicas; a re-planned one maps the others by model
    assert K.restore_sources(saved, 1, {"actor@1"}, restart=False) == {
        "actor": "actor@1", "critic": "critic@1", "actor~vllm": "actor@1"}
    assert K.restore_sources(saved, 0, {"actor@1"}, restart=False) == {
        "actor": "actor@0", "critic": "critic@1", "actor~vllm": "actor~vllm@0"}
    # an extended run restarts at its cut: every copy from the best, its own or not
    assert K.restore_sources(saved, 0, {"actor@1"}, restart=True) == {
        "actor": "actor@1", "critic": "critic@1", "actor~vllm": "actor@1"}


@given(st.integers(0, 200), st.integers(0, 4), st.integers(1, 200), st.integers(1, 400))
def test_a_resume_restarts_at_its_cut_only_when_extended_near_the_end_it_was_made_for(
        cut, reach, made_for, steps):
    restarts = K.restarts_at_cut(cut, reach, made_for, steps)
    if steps == made_for:
        assert not restarts                       # a plain resume continues from the cut
    else:
        assert restarts == (cut + 2 * reach > min(made_for, steps))


def test_the_eval_runs_on_the_first_device_of_the_first_replica_that_generates():
    homes = {"critic": [1], "actor+critic": [2, 3], "actor": [0]}
    assert K.eval_home(homes, lambda m: m in {"actor+critic", "actor"}) == ("actor+critic", 2)
    assert K.eval_home({"critic": [1]}, lambda m: m == "actor") is None


def test_a_call_that_timed_out_blames_the_worker_that_does_not_answer():
    assert first_silent([0, 1, 2], frozenset({2})) == 2
    assert first_silent([0, 1, 2], frozenset({3})) == 0     # only the late ones count
    assert first_silent([], frozenset()) == -1


def test_the_worked_examples_hold():
    result = doctest.testmod(K)
    assert result.attempted and result.failed == 0
    from rpeg.runtime.core import flight
    result = doctest.testmod(flight)
    assert result.attempted and result.failed == 0


_REPLICAS = st.dictionaries(
    st.builds(lambda m, d: f"{m}@{d}", st.sampled_from(["actor", "actor~vllm", "critic", "ref"]),
              st.integers(0, 2)),
    st.tuples(st.integers(0, 3), st.booleans(), st.booleans(), st.booleans()))


@given(_REPLICAS)
def test_a_cut_saves_every_replica_a_resume_cannot_rebuild(versions):
    """(version, trained home, frozen, carries partial rollouts) per replica: a replica is
    left out only when frozen, or when a trained one of the same copy is at its version and
    it keeps no partial rollouts of its own."""
    from rpeg.graph.ids import ReplicaAt
    skip = K.rebuildable(versions)
    for k, (v, home, frozen, carries) in versions.items():
        if frozen:
            assert k in skip
        elif home or carries:
            assert k not in skip
        elif k in skip:
            assert any(ReplicaAt(o).key == ReplicaAt(k).key and h and ov == v
                       for o, (ov, h, _, _) in versions.items())


_STATUSES = st.sampled_from(["pending", "finished", "error", "cancelled", "lost"])


@given(st.lists(_STATUSES), st.floats(0, 100), st.floats(0, 100))
def test_a_wait_on_the_workers_is_stuck_only_past_its_limit_with_a_call_still_running(
        statuses, waited, limit):
    """A call still running ("pending", or "lost": its result waits to be made again) keeps
    the wait going until the limit, then the wait is stuck; a wait whose calls all ended
    (finished, failed or cancelled) is over, however long it took."""
    at = K.waiting(statuses, waited, limit)
    running = [s for s in statuses if s not in ("finished", "error", "cancelled")]
    if not running:
        assert at is K.Wait.ENDED
    else:
        assert at is (K.Wait.STUCK if waited > limit else K.Wait.RUNNING)


def test_an_ended_wait_lost_a_worker_when_a_call_was_cancelled_or_raised_a_loss():
    class KilledWorker(Exception):
        pass

    assert not K.lost_in([])
    assert not K.lost_in([("finished", None), ("error", ValueError("a bad reward"))])
    assert K.lost_in([("finished", None), ("cancelled", None)])
    assert K.lost_in([("error", KilledWorker("w")), ("finished", None)])
    assert K.lost_in([("error", ConnectionResetError())])
    # the errors are read lazily, up to the first loss
    seen = []

    def calls():
        for s, e in (("error", EOFError()), ("error", ValueError())):
            seen.append(s)
            yield s, e
    assert K.lost_in(calls()) and seen == ["error"]


def test_carried_outputs_not_taken_by_a_worker_that_went_are_a_loss():
    assert K.carry_lost(ConnectionResetError()) and K.carry_lost(OSError("Timed out connecting"))
    assert not K.carry_lost(TypeError("cannot pickle"))
