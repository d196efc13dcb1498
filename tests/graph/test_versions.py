"""The one rule of which parameter version an op reads: its invariants, and the graph's
version edges agree with it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from rpeg.graph import build, unroll
from rpeg.graph.versions import bound_problem, carry_room, read_version, readable, writer_step
from rpeg.spec import load
from rpeg.spec.model import OpKind

READERS = (OpKind.GENERATE, OpKind.FORWARD)
small = st.integers(0, 8)


@given(st.sampled_from(READERS), small, small, small)
def test_what_an_op_reads_lies_in_its_window_and_carry_only_widens_it(kind, step, lag, carry):
    lo, hi = readable(kind, step, lag, carry)
    assert lo <= read_version(kind, step, lag) <= hi == step
    assert lo == max(0, step - lag - carry)
    assert readable(kind, step, lag + carry) == (lo, hi)     # carry spends the bound like lag


@given(small, small, small)
def test_a_carry_fits_the_bound_exactly_when_its_room_allows(bound, lag, carry):
    fits = bound_problem("rollout", lag, carry, bound) is None
    assert fits == (lag + carry <= bound)
    assert fits == (lag <= bound and carry <= carry_room(bound, lag))


@given(small)
def test_training_reads_its_own_step_and_a_sync_carries_the_next(step):
    assert readable(OpKind.TRAIN, step, 3) == (step, step)
    assert read_version(OpKind.SYNC_WEIGHTS, step, -1) == step + 1
    assert writer_step(OpKind.GENERATE, step, 1) == max(0, step - 1) - 1


def test_the_unrolled_graph_waits_for_the_writer_of_the_version_it_reads(pipelines):
    ppo = load(pipelines / "tiny_ppo.rpeg")
    for lag in (0, 1):
        g = build(ppo, staleness={"rollout": lag})
        u = unroll(g, steps=4)
        for s in range(4):
            inst = next(i for i in u.instances if i.op == "rollout" and i.step == s)
            waits = [d.src.step for d in u.deps_of(inst) if d.kind.value == "version"]
            assert u.version_read(inst) == read_version(OpKind.GENERATE, s, lag)
            assert waits == ([u.version_read(inst) - 1] if u.version_read(inst) else [])
