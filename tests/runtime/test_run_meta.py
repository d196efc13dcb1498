"""run.json as a typed value: the keys every rpeg wrote, read back and written unchanged."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from rpeg.runtime.rundir.check import check_meta
from rpeg.runtime.rundir.meta import Recovery, Replan, RunMeta, Status

# what a run wrote to run.json before its workers were set up (the keys of a new run)
NEW_RUN_KEYS = ["checkpoint_every", "overrides", "pipeline", "recoveries", "replans",
                "resumes", "scheduler", "spec", "started", "status", "steps", "trackers"]


def _new() -> RunMeta:
    meta = RunMeta.new("tiny_ppo", steps=6, scheduler="local", started=12.5, spec=None,
                       overrides=("workload.steps=6",))
    meta.checkpoint_every, meta.trackers = 2, ["jsonl"]
    return meta


def test_a_new_run_writes_the_keys_it_always_wrote():
    out = _new().to_json()
    assert sorted(out) == NEW_RUN_KEYS
    assert out["status"] == "running" and out["spec"] is None
    assert out["overrides"] == ["workload.steps=6"]


def test_a_finished_run_round_trips_through_its_json_unchanged():
    meta = _new()
    meta.setup_s, meta.workers = 3.25, {0: "tcp://a:1", 1: "tcp://b:2"}
    meta.worker_history = {0: ["tcp://a:1"], 1: ["tcp://c:3", "tcp://b:2"]}
    meta.homes, meta.cuda, meta.tasks = {"actor": [0], "critic": [1]}, False, 41
    meta.recoveries.append(Recovery(1, 1, "tcp://c:3", "actor_step/s2", 2, "worker lost",
                                    "task-ended-x", 2, 99.0, abandoned_ops=3))
    meta.replans.append(Replan("only 1 worker(s) left", 2, 1, 2, 100.0))
    meta.status, meta.wall_s, meta.host = Status.OK, 8.5, {"client_cpu_s": 0.1}
    text = json.dumps(meta.to_json(), sort_keys=True)
    back = RunMeta.from_json(check_meta(json.loads(text), "run.json"))
    assert back == meta
    assert json.dumps(back.to_json(), sort_keys=True) == text
    assert json.loads(text)["workers"] == {"0": "tcp://a:1", "1": "tcp://b:2"}


def test_a_loss_recorded_before_its_rollback_ends_leaves_abandoned_ops_out():
    rec = Recovery(1, 0, "tcp://a:1", "set-up", 0, "op stuck", "", 0, 1.0)
    assert "abandoned_ops" not in rec.to_json()


def test_an_older_record_keeps_the_keys_this_version_does_not_know():
    old = {"steps": 4, "status": "interrupted", "spec_dir": "/somewhere",
           "recoveries": [{"worker": "tcp://a:1", "device": 0, "why": "old field"}]}
    meta = RunMeta.from_json(old)
    assert meta.extra == {"spec_dir": "/somewhere"} and meta.lost_workers() == {"tcp://a:1"}
    out = meta.to_json()
    assert out["spec_dir"] == "/somewhere" and out["recoveries"][0]["why"] == "old field"
    assert "tasks" not in out and "wall_s" not in out and "cuda" not in out


def test_a_status_this_version_does_not_know_is_read_as_unknown():
    assert RunMeta.from_json({"steps": 1, "status": "paused"}).status is Status.UNKNOWN


_addr = st.text("abc:/0123456789", min_size=1, max_size=12)
_optional = {
    "started": st.floats(0, 1e10),
    "checkpoint_every": st.integers(1, 100),
    "trackers": st.lists(st.sampled_from(["jsonl", "tensorboard", "wandb"])),
    "setup_s": st.floats(0, 1e4),
    "workers": st.dictionaries(st.integers(0, 9).map(str), _addr, min_size=1),
    "worker_history": st.dictionaries(st.integers(0, 9).map(str), st.lists(_addr),
                                      min_size=1),
    "homes": st.dictionaries(st.sampled_from(["actor", "critic", "ref"]),
                             st.lists(st.integers(0, 9))),
    "cuda": st.booleans(),
    "tasks": st.integers(1, 10**6),
    "wall_s": st.floats(0, 1e6),
    "extensions": st.lists(st.fixed_dictionaries(
        {"from_step": st.integers(0, 9), "from_steps": st.integers(1, 9),
         "to_steps": st.integers(1, 99), "at": st.floats(0, 1e10)}), min_size=1),
    "spec_dir": _addr,
}


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries(
    {"pipeline": st.sampled_from(["tiny_ppo", "grpo"]), "steps": st.integers(1, 10**6),
     "status": st.sampled_from([s.value for s in Status if s is not Status.UNKNOWN]),
     "scheduler": st.sampled_from(["local", "tcp://h:8786"]),
     "spec": st.none() | _addr, "overrides": st.lists(_addr),
     "recoveries": st.lists(st.fixed_dictionaries(
         {"attempt": st.integers(1, 4), "device": st.integers(-1, 9), "worker": _addr,
          "op": _addr, "step": st.integers(-1, 99), "reason": _addr, "stimulus": _addr,
          "rolled_back_to": st.integers(0, 99), "at": st.floats(0, 1e10)},
         optional={"abandoned_ops": st.integers(-1, 99)})),
     "replans": st.just([]), "resumes": st.just([])},
    optional=_optional))
def test_every_record_rpeg_writes_round_trips_key_for_key(record):
    assert RunMeta.from_json(check_meta(record, "run.json")).to_json() == record


def test_the_worked_example_holds():
    import doctest

    from rpeg.runtime.rundir import meta
    result = doctest.testmod(meta)
    assert result.attempted and result.failed == 0
