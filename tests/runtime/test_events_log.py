"""The run's op events on disk: appended at each checkpoint (a checkpoint records how far,
not the events), trace.json rewritten only when they have doubled and at the end, so a
long run writes its trace in time linear in its length."""

from __future__ import annotations

import json

import pytest

from rpeg.errors import RuntimeFailure
from rpeg.runtime import RunOptions, verify_run
from rpeg.runtime.dask.runner import Resilience, run_resilient
from rpeg.runtime.placement import split_plan
from rpeg.runtime.rundir import checkpoints as ckio
from rpeg.runtime.rundir.directory import EVENTS, RunDir
from rpeg.runtime.rundir.state import RunState


def _ev(i: int) -> dict:
    return {"id": f"op/s{i}", "op": "op", "kind": "forward", "step": i, "device": 0,
            "worker": "w", "start": float(i), "end": i + 0.5}


def test_events_append_and_cut_back_to_a_checkpoint(tmp_path):
    rd = RunDir.create(tmp_path, "p")
    first = rd.append_events([_ev(0), _ev(1)])
    rd.append_events([_ev(2)])
    assert [e["step"] for e in rd.cut_events(first)] == [0, 1]      # step 2 runs again
    assert (rd.path / EVENTS).stat().st_size == first
    with pytest.raises(RuntimeFailure, match="must hold the"):
        rd.cut_events(first + 10)


def test_trace_is_rewritten_when_events_double_and_at_the_end(tmp_path, monkeypatch):
    rd = RunDir.create(tmp_path, "p")
    writes = []
    monkeypatch.setattr(RunDir, "write_trace", lambda self, ev, w, t0: writes.append(len(ev)))
    state = RunState(0, [], [], {}, {})
    for i in range(1000):
        state.events.append(_ev(i))
        state.write_trace(rd, {0: "w"}, 0.0)             # as at every checkpoint
    assert writes == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    state.write_trace(rd, {0: "w"}, 0.0, force=True)     # the run ends
    state.write_trace(rd, {0: "w"}, 0.0, force=True)     # nothing new: not again
    assert writes[-1] == 1000 and writes.count(1000) == 1


@pytest.mark.slow           # a real run on a cluster of its own; the log's rules are tested above
def test_a_run_keeps_its_events_beside_its_checkpoints(ppo, tmp_path, local_cluster):
    plan = split_plan(ppo, 2, staleness=1)
    with local_cluster(2) as address:
        result = run_resilient(ppo, plan, RunOptions(steps=5, scheduler=address,
                                                     root=str(tmp_path), progress=False),
                               spec_path=ppo.path, resilience=Resilience(checkpoint_every=2))
    assert verify_run(result.path).ok
    logged = [json.loads(x) for x in (result.path / EVENTS).read_text().splitlines()]
    traced = json.loads((result.path / "trace.json").read_text())["traceEvents"]
    assert len(logged) == sum(e.get("ph") == "X" for e in traced) > 0
    ck = ckio.latest(result.path)
    assert ck is not None and ck.step == 5
    assert ck.state["events_bytes"] == (result.path / EVENTS).stat().st_size
    assert ck.state["events_count"] == len(logged)
    assert "events" not in ck.state                      # the log, not a copy per checkpoint
